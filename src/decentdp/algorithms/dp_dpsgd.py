"""DP-DPSGD: A(DP)^2SGD of Xu, Zhang, Wang (TPAMI 2021, arXiv:2008.09246), a baseline of DPDL (specs B.1).

Each worker adds Gaussian noise to its (clipped) minibatch gradient sum and gossips::

    g~_k^t = sum_{i=1}^{B} clip_C(grad F_k(w_k^t; xi_k^{t,i})) + n,  n ~ N(0, sigma^2 C^2 I)   (B.1, line 1)
    [w^{t+1/2}] = [w^t] A_t                                                                  (line 2)
    w_k^{t+1} = w_k^{t+1/2} - eta g~_k^t / L_k                                               (line 3)

The paper bounds the gradient norm by G instead of clipping; for deep nets clipping to C plays that
role (specs B.1), and the sum is divided by the expected batch ``L_k`` so that ``eta`` has DP-SGD's
meaning.  Noise is calibrated with the RDP accountant over the worker's iterations, as the paper's
abstract says (its closed-form sigma could not be read).

Two protocols (``schedule.kind``):

* ``synchronous`` (default): ``A_t = W`` every round: the synchronous simulation the DPDL comparison
  uses, and the same update as DP-DSGD with plain SGD, which this class extends;
* ``pairing``: the asynchronous AD-PSGD pattern, ``A_t`` averages each active worker with one
  neighbour, ``(w_k + w_j) / 2``, using the pairs of the TOP-DP protocol's scheduler; unpaired
  workers take their step alone and offline workers neither compute nor move.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from decentdp.algorithms.base import RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.dp_dsgd import DPDSGD
from decentdp.algorithms.registry import register


@register
class DPDPSGD(DPDSGD):
    """A(DP)^2SGD: noisy minibatch gradients with gossip (synchronous W, or pairwise averaging)."""

    name: ClassVar[str] = "dp-dpsgd"
    schedules: ClassVar[tuple[str, ...]] = ("synchronous", "pairing")
    follows_plan: ClassVar[bool] = True

    def round(self, state: State, ctx: RoundContext) -> State:
        plan = ctx.plan
        if plan is None or plan.partner is None:
            if plan is not None and not plan.everyone_active:
                return self._pairwise(state, ctx, plan.active, ctx.network.agent_ids)
            return super().round(state, ctx)                 # A_t = W: lines 1-3 synchronously
        return self._pairwise(state, ctx, plan.active, plan.partner)

    def _pairwise(self, state: State, ctx: RoundContext, active: torch.Tensor, partner: torch.Tensor) -> State:
        params = state["params"]
        grad = ctx.oracle.gradient(params)                    # line 1 (inactive rows: zero, not charged)
        other = ctx.network.swap(params, partner)             # the partner's model
        paired = active & (partner != ctx.network.agent_ids)
        mixed = torch.where(paired[:, None], (params + other) / 2, params)   # line 2: (w_k + w_j) / 2
        opt = unprefixed("opt", state)
        stepped, new_opt = self.optimizer.step(mixed, grad, opt, ctx.lr, inplace=True)  # line 3
        keep = active[:, None]
        new_opt = {key: torch.where(keep, value, opt[key]) for key, value in new_opt.items()}
        return {"params": torch.where(keep, stepped, params), **prefixed("opt", new_opt)}
