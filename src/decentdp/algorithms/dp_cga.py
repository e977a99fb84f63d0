"""DP-CGA: Cross-Gradient Aggregation (Esfandiari et al., ICML 2021) with private cross-gradients (specs A.5.1, B.4).

Cross- and self-gradients are released exactly as in DPDL (eqs. 8-12 of specs A.3, one joint event
per data owner; :mod:`~decentdp.algorithms.components.cross_gradients`).  Receiver ``i`` then projects, for each
parameter tensor ``b`` of the model separately (the authors' loop over ``model.parameters()``), its
own gradient onto the cone of its neighbours' cross-gradients by the GEM-style dual QP of the
authors' ``Optimizers/CGA.py``, solved with ``quadprog`` (post-processing of released values)::

    G = [pi_ij g_b^{i<-j}]_{j in N_i, j != i}  (all-zero rows dropped),   g = pi_ii g_b^{i<-i}
    v* = argmin_v 1/2 v^T (G G^T + 1e-12 I) v + (G g)^T v   s.t.  v >= margin      (A.5.1 step 3)
    g~_b = G^T v* + g

and takes CGA's consensus-plus-momentum step (A.5.1 step 4; the code's ``nesterov=False`` update)::

    m_i <- mu m_i + g~_i ;   x_i <- sum_j pi_ij x_j - eta (g~_i + mu m_i)

``pi`` is the mixing matrix W.  The Gram matrices ``G G^T`` and ``G g`` of all agents and tensors are
computed in batched products; only the small QPs (``deg_i x deg_i``) are solved one by one, since
quadprog has no batched interface.  When a QP fails (quadprog raises ``ValueError``: a Gram matrix
not positive definite, or constraints it cannot meet) the agent's previous solution for that tensor is
reused, as the authors' code does (zeros, i.e. no projection, before any success), and counted; the first
failure of each parameter tensor is logged.  A tensor with fewer coordinates than the agent has neighbours (the
first convolution's 6 biases beside 9 neighbours on the complete graph) has a singular Gram matrix, so its QP
fails in every round, as in the authors' code, whose ridge (1e-12) is too small to make it definite.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np
import quadprog
import torch
from pydantic import Field

from decentdp.algorithms.base import AlgorithmSettings, Network, RoundContext, SettingsAlgorithm, State
from decentdp.algorithms.components.cross_gradients import cross_gradients, self_weights
from decentdp.algorithms.registry import register

log = logging.getLogger(__name__)

_QP_RIDGE = 1e-12  # the authors' eps added to G G^T


class CGASettings(AlgorithmSettings):
    """DP-CGA's settings (specs A.5.1)."""

    momentum: float = Field(0.5, ge=0.0, lt=1.0, description="mu of CGA's momentum (README example 0.5)")
    margin: float = Field(0.5, ge=0.0, description="lower bound of the QP's dual variables (authors' 0.5)")


def solve_projection(gram: np.ndarray, linear: np.ndarray, margin: float) -> np.ndarray:
    """``argmin_v 1/2 v^T (gram + ridge I) v + linear^T v  s.t.  v >= margin`` (quadprog; raises ValueError)."""
    size = len(linear)
    p = 0.5 * (gram + gram.T) + _QP_RIDGE * np.eye(size)
    return quadprog.solve_qp(p, -linear, np.eye(size), np.full(size, margin))[0]


def edge_slots(network: Network) -> tuple[torch.Tensor, torch.Tensor]:
    """Receiver row and position of each in-edge among its receiver's in-edges."""
    receiver = network.rows(network.in_edges[:, 1])
    order = torch.argsort(receiver, stable=True)
    counts = torch.bincount(receiver, minlength=network.n_agents)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(receiver)
    slot[order] = torch.arange(len(receiver), device=receiver.device) - starts[receiver[order]]
    return receiver, slot


