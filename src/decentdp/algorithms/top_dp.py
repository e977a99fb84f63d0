"""TOP-DP, synchronous: Guo et al., Algorithm 1 (topology-aware noise, time-aware decay, eqs. 3-6).

Each agent keeps its local estimate ``x~_i`` and the last message each neighbour sent it.  Setup
(lines 4-6): one noisy step from the common start, sent to every neighbour.  Round ``t``::

    sigma_{t,i} = sigma_{0,i} gamma^floor(t / period)                                  (line 8, eq. 6b)
    g_i = clipped gradient sum on a Poisson batch                                      (line 9, eq. 6a)
    cover: for k in N_i in random order, j in N_i^* n N_i^k uses k's message            (lines 10-17, eq. 4)
    x~_i^j = alpha x~_i + (1 - alpha) x~_k^i - lambda (g_i + G_i^j) / L_i,  G_i^j ~ N(0, (sigma_i^j C)^2)
                                                                                      (lines 15-16, eq. 5c)
    x~_i  <- alpha x~_i + (1 - alpha) x~_{j*}^i - lambda (g_i + G_i) / L_i,  j* in N_i   (lines 18-19)
    uncovered j receive the new x~_i                                                   (lines 20-22)

All messages of a round are one stacked release: the agents' sums are computed once and repeated
per cover group (:meth:`~decentdp.privacy.oracle.DataOracle.repeat`), each row with its own noise.
The receivers ``j`` that one neighbour ``k`` covers (lines 14-16) all get the same expression; they
get one message (one noise draw), not one per receiver: each receiver alone sees the same
distribution either way (view a), and colluding receivers learn less from one copy than from several
independent ones (view b).  The mixes of eq. 5c and line 19 are applied to those ``N + G`` released
rows (``G`` groups, ordered by sender) in place, as one sparse product that reads each row's own and
received estimate where it lies (:func:`add_selected`).

The state is the senders' side, per agent: ``params`` (the local estimates), ``messages`` (each agent's
group messages, agents in order; ``messages.rows`` counts each agent's, a ragged per-agent entry, see
:func:`~decentdp.algorithms.base.ragged_rows_key`) and ``pick`` (per agent, for each out-neighbour
its global id and what it gets: 0 for the local estimate, ``1 + m`` for message ``m``, lines 20-22;
a neighbour of a redrawn graph that is not in it gets the estimate, as in line 6).  A round first
delivers the last round's messages with :meth:`~decentdp.algorithms.base.Network.exchange_rows`
(in one process the receivers read the released rows in place: no ``(E, d)`` tensor is formed), so
the state merges and re-splits over processes like any other.  The accounting views (a)-(c) are
described in :mod:`decentdp.algorithms.components.topology_noise`; budgets hold on the joint event of every
noisy copy of a round's sum, which bounds every observer; the per-receiver view (a) is reported as a paper figure.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from decentdp.algorithms.base import (
    Calibrated,
    NoisePlan,
    RoundContext,
    RunFacts,
    State,
    once_per_graph,
    ragged_rows_key,
)
from decentdp.algorithms.components.select_mix import SelectMix
from decentdp.algorithms.components.topology_noise import (
    COUNTERS,
    CoverGroups,
    CoverPlanner,
    RowGaussian,
    TopDPSettings,
    calibrate_top_dp,
    cover_groups,
    report,
)
from decentdp.algorithms.registry import register
from decentdp.privacy.mechanisms import NoNoise
from decentdp.privacy.report import AlgorithmPrivacy


def add_selected(out: torch.Tensor, source: torch.Tensor, columns: torch.Tensor, weights: Sequence[float],
                 beta: float = 1.0) -> torch.Tensor:
    """``out[r] <- beta out[r] + sum_m weights[m] source[columns[m, r]]`` for every row, in ``out``'s storage:
    one sparse (CSR) product with ``len(weights)`` entries per row, which reads each source row where it
    lies instead of gathering the rows into temporaries first."""
    count, per_row = columns.shape[1], len(weights)
    device = columns.device
    values = torch.tensor(weights, dtype=out.dtype, device=device).repeat(count)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": a CSR product is all that is used
        warnings.simplefilter("ignore", UserWarning)
        select = torch.sparse_csr_tensor(torch.arange(0, per_row * count + 1, per_row, device=device),
                                         columns.t().reshape(-1), values, size=(count, source.shape[0]),
                                         device=device)
    return out.addmm_(select, source, beta=beta)


class TopDPBase(SelectMix):
    """What both TOP-DP protocols share: settings, decay, calibration, counters, the setup step.

    Agents are addressed by global id wherever a neighbour's value is read (sigma, expected batch),
    so that a shard of a sharded run plans exactly as the simulator does."""

    Settings = TopDPSettings
    finite_budgets_reason: ClassVar[str | None] = ("it reuses each neighbour's noise in proportion to its sigma, and "
                                                   "an agent with an infinite budget adds none")

    def __init__(self, alpha: float, topology_aware: bool = True, decay_gamma: float = 0.9,
                 decay_period: int = 1000) -> None:
        super().__init__(alpha)
        self.topology_aware = topology_aware
        self.gamma = decay_gamma
        self.period = decay_period

    @classmethod
    def from_settings(cls, settings: TopDPSettings) -> TopDPBase:
        return cls(settings.alpha, settings.topology_aware, settings.decay_gamma, settings.decay_period)

    @property
    def setup_releases(self) -> int:
        return 1

    #: Whether a round sends one message per cover group besides the estimate (Alg. 1), or one (Alg. 2).
    messages_per_cover: ClassVar[bool] = True

    def calibrate(self, plan: NoisePlan) -> Calibrated:
        return calibrate_top_dp(plan, self.alpha, self.gamma, self.period, self.setup_releases,
                                self.topology_aware, self.messages_per_cover)

    def init_state(self, params: torch.Tensor) -> State:
        """The estimates and, per agent, the counters of its messages (per agent, so that shards split them)."""
        counters = {f"count.{name}": torch.zeros(params.shape[0], dtype=torch.int64, device=params.device)
                    for name in COUNTERS}
        return {"params": params, **counters}

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """The run's message counts (``privacy.json``): residual-noise and full-noise messages, coverable
        edges that fell back to full noise (heterogeneous budgets) and uncoverable ones."""
        return AlgorithmPrivacy({"top_dp_messages": report({name: int(state[f"count.{name}"].sum())
                                                            for name in COUNTERS})})

    def sigma(self, ctx: RoundContext) -> np.ndarray:
        """sigma_{t,i} of every agent of the run, by global id (eq. 6b; 0 in a non-private run)."""
        mechanism = ctx.oracle.mechanism
        if mechanism is None:
            return np.zeros(ctx.network.n_total)
        return mechanism.noise_multipliers.cpu().double().numpy() * self.gamma ** (ctx.round_index // self.period)

    def expected_batches(self, ctx: RoundContext) -> np.ndarray:
        """``L`` of the agents held here and of their neighbours, by global id (NaN for the others), for the
        reuse coefficients of eq. 5a.  The neighbours' arrive with one broadcast per graph: a collective,
        made by every shard in its first round on the graph."""
        net = ctx.network

        def gather() -> np.ndarray:
            local = ctx.oracle.expected_batch.to(net.agent_ids.device)
            received = net.broadcast(local[:, None])[:, 0]
            batch = np.full(int(net.n_total), np.nan)
            batch[net.agent_ids.cpu().numpy()] = local.double().cpu().numpy()
            batch[net.in_edges[:, 0].cpu().numpy()] = received.double().cpu().numpy()
            return batch

        return once_per_graph(net, "top-dp expected batches", gather)

    def host_graph(self, ctx: RoundContext) -> tuple[np.ndarray, np.ndarray]:
        """The held agents' global ids and the out-edges as (sender's local row, receiver's global id), on the
        host: read from the network once per graph, not in every round (no device read-back per round)."""
        net = ctx.network
        return once_per_graph(net, "top-dp out-edges", lambda: (
            net.agent_ids.cpu().numpy(),
            torch.stack([net.rows(net.out_edges[:, 0]), net.out_edges[:, 1]], dim=1).cpu().numpy()))

    def mechanism(self, ctx: RoundContext, multipliers: np.ndarray, owners: np.ndarray, full: np.ndarray,
                  ) -> RowGaussian | NoNoise:
        """The release's noise: ``multipliers`` per row of local owner ``owners[r]``, ``full`` sigma_t per local row."""
        if ctx.oracle.mechanism is None:
            return NoNoise()
        return RowGaussian(multipliers, owners, full, ctx.oracle.clip_norm, self.host_graph(ctx)[1])

    def setup(self, state: State, ctx: RoundContext) -> State:
        """Lines 2-3 (Alg. 2) / 4-6 (Alg. 1): one noisy step from x_0 at full sigma_0, sent to all neighbours."""
        params = state["params"]
        return {**state, "params": params - ctx.lr * ctx.oracle.gradient(params)}

    @staticmethod
    def count(state: State, senders: np.ndarray, **flags: np.ndarray) -> dict[str, torch.Tensor]:
        """The counters plus, per local agent, its messages this round with each flag set (``senders``: rows)."""
        counts = {}
        for name in COUNTERS:
            current = state[f"count.{name}"]
            added = np.bincount(senders[flags[name]], minlength=len(current)) if name in flags else 0
            counts[f"count.{name}"] = current + torch.from_numpy(np.asarray(added, dtype=np.int64)).to(current.device)
        return counts


