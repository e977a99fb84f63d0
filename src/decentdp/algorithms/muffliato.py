"""Muffliato-SGD (Cyffers, Even, Bellet, Massoulié, NeurIPS 2022, arXiv:2206.05091; specs B.2), a baseline of DPDL.

Each round every agent injects one noisy gradient step, then the agents run ``K`` noise-free
Chebyshev-accelerated gossip steps (authors' ``private_step_gd`` and ``acceleratedsimulation``)::

    u_v = (sum_b clip_C(grad l(theta_v; b)) + sigma_v C xi) / L_v        (step 1: one release per round)
    u_v <- u_v min(1, G / |u_v|)                                          (step 2: post-processing clip)
    y^0 = theta - eta u                                                   (step 3)
    y^1 = W y^0 ;  y^{t+1} = gamma W y^t + (1 - gamma) y^{t-1}            (step 4, t < K)
    gamma = 2 (1 - sqrt(l2 (1 - l2/4))) / (1 - l2/2)^2                    (``gamma_tcheb``)

with ``l2`` the spectral gap of ``W`` (Metropolis-Hastings, the authors' ``hamilton`` weights, is
``topology.mixing = "metropolis-hastings"``) and ``K = T_mix`` by default (``graphutils.T_mix``,
with sigma the agents' median noise multiplier, at least 1/2 so that a non-private run gets
``log(N) / sqrt(l2)`` steps).  The graph may be redrawn each round (``topology.redraw_every``).

Besides the local-DP epsilon of the ledger, the state accumulates each round's pairwise network-DP
RDP (:mod:`decentdp.privacy.network_dp`); :meth:`Muffliato.privacy_extras` turns it into the
``N x N`` matrix eps_{u->v} of ``privacy.json`` and ``epsilon_pairwise_max`` of the summary.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import AlgorithmSettings, Network, RoundContext, SettingsAlgorithm, State
from decentdp.algorithms.registry import register
from decentdp.privacy import network_dp
from decentdp.privacy.accounting import RDP_ORDERS


class MuffliatoSettings(AlgorithmSettings):
    """Muffliato's settings (specs B.2)."""

    gossip_steps: int = Field(0, ge=0, description="accelerated gossip steps per round (0: T_mix of the graph)")
    update_clip: float | None = Field(None, gt=0, description="G: post-processing clip of the noisy gradient "
                                                              "(the authors' L; none by default)")


def accelerated_gossip(network: Network, x: torch.Tensor, steps: int, gamma: float) -> torch.Tensor:
    """``steps`` Chebyshev-accelerated gossip steps from ``y^0 = x``: ``y^1 = W y^0``, then
    ``y^{t+1} = gamma W y^t + (1 - gamma) y^{t-1}``."""
    previous, current = x, network.mix(x)
    for _ in range(steps - 1):
        previous, current = current, network.mix_add(current, previous, (1 - gamma) / gamma).mul_(gamma)
    return current


def dense_mixing(network: Network) -> np.ndarray:
    """The whole run's mixing matrix W (public, :meth:`Network.public_graph`) as the network applies it: its
    weights rounded to the network's dtype, in float64."""
    w = network.public_graph().dense_mixing()
    return torch.from_numpy(w).to(network.in_weights.dtype).double().numpy()


@register
class Muffliato(SettingsAlgorithm):
    """Muffliato-SGD: one noisy gradient step, then accelerated gossip; pairwise network-DP accounting."""

    name: ClassVar[str] = "muffliato"
    Settings = MuffliatoSettings

    def __init__(self, settings: MuffliatoSettings) -> None:
        super().__init__(settings)
        self._graph: tuple[Network, float, int, np.ndarray] | None = None

    @property
    def round_temporaries(self) -> int:
        return 4  # the gradient, the step and two gossip iterates

    def init_state(self, params: torch.Tensor) -> State:
        rdp = torch.zeros(params.shape[0], params.shape[0], len(RDP_ORDERS), dtype=torch.float64,
                          device=params.device)
        return {"params": params, "pairwise_rdp": rdp}

    def _prepare(self, ctx: RoundContext, sigmas: np.ndarray) -> tuple[float, int, np.ndarray]:
        """gamma, K and the pairwise coefficients of this round's network (computed once per graph) from
        the whole graph's W and every agent's sigma (public), the coefficients' rows those of the local
        senders (the rows of the state's ``pairwise_rdp`` held here)."""
        net = ctx.network
        if self._graph is None or self._graph[0] is not net:
            w = dense_mixing(net)
            gap = network_dp.spectral_gap(w)
            gamma = network_dp.chebyshev_gamma(gap)
            sigma = max(0.5, float(np.median(sigmas)))
            steps = self.settings.gossip_steps or network_dp.mixing_steps(gap, net.n_total, sigma)
            polys = network_dp.gossip_polynomials(w, steps, gamma)[:steps]  # messages y^0 .. y^{K-1}
            coefficients = network_dp.pairwise_coefficients(polys, (w > 0).astype(float))
            self._graph = (net, gamma, steps, coefficients[net.agent_ids.cpu().numpy()])
        return self._graph[1], self._graph[2], self._graph[3]

    def round(self, state: State, ctx: RoundContext) -> State:
        oracle = ctx.oracle
        sigmas = np.zeros(ctx.network.n_total) if oracle.mechanism is None else \
            oracle.mechanism.noise_multipliers.double().cpu().numpy()        # every agent's (public)
        gamma, steps, coefficients = self._prepare(ctx, sigmas)
        update = oracle.gradient(state["params"])                                    # step 1
        if self.settings.update_clip is not None:                                   # step 2
            update.mul_((self.settings.update_clip / update.norm(dim=1, keepdim=True).clamp(min=1e-12)).clamp(max=1))
        injected = update.mul_(-ctx.lr).add_(state["params"])                       # step 3
        params = accelerated_gossip(ctx.network, injected, steps, gamma)             # step 4
        rdp = network_dp.round_pairwise_rdp(coefficients, sigmas[ctx.network.agent_ids.cpu().numpy()],  # local senders
                                            oracle.sample_rates.double().cpu().numpy())
        return {"params": params,
                "pairwise_rdp": state["pairwise_rdp"] + torch.from_numpy(rdp).to(state["pairwise_rdp"].device)}

    def privacy_extras(self, state: State, delta: float, local: np.ndarray) -> dict[str, Any]:
        """eps_{u->v} (RDP-converted network bound, capped by u's reported local epsilon: v's view is
        post-processing of u's releases) and its largest value off the diagonal."""
        epsilons = np.minimum(network_dp.pairwise_epsilon(state["pairwise_rdp"].cpu().numpy(), delta),
                              np.asarray(local, dtype=float)[:, None])
        np.fill_diagonal(epsilons, 0.0)
        off = epsilons[~np.eye(len(epsilons), dtype=bool)]
        largest = float(off.max()) if off.size else 0.0
        return {"epsilon_pairwise_max": None if math.isinf(largest) else largest,
                "epsilon_pairwise_network": [[None if math.isinf(e) else e for e in row] for row in epsilons.tolist()]}
