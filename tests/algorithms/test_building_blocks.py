"""The simulator's pieces: message passing, optimizers, schedules, random streams, algorithms."""

from __future__ import annotations

import json
import math
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch

from decentdp.algorithms import algorithm_names, register
from decentdp.algorithms.base import Network, PublicGraph, RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.components.optim import SGD, Adam, OptimizerAlgorithm
from decentdp.algorithms.components.schedules import Schedule
from decentdp.algorithms.dp_dinno import DPDiNNO, disagreement_map
from decentdp.algorithms.dp_dsgd import DPDSGD
from decentdp.algorithms.dp_dsgt import DPDSGT
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.rng import AgentRandom, Stream
from decentdp.runtime.network import SimulatedNetwork
from decentdp.topology import build_topology
from decentdp.util.profiling import PhaseTimer, TimedNetwork

from conftest import tiny_config


def _network(graph: str = "ring", n: int = 6, **params: float) -> SimulatedNetwork:
    return SimulatedNetwork(build_topology(graph, n, seed=0, **params), dtype=torch.float64)


def test_message_passing_primitives_agree_with_mixing() -> None:
    net = _network("erdos-renyi", 8, p=0.5)
    x = torch.randn(8, 5, dtype=torch.float64)
    w = torch.tensor(net.topology.mixing)
    src, dst = net.out_edges[:, 0], net.out_edges[:, 1]
    via_messages = net.aggregate(net.broadcast(x), weights=w[dst, src]) + torch.diag(w)[:, None] * x
    torch.testing.assert_close(via_messages, net.mix(x))
    torch.testing.assert_close(net.neighbor_sum(x), net.aggregate(net.broadcast(x)))
    torch.testing.assert_close(net.degrees, torch.tensor(net.topology.adjacency().sum(1)))


class _PrimitivesOnly(Network):
    """A backend that implements the three primitives and nothing else, so that every other method is
    ``Network``'s own: a simulated network's graph whose messages arrive in another order than they leave
    (in-edges shuffled), as between processes."""

    def __init__(self, inner: SimulatedNetwork, seed: int = 0) -> None:
        self.inner = inner
        self.order = torch.randperm(len(inner.out_edges), generator=torch.Generator().manual_seed(seed))
        self.n_agents, self.n_total, self.agent_ids = inner.n_agents, inner.n_total, inner.agent_ids
        self.out_edges, self.in_edges = inner.out_edges, inner.in_edges[self.order]
        self.in_weights, self.degrees = inner.in_weights[self.order], inner.degrees

    def rows(self, agent_ids: torch.Tensor) -> torch.Tensor:
        return agent_ids

    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        return messages[self.order]

    def public_graph(self) -> PublicGraph:
        return self.inner.public_graph()


