"""The private selection's RDP bound against the exact Renyi divergence of the selection, by brute force.

A trial ``Q`` here is any mechanism with finitely many outputs ``0 .. m-1`` ordered by score (the real
trial's output, hyper-parameters and a noisy score, is such an output once its scores are ranked).  The
selection runs ``Q`` ``K`` times and releases the best output, so ``P[best <= y] = E[F(y)^K] = G(F(y))``
with ``F`` the trial's distribution function and ``G`` the probability generating function of ``K``
(Poisson's ``K = 0`` releases nothing: one more output).  The exact Renyi divergence of the two selections
is then a finite sum, computed here without the library; :func:`selection_rdp` applied to the trial's
exact RDP curve must lie above it at every order, for random pairs of trial distributions.  Two planted
bugs (pricing the selection as one trial; dropping the theorems' ``log E[K] / (lambda - 1)`` term) are
shown to be caught by the same comparison.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import logsumexp

from decentdp.privacy.accounting import RDP_ORDERS
from decentdp.tuning.selection import TrialCount, selection_rdp, truncated_negative_binomial_pmf

ORDERS = RDP_ORDERS[RDP_ORDERS > 1]

COUNTS = [
    TrialCount("negative-binomial", mean=10, eta=1.0),  # geometric
    TrialCount("negative-binomial", mean=5, eta=0.0),  # logarithmic
    TrialCount("negative-binomial", mean=20, eta=-0.5),
    TrialCount("negative-binomial", mean=4, eta=3.0),
    TrialCount("poisson", mean=8),
]


def _renyi(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """``D_lambda(P || Q)`` at every order of :data:`ORDERS`, in log space (large orders overflow)."""
    return np.array([logsumexp(a * log_p + (1 - a) * log_q) / (a - 1) for a in ORDERS])


def _exact_rdp(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The RDP curve of a mechanism whose outputs on two neighbouring datasets have laws ``p`` and ``q``:
    the larger of the two directions' divergences."""
    log_p, log_q = np.log(p), np.log(q)
    return np.maximum(_renyi(log_p, log_q), _renyi(log_q, log_p))


def _generating_function(count: TrialCount, x: np.ndarray) -> np.ndarray:
    """``E[x^K]``: Poisson ``exp(mu (x - 1))``; the truncated negative binomial's, from Definition 1 of
    Papernot and Steinke, ``((1 - (1-gamma) x)^-eta - 1) / (gamma^-eta - 1)`` (``eta != 0``) and
    ``log(1 - (1-gamma) x) / log(gamma)`` (``eta = 0``)."""
    if count.distribution == "poisson":
        return np.exp(count.mean * (x - 1))
    assert count.eta is not None
    eta, gamma = count.eta, count.gamma
    if eta == 0:
        return np.log1p(-(1 - gamma) * x) / math.log(gamma)
    return np.expm1(-eta * np.log1p(-(1 - gamma) * x)) / math.expm1(-eta * math.log(gamma))


def _best_of_k(trial: np.ndarray, count: TrialCount) -> np.ndarray:
    """The law of the best of ``K`` independent outputs of a trial with law ``trial`` (the largest index
    wins); Poisson puts ``exp(-mu)`` on an extra first output, 'no trial ran'."""
    cdf = np.concatenate([[0.0], np.cumsum(trial)])
    cdf[-1] = 1.0
    law = np.diff(_generating_function(count, cdf))
    if count.distribution == "poisson":
        law = np.concatenate([[math.exp(-count.mean)], law])
    return law


def _trial_pairs(seed: int, pairs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random pairs of trial laws on 2 to 5 outputs, bounded away from zero (finite divergences)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(pairs):
        size = int(rng.integers(2, 6))
        pair = []
        for _ in range(2):
            law = np.maximum(rng.dirichlet(np.full(size, rng.uniform(0.2, 3.0))), 1e-6)
            pair.append(law / law.sum())
        out.append((pair[0], pair[1]))
    return out


def test_the_generating_functions_reproduce_the_trial_count_laws() -> None:
    """The brute force's one modelling step, checked: the best of ``K`` draws of a two-output trial puts
    ``1 - E[(1-p)^K]`` on the better output; compare with a direct sum over ``K``'s law."""
    p_better = 0.3
    for count in COUNTS:
        if count.distribution == "poisson":
            ks = np.arange(0, 400)
            log_pmf = -count.mean + ks * math.log(count.mean) - np.array([math.lgamma(k + 1) for k in ks])
        else:
            assert count.eta is not None
            # Definition 1's ratios P[k+1] / P[k] = (1-gamma) (k+eta) / (k+1), from the library's P[1];
            # far enough that the heavy tail of eta = -0.5 (gamma ~ 7e-4) is summed
            ks = np.arange(1, 200_000)
            ratios = (1 - count.gamma) * (ks[:-1] + count.eta) / (ks[:-1] + 1)
            first = truncated_negative_binomial_pmf(count.eta, count.gamma, 1)
            log_pmf = math.log(first) + np.concatenate([[0.0], np.cumsum(np.log(ratios))])
        pmf = np.exp(log_pmf)
        assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
        direct = float(np.sum(pmf * (1 - (1 - p_better) ** ks)))
        law = _best_of_k(np.array([1 - p_better, p_better]), count)
        assert law.sum() == pytest.approx(1.0, abs=1e-12)
        assert law[-1] == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("count", COUNTS, ids=lambda c: f"{c.distribution}-{c.eta}-{c.mean}")
def test_selection_bound_is_above_the_exact_renyi_divergence(count: TrialCount) -> None:
    worst = -math.inf
    for p, q in _trial_pairs(seed=0, pairs=40):
        exact = _exact_rdp(_best_of_k(p, count), _best_of_k(q, count))
        bound = selection_rdp(_exact_rdp(p, q), count, ORDERS)
        worst = max(worst, float(np.max(exact - bound)))
    assert worst <= 1e-9, f"the selection's exact RDP exceeds the bound by {worst}"


def test_the_comparison_catches_planted_pricing_bugs() -> None:
    """Pricing the selection as one trial, or without the ``log E[K] / (lambda - 1)`` term, falls below
    the exact divergence for most random trials: the comparison above can fail."""
    count = TrialCount("negative-binomial", mean=10, eta=1.0)
    below_one_trial = below_without_log_term = 0
    pairs = _trial_pairs(seed=1, pairs=40)
    for p, q in pairs:
        exact = _exact_rdp(_best_of_k(p, count), _best_of_k(q, count))
        one_trial = _exact_rdp(p, q)
        without_log_term = selection_rdp(one_trial, count, ORDERS) - math.log(count.mean) / (ORDERS - 1)
        below_one_trial += bool(np.any(exact > one_trial + 1e-9))
        below_without_log_term += bool(np.any(exact > without_log_term + 1e-9))
    assert below_one_trial > len(pairs) // 2
    assert below_without_log_term > len(pairs) // 2
