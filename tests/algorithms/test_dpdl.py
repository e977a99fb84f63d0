"""DPDL and its baselines: the private cross-gradient path, its joint accounting, the NGM reduction,
Muffliato's accelerated gossip and pairwise network DP, and bad input.

Reference values are computed independently: one-sample-at-a-time autograd, dp_accounting, numpy
closed forms and a plain per-agent NGM loop; never read back from the code under test.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from torch.func import functional_call

from decentdp.algorithms.base import RoundContext
from decentdp.algorithms.components.cross_gradients import cross_gradients, reverse_edges
from decentdp.algorithms.dp_cga import DPCGA, CGASettings
from decentdp.algorithms.dpdl import DPDL, DPDLSettings
from decentdp.algorithms.muffliato import accelerated_gossip, dense_mixing
from decentdp.config import validate_config
from decentdp.data.partition import partition
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.gradients.stacked_model import gradient_model
from decentdp.models import build_model, classification_loss
from decentdp.privacy import network_dp
from decentdp.privacy.accounting import epsilon_spent
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import GaussianMechanism
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.sampling import AgentData, PoissonSampler
from decentdp.rng import AgentRandom
from decentdp.runtime.network import SimulatedNetwork
from decentdp.topology import build_topology

DELTA = 1e-5
SHAPE = (1, 4, 4)


def _setup(graph: str = "path", n_agents: int = 3, per_agent: int = 12, batch: int = 5, sigma: float | None = 0.0,
           clip: float = 0.05, model: str = "mlp") -> tuple[DataOracle, SimulatedNetwork, torch.nn.Module]:
    """A tiny oracle (``sigma = None``: non-private) and network over random data."""
    torch.manual_seed(0)
    module = build_model(model, SHAPE, 3, seed=1)
    x = torch.randn(n_agents * per_agent, *SHAPE)
    y = torch.randint(0, 3, (n_agents * per_agent,))
    data = AgentData(x, y, tuple(torch.arange(i * per_agent, (i + 1) * per_agent) for i in range(n_agents)))
    rates = torch.full((n_agents,), min(1.0, batch / per_agent), dtype=torch.float64)
    rng = AgentRandom(5)
    mechanism = None if sigma is None else GaussianMechanism(torch.full((n_agents,), sigma), clip)
    oracle = DataOracle(gradient_model(module, classification_loss), PoissonSampler(data, rates, rng),
                        PrivacyLedger(n_agents, math.inf, DELTA), rng, mechanism, clip)
    network = SimulatedNetwork(build_topology(graph, n_agents, mixing="metropolis-hastings", seed=0))
    return oracle, network, module


def _params(oracle: DataOracle, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    base = oracle.model.initial_parameters()
    return base + 0.3 * torch.randn(oracle.n_agents, base.numel())


def _sample_gradient(module: torch.nn.Module, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One sample's gradient by plain autograd."""
    names = [name for name, _ in module.named_parameters()]
    shapes = [p.shape for _, p in module.named_parameters()]
    flat = flat.detach().clone().requires_grad_(True)
    views = dict(zip(names, (chunk.view(s) for chunk, s in zip(flat.split([math.prod(s) for s in shapes]), shapes,
                                                                 strict=True)), strict=True))
    loss = classification_loss(functional_call(module, views, (x[None],)), y[None])
    (grad,) = torch.autograd.grad(loss, flat)
    return grad