def test_a_backend_of_the_primitives_alone_gets_every_other_method() -> None:
    """``Network``'s helpers, built on ``rows``, ``exchange`` and ``public_graph``, give what the simulator's
    fused versions give: mixing up to summation order, rows exactly; a swap between agents that are not two
    neighbours choosing each other is refused."""
    net = _network("erdos-renyi", 9, p=0.5)
    bare = _PrimitivesOnly(net)
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for method in ("mix", "neighbor_sum"):
        torch.testing.assert_close(getattr(bare, method)(x), getattr(net, method)(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(bare.mix_add(x, x.clone(), -0.5), net.mix_add(x, x.clone(), -0.5), rtol=0, atol=1e-12)
    assert torch.equal(bare.broadcast(x), x[bare.in_edges[:, 0]])
    rows = torch.cat([x, -x])
    pick = torch.randint(0, 18, (len(bare.out_edges),), generator=torch.Generator().manual_seed(1))
    received, index = bare.exchange_rows(rows, pick)
    assert torch.equal(received[:18], rows) and torch.equal(received[index], bare.exchange(rows[pick]))
    ring = _PrimitivesOnly(_network("ring", 6))
    y = torch.arange(6.0)[:, None]
    partner = torch.tensor([1, 0, 2, 4, 3, 5])  # pairs (0,1), (3,4); agents 2 and 5 idle
    assert torch.equal(ring.swap(y, partner), ring.inner.swap(y, partner))
    for unpaired in ([3, 1, 2, 0, 4, 5], [1, 2, 1, 3, 4, 5]):  # not neighbours; 0 chose 1, who chose 2
        with pytest.raises(ValueError, match="not a pair of neighbours"):
            ring.swap(y, torch.tensor(unpaired))


def test_the_profiler_passes_the_public_graph_through_untimed() -> None:
    """``TimedNetwork`` (``--profile``) hands algorithms the wrapped network's own cached public graph, not
    counted as communication (no message is sent), and times ``exchange_rows`` as every network call."""
    net = _network("erdos-renyi", 8, p=0.5)
    timer = PhaseTimer()
    timed = TimedNetwork(net, timer)
    assert timed.public_graph() is net.public_graph() and "communication" not in timer.seconds
    rows, pick = torch.randn(8, 3, dtype=torch.float64), net.out_edges[:, 0]
    received, index = timed.exchange_rows(rows, pick)
    assert received is rows and torch.equal(received[index], net.broadcast(rows)) and "communication" in timer.seconds


def test_per_edge_messages_reach_their_receiver() -> None:
    net = _network("star", 5)
    messages = torch.arange(len(net.out_edges), dtype=torch.float64)[:, None]  # a distinct message per edge
    received = net.aggregate(net.exchange(messages))
    for agent in range(5):
        assert received[agent, 0] == messages[net.in_edges[:, 1] == agent].sum()


def test_pairwise_swap_exchanges_between_neighbours_only() -> None:
    net = _network("ring", 6)
    x = torch.arange(6.0)[:, None]
    partner = torch.tensor([1, 0, 2, 4, 3, 5])  # pairs (0,1), (3,4); agents 2 and 5 idle or offline
    assert net.swap(x, partner)[:, 0].tolist() == [1, 0, 2, 4, 3, 5]
    with pytest.raises(ValueError, match="not a pair of neighbours"):
        net.swap(x, torch.tensor([3, 1, 2, 0, 4, 5]))


@pytest.mark.parametrize("graph,n,sparse", [("ring", 300, True), ("ring", 30, True), ("complete", 10, False),
                                             ("complete", 300, False)])
def test_sparse_graphs_mix_with_a_sparse_operator(graph: str, n: int, sparse: bool, device: torch.device) -> None:
    net = SimulatedNetwork(build_topology(graph, n, seed=0), device=device)
    x = torch.randn(n, 3, device=device)
    assert (net._mixing.layout == torch.sparse_csr) is sparse  # one CSR operator
    dense = torch.tensor(net.topology.mixing, dtype=torch.float32, device=device)
    torch.testing.assert_close(net.mix(x), dense @ x)


@pytest.mark.parametrize("graph,n", [("ring", 300), ("complete", 6), ("ring", 6)])
def test_mix_add_updates_in_place(graph: str, n: int, device: torch.device) -> None:
    net = SimulatedNetwork(build_topology(graph, n, seed=0), device=device)
    x, y = torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)
    expected = net.mix(x) - 0.3 * y
    result = net.mix_add(x, y, -0.3)
    assert result.data_ptr() == y.data_ptr()
    torch.testing.assert_close(result, expected)


def test_dsgd_with_plain_sgd_equals_mixing_then_stepping() -> None:
    net = _network("ring", 5)
    params, grad = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ctx = RoundContext(round_index=0, lr=0.2, network=net, oracle=_FixedOracle(lambda params: grad.clone()))
    fused = DPDSGD(SGD()).round({"params": params}, ctx)["params"]
    torch.testing.assert_close(fused, net.mix(params) - 0.2 * grad)


@pytest.mark.parametrize("optimizer", [SGD(), SGD(momentum=0.9, weight_decay=1e-3), SGD(momentum=0.9, nesterov=True),
                                       Adam(weight_decay=1e-3)])
def test_inplace_optimizer_steps_equal_functional_ones(optimizer: SGD | Adam) -> None:
    params, grad = torch.randn(4, 5), torch.randn(4, 5)
    state = optimizer.init(params)
    expected, expected_state = optimizer.step(params, grad, state, 0.1)
    scratch = params.clone()
    result, result_state = optimizer.step(scratch, grad, state, 0.1, inplace=True)
    assert result.data_ptr() == scratch.data_ptr()
    torch.testing.assert_close(result, expected)
    for key in expected_state:
        torch.testing.assert_close(result_state[key], expected_state[key])


@pytest.mark.parametrize("momentum,nesterov,weight_decay", [(0.0, False, 0.0), (0.9, False, 1e-4), (0.9, True, 0.0)])
def test_sgd_matches_torch_optim(momentum: float, nesterov: bool, weight_decay: float) -> None:
    _check_against_torch(SGD(momentum, weight_decay, nesterov),
                         lambda p: torch.optim.SGD(p, lr=0.05, momentum=momentum, nesterov=nesterov,
                                                   weight_decay=weight_decay))


def test_adam_matches_torch_optim() -> None:
    _check_against_torch(Adam(weight_decay=1e-3), lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=1e-3))


