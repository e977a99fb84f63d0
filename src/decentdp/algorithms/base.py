"""What every decentralized learning algorithm sees of the world, and what it provides to the runtime.

An algorithm is a pure round function over stacked agent state: it receives the state of all the
agents an engine holds (``(N, d)`` tensors, row ``r`` for global agent ``network.agent_ids[r]``)
and a :class:`RoundContext` with the only ways to reach the outside world:

* ``ctx.oracle`` (:class:`~decentdp.privacy.oracle.DataOracle`): private data, clipping and noisy
  releases, charged to the ledger of the agent that released;
* ``ctx.network`` (:class:`Network`): messages to neighbours, which must be releases or
  post-processing of releases (a backend implements three primitives; the rest is built on them);
* ``ctx.plan`` (:class:`RoundPlan`): who is active this round and who pairs with whom;
* ``ctx.public_generator``: public randomness (choices that need no secrecy).

It never indexes other agents' rows, never touches data and never draws private randomness, so the
same code runs in the simulator and in a sharded multi-machine engine.  The runtime implements the
interfaces declared here; imports only point down (runtime -> algorithms -> privacy).

An algorithm is one file: a subclass of :class:`Algorithm` decorated with
:func:`~decentdp.algorithms.registry.register`, with its typed :class:`AlgorithmSettings`.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar

import numpy as np
import torch
from pydantic import AfterValidator, BaseModel, ConfigDict

from decentdp.privacy.oracle import SETUP_ROUND, DataOracle
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.rng import AgentRandom, Stream

if TYPE_CHECKING:
    from decentdp.algorithms.components.schedules import Schedule
    from decentdp.topology import Topology

State = dict[str, torch.Tensor]
T = TypeVar("T")


def ragged_rows_key(key: str) -> str:
    """The companion of a *ragged* per-agent state entry: ``state[key]`` holds each agent's rows one after
    the other, agents in order, and ``state[ragged_rows_key(key)]`` (one int64 per agent) how many are
    each agent's.  Like an entry with one row per agent, the runtime splits and merges it by agent."""
    return f"{key}.rows"


@dataclass(frozen=True, eq=False)
class PublicGraph:
    """The whole run's communication graph and mixing weights, on the host: public, the same in every process.

    Edges are directed ``(src, dst)`` global ids (each undirected link twice), in the run's edge order,
    which fixes each agent's neighbour order (:meth:`neighbours`).  It is what every agent may know of
    the graph (a neighbour's neighbours for TOP-DP's cover, W for Muffliato's accounting, the largest
    in-degree for dp-cga's padding), without a single message."""

    n_agents: int
    edges: np.ndarray         # (E, 2) int64 global (src, dst)
    weights: np.ndarray       # (E,) float64 w_dst,src of each edge
    self_weights: np.ndarray  # (n_agents,) float64 w_ii

    @cached_property
    def in_degrees(self) -> np.ndarray:
        """Neighbours sending to each agent, ``(n_agents,)`` int64."""
        return np.bincount(self.edges[:, 1], minlength=self.n_agents).astype(np.int64)

    @cached_property
    def out_degrees(self) -> np.ndarray:
        """Neighbours each agent sends to, ``(n_agents,)`` int64."""
        return np.bincount(self.edges[:, 0], minlength=self.n_agents).astype(np.int64)

    @cached_property
    def neighbours(self) -> list[list[int]]:
        """Each agent's out-neighbours, in edge order."""
        result: list[list[int]] = [[] for _ in range(self.n_agents)]
        for src, dst in self.edges.tolist():
            result[src].append(dst)
        return result

    def dense_mixing(self) -> np.ndarray:
        """W as an ``(n_agents, n_agents)`` float64 matrix (for dense accounting over small runs only)."""
        w = np.zeros((self.n_agents, self.n_agents))
        w[self.edges[:, 1], self.edges[:, 0]] = self.weights
        w[np.arange(self.n_agents), np.arange(self.n_agents)] = self.self_weights
        return w