@register
class DPCGA(SettingsAlgorithm):
    """CGA with noisy cross-gradients: QP projection per parameter tensor, momentum and consensus."""

    name: ClassVar[str] = "dp-cga"
    Settings = CGASettings

    def __init__(self, settings: CGASettings) -> None:
        super().__init__(settings)
        self.failures = 0  # QPs that failed and reused the previous solution (over the run)
        self._logged: set[int] = set()  # parameter tensors whose failures have been logged once

    def sums_per_batch(self, degrees: np.ndarray) -> np.ndarray:
        return np.asarray(degrees, dtype=np.int64) + 1

    @property
    def round_temporaries(self) -> int:
        return 7  # own models and gradients (the cross-gradient call's), the projection, the momentum update,
        #           mixing outputs (edge rows on top)

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params, "momentum": torch.zeros_like(params),
                "dual": torch.zeros(params.shape[0], 0, 0, dtype=torch.float64, device=params.device)}

    def round(self, state: State, ctx: RoundContext) -> State:
        net = ctx.network
        params = state["params"]
        grads = cross_gradients(params, ctx)
        receiver, slot = edge_slots(net)
        width = int(net.public_graph().in_degrees.max(initial=0))  # the graph's: the same padding in every process
        stacked = params.new_zeros(net.n_agents, max(width, 1), params.shape[1])   # G of every agent, padded
        stacked[receiver, slot] = grads.received * net.in_weights.to(params.dtype)[:, None]
        own = grads.own * self_weights(net).to(params.dtype)[:, None]              # g = pi_ii g^{i<-i}
        dual, solutions = self._project(state["dual"], stacked, own, ctx.oracle.model.numels)
        projected = own.add_(torch.einsum("nkd,nkd->nd", stacked, dual))            # g~ = G^T v + g
        momentum = projected.add(state["momentum"], alpha=self.settings.momentum)   # m <- mu m + g~
        step = projected.add_(momentum, alpha=self.settings.momentum)               # g~ + mu m
        params = net.mix_add(params, step, -ctx.lr)                                  # sum_j pi_ij x_j - eta (...)
        return {"params": params, "momentum": momentum, "dual": solutions}

    def _project(self, previous: torch.Tensor, stacked: torch.Tensor, own: torch.Tensor,
                 numels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The QP solutions ``(N, tensors, K)`` per (agent, parameter tensor), and expanded over each
        tensor's coordinates, ``(N, K, d)``; ``previous`` holds the last round's solutions."""
        n, width, _ = stacked.shape
        if previous.shape != (n, len(numels), width):  # the first round, or the graph was redrawn
            previous = torch.zeros(n, len(numels), width, dtype=torch.float64, device="cpu")  # QPs run on the CPU
        solutions = previous.double().cpu().clone()
        blocks_g = stacked.split(numels, dim=2)
        blocks_own = own.split(numels, dim=1)
        for b, (g_b, own_b) in enumerate(zip(blocks_g, blocks_own, strict=True)):
            gram = torch.bmm(g_b, g_b.transpose(1, 2)).double().cpu().numpy()       # G G^T, all agents at once
            linear = torch.bmm(g_b, own_b[:, :, None]).squeeze(2).double().cpu().numpy()  # G g
            for agent in range(n):
                rows = np.flatnonzero(np.diag(gram[agent]) > 0)                       # all-zero rows dropped
                if len(rows) == 0:
                    solutions[agent, b] = 0.0
                    continue
                try:
                    value = solve_projection(gram[agent][np.ix_(rows, rows)], linear[agent][rows], self.settings.margin)
                except ValueError as error:
                    self.failures += 1
                    if b not in self._logged:  # a tensor with fewer coordinates than neighbours fails every round
                        self._logged.add(b)
                        log.warning("CGA projection QP failed for agent %d, tensor %d (%s): previous solution "
                                    "reused (this tensor's later failures are counted, not logged)", agent, b, error)
                    continue
                solutions[agent, b] = 0.0
                solutions[agent, b, torch.from_numpy(rows)] = torch.from_numpy(value)
        expanded = torch.repeat_interleave(solutions.to(stacked.dtype).to(stacked.device).transpose(1, 2),
                                           torch.tensor(numels, device=stacked.device), dim=2)
        return expanded, solutions
