"""RDP of the Poisson-sampled Gaussian mechanism at every order at once: dp_accounting's series, vectorised.

dp_accounting prices a sampled Gaussian order by order in Python loops (Mironov, Talwar & Zhang 2019,
"Renyi differential privacy of the sampled Gaussian mechanism", Sec. 3.3): ``log A_alpha`` is a finite
binomial sum for an integer order and, for a fractional one, a series of two parts (the integrals below and
above ``z0``) that it adds term by term until both parts' terms decrease and fall ``e^30`` below the total.
With a large noise multiplier the fractional series runs hundreds of terms, so one curve at the default
orders costs about a quarter of a second here, and calibrating a sampled run evaluates dozens of curves.

This module computes the same terms as arrays, one row per order, adds each row in the same order with
``np.logaddexp.accumulate`` (dp_accounting's ``_log_add``, ``max + log1p(exp(min - max))``), and stops each
row at the term where dp_accounting's loop stops (the same test, evaluated at every term).  The result agrees
with dp_accounting to rounding (``tests/privacy/test_sampled_gaussian_rdp.py`` checks a grid of rates,
multipliers and orders); :func:`decentdp.privacy.accounting.rdp_curve` uses it for every sampled Gaussian.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

#: Terms of a fractional order's series before it is declared divergent (dp_accounting's
#: ``_MAX_STEPS_LOG_A_FRAC``); such an order is priced at infinity, so it never gives the epsilon.
MAX_SERIES_TERMS = 1000
#: RDP values below this are rounding in the series (``log_a`` is the log of a sum near 1, absolute error about
#: 1e-16): replaced by the unsampled Gaussian's, a sound upper bound.
SERIES_FLOOR = 1e-12
#: Terms each fractional series is first summed over (most stop within them at the multipliers runs use).
FIRST_TERMS = 64


def sampled_gaussian_rdp(sample_rate: float, noise_multiplier: float, orders: np.ndarray) -> np.ndarray:
    """RDP of one release of the Gaussian mechanism of multiplier ``noise_multiplier`` on a Poisson sample at
    rate ``sample_rate``, at each of ``orders`` (all above 1), under add/remove-one neighbouring.

    It fails closed: a rate outside [0, 1] or a negative multiplier is refused (as dp_accounting refuses them),
    a multiplier whose square underflows to 0 is priced as no noise, and any order whose series gives NaN is
    priced at infinity, so that no input can make the epsilon smaller than the mechanism's."""
    orders = np.asarray(orders, dtype=np.float64)
    q, sigma = float(sample_rate), float(noise_multiplier)
    if not 0 <= q <= 1:
        raise ValueError(f"the sampling rate must lie in [0, 1], got {sample_rate!r}")
    if not sigma >= 0:
        raise ValueError(f"the noise multiplier must be non-negative, got {noise_multiplier!r}")
    if q == 0:
        return np.zeros(len(orders))
    if sigma**2 == 0:
        return np.full(len(orders), np.inf)
    if q == 1:
        return orders / (2 * sigma**2)
    integer = orders == np.floor(orders)
    log_a = np.empty(len(orders))
    log_a[integer] = [_log_a_integer(q, sigma, int(order)) for order in orders[integer]]
    log_a[~integer] = _log_a_fractional(q, sigma, orders[~integer])
    curve = log_a / (orders - 1)
    # Below the series' absolute rounding (log_a is a log of a sum near 1) a value says nothing, and may even be
    # negative (about -1e-20 at q = 1e-5, sigma = 1e5), which dp_accounting's conversion reads as epsilon 0 for any
    # count of releases; there the unsampled Gaussian's alpha / (2 sigma^2), never below the sampled one, is used.
    curve = np.where(curve < SERIES_FLOOR, orders / (2 * sigma**2), curve)
    return np.where(np.isnan(curve), np.inf, curve)


def _log_comb(n: np.ndarray | float, k: np.ndarray | float) -> np.ndarray:
    """Log of the (generalised) binomial coefficient, as dp_accounting computes it."""
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """``log A_alpha`` for an integer order: the binomial sum over ``i = 0 .. alpha``, added in order."""
    i = np.arange(alpha + 1, dtype=np.float64)
    terms = _log_comb(float(alpha), i) + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
    return float(np.logaddexp.accumulate(terms)[-1])


def _log_a_fractional(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """``log A_alpha`` for fractional orders: both parts' series, each row stopped where dp_accounting's loop
    stops (both terms below the previous ones and ``e^30`` below the running total); infinity for a row that
    does not stop within :data:`MAX_SERIES_TERMS` terms.  Rows are summed over :data:`FIRST_TERMS` terms
    first (most orders stop there) and the rows still running again over four times as many."""
    log_a = np.full(len(alphas), np.inf)
    running = np.arange(len(alphas))
    terms = FIRST_TERMS
    while len(running):
        values, stopped = _series(q, sigma, alphas[running], min(terms, MAX_SERIES_TERMS))
        log_a[running[stopped]] = values[stopped]
        if terms >= MAX_SERIES_TERMS:
            break
        running, terms = running[~stopped], terms * 4
    return log_a


def _series(q: float, sigma: float, alphas: np.ndarray, terms: int) -> tuple[np.ndarray, np.ndarray]:
    """Each order's sum over its first ``terms`` terms, up to the term where it stops, and whether it stopped."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    i = np.arange(terms, dtype=np.float64)[None, :]
    alpha = alphas[:, None]
    j = alpha - i
    log_coef = _log_comb(alpha, i)
    log_t0 = log_coef + i * math.log(q) + j * math.log1p(-q)
    log_t1 = log_coef + j * math.log(q) + i * math.log1p(-q)
    log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
    log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
    log_s0 = log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0
    log_s1 = log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1
    total = np.logaddexp(np.logaddexp.accumulate(log_s0, axis=1), np.logaddexp.accumulate(log_s1, axis=1))
    stops = np.zeros_like(total, dtype=bool)
    stops[:, 1:] = ((log_s0[:, 1:] < log_s0[:, :-1]) & (log_s1[:, 1:] < log_s1[:, :-1])
                    & (np.maximum(log_s0[:, 1:], log_s1[:, 1:]) < total[:, 1:] - 30))
    first = np.argmax(stops, axis=1)
    return total[np.arange(len(alphas)), first], stops.any(axis=1)


def _log_erfc(x: np.ndarray) -> np.ndarray:
    """``log(erfc(x))``, accurate for large ``x`` (dp_accounting's form, through ``log_ndtr``)."""
    return math.log(2) + special.log_ndtr(-x * 2**0.5)
