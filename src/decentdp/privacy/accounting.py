"""Privacy accounting: accountants that price the events mechanisms release, and noise calibration.

A release is described by a ``dp_accounting`` event (:mod:`decentdp.privacy.events`): most often the
sampled Gaussian mechanism (Mironov et al. 2019), a Poisson-subsampled batch of rate ``q``, per-sample
gradients clipped to norm ``C`` and summed, plus ``N(0, sigma^2 C^2)`` noise; also Laplace releases
and joint releases of several sums on one batch.  A *history* is a sequence of ``(event, count)``
runs, and its epsilon comes from one of dp_accounting's accountants:

* RDP (Rényi DP, Mironov 2017) is fast and composes additively, so a ledger can keep a running
  total per agent; it is what we calibrate noise and enforce budgets with, as Opacus and the
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
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Literal

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from dp_accounting.rdp.rdp_privacy_accountant import _laplace_rdp

from decentdp.errors import ConfigError, PrivacyError
from decentdp.privacy.events import gaussian_event

AccountantName = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

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


History = tuple[tuple[dp_accounting.DpEvent, int], ...]
"""A release history: ``(event, count)`` runs of identical releases, oldest first."""


def history_event(history: History) -> dp_accounting.DpEvent:
    """The composition of a history, as one ``dp_accounting`` event."""
    parts = [dp_accounting.SelfComposedDpEvent(event, count) for event, count in history if count > 0]
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


RDP_ORDERS = np.asarray(rdp_privacy_accountant.RdpAccountant().orders, dtype=np.float64)
"""The orders every RDP curve is computed at (dp_accounting's defaults)."""


@lru_cache(maxsize=2**17)
def rdp_curve(event: dp_accounting.DpEvent) -> np.ndarray:
    """RDP of one release of ``event`` at :data:`RDP_ORDERS` (read-only; cached per distinct event).

    Unsampled Gaussian and Laplace events use the closed forms dp_accounting itself evaluates
    (``alpha / (2 sigma^2)``; Mironov 2017, Prop. 6), without building an accountant per event, so
    that a ledger of 10^5 releases with distinct noise stays fast; every other event is priced by
    dp_accounting's ``RdpAccountant``.
    """
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        curve = np.full(len(RDP_ORDERS), np.inf)
    elif isinstance(event, dp_accounting.GaussianDpEvent):
        curve = RDP_ORDERS / (2 * event.noise_multiplier**2)
    elif isinstance(event, dp_accounting.LaplaceDpEvent):
        epsilon = 1 / event.noise_multiplier
        curve = np.array([_laplace_rdp(epsilon, order) for order in RDP_ORDERS])
    else:
        with _quiet_absl():
            accountant = rdp_privacy_accountant.RdpAccountant()
            if not accountant.supports(event):
                raise PrivacyError(f"the RDP accountant cannot price {type(event).__name__}; use privacy.accountant "
                                   "= 'pld'")
            curve = accountant.compose(event).rdp.copy()
    curve.setflags(write=False)
    return curve


def rdp_epsilon(total: np.ndarray, delta: float) -> float:
    """Epsilon at ``delta`` of a composed RDP curve (dp_accounting's conversion; infinite orders are skipped)."""
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(RDP_ORDERS, total, delta)
    return float(epsilon)


def rdp_total(history: History) -> np.ndarray | int:
    """RDP composes additively: the sum of ``count`` times each event's curve, oldest first."""
    return sum(count * rdp_curve(event) for event, count in history if count > 0)


@lru_cache(maxsize=4096)
def epsilon_of_history(history: History, delta: float, accountant: str = "pld") -> float:
    """Epsilon spent at ``delta`` by a history of releases; cached because agents share histories."""
    history = tuple((event, count) for event, count in history if count > 0)
    if not history:
        return 0.0
    if any(isinstance(event, dp_accounting.NonPrivateDpEvent) for event, _ in history):
        return math.inf
    if accountant == "rdp":
        return rdp_epsilon(np.asarray(rdp_total(history)), delta)
    smallest = min((multiplier for event, _ in history if (multiplier := _gaussian_multiplier(event)) is not None),
                   default=math.inf)
    if accountant == "pld" and smallest < PLD_MIN_NOISE_MULTIPLIER:
        raise PrivacyError(f"PLD accounting is impractical for sigma = {smallest:g} < {PLD_MIN_NOISE_MULTIPLIER}; "
                           "use the RDP accountant")
    with _quiet_absl():
        return float(make_accountant(accountant).compose(history_event(history)).get_epsilon(delta))


def _gaussian_multiplier(event: dp_accounting.DpEvent) -> float | None:
    """The noise multiplier of a (sampled) Gaussian event, else None."""
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        event = event.event
    return event.noise_multiplier if isinstance(event, dp_accounting.GaussianDpEvent) else None


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
    event = gaussian_event(float(noise_multiplier), float(sample_rate))
    return epsilon_of_history(((event, int(steps * releases_per_step)),), float(delta), accountant)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    releases_per_step: int = 1,
    accountant: str = "rdp",
    tolerance: float = 1e-4,
) -> float:
    """Smallest noise multiplier whose planned releases, ``steps * releases_per_step`` sampled Gaussian
    mechanisms at rate ``sample_rate``, stay within (target_epsilon, delta) (see :func:`calibrate_scale`)."""
    check_epsilon_delta(target_epsilon, delta)
    check_sampling(sample_rate, steps, releases_per_step)
    if math.isinf(target_epsilon):
        return 0.0
    count = int(steps * releases_per_step)
    return calibrate_scale(lambda sigma: gaussian_event(sigma, float(sample_rate)), count, target_epsilon, delta,
                           accountant, tolerance,
                           describe=f"sample rate {sample_rate} over {count} releases")


def calibrate_scale(event_of: Callable[[float], dp_accounting.DpEvent], count: int, target_epsilon: float,
                    delta: float, accountant: str = "rdp", tolerance: float = 1e-4, describe: str = "") -> float:
    """Smallest noise multiplier ``s`` such that ``count`` releases of ``event_of(s)`` stay within
    (target_epsilon, delta): the calibration of any mechanism whose event grows more private with ``s``.

    A bisection that always returns the *safe* end of its bracket, so the result never overshoots
    the target under the same accountant (budget enforcement relies on this); within ``tolerance``
    (relative) of the exact root.
    """
    if math.isinf(target_epsilon):
        return 0.0

    def eps(scale: float) -> float:
        return epsilon_of_history(((event_of(scale), count),), float(delta), accountant)

    low, high = 0.0, 1.0
    while eps(high) > target_epsilon:
        low, high = high, high * 2
        if high > _MAX_NOISE_MULTIPLIER:
            raise PrivacyError(
                f"no noise multiplier up to {_MAX_NOISE_MULTIPLIER:g} reaches epsilon={target_epsilon} at "
                f"delta={delta} with {describe or f'{count} releases'}; raise epsilon or delta"
            )
    while high - low > tolerance * high:
        middle = (low + high) / 2
        if eps(middle) > target_epsilon:
            low = middle
        else:
            high = middle
    return high