@register
class TopDP(TopDPBase):
    """Algorithm 1: per-receiver messages with residual noise, every agent every round."""

    name: ClassVar[str] = "top-dp"
    schedules: ClassVar[tuple[str, ...]] = ("synchronous",)
    follows_plan: ClassVar[bool] = False

    @property
    def round_temporaries(self) -> int:
        # the sums (N rows), the released rows (N + G, the next state) and the last round's (N + G), with
        # G / N = 2.1 cover groups per agent at the paper's setting (at most the mean degree)
        return 6

    def planner(self, ctx: RoundContext) -> CoverPlanner:
        """Who can cover whom on the round's graph (lines 10-17's candidates), once per graph."""
        return once_per_graph(ctx.network, "cover planner", lambda: CoverPlanner(ctx.network))

    def out_positions(self, ctx: RoundContext) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, int]:
        """Per out-edge: its sender's local row and its receiver's global id (on the device), its position among
        the sender's out-edges (on the host), and the width of ``pick``: the whole graph's largest
        out-degree, so that every process's rows of ``pick`` have the same width.  Once per graph."""
        net = ctx.network

        def positions() -> tuple[torch.Tensor, torch.Tensor, np.ndarray, int]:
            edges = self.host_graph(ctx)[1]
            senders = edges[:, 0]
            order = np.argsort(senders, kind="stable")
            counts = np.bincount(senders, minlength=net.n_agents)
            position = np.empty(len(senders), dtype=np.int64)
            position[order] = np.arange(len(senders)) - (np.cumsum(counts) - counts)[senders[order]]
            device = net.agent_ids.device
            width = int(net.public_graph().out_degrees.max(initial=0))
            return torch.from_numpy(senders).to(device), torch.from_numpy(edges[:, 1]).to(device), position, width

        return once_per_graph(net, "top-dp out positions", positions)

    def setup(self, state: State, ctx: RoundContext) -> State:
        """Line 6: every neighbour gets the agent's estimate (no messages yet; delivered by round 0)."""
        state = super().setup(state, ctx)
        params, n = state["params"], ctx.network.n_agents
        return {**state, "messages": params.new_empty(0, params.shape[1]),
                ragged_rows_key("messages"): torch.zeros(n, dtype=torch.int64, device=params.device),
                "pick": torch.zeros(n, 0, 2, dtype=torch.int64, device=params.device)}

    def deliver(self, state: State, ctx: RoundContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Lines 20-22 of the last round (line 6 after the setup): out-edge ``(i, j)`` carries ``i``'s estimate,
        or its message ``m`` where ``pick`` pairs ``j`` with ``1 + m``; a neighbour the last round's graph
        did not have (a redrawn graph) gets the estimate, as in line 6.  Returns the rows the held agents
        received (their own estimates first) and, per in-edge, the index of the row it received."""
        net = ctx.network
        params, messages, counts = state["params"], state["messages"], state[ragged_rows_key("messages")]
        sender, receiver = self.out_positions(ctx)[:2]
        table = state["pick"].index_select(0, sender)                          # (E, width, 2) of each sender
        picked = (table[..., 1] * (table[..., 0] == receiver[:, None])).sum(1)
        first = torch.cumsum(counts, 0) - counts                               # each agent's first message
        pick = torch.where(picked == 0, sender, net.n_agents + first[sender] + picked - 1)
        return net.exchange_rows(outbox(params, messages), pick)

    def round(self, state: State, ctx: RoundContext) -> State:
        received, index = self.deliver(state, ctx)                                 # last round's lines 20-22
        sigma = self.sigma(ctx)                                                    # line 8
        generator = ctx.public_generator()
        groups, coverable, multipliers = self.cover(ctx, sigma, generator)         # lines 10-17
        noisy = self.release(ctx, received, index, groups, multipliers, sigma, generator)  # 9, 15-16, 18-19
        return self.pick(state, ctx, noisy, groups, coverable)                     # lines 20-22

    def cover(self, ctx: RoundContext, sigma: np.ndarray, generator: torch.Generator,
              ) -> tuple[CoverGroups, np.ndarray | None, np.ndarray]:
        """Lines 10-17 (eq. 4): for each out-edge the neighbour whose message covers it, as groups ordered by
        sender, which edges could be covered at all, and each group's noise multiplier (its residual sigma).
        Without topology-aware noise, or without noise, no edge is covered."""
        edges = self.host_graph(ctx)[1]
        if self.topology_aware and ctx.oracle.mechanism is not None:
            planner = self.planner(ctx)
            plan = planner.plan(self.alpha, sigma, self.expected_batches(ctx), generator)
            groups = by_sender(cover_groups(plan.via), edges[:, 0])
            return groups, planner.coverable, plan.multiplier[groups.first]
        return cover_groups(np.full(len(edges), -1, dtype=np.int64)), None, np.zeros(0)

    def release(self, ctx: RoundContext, received: torch.Tensor, index: torch.Tensor, groups: CoverGroups,
                group_multipliers: np.ndarray, sigma: np.ndarray, generator: torch.Generator) -> torch.Tensor:
        """Lines 9, 15-16, 18-19: one clipped sum per agent on one batch, released as one row per agent (its
        estimate's update, full sigma_t) and one per cover group (residual sigma), then mixed in place::

            -lambda (g + G) / L_i  +  alpha x~_i  +  (1 - alpha) x~_k   (k = the group's cover, or j*)

        ``received``: the held agents' estimates, then the rows they received (``index``: per in-edge)."""
        net, oracle = ctx.network, ctx.oracle
        n, alpha = net.n_agents, self.alpha
        ids, edges = self.host_graph(ctx)
        senders = edges[:, 0]
        jstar = self.in_edges(net).choose(generator)                               # line 18
        rows = np.concatenate([np.arange(n), senders[groups.first]])               # local row, then one per group
        multipliers = np.concatenate([sigma[ids], group_multipliers])
        slots = torch.from_numpy(np.concatenate([ids, edges[groups.first, 1]]))   # receivers: noise keys
        key = oracle.batch()                                                       # line 9: one batch, one sum
        sums = oracle.repeat(oracle.clip(key, received[:n]), torch.from_numpy(rows))
        (noisy,) = oracle.release(sums, mechanism=self.mechanism(ctx, multipliers, rows, sigma[ids]), receivers=slots)
        scale = (-ctx.lr / oracle.expected_batch.double().cpu().numpy())[rows]
        uniform = bool((scale == scale[0]).all())
        device = noisy.device
        if not uniform:
            noisy.mul_(torch.from_numpy(scale).to(device, noisy.dtype)[:, None])
        reads = torch.cat([jstar, torch.from_numpy(groups.via).to(device)])       # in-edges (k, i) of every row
        columns = torch.stack([torch.from_numpy(rows).to(device), index.index_select(0, reads)])
        add_selected(noisy, received, columns, (alpha, 1 - alpha), beta=float(scale[0]) if uniform else 1.0)
        return noisy

    def pick(self, state: State, ctx: RoundContext, noisy: torch.Tensor, groups: CoverGroups,
             coverable: np.ndarray | None) -> State:
        """Lines 20-22, delivered by the next round: an uncovered receiver gets the sender's new estimate as it
        is, a covered one its group's message (the sender's message number: groups are ordered by sender);
        the new state, with the round's message counts."""
        n, device = ctx.network.n_agents, noisy.device
        senders, receivers = self.host_graph(ctx)[1].T
        counts = np.bincount(senders[groups.first], minlength=n)
        number = np.arange(len(groups.first)) - (np.cumsum(counts) - counts)[senders[groups.first]]
        covered = groups.edge_group >= 0
        position, width = self.out_positions(ctx)[2:]
        table = np.zeros((n, width, 2), dtype=np.int64)
        table[..., 0] = -1
        message = np.zeros(len(senders), dtype=np.int64)
        message[covered] = 1 + number[groups.edge_group[covered]]
        table[senders, position] = np.stack([receivers, message], 1)
        flags = {"reduced": covered, "full": ~covered}
        if coverable is not None:
            flags.update(fallback=~covered & coverable, uncoverable=~covered & ~coverable)
        return {"params": noisy[:n], "messages": noisy[n:],
                ragged_rows_key("messages"): torch.from_numpy(counts).to(device),
                "pick": torch.from_numpy(table).to(device), **self.count(state, senders, **flags)}


def by_sender(groups: CoverGroups, senders: np.ndarray) -> CoverGroups:
    """The same groups ordered by their sender (``senders``: the local sender row of each out-edge), each
    sender's in their order: its messages lie together, a ragged per-agent list."""
    order = np.argsort(senders[groups.first], kind="stable")
    renumber = np.empty_like(order)
    renumber[order] = np.arange(len(order))
    if not len(order):  # no neighbour covers anyone (e.g. a complete graph): every receiver gets the estimate
        return groups
    edge_group = np.where(groups.edge_group >= 0, renumber[np.maximum(groups.edge_group, 0)], -1)
    return CoverGroups(groups.via[order], groups.first[order], edge_group)


def outbox(params: torch.Tensor, messages: torch.Tensor) -> torch.Tensor:
    """The estimates followed by the messages, as one tensor: the storage they share when a round left them
    adjacent (no copy), else (a state read from a checkpoint, or re-split) a concatenation."""
    if len(messages) == 0:
        return params
    storage = params.untyped_storage()
    if params.is_contiguous() and messages.is_contiguous() and messages.dtype == params.dtype \
            and messages.untyped_storage().data_ptr() == storage.data_ptr() \
            and messages.storage_offset() == params.storage_offset() + params.numel():
        size = (len(params) + len(messages), params.shape[1])
        return params.new_empty(0).set_(storage, params.storage_offset(), size)
    return torch.cat([params, messages])