def _check_against_torch(ours: SGD | Adam, make_reference) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    params = torch.randn(3, 4, dtype=torch.float64)
    reference = [torch.nn.Parameter(row.clone()) for row in params]
    optimizer = make_reference(reference)
    state = ours.init(params)
    for _ in range(5):
        grads = torch.randn(3, 4, dtype=torch.float64)
        params, state = ours.step(params, grads, state, 0.05)
        for row, g in zip(reference, grads, strict=True):
            row.grad = g.clone()
        optimizer.step()
    torch.testing.assert_close(params, torch.stack([p.detach() for p in reference]))


def test_schedules_hit_their_endpoints() -> None:
    log = Schedule("logspace", 0.1, 0.001, 101)
    assert log(0) == pytest.approx(0.1) and log(100) == pytest.approx(0.001) and log(50) == pytest.approx(0.01)
    cosine = Schedule("cosine", 0.1, 0.0, 11)
    assert cosine(0) == pytest.approx(0.1) and cosine(10) == pytest.approx(0.0) and cosine(5) == pytest.approx(0.05)
    assert Schedule("constant", 0.3, 0.3, 5)(4) == 0.3


def test_agent_streams_are_keyed_and_independent_of_other_agents() -> None:
    rng = AgentRandom(11)
    block = rng.normal([0, 1, 2, 3], 1000, round_index=5, stream=Stream.NOISE)
    alone = rng.normal([2], 1000, round_index=5, stream=Stream.NOISE)
    torch.testing.assert_close(block[2:3], alone, rtol=0, atol=0)  # a shard holding only agent 2 agrees
    assert not torch.equal(block[0], block[1])
    assert not torch.equal(rng.normal([0], 1000, 6, Stream.NOISE), block[:1])
    assert not torch.equal(rng.normal([0], 1000, 5, Stream.NOISE, step=1), block[:1])


class _FixedOracle:
    """An oracle whose gradient is a known function of the parameters (no data, no noise)."""

    def __init__(self, gradient) -> None:  # type: ignore[no-untyped-def]
        self.gradient = gradient


def _quadratic(targets: torch.Tensor) -> _FixedOracle:
    """Agent i's loss 1/2 ||theta - b_i||^2, whose network optimum is mean(b)."""
    return _FixedOracle(lambda params: params - targets)


def _run(algorithm, net: SimulatedNetwork, targets: torch.Tensor, rounds: int, lr) -> dict:  # type: ignore[no-untyped-def]
    state = algorithm.init_state(torch.zeros_like(targets))
    for k in range(rounds):
        state = algorithm.round(state, RoundContext(k, lr(k), net, _quadratic(targets)))
    return state


def test_dsgd_on_a_quadratic_converges_to_the_known_optimum() -> None:
    torch.manual_seed(0)
    net = _network("ring", 8)
    targets = torch.randn(8, 3, dtype=torch.float64) * 3
    state = _run(DPDSGD(SGD()), net, targets, 3000, lambda k: 1 / (k + 2))  # diminishing steps: exact limit
    torch.testing.assert_close(state["params"], targets.mean(0).expand(8, 3), atol=1e-2, rtol=0)


