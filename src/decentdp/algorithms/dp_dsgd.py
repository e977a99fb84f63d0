"""DP-DSGD: Bayrooti et al., Algorithm 1 (the DP version of DSGD, equation 3).

Each round every agent computes its private gradient at its current parameters, averages its
neighbours' parameters with the mixing matrix and steps from that average::

    theta_i^{k+1} = sum_j w_ij theta_j^k - eta^k G~(theta_i^k; D_i)          (Alg. 1, line 10)

The step is taken by the configured optimizer, so momentum and weight decay (the paper code's
SGD settings) act on the mixed parameters; plain SGD gives line 10 exactly.
"""

from __future__ import annotations

from typing import ClassVar

from decentdp.algorithms.base import RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.components.optim import SGD, OptimizerAlgorithm
from decentdp.algorithms.registry import register


@register
class DPDSGD(OptimizerAlgorithm):
    """Decentralized SGD with private gradients and synchronous gossip."""

    samplings: ClassVar[tuple[str, ...]] = ("poisson", "cyclic")  # one release a round, the run's mechanism

    name: ClassVar[str] = "dp-dsgd"

    @property
    def round_temporaries(self) -> int:
        # Plain SGD: only the gradient sums, which become the new parameters; the oracle writes them into the
        # block of the parameters the last round replaced (DataOracle._take_spare), so no slack for the allocator.
        return 1 if self._fused else 3

    @property
    def _fused(self) -> bool:
        return isinstance(self.optimizer, SGD) and self.optimizer.plain

    def round(self, state: State, ctx: RoundContext) -> State:
        params = state["params"]
        grad = ctx.oracle.gradient(params)                   # Alg. 1 lines 7-9, at theta_i^k
        if self._fused:
            # Line 10 exactly, written into the gradient's storage: no separate mixing output.
            return {"params": ctx.network.mix_add(params, grad, -ctx.lr)}  # plain SGD has no state
        mixed = ctx.network.mix(params)                       # sum_j w_ij theta_j^k
        params, opt = self.optimizer.step(mixed, grad, unprefixed("opt", state), ctx.lr, inplace=True)  # line 10
        return {"params": params, **prefixed("opt", opt)}