def _mean_gradient(module: torch.nn.Module, flat: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    return torch.stack([_sample_gradient(module, flat, xs[b], ys[b]) for b in range(len(ys))]).mean(0)


def _loop_clipped_sum(module, flat, batch_x, batch_y, mask, clip: float) -> torch.Tensor:
    total = torch.zeros_like(flat)
    for b in range(len(mask)):
        if mask[b] > 0:
            g = _sample_gradient(module, flat, batch_x[b], batch_y[b])
            total += g * min(1.0, clip / float(g.norm()))
    return total


def test_cross_gradients_match_a_plain_loop_over_agents_models_and_samples() -> None:
    oracle, net, module = _setup(sigma=0.0)
    params = _params(oracle)
    oracle.begin(0)
    grads = cross_gradients(params, RoundContext(0, 0.1, net, oracle))
    batch = oracle.sampler.sample(0, 0)  # keys are deterministic: the same batch the round drew
    expected = oracle.expected_batch
    for i in range(3):
        want = _loop_clipped_sum(module, params[i], batch.x[i], batch.y[i], batch.mask[i], oracle.clip_norm)
        torch.testing.assert_close(grads.own[i], want / expected[i], atol=1e-5, rtol=1e-4)
    for e, (src, dst) in enumerate(net.in_edges.tolist()):  # received[e]: dst's model on src's batch
        want = _loop_clipped_sum(module, params[dst], batch.x[src], batch.y[src], batch.mask[src], oracle.clip_norm)
        torch.testing.assert_close(grads.received[e], want / expected[src], atol=1e-5, rtol=1e-4)


def test_reverse_edges_send_each_message_back_along_its_link() -> None:
    _, net, _ = _setup(graph="ring", n_agents=5)
    reverse = reverse_edges(net)
    assert torch.equal(net.in_edges[reverse], net.out_edges.flip(1))


def test_each_released_sum_carries_noise_sigma_c_and_each_owner_pays_one_joint_event() -> None:
    sigma, clip = 3.0, 0.5
    noisy, net, _ = _setup(sigma=sigma, clip=clip, model="mlp")
    clean, _, _ = _setup(sigma=0.0, clip=clip, model="mlp")
    params = _params(noisy)
    noisy.begin(0)
    clean.begin(0)
    a = cross_gradients(params, RoundContext(0, 0.1, net, noisy))
    b = cross_gradients(params, RoundContext(0, 0.1, net, clean))
    batch = noisy.expected_batch
    own_noise = (a.own - b.own) * batch[:, None]
    cross_noise = (a.received - b.received) * batch[net.in_edges[:, 0]][:, None]
    for row in torch.cat([own_noise, cross_noise]):
        assert abs(float(row.std()) / (sigma * clip) - 1) < 0.1  # d is a few hundred: 10% is > 3 std errors
    assert float(torch.corrcoef(torch.stack([own_noise[1], cross_noise[0], cross_noise[1]])).abs().triu(1).max()) < 0.2
    # One release per owner; its event is one sampled Gaussian of multiplier sigma / sqrt(deg + 1).
    assert noisy.ledger.releases().tolist() == [1, 1, 1]
    rate = float(noisy.sample_rates[0])
    epsilons = noisy.ledger.epsilon("rdp")
    for agent, degree in enumerate([1, 2, 1]):  # the path 0 - 1 - 2
        event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma / math.sqrt(degree + 1)))
        want = rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(DELTA)
        assert epsilons[agent] == pytest.approx(want, rel=1e-6)


def test_dpdl_without_noise_or_calibration_and_with_mixing_weights_is_ngm() -> None:
    oracle, net, module = _setup(graph="ring", n_agents=4, per_agent=6, batch=6, sigma=None)  # q = 1: full data
    params = _params(oracle)
    algo = DPDL(DPDLSettings(momentum=0.7, calibration_scale=0.0, cross_coef="mixing"))
    state = algo.init_state(params.clone())
    w = torch.tensor(net.topology.mixing, dtype=torch.float32)
    x, v = params.clone(), torch.zeros_like(params)
    data = oracle.sampler.data
    lr = 0.2
    for k in range(2):
        oracle.begin(k)
        state = algo.round(state, RoundContext(k, lr, net, oracle))
        full = [(data.x[data.indices[j]], data.y[data.indices[j]]) for j in range(4)]
        g = torch.stack([sum(w[i, j] * _mean_gradient(module, x[i], *full[j]) for j in range(4) if w[i, j] > 0)
                         for i in range(4)])
        v_tilde = 0.7 * v + g                                  # NGM momentum (alpha_NGC = 1)
        x, v = w @ (x - lr * v_tilde), w @ v_tilde              # gossip of model and momentum
    torch.testing.assert_close(state["params"], x, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state["momentum"], v, atol=1e-5, rtol=1e-4)