def test_dsgt_converges_exactly_with_a_constant_step() -> None:
    torch.manual_seed(0)
    net = _network("ring", 8)
    targets = torch.randn(8, 3, dtype=torch.float64) * 3
    state = _run(DPDSGT(), net, targets, 500, lambda k: 0.2)
    torch.testing.assert_close(state["params"], targets.mean(0).expand(8, 3), atol=1e-8, rtol=0)


@pytest.mark.parametrize("optimizer", [SGD(), Adam()], ids=["sgd", "adam-reset-each-round"])
def test_dinno_on_a_quadratic_reaches_consensus_at_the_optimum(optimizer: SGD | Adam) -> None:
    torch.manual_seed(0)
    net = _network("ring", 6)
    targets = torch.randn(6, 2, dtype=torch.float64)
    algorithm = DPDiNNO(optimizer, rho=0.5, primal_steps=5, reset_each_round=isinstance(optimizer, Adam))
    state = _run(algorithm, net, targets, 1000, lambda k: 0.02)
    torch.testing.assert_close(state["params"], targets.mean(0).expand(6, 2), atol=1e-6, rtol=0)
    assert state["dual"].sum(0).abs().max() < 1e-9  # duals stay in the range of the Laplacian


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_dinno_disagreement_map_is_one_round_of_the_algorithm(momentum: float, nesterov: bool) -> None:
    """Without a loss, DiNNO's round moves a Laplacian eigenvector of disagreement exactly as
    :func:`disagreement_map` says: the map, not a guess, is what the stability warning multiplies."""
    net = _network("ring", 6)
    eigenvalues, vectors = np.linalg.eigh(nx.laplacian_matrix(net.topology.graph).toarray().astype(float))
    lam, vector = eigenvalues[3], vectors[:, 3]  # lambda = 3 on the ring of six
    lr, rho = 0.2, 0.4
    algorithm = DPDiNNO(SGD(momentum=momentum, nesterov=nesterov), rho=rho)
    state = algorithm.init_state(torch.tensor(vector)[:, None])
    mode = np.array([1.0, 0.0, 0.0])  # (e, lr y, lr b)
    step = disagreement_map(np.array([lr * rho * lam]), momentum, nesterov)[0]
    for k in range(12):
        state = algorithm.round(state, RoundContext(k, lr, net, _FixedOracle(torch.zeros_like)))
        mode = step @ mode
        torch.testing.assert_close(state["params"][:, 0], torch.tensor(mode[0] * vector), atol=1e-10, rtol=1e-9)


def _dinno_warnings(optimizer: SGD | Adam, lr: float, reset: bool = False, primal_steps: int = 1) -> list[str]:
    """The tuned epsilon = 1 row's penalty ratio (rho = 0.5 / 5.478, growth 1.0003) on its complete graph of 10."""
    algorithm = DPDiNNO(optimizer, rho=0.09128, rho_growth=1.0003, primal_steps=primal_steps, reset_each_round=reset)
    return algorithm.stability_warnings(build_topology("complete", 10, seed=0), Schedule("constant", lr, lr, 1000))


def test_dinno_warns_when_one_primal_step_makes_its_agents_drift_apart() -> None:
    """Plain SGD needs lr rho_k lambda < 4/3 (a trial at lr = 1.3 diverged by round 500, one at 0.6 did not);
    momentum and Adam's kept moments grow at every step (a momentum trial at lr = 0.03 diverged by round 250)."""
    assert _dinno_warnings(SGD(), 0.6) == []
    assert _dinno_warnings(SGD(), 1.3)[0].startswith("algorithm.lr:")
    assert _dinno_warnings(SGD(momentum=0.9), 0.01)[0].startswith("algorithm.momentum = 0.9:")
    assert _dinno_warnings(Adam(), 0.001)[0].startswith("algorithm.reset_optimizer_each_round = false:")
    assert _dinno_warnings(Adam(), 0.03, reset=True) == []  # lr * sign(G): bounded steps
    assert _dinno_warnings(SGD(momentum=0.9), 0.01, primal_steps=2) == []  # not what the map describes
    experiment = build_experiment(validate_config(tiny_config(
        algorithm={"name": "dp-dinno", "optimizer": "sgd", "momentum": 0.9}, privacy={"epsilon": "inf"},
        experiment={"rounds": 400})))
    assert any(w.startswith("algorithm.momentum = 0.9:") for w in experiment.warnings)


