"""The brute-force privacy harness's tracing machinery, shared by the test files that use it.

An algorithm's own round code runs with every source traced (see ``test_privacy_harness.py``'s docstring):
:func:`traced_run` returns the run, its :class:`Sources` and the log of what every message carried;
:func:`exact_epsilon` computes an observer's exact loss from that log, independently of the library's
accountants; :func:`violations` lists every reported epsilon below it.  It is a module of its own (not a
test file) so that each test file imports it under one name.
"""


from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
from tests.conftest import tiny_config

from decentdp.algorithms import algorithm_class, algorithm_names
from decentdp.config import validate_config
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_facts
from decentdp.privacy import oracle as oracle_module
from decentdp.privacy.accounting import gaussian_dp_epsilon
from decentdp.privacy.oracle import DataOracle
from decentdp.runtime.network import GraphSequence, SimulatedNetwork
from decentdp.runtime.simulator import Simulator

DELTA = 1e-5

#: Algorithms the harness does not trace, and why.
NOT_TRACED = {
    "dpdl": "cosine-similarity weights of received rows (eq. 15-16) are not linear; its released sums are checked "
            "against their exact loss in test_sampled_exact_untraced.py",
    "dp-cga": "the quadratic-program projection is not linear; its released sums are checked against their exact "
              "loss in test_sampled_exact_untraced.py",
    "li18": "Laplace noise: not a linear-Gaussian view",
    "central-dpsgd": "one pooled agent sends no message; its released sums are checked against their exact loss "
                     "in test_sampled_exact_untraced.py",
    "no-noise": "non-private: every reported epsilon is infinite",
}

#: Settings that keep a traced algorithm linear (the privacy events do not depend on them).
LINEAR_SETTINGS: dict[str, dict[str, Any]] = {
    "dp-dinno": {"optimizer": "sgd", "momentum": 0.0},
    "dp-dpsgd": {"optimizer": "sgd"},
    "local": {"optimizer": "sgd"},
}

#: Algorithms that report each ``privacy.colluding`` set's epsilon (``epsilon_colluding``).
REPORTS_COLLUDING = {"decor", "mafalda-sgd", "muffliato", "zip-dl"}

#: Algorithms that sample cyclically (``data.sampling = 'cyclic'``, ``b`` batches): the exact loss lets one record
#: move the data terms of one participation class (round mod b) only.
CYCLIC = {"mafalda-sgd"}

#: Agents go offline and re-pair with earlier partners (TOP-DP's Alg. 2: the issue's item 3(B)); UDP's sampled users
#: sit out rounds, so its receivers mix fewer messages and its senders release fewer.
SCHEDULES = {"top-dp-async": {"kind": "pairing", "offline_probability": 0.3},
             "udp": {"kind": "sampled", "participation": 0.6}}
#: Algorithms built for one fixed graph, which refuse ``topology.redraw_every``.
FIXED_GRAPH = {"decor", "mafalda-sgd"}
#: Each schedule kind's settings when the harness runs it (offline agents and sampled users included).
SCHEDULE_SETTINGS = {"synchronous": {"kind": "synchronous"}, **{entry["kind"]: entry for entry in SCHEDULES.values()}}


