"""Privacy accounting: the events our mechanisms release, and the accountants that price them.

Every noisy release in decentdp is the *sampled Gaussian mechanism* (Mironov et al. 2019): a
Poisson-subsampled batch (rate ``q``), per-sample gradients clipped to norm ``C``, summed, plus
``N(0, sigma^2 C^2)`` noise.  We describe such a release with Google's ``dp_accounting`` events
(``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``) and let its accountants price them:

* RDP (Rényi DP, Mironov 2017) is fast and is what we calibrate noise with, as Opacus and the
  consensus paper's code do;
* PLD (privacy loss distributions, Koskela et al.; Doroshenko et al. 2022) is tight, and is the
  epsilon we report.

Both are valid upper bounds on the true epsilon of the mechanism that ran; PLD is the smaller one.
Neighbouring datasets differ by adding or removing one record (the relation under which Poisson
subsampling amplifies privacy).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Literal

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from decentdp.errors import ConfigError, PrivacyError

AccountantName = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

#: One run of identical releases: (noise multiplier sigma, sampling rate q, number of releases).
Run = tuple[float, float, int]

_MAX_NOISE_MULTIPLIER = 1e6
#: Below this sigma a PLD's support explodes (minutes and gigabytes); such mechanisms give
#: epsilons in the hundreds anyway, where RDP's looser bound is just as informative.
PLD_MIN_NOISE_MULTIPLIER = 0.1
_PLD_DISCRETIZATION = 1e-3  # pessimistic discretisation: a valid upper bound, within 0.3% of 1e-4 here, 7x faster


def check_epsilon_delta(epsilon: float, delta: float, *, epsilon_field: str = "privacy.epsilon",
                        delta_field: str = "privacy.delta") -> None:
    """Reject an (epsilon, delta) pair that no accountant can meet, naming the offending field."""
    if math.isnan(epsilon) or epsilon <= 0:
        raise ConfigError(epsilon_field, f"must be a positive number or 'inf', got {epsilon!r}")
    if not 0 < delta < 1:
        raise ConfigError(delta_field, f"must lie strictly between 0 and 1, got {delta!r}")


def check_sampling(sample_rate: float, steps: int, releases_per_step: int = 1) -> None:
    """Reject sampling rates outside (0, 1] and non-positive step counts (CLI option names)."""
    if not 0 < sample_rate <= 1:
        raise ConfigError("--sample-rate", f"must lie in (0, 1], got {sample_rate!r}")
    if int(steps) != steps or steps < 1:
        raise ConfigError("--steps", f"must be a positive integer, got {steps!r}")
    if int(releases_per_step) != releases_per_step or releases_per_step < 1:
        raise ConfigError("--releases-per-step", f"must be a positive integer, got {releases_per_step!r}")


def sampled_gaussian_event(noise_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
    """One release of the sampled Gaussian mechanism (no sampling event when ``q == 1``)."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample_rate >= 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian)


def runs_event(runs: Sequence[Run]) -> dp_accounting.DpEvent:
    """The composition of runs of identical releases, as one ``dp_accounting`` event."""
    parts = [
        dp_accounting.SelfComposedDpEvent(sampled_gaussian_event(sigma, q), count)
        for sigma, q, count in runs
        if count > 0
    ]
    if not parts:
        return dp_accounting.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


def make_accountant(name: str) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant by name (``rdp`` or ``pld``)."""
    if name == "rdp":
        return rdp_privacy_accountant.RdpAccountant()
    if name == "pld":
        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=_PLD_DISCRETIZATION)
    raise ConfigError("privacy.accountant", f"unknown accountant {name!r}; allowed: {', '.join(ACCOUNTANTS)}")


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Silence dp_accounting's per-order convergence warnings for tiny sigmas (they only drop orders)."""
    absl_logger = logging.getLogger("absl")
    previous = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(previous)


_RDP_ORDERS = rdp_privacy_accountant.RdpAccountant().orders  # the orders every _rdp_curve is computed at