class Network(ABC):
    """Message passing among the agents an engine holds (message -> aggregate, as PyG's ``MessagePassing``).

    Rows are local (``agent_ids[r]`` is row ``r``'s global id); edges are directed ``(src, dst)``
    pairs of *global* ids, each undirected link appearing twice.  Messages are built in the order of
    ``out_edges`` (edges leaving local agents) and arrive in the order of ``in_edges`` (edges
    entering local agents); in one process both are the same list.

    A backend describes its agents and edges (the attributes below) and implements three primitives:
    :meth:`rows`, :meth:`exchange` (the one way a message moves) and :meth:`public_graph`.  Every other
    method is built on them here, so a new backend gets it for free.  A backend may override one of them
    with a fused version that returns the same values with less work (as PyG's ``message_and_aggregate``
    replaces message then aggregate): the simulator mixes with one matrix product and lets receivers read
    rows in place, a shard sends each peer shard its halo rows once per call instead of once per edge.
    """

    n_agents: int              # local agents (rows)
    n_total: int               # agents in the whole run
    agent_ids: torch.Tensor    # (n_agents,) global ids of the local rows
    out_edges: torch.Tensor    # (E_out, 2) global (src, dst), src held here
    in_edges: torch.Tensor     # (E_in, 2) global (src, dst), dst held here
    in_weights: torch.Tensor   # (E_in,) mixing weight w_dst,src of each in-edge
    degrees: torch.Tensor      # (n_agents,) neighbours, excluding self

    # -- the primitives every backend implements ----------------------------------------------------------

    @abstractmethod
    def rows(self, agent_ids: torch.Tensor) -> torch.Tensor:
        """Local rows of global ids held here."""

    @abstractmethod
    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        """Deliver per-edge messages ``(E_out, ...)`` built by each edge's sender: ``(E_in, ...)`` as received."""

    @abstractmethod
    def public_graph(self) -> PublicGraph:
        """The whole run's public graph on the host (every agent's edges, not only the local ones), the
        same object for as long as this network lives."""

    # -- built on the primitives; a backend may override each with a fused version ---------------------------

    def aggregate(self, received: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Sum (weighted by ``(E_in,)`` weights if given) what each local agent received: ``(n_agents, ...)``."""
        if weights is not None:
            received = received * weights.reshape(-1, *([1] * (received.dim() - 1)))
        out = torch.zeros(self.n_agents, *received.shape[1:], dtype=received.dtype, device=received.device)
        return out.index_add_(0, self.rows(self.in_edges[:, 1]), received)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Each agent sends its row to all neighbours: ``(E_in, ...)`` as received."""
        return self.exchange(x[self.rows(self.out_edges[:, 0])])

    def neighbor_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``sum_{j in N(i)} x_j`` over neighbours, excluding ``i`` itself."""
        return self.aggregate(self.broadcast(x))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """Gossip averaging ``x_i <- sum_j w_ij x_j`` with the mixing matrix W (a new tensor the caller owns):
        the neighbours' rows weighted by ``in_weights``, plus each agent's own row weighted by ``w_ii``."""
        own = self._self_weights().to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return self.aggregate(self.broadcast(x), self.in_weights.to(x.dtype)).add_(own * x)

    def mix_add(self, x: torch.Tensor, into: torch.Tensor, alpha: float) -> torch.Tensor:
        """``W x + alpha * into``, computed in ``into``'s storage (a temporary the caller owns) and returned."""
        return into.mul_(alpha).add_(self.mix(x))

    def swap(self, x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        """Pairwise exchange: row ``i`` gets the row of global agent ``partner[i]`` (``partner[i]`` = own id: idle).

        Each agent sends its row on the edge to its partner, with a flag saying which edge that is, so that
        a receiver takes a row only from a partner that chose it too; a pair that is not two neighbours
        choosing each other raises ``ValueError``."""
        sender, receiver = self.rows(self.out_edges[:, 0]), self.rows(self.in_edges[:, 1])
        offered = self.exchange(partner[sender] == self.out_edges[:, 1])   # per in-edge: its sender chose its receiver
        values = self.exchange(x[sender])
        taken = partner[receiver] == self.in_edges[:, 0]                   # per in-edge: from the receiver's partner
        got = torch.zeros(self.n_agents, dtype=torch.bool, device=partner.device)
        got[receiver[taken & offered]] = True
        lonely = (partner != self.agent_ids) & ~got
        if bool(lonely.any()):
            row = int(torch.nonzero(lonely)[0, 0])
            raise ValueError(f"agents {int(self.agent_ids[row])} and {int(partner[row])} are not a pair of "
                             "neighbours in this round")
        out = x.clone()
        out[receiver[taken]] = values[taken]
        return out

    def exchange_rows(self, rows: torch.Tensor, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Out-edge ``e`` carries ``rows[pick[e]]``, where ``rows`` starts with the ``n_agents`` local rows
        (several edges may carry one row).  Returns ``(received, index)``: the rows the receivers hold,
        starting with ``rows`` itself, and per in-edge the index of the row it received.  What arrives is
        :meth:`exchange` of ``rows[pick]`` (TOP-DP's last-round messages), which this builds; a fused version
        need form no ``(E, ...)`` message tensor."""
        arrived = self.exchange(rows.index_select(0, pick))
        return torch.cat([rows, arrived]), len(rows) + torch.arange(len(arrived), device=pick.device)

    def _self_weights(self) -> torch.Tensor:
        """``w_ii`` of each local row, from the public graph (once per graph), in ``in_weights``' dtype and device."""
        return once_per_graph(self, "self weights", lambda: torch.as_tensor(
            self.public_graph().self_weights[host_graph(self).agent_ids.numpy()], dtype=self.in_weights.dtype,
            device=self.in_weights.device))


@dataclass(frozen=True)
class HostGraph:
    """A network's static index tensors, copied to the host once (see :func:`host_graph`)."""

    agent_ids: torch.Tensor  # (n_agents,) global ids of the local rows
    in_edges: torch.Tensor   # (E_in, 2)
    out_edges: torch.Tensor  # (E_out, 2)
    in_rows: torch.Tensor    # (E_in,) local row of each in-edge's receiver


_PER_GRAPH: dict[tuple[int, str], Any] = {}


def once_per_graph(network: Network, name: str, compute: Callable[[], T]) -> T:
    """``compute()`` once for as long as ``network``'s graph lives, then the same value.

    Keyed by the identity of the network's ``in_edges`` tensor, which lives exactly as long as its
    graph (wrappers made per round, such as the profiler's, share it), and dropped with it."""
    key = (id(network.in_edges), name)
    if key not in _PER_GRAPH:
        _PER_GRAPH[key] = compute()
        weakref.finalize(network.in_edges, _PER_GRAPH.pop, key, None)
    return _PER_GRAPH[key]


def host_graph(network: Network) -> HostGraph:
    """The network's ids and edges on the host, for bookkeeping (data owners, noise keys, receivers).

    Read back from the device once per graph, not every round: a read-back waits for everything
    queued on an accelerator."""
    return once_per_graph(network, "host", lambda: HostGraph(
        network.agent_ids.cpu(), network.in_edges.cpu(), network.out_edges.cpu(),
        network.rows(network.in_edges[:, 1]).cpu()))


@dataclass(frozen=True)
class RoundPlan:
    """Who takes part in a round: ``active`` agents (a boolean mask over local rows) and, for pairwise
    protocols, ``partner`` (global ids; an agent's own id when it is unpaired), on the engine's device;
    ``active_by_id``: every agent's activity, local or not, indexed by global id (the plan is public), which
    an agent reads to know whether a neighbour held by another process sends this round.

    ``active_on_host`` and ``partner_on_host`` are the same values as the scheduler drew them, on the
    host: bookkeeping (the oracle's, an algorithm's noise plan) reads them, so that planning a round
    never reads a value back from the device."""

    active: torch.Tensor
    active_by_id: torch.Tensor
    active_by_id_on_host: np.ndarray
    partner: torch.Tensor | None = None
    active_on_host: np.ndarray | None = None
    partner_on_host: np.ndarray | None = None

    @property
    def everyone_active(self) -> bool:
        """Whether every agent of the run is active, on every process alike (a shard deciding from its own
        agents alone would take another branch than its peers, and their exchanges would not meet)."""
        return bool(self.active_by_id_on_host.all())

    def neighbour_active(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether the agents of global ``ids`` (neighbours, on any process) are active this round."""
        return self.active_by_id[ids]


@dataclass(frozen=True)
class RoundContext:
    """Everything a round may use besides the algorithm's own state.

    ``plan`` is ``None`` for a synchronous round where every agent is active; ``rng`` gives public
    randomness (absent in unit tests that need none).
    """

    round_index: int
    lr: float
    network: Network
    oracle: DataOracle
    plan: RoundPlan | None = None
    rng: AgentRandom | None = None

    @property
    def is_setup(self) -> bool:
        """Whether this is the setup phase before round 0 (e.g. a private warm start)."""
        return self.round_index == SETUP_ROUND

    def public_generator(self, step: int = 0) -> torch.Generator:
        """A generator of public random choices for this round, keyed by (seed, round, step); it carries
        no secret, so nothing drawn from it may protect privacy."""
        if self.rng is None:
            raise RuntimeError("this context has no random streams")
        return self.rng.round_generator(self.round_index, Stream.PUBLIC, step)


@dataclass(frozen=True)
class PublicRun:
    """What every agent can compute before the first round: each round's network and public generator, and
    each agent's expected batch as the oracle holds it (float32), for an algorithm that calibrates on the
    public choices its rounds will make (TOP-DP's covers).  It must draw exactly as its rounds do."""

    network: Callable[[int], Network]
    generator: Callable[[int], torch.Generator]
    expected_batches: np.ndarray


@dataclass(frozen=True)
class NoisePlan:
    """What a run plans, for an algorithm that calibrates its own noise (:meth:`Algorithm.calibrate`):
    everything is public (budgets, sizes, graph degrees), one entry per agent where it is a list."""

    budgets: list[float]          # epsilon_i
    delta: float
    sample_rates: list[float]     # q_i = L / |D_i|
    sizes: list[int]              # |D_i|
    rounds: int                   # T
    dim: int                      # d, the number of parameters
    clip: float                   # C
    accountant: str               # the run's accountant (calibration and budgets)
    relation: str                 # neighbouring relation
    participation: float          # the probability that an agent takes part in a round (1 - offline, sampled)
    degrees: list[int]            # neighbours per agent in the run's first graph
    neighbours: list[list[int]]   # each agent's neighbours in the run's first graph
    redrawn: bool                 # whether the graph is redrawn during the run (any agent may meet any other)
    public: PublicRun | None = None  # the run's public choices, replayable (None: plan for the worst case)
    colluding: list[list[int]] = field(default_factory=list)  # privacy.colluding: sets that pool their views
    period: int | None = None     # cyclic sampling: b, the batches each agent's records are split into (None: Poisson)
    noise: str = "simulation"     # privacy.noise


@dataclass(frozen=True)
class Calibrated:
    """An algorithm's own calibration: the mechanism its rounds start from, the noise multiplier of
    each agent (``setup.json`` and the summary show them), and what the paper states about it (a
    JSON-ready dict, reported beside our accounting)."""

    mechanism: Any
    noise_multipliers: list[float]
    paper_accounting: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)  # how our own calibration sized the noise (setup.json)
    observer: str | None = None  # who the budgets' epsilon names, when not every observer together (privacy.json)
    notices: list[str] = field(default_factory=list)  # what the run must tell its user about this noise (warnings)


@dataclass(frozen=True)
class RunFacts:
    """What is public about a run once it ends, for an algorithm's own privacy results
    (:meth:`Algorithm.privacy_results`): its graphs, steps, noise and each agent's per-release epsilon."""

    rounds: int                                # rounds run
    network: Callable[[int], Network]          # the network of round k
    lr: Callable[[int], float]                 # the step size of round k
    noise_multipliers: np.ndarray              # sigma_i (0 in a non-private run)
    expected_batches: np.ndarray               # L_i = q_i |D_i|
    delta: float
    relation: str                              # privacy.neighbouring
    local_epsilon: np.ndarray                  # each agent's reported epsilon over all its releases (agent view)
    sample_rates: np.ndarray | None = None     # q_i (None: price every release unsampled, q = 1)
    colluding: list[list[int]] = field(default_factory=list)  # privacy.colluding
    accountant: str = "tight"                  # privacy.accountant


#: The largest float32: parameters, steps and noise scales are float32 tensors, so a value above it overflows.
FLOAT32_MAX = 3.4028234663852886e38


def _within_float32(value: float | None) -> float | None:
    if value is not None and value > FLOAT32_MAX:
        raise ValueError(f"{value:g} is above the largest float32 ({FLOAT32_MAX:.4g}), the type of the tensors it "
                         "scales")
    return value


#: A float that multiplies float32 tensors (a config's learning rate and clip, an algorithm's noise scales).
Float32 = Annotated[float, AfterValidator(_within_float32)]


class AlgorithmSettings(BaseModel):
    """An algorithm's own settings (fields of the config's ``[algorithm]`` section besides the common
    ones); subclasses add typed, ranged fields, validated like every other config section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class Algorithm(ABC):
    """A decentralized learning algorithm as a round function over stacked agent state."""

    name: ClassVar[str]
    #: The typed settings this algorithm reads from ``[algorithm]``.
    Settings: ClassVar[type[AlgorithmSettings]] = AlgorithmSettings
    #: True when all agents' data are pooled into one agent (central training baselines).
    pools_data: ClassVar[bool] = False
    #: Whether its agents send messages at all.  One that never does (local training, and the pooled baselines that
    #: build on it) reads no ``[topology]`` field but ``agents``, and a run that sets one is told it changes nothing
    #: (:meth:`~decentdp.config.schema.ExperimentConfig.unread_by_the_algorithm`).
    communicates: ClassVar[bool] = True
    #: Whether its rounds weight messages with the topology's mixing matrix (``topology.mixing``).  The others
    #: weight their neighbours in their own update rule, and a run that names a mixing is told it changes nothing
    #: (``tests/algorithms/test_every_setting_is_read.py`` checks the flag against runs under two mixings).
    reads_mixing: ClassVar[bool] = True
    #: Round schedules the algorithm supports (``schedule.kind``); the first is its default.
    schedules: ClassVar[tuple[str, ...]] = ("synchronous",)
    #: Whether the round reads ``ctx.plan`` so that inactive agents neither send, receive nor move
    #: (required for ``schedule.offline_probability > 0``).
    follows_plan: ClassVar[bool] = False
    #: Whether it reports each sender's epsilon towards each ``privacy.colluding`` set (``epsilon_colluding``: an
    #: observer-view accountant over the run's messages).  The others report one epsilon that bounds every observer
    #: at once, all other agents together, so a colluding set adds nothing there and is refused.
    reports_colluding: ClassVar[bool] = False
    #: Whether the budgets' epsilon (the ledger's) bounds every observer together.  DECOR's names one curious
    #: agent or colluding set (its everyone-together loss is ``epsilon_local``), so what pools every agent's
    #: model, such as a private selection's score, cannot be priced on its ledger.
    budgets_bound_everyone: ClassVar[bool] = True
    #: How its agents may draw their batches (``data.sampling``); the first is its default.  ``poisson``:
    #: independent Poisson batches every round (amplified by sampling); ``cyclic``: each agent's records split
    #: once into ``b`` fixed batches, batch ``t mod b`` in round ``t`` (:class:`~decentdp.privacy.sampling.
    #: CyclicSampler`; each release unsampled, and a record's rounds are those of its batch alone).  Cyclic runs
    #: charge each agent its first release of each pass over its batches, which covers an algorithm whose one
    #: release a round uses the run's fixed mechanism for all its neighbours; an algorithm opts in once that holds
    #: (per-receiver releases or noise that changes by round would need a charge per release instead).
    samplings: ClassVar[tuple[str, ...]] = ("poisson",)
    #: Why the samplings it lacks are refused (said with the refusal).
    sampling_note: ClassVar[str] = ("cyclic runs charge an agent once per pass over its batches, which covers one "
                                    "release a round with the run's fixed mechanism; this algorithm has not been "
                                    "shown to release only that way")
    #: Whether its releases carry noise.  One that adds none (``no-noise``, a non-private reference) is refused
    #: any finite budget: its run must say it is not private, ``privacy.epsilon = 'inf'``.
    adds_noise: ClassVar[bool] = True
    #: Why a private run of it needs one fixed graph (``topology.redraw_every = 0``), or ``None`` where a graph
    #: redrawn during the run serves.
    fixed_graph_reason: ClassVar[str | None] = None
    #: Why a private run of it needs a finite budget for every agent (no ``'inf'`` entry in
    #: ``privacy.agent_epsilons``), or ``None`` where a non-private agent may run beside private ones.
    finite_budgets_reason: ClassVar[str | None] = None
    #: The ``privacy.noise`` modes a private run of it can draw its noise in.
    noise_modes: ClassVar[tuple[str, ...]] = ("simulation", "secure")
    #: Why the noise modes it lacks are refused (said with the refusal).
    noise_mode_note: ClassVar[str] = ""

    @classmethod
    def from_settings(cls, settings: Any) -> Algorithm:
        """Build the algorithm from its validated settings (default: no settings)."""
        return cls()

    def calibrate(self, plan: NoisePlan) -> Calibrated | None:
        """The algorithm's own noise calibration for a private run, or ``None`` for the run's default (a
        Gaussian mechanism calibrated for ``releases_per_round`` sampled releases per round).  Raise
        :class:`~decentdp.errors.ConfigError` for a plan it cannot serve (called before anything is written, but after
        the data loads: what the config alone decides is refused at config time, by the class's flags above)."""
        return None

    @property
    def releases_per_round(self) -> int:
        """Noisy gradient releases each active agent makes per round; noise calibration plans for these."""
        return 1

    def sums_per_batch(self, degrees: np.ndarray) -> np.ndarray:
        """Sums each agent releases on one batch per release, given its neighbour counts (1 by default)."""
        return np.ones(len(degrees), dtype=np.int64)

    @property
    def joint_accounting(self) -> bool:
        """How calibration prices ``k_i = sums_per_batch`` sums on one batch.  True (sound, the default):
        one Gaussian of sensitivity ``sqrt(k_i) C`` (specs A.4), so the multiplier calibrated for the
        planned releases is scaled by ``sqrt(k_i)``.  False: ``k_i`` independently sampled releases,
        the looser accounting a paper may use; the ledger still charges the joint event."""
        return True

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """The algorithm's own privacy results of a finished run, from its final state and what is public about
        it (e.g. Muffliato's pairwise network DP, priced by :mod:`decentdp.privacy.observer_pricing`); default
        none."""
        return AlgorithmPrivacy()

    @property
    def setup_releases(self) -> int:
        """Noisy gradient releases each agent makes in the setup phase; calibration plans for them too."""
        return 0

    @property
    def round_temporaries(self) -> int:
        """``(N, d)`` matrices a round allocates besides its state at its peak (gradient sums, mixing
        outputs, updates), with some slack for the allocator; the memory plan budgets them."""
        return 3

    def memory_refusal(self, agents: int, dim: int, rounds: int, limit_bytes: int | None) -> Exception | None:
        """For a private run of ``rounds`` rounds, a clearer refusal than the memory plan's own (and before any
        calibration) when what this algorithm keeps per agent cannot fit ``limit_bytes`` (``None``: no limit
        known), e.g. a history of past noise; default none."""
        return None

    def stability_warnings(self, topology: Topology, schedule: Schedule) -> list[str]:
        """Settings under which this algorithm's round diverges on the run's (first) graph with the run's
        learning-rate schedule, one message each, announced when the run starts (default: none)."""
        return []

    @abstractmethod
    def init_state(self, params: torch.Tensor) -> State:
        """Initial state from the agents' initial parameters ``(N, d)`` (key ``params`` holds them)."""

    def setup(self, state: State, ctx: RoundContext) -> State:
        """The setup phase before round 0 (``ctx.is_setup``), with releases of its own; default: none."""
        return state

    @abstractmethod
    def round(self, state: State, ctx: RoundContext) -> State:
        """One round: every active agent computes from the previous round's values (Jacobi)."""


class SettingsAlgorithm(Algorithm):
    """An algorithm that keeps its validated settings as ``self.settings`` (built by ``from_settings``)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    @classmethod
    def from_settings(cls, settings: Any) -> Algorithm:
        return cls(settings)


def prefixed(prefix: str, state: State) -> State:
    """Namespace a sub-state (e.g. an optimizer's) inside an algorithm's flat state dict."""
    return {f"{prefix}.{key}": value for key, value in state.items()}


def unprefixed(prefix: str, state: State) -> State:
    """The sub-state stored under ``prefix`` by :func:`prefixed`."""
    start = len(prefix) + 1
    return {key[start:]: value for key, value in state.items() if key.startswith(prefix + ".")}
