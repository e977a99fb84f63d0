"""The vectorised sampled-Gaussian RDP equals dp_accounting's, order by order (it replaces it in ``rdp_curve``).

Every epsilon of a Poisson-sampled run under the RDP (or tight) accountant is built on these curves, so the
check is equality with the library that the accounting was validated against, over rates, multipliers and
orders that runs use and beyond (tiny and near-one rates, multipliers from 0.3 to 100, where some fractional
series do not converge and both price the order at infinity).
"""

from __future__ import annotations

import logging
import math

import dp_accounting
import mpmath
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from decentdp.privacy.accounting import (
    RDP_ORDERS,
    epsilon_of_history,
    epsilon_spent,
    gaussian_dp_epsilon,
    narrow_bracket,
    rdp_curve,
    rdp_epsilon,
)
from decentdp.privacy.events import gaussian_event
from decentdp.privacy.ledger import _rdp_epsilon_fast
from decentdp.privacy.sampled_gaussian_rdp import SERIES_FLOOR, sampled_gaussian_rdp

RATES = [1e-5, 1e-3, 0.01, 0.0625, 0.2, 0.5, 0.9, 0.999]
MULTIPLIERS = [0.3, 0.8, 1.0, 2.0, 5.0, 30.0, 100.0]


@pytest.mark.parametrize("rate", RATES)
def test_every_order_equals_dp_accountings(rate: float, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="absl")  # dp_accounting warns for each divergent order
    orders = np.concatenate([RDP_ORDERS, [1.05, 7.3, 40.5]])
    for multiplier in MULTIPLIERS:
        ours = sampled_gaussian_rdp(rate, multiplier, orders)
        reference = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(rate, multiplier, orders)
        exact = reference >= SERIES_FLOOR  # below it, rounding: ours is the unsampled Gaussian's, above the truth
        np.testing.assert_allclose(ours[exact], reference[exact], rtol=1e-13, atol=0, equal_nan=False,
                                   err_msg=f"q={rate}, sigma={multiplier}")
        np.testing.assert_array_equal(ours[~exact], orders[~exact] / (2 * multiplier**2))


def test_rounding_in_the_series_never_prices_a_release_at_epsilon_zero() -> None:
    """A review: at q = 1e-5, sigma = 1e5 the series came out near -1e-20 at some orders, dp_accounting's
    conversion read that as epsilon 0, and the tight accountant reported 0 for a million releases.  One release
    alone already has delta(0) = q TV(N(0, s^2), N(1, s^2)) = 4.0e-11 > delta = 1e-12, so its epsilon is above 0."""
    event = gaussian_event(1e5, 1e-5)
    curve = rdp_curve(event)
    assert np.all(curve > 0)
    tv = 2 * stats.norm.cdf(0.5 / 1e5) - 1
    assert 1e-5 * tv > 1e-12
    for count in (1, 10**6):
        assert epsilon_of_history(((event, count),), 1e-12, "rdp") > 0
        assert epsilon_of_history(((event, count),), 1e-12, "tight") > 0


def test_edge_rates_and_multipliers_match_dp_accounting() -> None:
    for rate, multiplier in [(0.0, 1.0), (1.0, 1.0), (0.3, 0.0), (1.0, 0.0)]:
        reference = rdp_privacy_accountant.RdpAccountant().compose(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(multiplier))).rdp
        np.testing.assert_array_equal(sampled_gaussian_rdp(rate, multiplier, RDP_ORDERS), reference)


def test_rdp_curve_prices_a_sampled_gaussian_with_the_vectorised_series() -> None:
    event = dp_accounting.PoissonSampledDpEvent(0.013, dp_accounting.GaussianDpEvent(1.37))
    reference = rdp_privacy_accountant.RdpAccountant().compose(event).rdp
    np.testing.assert_allclose(rdp_curve(event), reference, rtol=1e-13, atol=0, equal_nan=False)


def test_it_fails_closed_where_dp_accounting_would_raise() -> None:
    """A multiplier whose square underflows (dp_accounting divides by zero) is priced as no noise, and NaN never
    reaches the conversion to epsilon, where ``max(0, nan)`` would read as no privacy loss at all."""
    assert np.isinf(sampled_gaussian_rdp(0.1, 1e-170, RDP_ORDERS)).all()
    assert epsilon_spent(1e-170, 1e-5, 0.1, 100, accountant="rdp") == np.inf
    history = ((gaussian_event(1.0, 0.1), 1000), (gaussian_event(1e-170, 0.1), 1))
    assert epsilon_of_history(history, 1e-5, "rdp") == np.inf
    for rate, multiplier in [(float("nan"), 1.0), (1.5, 1.0), (-0.1, 1.0), (0.1, -1.0), (0.1, float("nan"))]:
        with pytest.raises(ValueError):
            sampled_gaussian_rdp(rate, multiplier, RDP_ORDERS)