@pytest.mark.parametrize(("optimizer", "reset", "primal_steps"),
                         [(SGD(), False, 1), (Adam(), True, 1), (SGD(), False, 2)])
def test_dinno_refuses_a_penalty_schedule_that_overflows_before_the_last_round(
        optimizer: SGD | Adam, reset: bool, primal_steps: int) -> None:
    """rho * 1.5^2000 leaves float64: the run crashed at round 1750 (Python's power) with Adam rebuilt each round,
    and at the build (the stability map's log of inf) with plain SGD; now every setting is refused by name."""
    algorithm = DPDiNNO(optimizer, rho=0.5, rho_growth=1.5, primal_steps=primal_steps, reset_each_round=reset)
    with pytest.raises(ConfigError, match=r"algorithm\.rho_growth: .* 1e352 by the last round overflows float32"):
        algorithm.stability_warnings(build_topology("complete", 4, seed=0), Schedule("constant", 0.1, 0.1, 2000))
    assert DPDiNNO(optimizer, rho=0.5, rho_growth=1.04, primal_steps=primal_steps,  # 1e34 at the end: kept
                   reset_each_round=reset).stability_warnings(build_topology("complete", 4, seed=0),
                                                              Schedule("constant", 1e-40, 1e-40, 2000)) == []


def test_dsgt_tracks_the_sum_of_the_latest_gradients(device: torch.device) -> None:
    """With sigma = 0 and a doubly stochastic W: sum_i y_i = sum_i G_i after every round (eq. 5)."""
    experiment = build_experiment(validate_config(tiny_config(
        privacy={"epsilon": "inf"}, topology={"graph": "erdos-renyi", "agents": 6, "p": 0.5},
        model={"name": "mlp"})), device=device)
    state = experiment.initial_state()
    for k in range(5):
        state = experiment.algorithm.round(state, experiment.simulator.context(k))
        torch.testing.assert_close(state["tracker"].sum(0), state["last_grad"].sum(0), atol=1e-5, rtol=1e-5)
        assert torch.count_nonzero(state["last_grad"]) > 0


def test_private_runs_are_bit_for_bit_reproducible(device: torch.device) -> None:
    raw = tiny_config(algorithm={"name": "dp-dsgd", "optimizer": "sgd", "momentum": 0.5})
    finals = []
    for _ in range(2):
        experiment = build_experiment(validate_config(raw), device=device)
        finals.append(experiment.simulator.run(experiment.initial_state(), 0, 3, lambda d, s: True)["params"])
    assert finals[0].device.type == device.type and torch.equal(finals[0], finals[1])


def test_central_training_pools_all_data_into_one_agent() -> None:
    experiment = build_experiment(validate_config(tiny_config(algorithm={"name": "central-dpsgd"})))
    assert experiment.data.n_agents == 1
    assert len(experiment.data.indices[0]) == len(experiment.dataset.y_train)
    assert float(experiment.sample_rates[0]) == pytest.approx(16 / len(experiment.dataset.y_train))
    assert math.isfinite(float(experiment.noise_multipliers[0]))
    np.testing.assert_array_equal(experiment.histograms.sum(0), np.bincount(experiment.dataset.y_train.numpy()))


def test_a_pooled_run_with_a_redrawn_graph_keeps_its_one_agent_network() -> None:
    """A review: central-dpsgd with ``topology.redraw_every`` (accepted and said to change nothing) got networks of
    the N agents it replaces from the first redraw on, while its run has one agent.  Its one-agent network stays."""
    experiment = build_experiment(validate_config(tiny_config(
        algorithm={"name": "central-dpsgd"}, topology={"graph": "erdos-renyi", "agents": 4, "p": 0.6,
                                                       "redraw_every": 2})))
    assert [experiment.graphs.at(k).n_agents for k in range(6)] == [1] * 6


def _tiny_experiment(name: str, device: torch.device):
    """The tiny config run by ``name``; non-private (epsilon = inf) where the algorithm adds no noise and says so."""
    try:
        return build_experiment(validate_config(tiny_config(algorithm={"name": name})), device=device)
    except ConfigError as error:
        if error.field != "privacy.epsilon":
            raise
    return build_experiment(validate_config(tiny_config(algorithm={"name": name}, privacy={"epsilon": "inf"})),
                            device=device)