@lru_cache(maxsize=1024)
def _rdp_curve(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one sampled Gaussian release at the accountant's orders (costly for small sigma)."""
    with _quiet_absl():
        return rdp_privacy_accountant.RdpAccountant().compose(
            sampled_gaussian_event(noise_multiplier, sample_rate)).rdp.copy()


def _rdp_epsilon(runs: tuple[Run, ...], delta: float) -> float:
    """RDP composes additively: sum the cached per-release curves, then convert once."""
    total = sum(count * _rdp_curve(sigma, q) for sigma, q, count in runs if count > 0)
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(_RDP_ORDERS, total, delta)
    return float(epsilon)


@lru_cache(maxsize=4096)
def epsilon_of_runs(runs: tuple[Run, ...], delta: float, accountant: str = "pld") -> float:
    """Epsilon spent at ``delta`` by a history of releases; cached because agents share histories."""
    if not runs or all(count == 0 for _, _, count in runs):
        return 0.0
    if any(sigma == 0 for sigma, _, count in runs if count > 0):
        return math.inf
    if accountant == "rdp":
        return _rdp_epsilon(runs, delta)
    smallest = min(sigma for sigma, _, count in runs if count > 0)
    if accountant == "pld" and smallest < PLD_MIN_NOISE_MULTIPLIER:
        raise PrivacyError(f"PLD accounting is impractical for sigma = {smallest:g} < {PLD_MIN_NOISE_MULTIPLIER}; "
                           "use the RDP accountant")
    with _quiet_absl():
        return float(make_accountant(accountant).compose(runs_event(runs)).get_epsilon(delta))


def epsilon_spent(
    noise_multiplier: float,
    delta: float,
    sample_rate: float,
    steps: int,
    releases_per_step: int = 1,
    accountant: str = "pld",
) -> float:
    """Epsilon of ``steps * releases_per_step`` sampled Gaussian releases with the given sigma."""
    check_sampling(sample_rate, steps, releases_per_step)
    if not 0 <= noise_multiplier <= _MAX_NOISE_MULTIPLIER:
        raise ConfigError("--sigma", f"must lie in [0, {_MAX_NOISE_MULTIPLIER:g}], got {noise_multiplier!r}")
    return epsilon_of_runs(((float(noise_multiplier), float(sample_rate), int(steps * releases_per_step)),),
                           float(delta), accountant)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    releases_per_step: int = 1,
    accountant: str = "rdp",
    tolerance: float = 1e-4,
) -> float:
    """Smallest noise multiplier whose planned releases stay within (target_epsilon, delta).

    The planned releases are ``steps * releases_per_step`` sampled Gaussian mechanisms at rate
    ``sample_rate``.  The search is a bisection that always returns the *safe* end of its bracket, so
    the result never overshoots the target under the same accountant (the budget check of a
    :class:`~decentdp.privacy.ledger.PrivacyLedger` relies on this); it is within ``tolerance``
    (relative) of the exact root.
    """
    check_epsilon_delta(target_epsilon, delta)
    check_sampling(sample_rate, steps, releases_per_step)
    if math.isinf(target_epsilon):
        return 0.0
    count = int(steps * releases_per_step)

    def eps(sigma: float) -> float:
        return epsilon_of_runs(((sigma, float(sample_rate), count),), float(delta), accountant)

    low, high = 0.0, 1.0
    while eps(high) > target_epsilon:
        low, high = high, high * 2
        if high > _MAX_NOISE_MULTIPLIER:
            raise PrivacyError(
                f"no noise multiplier up to {_MAX_NOISE_MULTIPLIER:g} reaches epsilon={target_epsilon} at "
                f"delta={delta} with sample rate {sample_rate} over {count} releases; raise epsilon or delta"
            )
    while high - low > tolerance * high:
        middle = (low + high) / 2
        if eps(middle) > target_epsilon:
            low = middle
        else:
            high = middle
    return high