def test_a_nan_order_bounds_nothing_in_either_conversion() -> None:
    """Whatever produced it, a NaN in a composed curve must not read as no privacy loss: it is skipped like an
    infinite order, so the other orders give the epsilon (and a curve of NaN gives infinity)."""
    curve = 100 * rdp_curve(gaussian_event(1.0, 0.1))
    poisoned = curve.copy()
    poisoned[3] = np.nan
    for conversion in (rdp_epsilon, _rdp_epsilon_fast):
        assert conversion(poisoned, 1e-5) == pytest.approx(conversion(curve, 1e-5), rel=1e-12)
        assert conversion(np.full_like(curve, np.nan), 1e-5) == np.inf


def test_a_nan_noise_multiplier_is_priced_as_no_privacy() -> None:
    """A NaN multiplier (only reachable through the API) is no noise, never free: its event is non-private, and a
    NaN Gaussian-DP parameter gives an infinite epsilon (both read as 0 before)."""
    assert epsilon_of_history(((gaussian_event(float("nan"), 0.1), 100),), 1e-5) == np.inf
    assert gaussian_dp_epsilon(float("nan"), 1e-5) == np.inf


def test_the_bracket_search_never_closes_on_a_point_whose_excess_is_nan() -> None:
    """Calibration returns the safe end of its bracket; a NaN excess (nothing bounds that point) counts as over
    the target, so the end returned lies where the excess is finite and at most 0."""
    def excess(scale: float) -> float:
        return float("nan") if 0.3 <= scale <= 0.9 else 1.0 - scale

    safe = narrow_bracket(excess, 0.0, 2.0, 1e-6)
    assert 1.0 <= safe <= 1.0 + 2e-6


@pytest.mark.parametrize("releases", [101, 200])
def test_unsampled_gaussian_histories_use_their_closed_form_at_any_multiplier(releases: int) -> None:
    """A review: past sigma / sqrt(T) < 0.1 the PLD accountant refused before reaching the closed form it uses
    for unsampled Gaussians, and tight fell back to RDP (96.9 where the exact epsilon is 92.5 at T = 101)."""
    event = gaussian_event(1.0, 1.0)
    exact = gaussian_dp_epsilon(math.sqrt(releases) / 1.0, 1e-5)
    for accountant in ("pld", "tight"):
        assert epsilon_of_history(((event, releases),), 1e-5, accountant) == pytest.approx(exact, rel=1e-12)
    assert epsilon_of_history(((event, releases),), 1e-5, "rdp") > exact


def _exact_one_release_epsilon(rate: float, sigma: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of one Poisson-sampled Gaussian release under add/remove, independently of
    any accountant: both hockey-stick divergences between ``(1 - q) N(0, s^2) + q N(1, s^2)`` and ``N(0, s^2)`` in
    closed form (each is a difference of Gaussian tails past the point where the density ratio crosses e^eps),
    evaluated at 60 digits (the tails cancel to 1e-20 here) and bisected on epsilon."""
    mpmath.mp.dps = 60
    q, s, target = mpmath.mpf(rate), mpmath.mpf(sigma), mpmath.mpf(delta)
    half = mpmath.mpf(1) / 2

    def hockey_stick(eps: mpmath.mpf) -> mpmath.mpf:
        e = mpmath.e ** eps
        cut = s**2 * mpmath.log((e - 1 + q) / q) + half                   # mixture over N(0): x past it
        removal = q * mpmath.ncdf(-(cut - 1) / s) - (e - 1 + q) * mpmath.ncdf(-cut / s)
        weight = 1 - e * (1 - q)                                           # N(0) over the mixture: x below
        addition = mpmath.mpf(0)
        if weight > 0:
            low = s**2 * mpmath.log(weight / (e * q)) + half
            addition = weight * mpmath.ncdf(low / s) - e * q * mpmath.ncdf((low - 1) / s)
        return max(removal, addition)

    if hockey_stick(mpmath.mpf(0)) <= target:
        return 0.0
    low, high = mpmath.mpf(0), mpmath.mpf(1)
    while hockey_stick(high) > target:
        high *= 2
    for _ in range(120):
        middle = (low + high) / 2
        low, high = (middle, high) if hockey_stick(middle) > target else (low, middle)
    return float(high)


@pytest.mark.parametrize(("rate", "sigma", "delta"), [(1e-5, 1e5, 1e-12), (1e-5, 1e4, 1e-12), (1e-4, 1e4, 1e-10),
                                                       (1e-3, 100.0, 1e-5), (0.01, 2.0, 1e-5)])
def test_one_sampled_release_is_priced_at_least_at_its_exact_epsilon(rate: float, sigma: float,
                                                                     delta: float) -> None:
    """Reported >= exact where the series' rounding used to price a release at 0 (the first three: exact
    1.9e-10, 2.7e-9, 1.9e-8), and tight to 1e-5 relative where the series is sound (the last: 0.0282591)."""
    exact = _exact_one_release_epsilon(rate, sigma, delta)
    history = ((gaussian_event(sigma, rate), 1),)
    for accountant in ("rdp", "pld", "tight"):
        assert epsilon_of_history(history, delta, accountant) >= exact, accountant
    assert epsilon_of_history(history, delta, "tight") <= exact * (1 + 1e-5) + 1e-4
