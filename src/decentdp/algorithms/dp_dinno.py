"""DP-DiNNO: Bayrooti et al., Algorithm 3 (the DP version of DiNNO's consensus ADMM, eqs. 6-7).

Per round ``k = 0, 1, ...``, with penalty ``rho = rho_0 * growth^(k+1)`` (grown before the dual
update, as in DiNNO's code) and graph neighbours ``N(i)``.  The paper's ``N_i`` includes ``i``
itself; its ``j = i`` term vanishes in (6) but would add a proximal term ``rho ||psi - theta_i||^2``
to (7).  We follow DiNNO's original method and code, which sum over neighbours only::

    y_i^{k+1} = y_i^k + rho sum_{j in N(i)} (theta_i^k - theta_j^k)                      (6; Alg. 3 line 8)
    psi^0 = theta_i^k;  for t = 1..T:                                                     (lines 9-15)
        G(psi) = g~(psi; D_i) + y_i^{k+1} + 2 rho sum_{j in N(i)} (psi - (theta_i^k + theta_j^k) / 2)
        psi <- optimizer_step(psi, G(psi))
    theta_i^{k+1} = psi^T                                                                 (line 16)

``G`` is the gradient of the primal objective (7); only ``g~`` depends on private data, so only it
is clipped and noised.  Each of the ``T`` primal steps is one noisy release (each draws its own
Poisson batch), so ``releases_per_round == T`` and the noise is calibrated for ``K * T`` releases
(the paper code accounted for ``K``).  The optimizer (Adam in the paper) keeps its state across
rounds unless ``reset_each_round`` reproduces the paper code's re-created optimizer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from decentdp.algorithms.base import RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.optim import Optimizer, OptimizerAlgorithm, OptimizerSettings
from decentdp.algorithms.registry import register


class DiNNOSettings(OptimizerSettings):
    """DiNNO's penalty schedule and inexact primal solver."""

    rho: float = Field(0.5, gt=0.0, description="penalty rho_0")
    rho_growth: float = Field(1.0, ge=1.0, description="rho in round k (from 0) is rho * rho_growth^(k+1)")
    primal_steps: int = Field(1, ge=1, description="T noisy primal steps per round")
    reset_optimizer_each_round: bool = Field(False, description="re-create the optimizer every round, as the "
                                                                "paper code does")


@register
class DPDiNNO(OptimizerAlgorithm):
    """Consensus ADMM with an inexact, private primal solver."""

    name: ClassVar[str] = "dp-dinno"
    Settings = DiNNOSettings

    def __init__(self, optimizer: Optimizer, rho: float, rho_growth: float = 1.0, primal_steps: int = 1,
                 reset_each_round: bool = False) -> None:
        super().__init__(optimizer)
        self.rho0 = rho
        self.rho_growth = rho_growth
        self.primal_steps = primal_steps
        self.reset_each_round = reset_each_round

    @classmethod
    def from_settings(cls, settings: DiNNOSettings) -> DPDiNNO:
        return cls(settings.build(), rho=settings.rho, rho_growth=settings.rho_growth,
                   primal_steps=settings.primal_steps, reset_each_round=settings.reset_optimizer_each_round)

    @property
    def releases_per_round(self) -> int:
        return self.primal_steps

    def init_state(self, params: torch.Tensor) -> State:
        return {**super().init_state(params), "dual": torch.zeros_like(params)}

    def round(self, state: State, ctx: RoundContext) -> State:
        net = ctx.network
        theta = state["params"]
        rho = self.rho0 * self.rho_growth ** (ctx.round_index + 1)
        degrees = net.degrees[:, None]
        neighbours = net.neighbor_sum(theta)
        dual = state["dual"] + rho * (degrees * theta - neighbours)              # (6), line 8
        anchor = (degrees * theta + neighbours) / 2                               # sum_j (theta_i + theta_j) / 2
        opt = self.optimizer.init(theta) if self.reset_each_round else unprefixed("opt", state)
        psi = theta                                                               # line 9
        for _ in range(self.primal_steps):                                        # line 10
            private = ctx.oracle.gradient(psi)                                    # lines 11-13 (a fresh batch)
            grad = private + dual + 2 * rho * (degrees * psi - anchor)            # line 14
            psi, opt = self.optimizer.step(psi, grad, opt, ctx.lr)                # line 15
        return {"params": psi, "dual": dual, **prefixed("opt", opt)}              # line 16