def test_accelerated_gossip_converges_at_the_chebyshev_rate_on_a_ring() -> None:
    n = 16
    net = SimulatedNetwork(build_topology("ring", n, mixing="metropolis-hastings", seed=0), dtype=torch.float64)
    w = dense_mixing(net)
    gap = network_dp.spectral_gap(w)
    gamma = network_dp.chebyshev_gamma(gap)
    rate = math.sqrt(gamma - 1)  # modulus of the recursion's roots in the accelerated regime
    assert rate < 1 - gap  # faster than plain gossip
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    error0 = float((x - x.mean(0)).norm())
    for steps in (10, 20, 40, 80):
        y = accelerated_gossip(net, x.clone(), steps, gamma)
        error = float((y - x.mean(0)).norm())
        torch.testing.assert_close(y.mean(0), x.mean(0))       # the average is kept
        assert error <= 2 * (steps + 1) * rate**steps * error0  # critically damped mode: t rate^t
        plain = float((torch.from_numpy(np.linalg.matrix_power(w, steps)) @ x - x.mean(0)).norm())
        if steps >= 20:
            assert error < plain


def test_pairwise_epsilon_matches_the_authors_formula_by_hand() -> None:
    # Path 0 - 1 - 2 with Metropolis-Hastings (the authors' "hamilton") weights.
    w = np.array([[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]])
    adjacency = (w > 0).astype(float)
    # contrib(W^t, u=0, w=1) = (W^t)_{10}^2 / |(W^t)_{1,:}|^2 = (1/9) / (1/3) = 1/3 for t = 1, 2;
    # the observer v = 2 has the single neighbour 1, so c[0, 2] = 2/3.
    c = network_dp.pairwise_coefficients([w, w @ w], adjacency)
    assert c[0, 2] == pytest.approx(2 / 3)
    assert c[0, 0] == 0.0
    sigma = 1.3
    rdp = network_dp.round_pairwise_rdp(c, np.full(3, sigma), np.ones(3))  # unsampled: no local cap below
    # eps(alpha) = alpha c / (2 sigma^2): a Gaussian of multiplier sigma / sqrt(c), composed over 5 rounds.
    eps = network_dp.pairwise_epsilon(5 * rdp, DELTA)
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / math.sqrt(2 / 3)), 5)
    assert eps[0, 2] == pytest.approx(rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(DELTA),
                                      rel=1e-9)
    # A direct neighbour sees the raw injection (P_0 = I): the local-DP value.
    with_identity = network_dp.pairwise_coefficients([np.eye(3), w], adjacency)
    capped = network_dp.round_pairwise_rdp(with_identity, np.full(3, sigma), np.ones(3))
    np.testing.assert_allclose(capped[0, 1], network_dp.RDP_ORDERS / (2 * sigma**2))


# -- bad input -----------------------------------------------------------------------------------------------
def test_bad_partitions_are_config_errors() -> None:
    labels = np.repeat(np.arange(10), 20)
    for alpha in (0.0, -1.0):
        with pytest.raises(ConfigError) as error:
            partition(labels, 5, "dirichlet", seed=0, alpha=alpha)
        assert error.value.field == "data.dirichlet_alpha"
    with pytest.raises(ConfigError) as error:
        partition(labels, 15, "pathological", seed=0)
    assert error.value.field == "topology.agents"
    parts = partition(labels, 20, "pathological", seed=0)
    assert all(len(set(labels[p].tolist())) == 1 for p in parts) and {len(p) for p in parts} == {10}


def _config(algorithm: str, **settings: Any) -> dict[str, Any]:
    return {
        "experiment": {"name": algorithm, "seed": 0, "rounds": 3, "eval_every": 3},
        "data": {"dataset": "digits", "partition": "dirichlet", "dirichlet_alpha": 1.0},
        "topology": {"graph": "ring", "agents": 4},
        "model": {"name": "linear"},
        "algorithm": {"name": algorithm, "lr": 0.1, "batch_size": 16, **settings},
        "privacy": {"epsilon": 2.0, "accountant": "rdp"},  # RDP: fast at the small sigmas of 3 rounds
    }


@pytest.mark.parametrize("algorithm", ["dpdl", "dp-cga"])
@pytest.mark.parametrize("momentum", [1.0, -0.1])
def test_momentum_outside_zero_one_names_the_field(algorithm: str, momentum: float) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(_config(algorithm, momentum=momentum))
    assert error.value.field == "algorithm.momentum"


