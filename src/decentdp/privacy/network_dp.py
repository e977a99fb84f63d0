"""Pairwise network differential privacy of Muffliato (Cyffers, Even, Bellet, Massoulié, NeurIPS 2022; specs B.2).

In Muffliato each agent adds Gaussian noise once to the value it injects, and the values are then
averaged by noise-free gossip.  An agent ``v`` sees only its neighbours' messages, in which agent
``u``'s noisy injection is diluted.  The authors' code (``graphutils.contrib``,
``muffliato.acceleratedsimulation``) bounds the Rényi DP of order ``alpha`` of ``u`` towards ``v``
after gossip steps with matrices ``P_1, ..., P_K`` (``y^t = P_t y^0``) by::

    eps_{u->v}(alpha) = alpha Delta^2 / (2 sigma^2) * sum_t sum_{w in N(v), w != v} (P_t)_{wu}^2 / |(P_t)_{w,:}|^2

clipped at the local-DP value ``alpha Delta^2 / (2 sigma^2)``.  Here ``Delta / sigma = 1 / sigma_u``:
the injected value is ``theta_u - eta (S_u + sigma_u C xi) / L_u`` with ``S_u`` of sensitivity ``C``.

This module computes the coefficient matrix ``c[u, v] = sum_t sum_w ...`` for given gossip matrices
(:func:`pairwise_coefficients`), the RDP curve of one round per pair (:func:`round_pairwise_rdp`:
the smaller, order by order, of the network bound and the local sampled Gaussian, both valid since
``v``'s view is post-processing of ``u``'s release), and their epsilons (:func:`pairwise_epsilon`).
Rounds compose additively in RDP.  The matrix has the shape of
:meth:`~decentdp.privacy.ledger.PrivacyLedger.pairwise_epsilon`: row ``u`` the sender, column ``v``
the observer, 0 on the diagonal.

Differences from the authors' code, on the safe side: the messages ``y^0`` (``P_0 = I``) count, so
a direct neighbour gets the local-DP value as the paper states; ``P_t`` are the Chebyshev
polynomials actually run (the authors' simulation uses ``W^t``; :func:`pairwise_coefficients` takes
any list).  Leakage of a round's noise through later rounds' messages is not counted (the per-round
composition of the authors' Muffliato-GD accounting; specs F.5 lists a third-party correction).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from decentdp.privacy.accounting import RDP_ORDERS, rdp_curve, rdp_epsilon
from decentdp.privacy.events import gaussian_event


def spectral_gap(w: np.ndarray) -> float:
    """lambda_2: the second-smallest eigenvalue of ``I - W`` (``graphutils.vplambda``)."""
    eigen = np.linalg.eigvalsh(np.eye(len(w)) - (w + w.T) / 2)
    return float(eigen[1]) if len(w) > 1 else 1.0


def chebyshev_gamma(gap: float) -> float:
    """The Chebyshev acceleration constant ``gamma = 2 (1 - sqrt(l (1 - l/4))) / (1 - l/2)^2`` (``gamma_tcheb``)."""
    return 2 * (1 - np.sqrt(gap * (1 - gap / 4))) / (1 - gap / 2) ** 2


def mixing_steps(gap: float, n_agents: int, sigma: float) -> int:
    """``T_mix = ceil(log(n max(1/4, sigma^2) / sigma^2) / sqrt(lambda_2))``: accelerated gossip steps to
    average down to the noise level (``graphutils.T_mix``); at least 1."""
    return max(1, int(np.ceil(np.log(n_agents * max(0.25, sigma**2) / sigma**2) / np.sqrt(gap))))


def gossip_polynomials(w: np.ndarray, steps: int, gamma: float) -> list[np.ndarray]:
    """``P_0 = I, P_1 = W, P_{t+1} = gamma W P_t + (1 - gamma) P_{t-1}``: ``y^t = P_t y^0`` (``t <= steps``)."""
    polys = [np.eye(len(w)), w.copy()]
    while len(polys) <= steps:
        polys.append(gamma * w @ polys[-1] + (1 - gamma) * polys[-2])
    return polys[: steps + 1]


def pairwise_coefficients(matrices: Sequence[np.ndarray], adjacency: np.ndarray) -> np.ndarray:
    """``c[u, v] = sum_P sum_{w in N(v), w != v} P_{wu}^2 / |P_{w,:}|^2`` (``contrib`` summed over the
    messages ``v`` receives from its neighbours ``w``); 0 on the diagonal."""
    n = len(adjacency)
    seen = np.zeros((n, n))  # seen[u, w]: what w's messages reveal of u
    for p in matrices:
        rows = np.linalg.norm(p, axis=1)
        seen += (p / np.where(rows > 0, rows, 1.0)[:, None]).T ** 2
    neighbours = (adjacency > 0) & ~np.eye(n, dtype=bool)
    coefficients = seen @ neighbours.astype(float)  # sum over w in N(v)
    np.fill_diagonal(coefficients, 0.0)
    return coefficients


def round_pairwise_rdp(coefficients: np.ndarray, noise_multipliers: np.ndarray,
                       sample_rates: np.ndarray) -> np.ndarray:
    """``(N, N, orders)``: one round's RDP of each sender towards each observer, the smaller of the network
    bound ``c[u, v] alpha / (2 sigma_u^2)`` and the sender's local sampled Gaussian (order by order)."""
    out = np.zeros((*coefficients.shape, len(RDP_ORDERS)))
    for u, (sigma, rate) in enumerate(zip(noise_multipliers.tolist(), sample_rates.tolist(), strict=True)):
        local = rdp_curve(gaussian_event(sigma, rate))
        if sigma <= 0:
            out[u] = np.where(coefficients[u][:, None] > 0, np.inf, 0.0)
            continue
        network = coefficients[u][:, None] * RDP_ORDERS[None, :] / (2 * sigma**2)
        out[u] = np.minimum(network, local[None, :])
    return out


def pairwise_epsilon(rdp: np.ndarray, delta: float) -> np.ndarray:
    """``(N, N)`` epsilons at ``delta`` of composed pairwise RDP curves; 0 where nothing was learned."""
    out = np.zeros(rdp.shape[:2])
    for u, v in zip(*np.nonzero(rdp.max(axis=2) > 0), strict=True):
        out[u, v] = rdp_epsilon(rdp[u, v], delta)
    return out


def plot_pairwise(epsilons: np.ndarray, path: Path, title: str = "") -> Path:
    """The ``N x N`` heat map of ``eps_{u->v}`` (row: sender, column: observer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    image = ax.imshow(np.where(np.isfinite(epsilons), epsilons, np.nan), cmap="viridis")
    fig.colorbar(image, ax=ax, label="epsilon")
    ax.set_xlabel("observer v")
    ax.set_ylabel("sender u")
    ax.set_title(title or "pairwise network DP: eps(u -> v)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
