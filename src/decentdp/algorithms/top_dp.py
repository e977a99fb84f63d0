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
independent ones (view b).  Every message is then one gather of ``(E, d)`` rows.  The accounting views (a)-(c) are
described in :mod:`decentdp.algorithms.topology_noise`; budgets hold per receiver (view a).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from decentdp.algorithms.base import Calibrated, NoisePlan, RoundContext, State
from decentdp.algorithms.registry import register
from decentdp.algorithms.select_mix import SelectMix
from decentdp.algorithms.topology_noise import (
    COUNTERS,
    CoverPlanner,
    RowGaussian,
    TopDPSettings,
    calibrate_top_dp,
    cover_groups,
    report,
)
from decentdp.privacy.mechanisms import NoNoise


class TopDPBase(SelectMix):
    """What both TOP-DP protocols share: settings, decay, calibration, counters, the setup step."""

    Settings = TopDPSettings
    budget_view: ClassVar[str] = "pairwise"

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

    def calibrate(self, plan: NoisePlan) -> Calibrated:
        return calibrate_top_dp(plan, self.gamma, self.period, self.setup_releases)

    def init_state(self, params: torch.Tensor) -> State:
        counters = {f"count.{name}": torch.zeros((), dtype=torch.int64, device=params.device) for name in COUNTERS}
        return {"params": params, **counters}

    def run_report(self, state: State) -> dict[str, Any]:
        return {"top_dp_messages": report({name: int(state[f"count.{name}"]) for name in COUNTERS})}

    def sigma(self, ctx: RoundContext) -> np.ndarray:
        """sigma_{t,i} of every agent this round (eq. 6b; 0 in a non-private run)."""
        mechanism = ctx.oracle.mechanism
        if mechanism is None:
            return np.zeros(ctx.oracle.n_agents)
        return mechanism.noise_multipliers.double().numpy() * self.gamma ** (ctx.round_index // self.period)

    def mechanism(self, ctx: RoundContext, multipliers: np.ndarray, owners: np.ndarray, sigma: np.ndarray,
                  ) -> RowGaussian | NoNoise:
        if ctx.oracle.mechanism is None:
            return NoNoise()
        return RowGaussian(multipliers, owners, sigma, ctx.oracle.clip_norm, ctx.network.out_edges.cpu().numpy())

    def setup(self, state: State, ctx: RoundContext) -> State:
        """Lines 2-3 (Alg. 2) / 4-6 (Alg. 1): one noisy step from x_0 at full sigma_0, sent to all neighbours."""
        params = state["params"]
        return {**state, "params": params - ctx.lr * ctx.oracle.gradient(params)}

    @staticmethod
    def count(state: State, **added: int) -> dict[str, torch.Tensor]:
        return {f"count.{name}": state[f"count.{name}"] + added.get(name, 0) for name in COUNTERS}


@register
class TopDP(TopDPBase):
    """Algorithm 1: per-receiver messages with residual noise, every agent every round."""

    name: ClassVar[str] = "top-dp"
    schedules: ClassVar[tuple[str, ...]] = ("synchronous",)
    follows_plan: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._planner: tuple[int, CoverPlanner] | None = None

    @property
    def round_temporaries(self) -> int:
        return 8  # the received messages and the new ones are (E, d); E / N is the mean degree

    def planner(self, ctx: RoundContext) -> CoverPlanner:
        net = ctx.network
        if self._planner is None or self._planner[0] != id(net.out_edges):
            self._planner = (id(net.out_edges), CoverPlanner(net))
        return self._planner[1]

    def setup(self, state: State, ctx: RoundContext) -> State:
        state = super().setup(state, ctx)
        return {**state, "received": ctx.network.broadcast(state["params"])}   # line 6

    def round(self, state: State, ctx: RoundContext) -> State:
        net, oracle = ctx.network, ctx.oracle
        x, received = state["params"], state["received"]
        n, alpha = net.n_agents, self.alpha
        sigma = self.sigma(ctx)                                                   # line 8
        batch = oracle.expected_batch.double().numpy()
        generator = ctx.public_generator()
        edges = net.out_edges
        if self.topology_aware and oracle.mechanism is not None:
            cover = self.planner(ctx).plan(alpha, sigma, batch, generator, range(n))   # lines 10-17
            groups = cover_groups(cover.via)
        else:
            cover, groups = None, cover_groups(np.full(len(edges), -1, dtype=np.int64))
        jstar = self.in_edges(net).choose(generator)                              # line 18
        via = torch.from_numpy(groups.via).to(x.device)                           # (G,) in-edges (k, i)
        sender = net.rows(net.in_edges[via, 1])
        rows = torch.cat([torch.arange(n, device=x.device), sender])              # local row, then one per group
        multipliers = np.concatenate([sigma, cover.multiplier[groups.first] if cover is not None else []])
        slots = torch.cat([net.agent_ids, edges[torch.from_numpy(groups.first).to(x.device), 1]])
        key = oracle.batch()                                                      # line 9: one batch, one sum
        sums = oracle.repeat(oracle.clip(key, x), rows)
        (noisy,) = oracle.release(sums, mechanism=self.mechanism(ctx, multipliers, rows.cpu().numpy(), sigma),
                                  receivers=slots)
        # eq. 5c / line 19 in place on the released rows: -lambda (g + G) / L_i + alpha x~_i + (1 - alpha) x~_k
        noisy.mul_((-ctx.lr / oracle.expected_batch.to(noisy.device))[rows, None])
        noisy[:n].add_(x, alpha=alpha).add_(received.index_select(0, jstar), alpha=1 - alpha)   # line 19
        if len(groups.via):                                                       # lines 15-16, one row per group
            noisy[n:].add_(x.index_select(0, sender), alpha=alpha).add_(received.index_select(0, via), alpha=1 - alpha)
        local = noisy[:n].clone() if len(groups.via) else noisy    # (a view would keep every row in the state)
        # lines 20-22: an uncovered j receives x~_i as it is; a covered one its group's message
        edge_group = torch.from_numpy(groups.edge_group).to(x.device)
        pick = torch.where(edge_group >= 0, n + edge_group, net.rows(edges[:, 0]))
        messages = noisy.index_select(0, pick)
        covered = int((groups.edge_group >= 0).sum())
        counts = self.count(state, reduced=covered, full=len(edges) - covered,
                            fallback=cover.fallback if cover else 0, uncoverable=cover.uncoverable if cover else 0)
        return {"params": local, "received": net.exchange(messages), **counts}
