"""Pairwise-cancelling correlated noise from edge secrets (DECOR), and what an observer of every message learns.

**The mechanism** (Allouah, Koloskova, El Firdoussi, Guerraoui, Jaggi, ICML 2024, Alg. 1).  Each round agent
``i`` releases its noisy update::

    m_i = (x_i + sigma C xi_i) / L_i  +  sum_{j in N(i)} s_ij v_ij          s_ij = +1 if i < j else -1

with ``x_i`` its clipped gradient sum, ``xi_i ~ N(0, I)`` its own noise and ``v_ij = v_ji ~ N(0, (tau C)^2 I)``
drawn from the secret that ``i`` and ``j`` share (:meth:`~decentdp.rng.AgentRandom.edge_normal`; X25519 edge
keys in secure mode).  The correlated terms cancel in ``sum_i m_i``: the average model carries only the own
noise, while each message also hides behind the noise of its sender's edges.

**The observer** (the paper's SecLDP, extended to curious agents).  An observer ``O`` (one agent, a colluding
set, or nobody: an external eavesdropper) sees *every* message of every round, knows its members' own noise
and the keys of every edge that touches ``O``, and, as DP's worst case, every other agent's data.  From the
models it sees it computes each round's update vector ``m``, whose noise is fresh every round: the rounds are
independent releases.  Within a round ``m`` is Gaussian with covariance ``Sigma_O`` (the noise ``O`` does not
hold) and only sender ``u``'s term depends on ``u``'s data, so ``e_u^T Sigma_O^+ m`` is sufficient and the
round is *exactly* a Gaussian mechanism on ``x_u`` with multiplier::

    sigma_eff(u, O) = 1 / (a_u sqrt(e_u^T Sigma_O^-1 e_u)),        a_u = 1 / L_u

(every sender has noise of its own, so ``Sigma_O`` is positive definite).  Poisson sampling amplifies it as it
does DP-SGD's, and the ledger composes the rounds.  An agent that sees fewer
messages (its neighbours' only) learns less, so its epsilon is at most this one; the brute-force tests
check both against the explicit multi-round view (:mod:`decentdp.privacy.observer_view`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import dp_accounting
import numpy as np
import torch

from decentdp.privacy.accounting import epsilon_spent
from decentdp.privacy.events import gaussian_event, joint_gaussian_event
from decentdp.privacy.mechanisms import NOISE_BLOCK_BYTES, GaussianMechanism, NoiseDraw, round_up_to_float32

#: Relative amount by which :func:`effective_multipliers` lowers each multiplier, so that rounding never leaves
#: one above the truth (far above the computation's own relative error, ~1e-14 in the tests' comparisons with
#: 100-digit arithmetic; a lower multiplier only raises the epsilon it is priced at).
MULTIPLIER_MARGIN = 1e-9
#: Distinct multipliers priced one by one; beyond, a geometric grid of this many (each value priced at the
#: grid point just below it: an upper bound, since epsilon decreases in the multiplier).
PRICED_MULTIPLIERS = 48


def graph_edges(pairs: np.ndarray) -> np.ndarray:
    """The undirected edges ``(i, j)``, ``i < j``, among directed ``pairs`` (``(P, 2)``, e.g. a
    :class:`~decentdp.algorithms.base.PublicGraph`'s edges), one row each, sorted (``(E, 2)`` int64)."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.unique(np.sort(pairs, axis=1), axis=0) if len(pairs) else np.zeros((0, 2), dtype=np.int64)


def effective_multipliers(message_scale: np.ndarray, own: np.ndarray, edges: np.ndarray, edge_scale: float,
                          observers: Sequence[Collection[int]]) -> np.ndarray:
    """``sigma_eff[u, o]`` of every sender ``u`` towards every observer ``observers[o]`` (module docstring), for
    messages ``m_i = message_scale_i (x_i + own_i xi_i) + sum_e +-edge_scale v_e`` in units of C (every
    ``own_i > 0``); ``nan`` where ``u`` is in the observer.

    The observer's covariance is ``Sigma = D + B B^T``, ``D`` the own noises' (diagonal, positive) and ``B`` the
    unknown edges'.  With ``D^-1/2 B = U S V^T`` (``U`` square, ``s_k = 0`` past the rank)::

        e_u^T Sigma^-1 e_u = (1 / d_u) sum_k U_uk^2 / (1 + s_k^2)

    a sum of positive terms: no matrix is inverted.  ``Sigma``'s condition number grows as ``tau^2``, and an
    eigendecomposition of it lost the small eigenvalues that carry the cancelled edges past ``correlation``
    ~1e5 (every sender read as leaked); the singular vectors of ``D^-1/2 B`` do not depend on ``tau`` at all.
    Each multiplier is lowered by :data:`MULTIPLIER_MARGIN`.
    """
    own = np.asarray(own, dtype=np.float64)
    if not (own > 0).all():
        raise ValueError("every sender needs noise of its own (own > 0) for its observers' views to be priced")
    n = len(own)
    incidence = np.zeros((n, len(edges)))
    incidence[edges[:, 0], np.arange(len(edges))] = 1.0
    incidence[edges[:, 1], np.arange(len(edges))] = -1.0
    out = np.full((n, len(observers)), np.nan)
    for column, observer in enumerate(observers):
        members = np.zeros(n, dtype=bool)
        members[list(observer)] = True
        unknown_edges = ~(members[edges[:, 0]] | members[edges[:, 1]]) if len(edges) else np.zeros(0, dtype=bool)
        outside = np.flatnonzero(~members)
        if not len(outside):
            continue
        diagonal = (message_scale[outside] * own[outside]) ** 2
        shrink = np.ones(len(outside))                                   # 1 / (1 + s_k^2), 1 past the rank
        basis = np.eye(len(outside))
        if unknown_edges.any():
            scaled = incidence[outside][:, unknown_edges] * edge_scale / np.sqrt(diagonal)[:, None]
            basis, singular, _ = np.linalg.svd(scaled, full_matrices=True)
            shrink[:len(singular)] = 1.0 / (1.0 + singular ** 2)
        precision = (basis ** 2 @ shrink) / diagonal                     # e_u^T Sigma^-1 e_u for every u outside
        out[outside, column] = (1.0 - MULTIPLIER_MARGIN) / (message_scale[outside] * np.sqrt(precision))
    return out


def epsilon_upper_bounds(multipliers: np.ndarray, rates: np.ndarray, steps: int, delta: float, accountant: str,
                         relation: str) -> np.ndarray:
    """Epsilon of ``steps`` Poisson-sampled Gaussian releases for each entry of ``multipliers`` (row ``u``
    sampled at ``rates[u]``): exact for up to :data:`PRICED_MULTIPLIERS` distinct values per rate, else each
    priced at the geometric grid point just below it (never below the truth).  ``nan`` stays ``nan``, 0 is
    not private (``inf``)."""
    out = np.full(multipliers.shape, np.nan)
    for rate in np.unique(rates):
        rows = rates == rate
        values = multipliers[rows]
        finite = values[np.isfinite(values) & (values > 0)]
        distinct = np.unique(finite)
        grid = distinct if len(distinct) <= PRICED_MULTIPLIERS else \
            np.geomspace(distinct[0], distinct[-1], PRICED_MULTIPLIERS)
        grid[0], grid[-1] = distinct[0], distinct[-1]  # (geomspace's ends may round away from them)
        priced = np.array([epsilon_spent(float(s), delta, float(rate), steps, 1, accountant, relation) for s in grid])
        block = np.full(values.shape, np.nan)
        usable = np.isfinite(values) & (values > 0)
        index = np.searchsorted(grid, values[usable], side="right") - 1  # the grid point at or below each
        block[usable] = priced[np.clip(index, 0, len(grid) - 1)]
        block[values == 0] = np.inf
        block[np.isinf(values)] = 0.0
        out[rows] = block
    return out


class CorrelatedGaussianMechanism(GaussianMechanism):
    """DECOR's release: the Gaussian mechanism's own noise ``sigma_i C`` (exact on a grid in secure mode), then
    each incident edge's shared noise ``+-tau C L_i`` on the clipped sum (``+-tau C`` once the oracle divides by
    ``L_i``, so that the two ends' terms cancel).  Its events are those of the observer view it was calibrated
    for: a Gaussian of multiplier ``event_multipliers[i]`` (the smallest ``sigma_eff`` over the observers)."""

    def __init__(self, noise_multipliers: torch.Tensor, sensitivity: float, edges: np.ndarray, edge_scale: float,
                 expected_batches: torch.Tensor, event_multipliers: torch.Tensor, observer: str) -> None:
        super().__init__(noise_multipliers, sensitivity)
        self.edges = edges
        self.edge_scale = float(edge_scale)
        self.expected_batches = expected_batches.double()
        self.event_multipliers = event_multipliers
        self.observer = observer

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        super().perturb(values, owners, noise, slots)
        held = {owner: row for row, owner in enumerate(owners.tolist())}  # owners index the per-agent tables: ids
        touching = [k for k, (i, j) in enumerate(self.edges.tolist()) if i in held or j in held]
        rows = max(1, NOISE_BLOCK_BYTES // (8 * values.shape[1]))
        for start in range(0, len(touching), rows):
            block = touching[start:start + rows]
            pairs = [tuple(self.edges[k].tolist()) for k in block]
            draws = noise.edge_normal(pairs, values.shape[1]).to(values.device)
            for draw, (i, j) in zip(draws, pairs, strict=True):
                for agent, sign in ((i, 1.0), (j, -1.0)):
                    if agent in held:
                        scale = self.edge_scale * self.sensitivity * float(self.expected_batches[agent])
                        if values.dtype != torch.float64:  # add_ rounds alpha to the nearest: round it up instead
                            # (a host scalar, on the CPU whatever the default device: it only becomes add_'s alpha)
                            scale = float(round_up_to_float32(torch.tensor(scale, dtype=torch.float64, device="cpu")))
                        values[held[agent]].add_(draw.to(values.dtype), alpha=sign * scale)

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        return joint_gaussian_event(float(self.event_multipliers[owner]), sample_rate, rows)

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        return gaussian_event(float(self.event_multipliers[owner]), sample_rate)