def test_a_failing_qp_reuses_the_previous_solution_and_logs_it(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    oracle, net, _ = _setup(graph="ring", n_agents=4, sigma=0.5)
    algo = DPCGA(CGASettings())
    state = algo.init_state(_params(oracle))
    oracle.begin(0)
    state = algo.round(state, RoundContext(0, 0.05, net, oracle))
    solved = state["dual"].clone()
    assert bool((solved[solved != 0] >= 0.5 - 1e-9).all())  # v >= margin where a QP ran

    def fail(*args: Any) -> None:
        raise ValueError("constraints are inconsistent, no solution")

    monkeypatch.setattr("decentdp.algorithms.dp_cga.quadprog.solve_qp", fail)
    oracle.begin(1)
    with caplog.at_level(logging.WARNING, logger="decentdp.algorithms.dp_cga"):
        state = algo.round(state, RoundContext(1, 0.05, net, oracle))
    assert torch.equal(state["dual"], solved) and algo.failures == solved.shape[0] * solved.shape[1]
    assert "previous solution reused" in caplog.text
    assert caplog.text.count("previous solution reused") == solved.shape[1]  # once per tensor, not per QP
    assert bool(torch.isfinite(state["params"]).all())


# -- from a config: calibration for joint releases --------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["dpdl", "dp-dpsgd", "muffliato", "dp-net-fleet", "dp-cga"])
def test_each_algorithm_spends_exactly_its_budget_from_a_config(algorithm: str, tmp_path: Path) -> None:
    result = run_experiment(validate_config(_config(algorithm)), tmp_path / "out", progress=False,
                            log=lambda message: None)
    summary = result.summary
    assert summary["finished"] and summary["refused_releases"] == 0
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    # sigma_i was calibrated for the joint events the ledger charged: the run's accountant reports the
    # budget spent, no more (DP-NET-FLEET's single-sum setup release is priced as a pair: a bit less).
    spent = max(privacy["epsilon_rdp"])
    assert spent == pytest.approx(2.0, rel=3e-2 if algorithm == "dp-net-fleet" else 2e-3)
    assert spent <= 2.0 + 1e-9
    if algorithm == "dpdl":
        # The paper's accounting, labelled: one release a round at a message's multiplier sigma_i sqrt(k_i), the
        # k_i = deg + 1 = 3 sums on a batch (ring) not composed; far below the sound epsilon the ledger charged.
        setup = json.loads((tmp_path / "out" / "setup.json").read_text())
        expected = [epsilon_spent(sigma, 1e-5, rate, 3, 1, "rdp")
                    for sigma, rate in zip(setup["noise_multipliers"], setup["sample_rates"], strict=True)]
        assert privacy["paper_epsilon"] == pytest.approx(expected, rel=1e-9)
        assert summary["paper_epsilon_max"] == pytest.approx(max(expected), rel=1e-9) and max(expected) < spent / 2
        assert "one release a round" in privacy["paper_epsilon_view"]
    if algorithm == "muffliato":
        assert 0 < summary["nonadaptive_epsilon_pairwise_max"] <= summary["epsilon_max"] + 1e-9
        assert len(privacy["nonadaptive_epsilon_pairwise_network"]) == 4
        assert "gradients fixed in advance" in privacy["nonadaptive_assumption"]
        assert (tmp_path / "out" / "pairwise_epsilon.png").exists()


def test_a_run_stopped_between_evaluations_prices_the_rounds_it_ran(tmp_path: Path) -> None:
    """The paper's figure of a run of 5 rounds stopped after 3, evaluated every 2: three rounds' releases (it priced
    the last evaluation's 2 before), and a run stopped before its first round prices nothing (it raised before)."""
    raw = _config("dpdl")
    raw["experiment"] |= {"rounds": 5, "eval_every": 2}
    stopped = run_experiment(validate_config(raw), tmp_path / "out", stop_after=3, progress=False,
                             log=lambda message: None)
    setup = json.loads((tmp_path / "out" / "setup.json").read_text())
    expected = [epsilon_spent(sigma, 1e-5, rate, 3, 1, "rdp")
                for sigma, rate in zip(setup["noise_multipliers"], setup["sample_rates"], strict=True)]
    assert stopped.summary["paper_epsilon_max"] == pytest.approx(max(expected), rel=1e-9)
    nothing = run_experiment(validate_config(raw), None, stop_after=0, progress=False, log=lambda message: None)
    assert "paper_epsilon_max" not in nothing.summary


@pytest.mark.parametrize("algorithm", ["dpdl", "dp-cga"])
def test_the_complete_graph_computes_each_owners_sum_once_and_trains_the_same(
        algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a round on the complete graph every agent holds the same model, so each owner's own gradient and its
    cross-gradients are one sum: the oracle computes it once (:func:`repeated_rows`), and the run is the one that
    computes every row, to rounding."""
    from decentdp.privacy import oracle as oracle_module

    raw = _config(algorithm)
    raw["topology"] = {"graph": "complete", "agents": 4}
    raw["model"] = {"name": "mlp", "options": {"hidden": 16}}
    found = oracle_module.repeated_rows
    repeats: list[int] = []

    def counted(models: torch.Tensor, owners: torch.Tensor) -> Any:
        result = found(models, owners)
        repeats.append(0 if result is None else len(owners) - len(result[0]))
        return result

    monkeypatch.setattr(oracle_module, "repeated_rows", counted)
    once = run_experiment(validate_config(raw), None, progress=False, log=lambda message: None)
    # every agent starts from the same initial model; DPDL's mixing on the complete graph keeps them equal (DP-CGA
    # steps each agent by its own projected direction after mixing, so only its first round repeats): each owner's
    # 3 neighbours' models repeat its own
    assert repeats == ([4 * 3] * 3 if algorithm == "dpdl" else [4 * 3, 0, 0])
    monkeypatch.setattr(oracle_module, "repeated_rows", lambda models, owners: None)
    every = run_experiment(validate_config(raw), None, progress=False, log=lambda message: None)
    torch.testing.assert_close(once.state["params"], every.state["params"], rtol=1e-5, atol=1e-6)


def test_calibration_scales_sigma_by_the_square_root_of_the_sums_per_batch() -> None:
    def sigmas(algorithm: str, graph: str) -> np.ndarray:
        raw = _config(algorithm)
        raw["topology"] = {"graph": graph, "agents": 4}
        return build_experiment(validate_config(raw)).noise_multipliers.double().numpy()

    # A path 0 - 1 - 2 - 3: agents 0 and 3 release 2 sums per batch, agents 1 and 2 release 3.
    np.testing.assert_allclose(sigmas("dpdl", "path") / sigmas("dp-dsgd", "path"),
                               np.sqrt([2, 3, 3, 2]), rtol=1e-6)


def test_the_papers_independent_accounting_is_labelled_and_overspends(tmp_path: Path) -> None:
    config = validate_config(_config("dpdl", accounting="independent") | {
        "experiment": {"name": "loose", "seed": 0, "rounds": 6, "eval_every": 6}})
    result = run_experiment(config, tmp_path / "out", progress=False, log=lambda message: None)
    # Calibrated for 3 independent releases per round, charged as one sqrt(3)C joint event: the true
    # budget runs out before the planned rounds end, and the ledger refuses the rest.
    assert result.summary["refused_releases"] > 0


def test_the_papers_epsilon_bounds_one_message_and_undercounts_all_of_them() -> None:
    """Checked against exact losses, full batches (q = 1, unsampled Gaussian releases, whose T-fold composition is
    exactly mu-GDP): one neighbour's message stream of multiplier s is mu = sqrt(T) / s, and ``paper_epsilon`` bounds
    it; all k messages on one batch together are mu = sqrt(k T) / s, and ``paper_epsilon`` is below that loss (the
    label says so), while the ledger's joint event is not."""
    from decentdp.algorithms.base import RunFacts
    from decentdp.privacy.accounting import gaussian_dp_epsilon

    k, rounds, delta, sigma = 3, 50, 1e-5, 4.0  # sigma: one message's multiplier (sqrt(k) x the calibrated one)
    facts = RunFacts(rounds=rounds, network=lambda t: None, lr=lambda t: 0.1, noise_multipliers=np.full(2, sigma),
                     expected_batches=np.full(2, 10.0), delta=delta, relation="add-remove",
                     local_epsilon=np.zeros(2), sample_rates=np.ones(2), accountant="tight")
    paper = DPDL(DPDLSettings()).privacy_results({}, facts).report["paper_epsilon"]
    one_message = gaussian_dp_epsilon(math.sqrt(rounds) / sigma, delta)
    all_messages = gaussian_dp_epsilon(math.sqrt(k * rounds) / sigma, delta)
    assert all(one_message <= value <= one_message * 1.01 for value in paper)
    assert max(paper) < all_messages
    ledger = epsilon_spent(sigma / math.sqrt(k), delta, 1.0, rounds, 1, "tight")  # one sqrt(k) C joint event a round
    assert ledger >= all_messages