@pytest.mark.parametrize("name", algorithm_names())
def test_rounds_create_every_tensor_on_an_explicit_device(name: str, device: torch.device) -> None:
    """With torch's default device set to 'meta', any tensor a round creates without naming a device is
    a meta tensor and fails as soon as it meets real data: so every creation takes its device from the
    data, the parameters or the engine, as a GPU run needs."""
    experiment = _tiny_experiment(name, device)
    state = experiment.initial_state()
    torch.set_default_device("meta")
    try:
        state = experiment.simulator.setup(state)  # the setup phase before round 0 (as a run has), then rounds
        for k in range(2):
            state = experiment.algorithm.round(state, experiment.simulator.context(k))
    finally:
        torch.set_default_device("cpu")
    assert state["params"].device.type == device.type and torch.isfinite(state["params"]).all()


@register
class _WarmStarted(OptimizerAlgorithm):
    """Local training after a setup phase that takes one private gradient step (a stand-in warm start)."""

    name = "test-warm-started"

    @property
    def setup_releases(self) -> int:
        return 1

    def setup(self, state: State, ctx: RoundContext) -> State:
        assert ctx.is_setup
        return {**state, "params": state["params"] - ctx.lr * ctx.oracle.gradient(state["params"])}

    def round(self, state: State, ctx: RoundContext) -> State:
        params, opt = self.optimizer.step(state["params"], ctx.oracle.gradient(state["params"]),
                                          unprefixed("opt", state), ctx.lr)
        return {"params": params, **prefixed("opt", opt)}


def test_a_setup_phase_releases_before_round_zero_and_is_planned_for(tmp_path: Path) -> None:
    raw = tiny_config(algorithm={"name": "test-warm-started"}, experiment={"rounds": 4, "eval_every": 2})
    experiment = build_experiment(validate_config(raw))
    plain = build_experiment(validate_config(tiny_config(algorithm={"name": "local"},
                                                         experiment={"rounds": 4, "eval_every": 2})))
    assert experiment.planned_releases == 5 == plain.planned_releases + 1
    assert (experiment.noise_multipliers > plain.noise_multipliers).all()  # calibrated for one more release
    whole = run_experiment(validate_config(raw), tmp_path / "whole", progress=False, log=lambda _: None)
    ledger = json.loads((tmp_path / "whole" / "privacy.json").read_text())
    assert ledger["releases"] == [5, 5, 5, 5]
    assert {run[2] for runs in ledger["ledger"]["agent_runs"] for run in runs} == {-1}  # the first release: setup
    # Resumed after round 2, the setup phase is not run again and the result is the same.
    run_experiment(validate_config(raw), tmp_path / "cut", progress=False, log=lambda _: None, stop_after=2)
    resumed = run_experiment(validate_config(raw), tmp_path / "cut", resume=True, progress=False, log=lambda _: None)
    torch.testing.assert_close(resumed.state["params"], whole.state["params"], rtol=0, atol=0)
    assert json.loads((tmp_path / "cut" / "privacy.json").read_text())["releases"] == [5, 5, 5, 5]


def test_redrawn_graphs_change_per_epoch_and_are_reproducible() -> None:
    raw = tiny_config(topology={"graph": "erdos-renyi", "agents": 8, "p": 0.4, "redraw_every": 3})
    graphs = build_experiment(validate_config(raw)).simulator.graphs
    again = build_experiment(validate_config(raw)).simulator.graphs
    edges = [graphs.at(k).out_edges.tolist() for k in range(9)]
    assert edges[0] == edges[1] == edges[2] and edges[3] == edges[5] and edges[6] == edges[8]
    assert len({str(e) for e in (edges[0], edges[3], edges[6])}) == 3  # a new graph every 3 rounds
    assert [again.at(k).out_edges.tolist() for k in range(9)] == edges
    fixed = build_experiment(validate_config(tiny_config(topology={"graph": "erdos-renyi", "agents": 8, "p": 0.4})))
    assert fixed.simulator.graphs.at(7).out_edges.tolist() == edges[0]  # epoch 0 is the run's own graph