class Sources:
    """The traced coordinates: kind, owner (data) or holder (noise; both ends of an edge secret) of each."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.kind: list[str] = []
        self.agent: list[int] = []
        self.partner: list[int] = []   # the other end of an edge secret, -1 for an agent's own draw
        self.round: list[int] = []     # the round a data term was released in (-1 for noise)

    def fresh(self, kind: str, agents: list[int], partners: list[int] | None = None,
              round_index: int = -1) -> torch.Tensor:
        start = len(self.kind)
        if start + len(agents) > self.capacity:
            raise RuntimeError("the harness's capacity is too small for this run")
        self.kind += [kind] * len(agents)
        self.agent += agents
        self.partner += partners if partners is not None else [-1] * len(agents)
        self.round += [round_index] * len(agents)
        rows = torch.zeros(len(agents), self.capacity, dtype=torch.float64)
        rows[torch.arange(len(agents)), torch.arange(start, start + len(agents))] = 1.0
        return rows


class TracingNoiseDraw:
    """Stands in for :class:`~decentdp.privacy.mechanisms.NoiseDraw`: a draw is a fresh noise coordinate."""

    sources: Sources
    exact = False  # the continuous path: every draw a coordinate

    def __init__(self, rng: Any, agent_ids: Any, round_index: int, release: int) -> None:
        self.agent_ids = agent_ids.tolist() if isinstance(agent_ids, torch.Tensor) else list(agent_ids)
        self.round_index = round_index

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64

    def normal(self, rows: Any, out: torch.Tensor, slots: Any = None, workers: int = 1) -> torch.Tensor:
        return out.copy_(self.sources.fresh("noise", [self.agent_ids[r] for r in rows]))

    def edge_normal(self, edges: Any, dim: int) -> torch.Tensor:
        """A fresh noise coordinate per edge, held by both its ends (an edge secret)."""
        return self.sources.fresh("noise", [i for i, _ in edges], [j for _, j in edges])


class TracingOracle(DataOracle):
    """A :class:`DataOracle` whose clipped sums are fresh data coordinates (one per row, its owner's)."""

    sources: Sources

    def _compute(self, models: torch.Tensor, batch: Any, owners: Any, host: torch.Tensor, out: torch.Tensor,
                 index: int) -> None:
        out.copy_(self.sources.fresh("data", self._host_ids[host].tolist(), round_index=self.round_index))


class TracingNetwork:
    """The round's network, recording the rows each message carries to its receiver."""

    def __init__(self, inner: SimulatedNetwork, log: list[tuple[np.ndarray, torch.Tensor]]) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _edges(self, x: torch.Tensor) -> None:
        src, dst = self.inner.in_edges[:, 0], self.inner.in_edges[:, 1]
        self.log.append((dst.numpy(), x[src].clone()))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        self._edges(x)
        return self.inner.mix(x)

    def mix_add(self, x: torch.Tensor, into: torch.Tensor, alpha: float) -> torch.Tensor:
        self._edges(x)
        return self.inner.mix_add(x, into, alpha)

    def neighbor_sum(self, x: torch.Tensor) -> torch.Tensor:
        self._edges(x)
        return self.inner.neighbor_sum(x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        self._edges(x)
        return self.inner.broadcast(x)

    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        self.log.append((self.inner.out_edges[:, 1].numpy(), messages.clone()))
        return self.inner.exchange(messages)

    def swap(self, x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        moved = partner != self.inner.agent_ids
        self.log.append((np.flatnonzero(moved.numpy()), x[partner[moved]].clone()))
        return self.inner.swap(x, partner)

    def exchange_rows(self, rows: torch.Tensor, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.log.append((self.inner.out_edges[:, 1].numpy(), rows[pick].clone()))
        return self.inner.exchange_rows(rows, pick)


#: A setting the property test varies, per algorithm that has it: TOP-DP's and its baselines' mixing weight
#: (which sets how much neighbour noise is reused), Muffliato's gossip steps K.
VARIED = {**{name: "alpha" for name in ("top-dp", "top-dp-async", "optimal", "udp")}, "muffliato": "gossip_steps"}
VALUES = {"alpha": [0.25, 0.5, 0.75], "gossip_steps": [1, 2, 4]}


def traced_run(name: str, n: int, p: float, seed: int, rounds: int, epsilon: float = 2.0, graph: str = "erdos-renyi",
               settings: dict[str, Any] | None = None, relation: str = "add-remove",
               colluding: list[list[int]] | None = None, data: dict[str, Any] | None = None,
               agent_epsilons: list[float] | None = None, schedule: dict[str, Any] | None = None,
               redraw_every: int = 0) -> tuple[Any, Sources, list[tuple[np.ndarray, torch.Tensor]]]:
    """Run ``rounds`` rounds of algorithm ``name`` with full batches on a random graph (or ``graph``), traced
    (``data``: e.g. cyclic sampling's ``{"sampling": "cyclic", "batches": b}``, each batch then a full share;
    ``agent_epsilons``: a budget per agent instead of ``epsilon``; ``schedule``: instead of the algorithm's
    :data:`SCHEDULES` entry or default; ``redraw_every``: a new random graph every that many rounds)."""
    raw = tiny_config(experiment={"rounds": rounds, "eval_every": rounds, "seed": seed}, data=data or {},
                      topology={"graph": graph, "agents": n, **({"p": p} if graph == "erdos-renyi" else {}),
                                **({"redraw_every": redraw_every} if redraw_every else {})},
                      algorithm={"name": name, "batch_size": 10_000, "lr": 0.3, **LINEAR_SETTINGS.get(name, {}),
                                 **(settings or {})},
                      privacy={**({"agent_epsilons": agent_epsilons} if agent_epsilons else {"epsilon": epsilon}),
                               "delta": DELTA, "clip": 1.0, "neighbouring": relation,
                               # the others refuse a colluding set: their one epsilon bounds all observers together
                               "colluding": colluding or [] if name in REPORTS_COLLUDING else []},
                      **({"schedule": schedule or SCHEDULES[name]} if schedule or name in SCHEDULES else {}))
    experiment = build_experiment(validate_config(raw))
    sources = Sources(capacity=64 * n * (rounds + 1))
    old = experiment.oracle
    oracle = TracingOracle(old.model, old.sampler, experiment.ledger, old.rng, old.mechanism, old.clip_norm)
    oracle.sources = TracingNoiseDraw.sources = sources
    log: list[tuple[np.ndarray, torch.Tensor]] = []
    built = experiment.graphs   # fixed, or redrawn every topology.redraw_every rounds: each graph in float64
    graphs = GraphSequence(SimulatedNetwork(experiment.topology, dtype=torch.float64),
                           lambda epoch: SimulatedNetwork(built.at(epoch * built.redraw_every).topology,
                                                          dtype=torch.float64),
                           built.redraw_every) if built.redraw_every else \
        GraphSequence(SimulatedNetwork(experiment.topology, dtype=torch.float64))
    simulator = Simulator(experiment.algorithm, graphs, oracle, experiment.simulator.scheduler,
                          experiment.simulator.schedule, experiment.simulator.rng,
                          wrap_network=lambda net: TracingNetwork(net, log))
    experiment.simulator, experiment.oracle, experiment.graphs = simulator, oracle, simulator.graphs
    saved = oracle_module.NoiseDraw
    oracle_module.NoiseDraw = TracingNoiseDraw
    try:
        state = experiment.algorithm.init_state(torch.zeros(n, sources.capacity, dtype=torch.float64))
        state = simulator.setup(state)
        state = simulator.run(state, 0, rounds, lambda k, s: True)
    finally:
        oracle_module.NoiseDraw = saved
    experiment.final_state = state
    return experiment, sources, log


def exact_epsilon(sources: Sources, log: list[tuple[np.ndarray, torch.Tensor]], observer: list[int],
                  sender: int, relation: str = "add-remove", period: int | None = None) -> float:
    """The exact epsilon at DELTA of ``sender`` towards ``observer`` (see the module docstring); with ``period``
    (cyclic sampling) a record moves the data terms of the rounds of one class ``t mod period`` only, so the
    supremum is the largest over the classes."""
    rows = [x[np.isin(receivers, observer)] for receivers, x in log
            if x.shape[-1] == sources.capacity]   # (narrower messages carry public values, e.g. batch sizes)
    seen = torch.cat(rows).numpy() if rows else np.zeros((0, sources.capacity))
    padding = sources.capacity - len(sources.kind)
    kind, agent = np.array(sources.kind + [""] * padding), np.array(sources.agent + [-1] * padding)
    partner = np.array(sources.partner + [-1] * padding)
    unknown = (kind == "noise") & ~np.isin(agent, observer) & ~np.isin(partner, observer)
    own = (kind == "data") & (agent == sender)
    a = seen[:, own]
    if not a.any():
        return 0.0
    b = seen[:, unknown]
    covariance = b @ b.T
    inverse = np.linalg.pinv(covariance, rcond=1e-10, hermitian=True)
    if not np.allclose(covariance @ inverse @ a, a, atol=1e-7 * np.abs(a).max()):
        return math.inf
    m = a.T @ inverse @ a
    classes = np.array(sources.round + [-1] * padding)[own] % period if period else np.zeros(m.shape[0], dtype=int)
    best = max(float(np.array(s) @ m[np.ix_(members, members)] @ np.array(s))
               for members in (np.flatnonzero(classes == k) for k in np.unique(classes))
               for s in itertools.product([-1.0, 1.0], repeat=len(members)))
    sensitivity = 2.0 if relation == "replace-one" else 1.0   # a replaced record moves a clipped sum by 2C
    return gaussian_dp_epsilon(sensitivity * math.sqrt(max(best, 0.0)), DELTA)


def reported_epsilons(experiment: Any, rounds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                             list[np.ndarray]]:
    """Each agent's epsilon towards every other agent together (the ledger's, or ``epsilon_local`` where the
    ledger names a narrower observer, as DECOR's pairwise budgets do), towards any single agent or
    ``privacy.colluding`` set (the ledger's), where the algorithm reports them the pairwise matrix eps(u -> v)
    and each colluding set's column (``nan`` for its members)."""
    ledger = experiment.ledger.reported_epsilon()[0]
    extras = experiment.algorithm.privacy_results(experiment.final_state, run_facts(experiment, rounds)).report
    everyone = np.array(extras["epsilon_local"], dtype=float) if "epsilon_local" in extras else ledger
    prefix = "nonadaptive_" if "nonadaptive_epsilon_pairwise_network" in extras else ""  # checked for fixed gradients
    pairwise = extras.get(f"{prefix}epsilon_pairwise_network")
    sets = [np.array(entry["epsilon"], dtype=float) for entry in extras.get(f"{prefix}epsilon_colluding", [])]
    return everyone, ledger, None if pairwise is None else np.array(pairwise, dtype=float), sets


def library_algorithms() -> set[str]:
    """The algorithms the package registers (tests register toy ones of their own in the same process)."""
    return {name for name in algorithm_names() if algorithm_class(name).__module__.startswith("decentdp.")}


TRACED = sorted(library_algorithms() - set(NOT_TRACED))


def violations(experiment: Any, sources: Sources, log: list[tuple[np.ndarray, torch.Tensor]], rounds: int,
               period: int | None, relation: str, colluding: list[int]) -> tuple[list[tuple[Any, ...]], np.ndarray]:
    """Every reported epsilon below the exact loss of its observer (sender, observer, reported, exact), and each
    sender's exact loss towards all the others together."""
    n = experiment.data.n_agents
    together, single, pairwise, sets = reported_epsilons(experiment, rounds)
    found, everyone = [], np.zeros(n)
    for sender in range(n):
        others = [v for v in range(n) if v != sender]
        everyone[sender] = exact_epsilon(sources, log, others, sender, relation, period)
        checks = [("all others", together[sender], everyone[sender])]
        for v in others:
            exact = exact_epsilon(sources, log, [v], sender, relation, period)
            checks += [(v, single[sender], exact)] + ([(v, pairwise[sender, v], exact)] if pairwise is not None else [])
        if sender not in colluding:
            exact = exact_epsilon(sources, log, colluding, sender, relation, period)
            checks += [("colluding", reported[sender], exact) for reported in sets]
        found += [(sender, observer, reported, exact) for observer, reported, exact in checks
                  if reported < exact - 1e-6]
    return found, everyone
