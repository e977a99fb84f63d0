"""DP-DSGT: Bayrooti et al., Algorithm 2 (the DP version of DSGT, equations 4-5).

Agents track the network-wide gradient with ``y``; both ``theta`` and ``y`` are gossiped::

    theta_i^{k+1} = sum_j w_ij (theta_j^k - eta^k y_j^k)                              (4; Alg. 2 line 8)
    y_i^{k+1}     = G~^{k+1}(theta_i^{k+1}) + sum_j w_ij y_j^k - G~^k(theta_i^k)       (5; Alg. 2 line 12)

with ``G~^0 = 0`` and ``y^0 = 0``.  Mixing is synchronous (from the previous round's values), which
preserves the tracking invariant ``sum_i y_i^k = sum_i G~^k_i`` for a doubly stochastic W (the
paper code's sequential in-place mixing breaks it).  Only the private gradients ``G~`` touch
data; ``theta`` and ``y`` are post-processing of them.  Weight decay, if set, is added to the
gradient before tracking.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from decentdp.algorithms.base import Algorithm, AlgorithmSettings, RoundContext, State
from decentdp.algorithms.registry import register


class DSGTSettings(AlgorithmSettings):
    """DSGT takes plain steps ``theta <- W(theta - lr y)`` (Alg. 2): no optimizer, only weight decay."""

    weight_decay: float = Field(0.0, ge=0.0)


@register
class DPDSGT(Algorithm):
    """Distributed stochastic gradient tracking with private gradients."""

    samplings: ClassVar[tuple[str, ...]] = ("poisson", "cyclic")  # one release a round, the run's mechanism

    name: ClassVar[str] = "dp-dsgt"
    Settings = DSGTSettings

    def __init__(self, weight_decay: float = 0.0) -> None:
        self.weight_decay = weight_decay

    @classmethod
    def from_settings(cls, settings: DSGTSettings) -> DPDSGT:
        return cls(settings.weight_decay)

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params, "tracker": torch.zeros_like(params), "last_grad": torch.zeros_like(params)}

    def round(self, state: State, ctx: RoundContext) -> State:
        net = ctx.network
        params = net.mix(state["params"] - ctx.lr * state["tracker"])       # (4), Alg. 2 line 8
        grad = ctx.oracle.gradient(params)                                   # lines 9-11
        if self.weight_decay:
            grad = grad + self.weight_decay * params
        tracker = grad + net.mix(state["tracker"]) - state["last_grad"]      # (5), line 12
        return {"params": params, "tracker": tracker, "last_grad": grad}
