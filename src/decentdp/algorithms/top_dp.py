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
per covered out-edge (:meth:`~decentdp.privacy.oracle.DataOracle.repeat`), each row with its own
noise, and every message is built in one ``(E, d)`` operation.  The accounting views (a)-(c) are
described in :mod:`decentdp.algorithms.topology_noise`; budgets hold per receiver (view a).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from decentdp.algorithms.base import Calibrated, NoisePlan, RoundContext, State
from decentdp.algorithms.registry import register
from decentdp.algorithms.select_mix import SelectMix, mix_step
from decentdp.algorithms.topology_noise import (
    COUNTERS,
    CoverPlanner,
    RowGaussian,
    TopDPSettings,
    calibrate_top_dp,
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
        planner = self.planner(ctx)
        if self.topology_aware and oracle.mechanism is not None:
            cover = planner.plan(alpha, sigma, batch, generator, range(n))        # lines 10-17
            covered = np.flatnonzero(cover.via >= 0)
        else:
            cover, covered = None, np.zeros(0, dtype=np.int64)
        jstar = self.in_edges(net).choose(generator)                              # line 18
        edges = net.out_edges
        src = net.rows(edges[:, 0])
        covered_t = torch.from_numpy(covered).to(x.device)
        rows = torch.cat([torch.arange(n, device=x.device), src[covered_t]])      # local row, then messages
        multipliers = np.concatenate([sigma, cover.multiplier[covered] if cover is not None else []])
        key = oracle.batch()                                                      # line 9: one batch, one sum
        sums = oracle.repeat(oracle.clip(key, x), rows)
        (noisy,) = oracle.release(sums, mechanism=self.mechanism(ctx, multipliers, rows.cpu().numpy(), sigma),
                                  receivers=torch.cat([net.agent_ids, edges[covered_t, 1]]))
        noisy.div_(oracle.expected_batch.to(noisy.device)[rows, None])
        local = mix_step(x, received.index_select(0, jstar), alpha, noisy[:n], ctx.lr)   # line 19
        messages = local.index_select(0, src)                                     # lines 20-22: x~_i as it is
        if len(covered):                                                          # lines 15-16 (eq. 5c)
            via = torch.from_numpy(cover.via[covered]).to(x.device)
            messages[covered_t] = mix_step(x.index_select(0, src[covered_t]), received.index_select(0, via),
                                           alpha, noisy[n:], ctx.lr)
        counts = self.count(state, reduced=len(covered), full=len(edges) - len(covered),
                            fallback=cover.fallback if cover else 0, uncoverable=cover.uncoverable if cover else 0)
        return {"params": local, "received": net.exchange(messages), **counts}
