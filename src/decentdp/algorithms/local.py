"""Local training: every agent runs (DP-)SGD on its own data and never communicates.

The lower baseline of the consensus paper: what an agent reaches alone.
"""

from __future__ import annotations

from typing import ClassVar

from decentdp.algorithms.base import RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.components.optim import OptimizerAlgorithm
from decentdp.algorithms.registry import register


@register
class LocalTraining(OptimizerAlgorithm):
    """``theta_i <- optimizer_step(theta_i, G_i(theta_i))`` with no messages."""

    samplings: ClassVar[tuple[str, ...]] = ("poisson", "cyclic")  # one release a round, the run's mechanism
    reads_mixing: ClassVar[bool] = False  # no messages
    communicates: ClassVar[bool] = False

    name: ClassVar[str] = "local"

    def round(self, state: State, ctx: RoundContext) -> State:
        params = state["params"]
        grad = ctx.oracle.gradient(params)
        params, opt = self.optimizer.step(params, grad, unprefixed("opt", state), ctx.lr)
        return {"params": params, **prefixed("opt", opt)}
