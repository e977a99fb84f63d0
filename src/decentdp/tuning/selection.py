"""Private hyper-parameter selection: random search with a random number of trials, only the best released.

Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022
(arXiv:2110.03620v2).  A mechanism ``Q`` (one trial: random hyper-parameters, a DP training run, a DP
score) is run ``K`` times, ``K`` drawn from a distribution independent of the data, and only the best
output is released.  The RDP of the whole selection is a small overhead on ``Q``'s, instead of ``K``
times it.  This module holds the math only (no I/O):

* the number of trials ``K``: the truncated negative binomial ``D_{eta,gamma}`` (Definition 1; ``eta = 1``
  is the geometric distribution, ``eta = 0`` the logarithmic) or a Poisson distribution (Section 3.3), and
  the mean of the former (and the ``gamma`` that gives a wanted mean);
* the RDP curve of the selection (Theorem 2 for the truncated negative binomial, Theorem 6 for Poisson),
  converted to (epsilon, delta) with the project's conversion (:func:`~decentdp.privacy.accounting.rdp_epsilon`).

Checked against the paper's statements as implemented by Google's ``dp_accounting``
(``rdp_privacy_accountant._compute_rdp_repeat_and_select``, which cites Theorems 2 and 6 of
arXiv:2110.03620v2); ``tests/tuning/test_selection.py`` compares :func:`selection_rdp` with it.  That
implementation allows ``eta >= 0`` only; the paper's Theorem 2 holds for every ``eta > -1``, which this
module allows.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.optimize import brentq

from decentdp.privacy.accounting import RDP_ORDERS, rdp_epsilon


def os_seed() -> np.ndarray:
    """128 bits from the operating system (``secrets``), as four 32-bit words: a seed no one can find by trying
    every value, in a form numpy's legacy ``RandomState`` (which Optuna's samplers draw from) takes whole (an
    integer seed there must lie below 2**32, which a search over all of them recovers)."""
    return np.frombuffer(secrets.token_bytes(16), dtype=np.uint32).copy()


def os_generator() -> np.random.Generator:
    """A numpy generator seeded from the operating system (:func:`os_seed`): draws that the sweep file, the
    trials' seeds and the study cannot reproduce, as the selection's privacy argument requires."""
    return np.random.default_rng(os_seed())


# ----------------------------------------------------------------------------- the number of trials


def truncated_negative_binomial_mean(eta: float, gamma: float) -> float:
    """``E[K]`` for ``K ~ D_{eta,gamma}`` (Definition 1 and the remark after it):
    ``eta (1 - gamma) / (gamma (1 - gamma^eta))`` for ``eta != 0``, ``(1/gamma - 1) / log(1/gamma)`` for
    ``eta = 0``."""
    _check_tnb(eta, gamma)
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def gamma_for_mean(eta: float, mean: float) -> float:
    """The ``gamma`` for which ``D_{eta,gamma}`` has mean ``mean`` (> 1): the mean falls from infinity at
    ``gamma -> 0`` to 1 at ``gamma -> 1``, strictly, so a bracketing root finder (Brent) finds it."""
    if not eta > -1:
        raise ValueError(f"eta must be > -1, got {eta}")
    if not mean > 1:
        raise ValueError(f"the mean number of trials must be > 1 for the truncated negative binomial, got {mean}")
    if eta == 1:
        return 1 / mean  # geometric
    low, high = 1e-300, 1 - 1e-12
    return float(brentq(lambda g: truncated_negative_binomial_mean(eta, g) - mean, low, high, xtol=1e-15,
                        rtol=1e-13, maxiter=500))


def truncated_negative_binomial_pmf(eta: float, gamma: float, k: int) -> float:
    """``P[K = k]`` for ``K ~ D_{eta,gamma}`` (Definition 1): for ``eta != 0``,
    ``(1-gamma)^k / (gamma^-eta - 1) * prod_{l=0}^{k-1} (l + eta) / (l + 1)``; for ``eta = 0``,
    ``(1-gamma)^k / (k log(1/gamma))``.  Zero for ``k < 1``."""
    _check_tnb(eta, gamma)
    if k < 1:
        return 0.0
    p = _first_mass(eta, gamma)
    for j in range(1, k):
        p *= (1 - gamma) * (j + eta) / (j + 1)
    return p


def sample_truncated_negative_binomial(eta: float, gamma: float, rng: np.random.Generator) -> int:
    """One draw of ``K ~ D_{eta,gamma}`` (``K >= 1``) by inverting its distribution function with one
    uniform from ``rng``: walk ``k = 1, 2, ...`` with ``P[k+1] = P[k] (1-gamma) (k+eta)/(k+1)``."""
    _check_tnb(eta, gamma)
    u = float(rng.random())
    k, p = 1, _first_mass(eta, gamma)
    cdf = p
    while cdf < u and p > 0.0:
        p *= (1 - gamma) * (k + eta) / (k + 1)
        k += 1
        cdf += p
    return k


def _first_mass(eta: float, gamma: float) -> float:
    """``P[K = 1]`` of ``D_{eta,gamma}``."""
    if eta == 0:
        return (1 - gamma) / math.log(1 / gamma)
    return (1 - gamma) * eta / math.expm1(-eta * math.log(gamma))


def _check_tnb(eta: float, gamma: float) -> None:
    if not eta > -1:
        raise ValueError(f"eta must be > -1, got {eta}")
    if not 0 < gamma < 1:
        raise ValueError(f"gamma must lie in (0, 1), got {gamma}")


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials ``K``: ``negative-binomial`` (``eta``, ``gamma``; ``K >= 1``)
    or ``poisson`` (mean ``mu``; ``K = 0`` happens with probability ``exp(-mu)``, and then nothing is run
    and nothing released)."""

    distribution: str
    mean: float
    eta: float | None = None

    def __post_init__(self) -> None:
        if self.distribution not in ("negative-binomial", "poisson"):
            raise ValueError(f"unknown distribution {self.distribution!r}; use 'negative-binomial' or 'poisson'")
        if not (math.isfinite(self.mean) and self.mean >= 1):
            raise ValueError(f"the mean number of trials must be at least 1, got {self.mean}")
        if self.distribution == "negative-binomial":
            if self.eta is None or not self.eta > -1:
                raise ValueError(f"eta must be > -1, got {self.eta}")
            if not self.mean > 1:
                raise ValueError("the truncated negative binomial needs a mean number of trials above 1")

    @property
    def gamma(self) -> float:
        """``gamma`` of the truncated negative binomial with this mean and ``eta``."""
        assert self.eta is not None
        return gamma_for_mean(self.eta, self.mean)

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of ``K``."""
        if self.distribution == "poisson":
            return int(rng.poisson(self.mean))
        assert self.eta is not None
        return sample_truncated_negative_binomial(self.eta, self.gamma, rng)

    def describe(self) -> dict[str, float | str]:
        """The distribution and its parameters, for ``selection.json``."""
        if self.distribution == "poisson":
            return {"distribution": "poisson", "mu": self.mean}
        assert self.eta is not None
        return {"distribution": "negative-binomial", "eta": self.eta, "gamma": self.gamma, "mean_trials": self.mean}


# ----------------------------------------------------------------------------- the privacy of the selection


def gaussian_score_rdp(score_noise: float, sensitivity: float = 1.0) -> np.ndarray:
    """RDP at :data:`RDP_ORDERS` of one score released with ``N(0, score_noise^2)`` noise:
    ``lambda sensitivity^2 / (2 score_noise^2)`` (Mironov 2017, Prop. 7)."""
    if not score_noise > 0:
        raise ValueError(f"score_noise must be > 0, got {score_noise}")
    return RDP_ORDERS * sensitivity**2 / (2 * score_noise**2)


def selection_rdp(trial_rdp: np.ndarray, count: TrialCount, orders: np.ndarray = RDP_ORDERS) -> np.ndarray:
    """The RDP curve of releasing the best of ``K`` trials, each ``(lambda, trial_rdp[lambda])``-RDP.

    Truncated negative binomial, Theorem 2: if ``Q`` is ``(lambda, eps)``- and ``(lambda_hat, eps_hat)``-RDP,
    the selection is ``(lambda, eps')``-RDP with::

        eps' = eps + (1 + eta) (1 - 1/lambda_hat) eps_hat + (1 + eta) log(1/gamma) / lambda_hat
                   + log(E[K]) / (lambda - 1),

    minimised over ``lambda_hat`` among ``orders`` (the same for every ``lambda``).

    Poisson, Theorem 6: if ``Q`` is ``(lambda, eps)``-RDP and ``(eps_hat, delta_hat)``-DP with
    ``exp(eps_hat) = 1 + 1/(lambda - 1)``, the selection is ``(lambda, eps')``-RDP with::

        eps' = eps + mu delta_hat + log(mu) / (lambda - 1),

    ``delta_hat`` obtained from ``Q``'s RDP curve by dp_accounting's RDP-to-DP conversion.

    Orders ``<= 1`` get no bound from the theorems (``inf``).  Last, since RDP never decreases with the
    order, each order takes the smallest bound of the orders above it.
    """
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(trial_rdp, dtype=np.float64)
    if rdp.shape != orders.shape:
        raise ValueError(f"trial_rdp has {rdp.shape} values for {orders.shape} orders")
    out = np.full(len(orders), np.inf)
    usable = orders > 1
    with np.errstate(divide="ignore", invalid="ignore"):
        if count.distribution == "poisson":
            mu = count.mean
            for i in np.flatnonzero(usable):
                eps_hat = math.log1p(1 / (orders[i] - 1))
                delta_hat, _ = rdp_privacy_accountant.compute_delta(orders, rdp, eps_hat)
                out[i] = rdp[i] + mu * delta_hat + math.log(mu) / (orders[i] - 1)
        else:
            assert count.eta is not None
            gamma, eta = count.gamma, count.eta
            hat = (1 + eta) * ((1 - 1 / orders) * rdp + math.log(1 / gamma) / orders)
            constant = float(np.min(np.where(np.isfinite(hat), hat, np.inf)))
            out[usable] = rdp[usable] + constant + math.log(count.mean) / (orders[usable] - 1)
    return np.minimum.accumulate(out[::-1])[::-1]


def selection_epsilon(trial_rdp: np.ndarray, count: TrialCount, delta: float) -> float:
    """Epsilon at ``delta`` of the selection (:func:`selection_rdp`, then the project's RDP conversion)."""
    return rdp_epsilon(selection_rdp(trial_rdp, count), delta)
