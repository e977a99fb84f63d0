"""Privacy accounting: accountants that price the events mechanisms release, and noise calibration.

A release is described by a ``dp_accounting`` event (:mod:`decentdp.privacy.events`): most often the
sampled Gaussian mechanism (Mironov et al. 2019), a Poisson-subsampled batch of rate ``q``, per-sample
gradients clipped to norm ``C`` and summed, plus ``N(0, sigma^2 C^2)`` noise; also Laplace releases
and joint releases of several sums on one batch.  A *history* is a sequence of ``(event, count)``
runs, and its epsilon comes from one of dp_accounting's accountants:

* RDP (Rényi DP, Mironov 2017) is fast and composes additively, so a ledger can keep a running
  total per agent (Opacus and the consensus paper's code calibrate with it);
* PLD (privacy loss distributions, Koskela et al.; Doroshenko et al. 2022) is tight up to its
  discretisation, which is pessimistic (rounds losses up), so it too is a valid upper bound;
* ``tight``, the default everywhere: the smaller of the two, which is as sound as either (both bound
  the same true epsilon) and never above what calibration promised, because calibration, budget
  enforcement and reporting all use it.  Where every release is pure DP (Laplace, sampled or not) it
  also takes basic composition, the sum of the releases' pure epsilons (:func:`pure_epsilon`), which
  holds at every delta: a few Laplace releases cost exactly what they spend, where PLD's discretisation
  rounds up (one release at epsilon 1: 1.00016) and RDP's conversion adds more.

**Neighbouring relation.**  Datasets are neighbours if they differ by adding or removing one record
(``add-remove``, the relation under which Poisson subsampling amplifies privacy and the one DP-SGD
papers state) or by replacing one (``replace-one``).  A run publishes each agent's dataset size ``|D_i|``
(a Poisson sample rate ``q_i = L / |D_i|`` depends on it), and with sizes public the consistent relation is
replace-one, which costs about twice the epsilon.  dp_accounting's PLD prices replace-one natively
for (sampled) Gaussian releases; for Laplace releases replace-one doubles the l1 sensitivity (and
sampling is not credited, a sound but loose bound).  RDP has no replace-one bound for Poisson
sampling, so there ``tight`` is the PLD value.
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
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant
from dp_accounting.rdp.rdp_privacy_accountant import _laplace_rdp

from decentdp.errors import ConfigError, PrivacyError
from decentdp.privacy.events import gaussian_event
from decentdp.privacy.sampled_gaussian_rdp import sampled_gaussian_rdp

AccountantName = Literal["tight", "pld", "rdp"]
ACCOUNTANTS: tuple[str, ...] = ("tight", "pld", "rdp")
Relation = Literal["add-remove", "replace-one"]
RELATIONS: tuple[str, ...] = ("add-remove", "replace-one")
DEFAULT_RELATION: Relation = "add-remove"

#: The largest noise multiplier the accountants price (above it epsilon is 0 to every printed digit).
MAX_NOISE_MULTIPLIER = 1e6
#: Below this sigma a PLD's support explodes (minutes and gigabytes); such mechanisms give
#: epsilons in the hundreds anyway, where RDP's looser bound is just as informative.
PLD_MIN_NOISE_MULTIPLIER = 0.1
#: Above this many releases a PLD takes minutes per evaluation (6 s at 10**7 sampled Gaussians, more than 100 s
#: at 10**8; a reviewer's 10**12-round run hung in calibration) and overflows numpy past about 10**18; RDP's
#: curve composes any count at once, so ``tight`` prices such a history by RDP alone.
PLD_MAX_RELEASES = 10**7
#: Pessimistic PLD discretisation (a valid upper bound at any value), chosen per history so that its
#: error stays near 0.25 % of epsilon: ``0.0025 epsilon / (4 + 3e-3 releases)`` clamped to [1e-4, 1e-2],
#: epsilon from RDP (under replace-one with Poisson sampling, which RDP cannot price, twice RDP's add-remove
#: epsilon: :func:`_pld_interval`).  The error was measured at about ``(4 + 3e-3 releases) x interval`` (epsilon 9.3
#: over 2000 releases: +0.5 % at 1e-2; 10 over 6000: +1.5 % at 1e-2; 0.33 over 122: +1.9 % at 1.6e-3;
#: 0.16 over 6400: +21 % at 1e-3, none visible at 1e-4).  Coarse intervals matter: a small sigma's
#: distribution is ten times cheaper to build at 1e-3 than at 1e-4 (0.7 s instead of 7 s for
#: sigma = 0.55), which keeps calibrating large budgets in seconds.
PLD_DISCRETIZATION = 1e-4
PLD_DISCRETIZATION_MAX = 1e-2


def check_epsilon_delta(epsilon: float, delta: float, *, epsilon_field: str = "privacy.epsilon",
                        delta_field: str = "privacy.delta") -> None:
    """Reject an (epsilon, delta) pair that no accountant can meet, naming the offending field."""
    if math.isnan(epsilon) or epsilon <= 0:
        raise ConfigError(epsilon_field, f"must be a positive number or 'inf', got {epsilon!r}")
    if not 0 < delta < 1:
        raise ConfigError(delta_field, f"must lie strictly between 0 and 1, got {delta!r}")


def check_sampling(sample_rate: float, steps: int, releases_per_step: int = 1) -> None:
    """Reject sampling rates outside (0, 1] and non-positive step counts (errors name the parameter: a caller
    with other names for them, such as the CLI's options, renames the field)."""
    if not 0 < sample_rate <= 1:
        raise ConfigError("sample_rate", f"must lie in (0, 1], got {sample_rate!r}")
    if int(steps) != steps or steps < 1:
        raise ConfigError("steps", f"must be a positive integer, got {steps!r}")
    if int(releases_per_step) != releases_per_step or releases_per_step < 1:
        raise ConfigError("releases_per_step", f"must be a positive integer, got {releases_per_step!r}")


History = tuple[tuple[dp_accounting.DpEvent, int], ...]
"""A release history: ``(event, count)`` runs of identical releases, oldest first."""


def history_event(history: History) -> dp_accounting.DpEvent:
    """The composition of a history, as one ``dp_accounting`` event."""
    parts = [dp_accounting.SelfComposedDpEvent(event, count) for event, count in history if count > 0]
    if not parts:
        return dp_accounting.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


def check_relation(relation: str) -> None:
    """Reject an unknown neighbouring relation."""
    if relation not in RELATIONS:
        raise ConfigError("privacy.neighbouring", f"unknown relation {relation!r}; allowed: {', '.join(RELATIONS)}")


#: Where the accountant is chosen: a run's config field and ``decentdp privacy``'s option, named together so that one
#: message is true in both contexts.
ACCOUNTANT_SETTING = "privacy.accountant, or --accountant of `decentdp privacy`"
#: Where the neighbouring relation is chosen (as :data:`ACCOUNTANT_SETTING`).
RELATION_SETTING = "privacy.neighbouring, or --neighbouring of `decentdp privacy`"


class UnpricedError(PrivacyError):
    """One accountant cannot price a history: ``reason`` says why, ``remedy`` what change to the releases would let
    it (empty where none would), and the message adds ``advice`` (which accountant to use instead).  Where neither
    PLD nor RDP can price a history, :func:`neither_prices` combines the two reasons and remedies into one
    message, so that no message sends the user from one accountant to the other and back."""

    def __init__(self, reason: str, remedy: str = "", advice: str = "") -> None:
        self.reason, self.remedy = reason, remedy
        super().__init__(f"{reason}; {advice}" if advice else reason)


def neither_prices(errors: list[UnpricedError]) -> PrivacyError:
    """The one message for a history that neither accountant can price: each reason, and the changes that would let
    one of them (``errors``: the accountants' :class:`UnpricedError`, PLD's first)."""
    reasons = ", and ".join(dict.fromkeys(error.reason for error in errors))
    remedies = " or ".join(dict.fromkeys(error.remedy for error in errors if error.remedy))
    return PrivacyError(f"neither accountant can price these releases: {reasons}" +
                        (f"; to price them, use {remedies}" if remedies else ""))


def make_accountant(name: str, relation: str = DEFAULT_RELATION,
                    interval: float = PLD_DISCRETIZATION) -> dp_accounting.PrivacyAccountant:
    """A fresh dp_accounting accountant by name (``rdp`` or ``pld``, discretised at ``interval``) for ``relation``.

    Under replace-one the events must first go through :func:`priced_event`, which rewrites what
    the accountant cannot price natively."""
    check_relation(relation)
    if name == "rdp":
        return rdp_privacy_accountant.RdpAccountant()
    if name == "pld":
        native = (dp_accounting.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
                  else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        return pld_privacy_accountant.PLDAccountant(native, value_discretization_interval=interval)
    raise ConfigError("privacy.accountant", f"unknown accountant {name!r}; allowed: {', '.join(ACCOUNTANTS)}")


@lru_cache(maxsize=2**12)
def priced_event(event: dp_accounting.DpEvent, accountant: str, relation: str) -> dp_accounting.DpEvent:
    """The event an accountant prices for one release of ``event`` under ``relation``.

    Add-remove: the event itself.  Replace-one changes one record's contribution from ``+C`` to
    ``-C``, doubling every sensitivity: PLD prices (sampled) Gaussians so natively; a Laplace
    release becomes Laplace of half the noise multiplier under add-remove (sampling, which
    dp_accounting cannot price for Laplace under replace-one, is dropped: sound, not tight); for
    RDP an unsampled Gaussian becomes Gaussian(sigma / 2), and a Poisson-sampled Gaussian has no
    RDP bound here (:class:`PrivacyError`)."""
    if relation == "add-remove" or isinstance(event, dp_accounting.NonPrivateDpEvent | dp_accounting.NoOpDpEvent):
        return event
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return dp_accounting.SelfComposedDpEvent(priced_event(event.event, accountant, relation), event.count)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return dp_accounting.ComposedDpEvent(tuple(priced_event(e, accountant, relation) for e in event.events))
    inner = event.event if isinstance(event, dp_accounting.PoissonSampledDpEvent) else event
    if isinstance(inner, dp_accounting.LaplaceDpEvent):
        return dp_accounting.LaplaceDpEvent(inner.noise_multiplier / 2)
    if isinstance(inner, dp_accounting.GaussianDpEvent):
        if accountant == "pld":
            return event
        if inner is event:
            return dp_accounting.GaussianDpEvent(inner.noise_multiplier / 2)
        raise UnpricedError("the RDP accountant has no replace-one bound for Poisson-sampled releases",
                            f"the add-remove relation (for RDP: {RELATION_SETTING})",
                            f"use the tight or PLD accountant ({ACCOUNTANT_SETTING})")
    raise PrivacyError(f"no replace-one accounting for {type(event).__name__}")


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
    that a ledger of 10^5 releases with distinct noise stays fast; a Poisson-sampled Gaussian uses
    dp_accounting's series vectorised (:mod:`decentdp.privacy.sampled_gaussian_rdp`: the same values, a
    tenth of the time, which a calibration's dozens of curves feel); a Poisson-sampled Laplace, which
    dp_accounting cannot price in RDP, is bounded by the unsampled Laplace (the PLD accountant credits its
    sampling); every other event is priced by dp_accounting's ``RdpAccountant``.
    """
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        curve = np.full(len(RDP_ORDERS), np.inf)
    elif isinstance(event, dp_accounting.GaussianDpEvent):
        curve = RDP_ORDERS / (2 * event.noise_multiplier**2)
    elif isinstance(event, dp_accounting.LaplaceDpEvent):
        epsilon = 1 / event.noise_multiplier
        curve = np.array([_laplace_rdp(epsilon, order) for order in RDP_ORDERS])
    elif (isinstance(event, dp_accounting.PoissonSampledDpEvent)
          and type(event.event) is dp_accounting.LaplaceDpEvent):
        # dp_accounting has no RDP of sampled Laplace; the unsampled one bounds it (Renyi divergence is jointly
        # quasi-convex, and each pair of components of the two mixtures is at most one Laplace release apart)
        curve = rdp_curve(event.event)
    elif (isinstance(event, dp_accounting.PoissonSampledDpEvent)
          and type(event.event) is dp_accounting.GaussianDpEvent):
        curve = sampled_gaussian_rdp(event.sampling_probability, event.event.noise_multiplier, RDP_ORDERS)
    else:
        with _quiet_absl():
            accountant = rdp_privacy_accountant.RdpAccountant()
            if not accountant.supports(event):
                raise UnpricedError(f"the RDP accountant cannot price {type(event).__name__}",
                                    advice=f"use the PLD accountant ({ACCOUNTANT_SETTING})")
            curve = accountant.compose(event).rdp.copy()
    if np.any(curve < 0):  # a divergence is never negative: rounding made it so, and the conversion would read 0
        raise UnpricedError(f"the RDP of {type(event).__name__} came out negative at some order (numerical "
                            "instability)", advice=f"use the PLD accountant ({ACCOUNTANT_SETTING})")
    curve.setflags(write=False)
    return curve


def rdp_epsilon(total: np.ndarray, delta: float) -> float:
    """Epsilon at ``delta`` of a composed RDP curve (dp_accounting's conversion; infinite orders are skipped).
    An order whose value is NaN bounds nothing and counts as infinite: dp_accounting's conversion would pick it
    and report ``max(0, nan)``, an epsilon of 0."""
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(RDP_ORDERS, np.where(np.isnan(total), np.inf, total), delta)
    return float(epsilon)


def rdp_total(history: History) -> np.ndarray | int:
    """RDP composes additively: the sum of ``count`` times each event's curve, oldest first."""
    return sum(count * rdp_curve(event) for event, count in history if count > 0)


def merged_history(history: History) -> History:
    """One entry per distinct event, its counts summed, in a fixed order (by the event's ``repr``).

    Composition does not depend on the order of the releases (RDP curves add; PLDs convolve), so this is the
    same guarantee, but a history whose events alternate (TOP-DP's joint releases change with each round's
    covers: hundreds of short runs of a handful of events) is priced with one PLD per distinct event instead of
    one per run, and agents whose runs differ only in order share one cache entry."""
    counts: dict[dp_accounting.DpEvent, int] = {}
    for event, count in history:
        if count > 0:
            counts[event] = counts.get(event, 0) + count
    return tuple(sorted(counts.items(), key=lambda run: repr(run[0])))


def epsilon_of_history(history: History, delta: float, accountant: str = "tight",
                       relation: str = DEFAULT_RELATION) -> float:
    """Epsilon spent at ``delta`` by a history of releases under ``relation``.  ``tight`` is the smaller of
    PLD and RDP, skipping one that cannot price the history (RDP under replace-one with sampling; PLD below
    :data:`PLD_MIN_NOISE_MULTIPLIER`).  The history's runs are merged first (:func:`merged_history`)."""
    return _epsilon_of_merged(merged_history(history), delta, accountant, relation)


@lru_cache(maxsize=4096)
def _epsilon_of_merged(history: History, delta: float, accountant: str, relation: str) -> float:
    """:func:`epsilon_of_history` of a merged history; cached because agents share histories."""
    if not history:
        return 0.0
    if any(isinstance(event, dp_accounting.NonPrivateDpEvent) for event, _ in history):
        return math.inf
    if accountant == "tight":
        pure = pure_epsilon(history, relation)
        values, errors = ([] if pure is None else [pure]), []
        for name in ("pld", "rdp"):
            try:
                values.append(_epsilon_of_merged(history, delta, name, relation))
            except UnpricedError as error:  # (any other PrivacyError holds for both, e.g. already combined)
                errors.append(error)
        if not values:
            raise neither_prices(errors)
        return min(values)
    if accountant == "rdp":
        try:
            priced = tuple((priced_event(event, accountant, relation), count) for event, count in history)
            total = rdp_total(priced)
        except UnpricedError as error:
            pld = _pld_obstacle(tuple((priced_event(event, "pld", relation), count) for event, count in history))
            raise error if pld is None else neither_prices([pld, error]) from None
        return rdp_epsilon(np.asarray(total), delta)
    priced = tuple((priced_event(event, accountant, relation), count) for event, count in history)
    if all(type(event) is dp_accounting.GaussianDpEvent for event, _ in priced):
        return _gaussian_epsilon(priced, delta, relation)  # exact, no discretisation: no minimum multiplier either
    obstacle = _pld_obstacle(priced)
    if obstacle is not None:
        raise _pld_unpriced(obstacle, history, relation)
    interval = _pld_interval(history, delta, relation)
    try:
        # Past a loss of about 709 nats dp_accounting's mass ratio overflows and its epsilon reads infinite: an
        # upper bound, and ``tight`` then takes RDP's finite one (Laplace, 72 replace-one releases of multiplier
        # 0.094: the PLD answers inf, while 70 and 73 releases give 704 and 734), so the overflow warning is silenced.
        with _quiet_absl(), np.errstate(over="ignore"):
            if relation == "add-remove":
                accountant_ = make_accountant(accountant, relation, interval)
                return float(accountant_.compose(history_event(priced)).get_epsilon(delta))
            return _replace_one_pld_epsilon(priced, delta, interval)
    except (MemoryError, OverflowError):  # a distribution too wide to discretise: epsilons far beyond any budget
        raise _pld_unpriced(UnpricedError("PLD accounting is impractical for this history (its loss distribution does "
                                          "not fit in memory)", "more noise (for PLD)"), history, relation) from None


def _pld_obstacle(priced: History) -> UnpricedError | None:
    """Why PLD accounting is impractical for a history of events priced for it (a multiplier below
    :data:`PLD_MIN_NOISE_MULTIPLIER`, more than :data:`PLD_MAX_RELEASES` releases), or None; unsampled Gaussians alone
    are composed in closed form, which has neither limit."""
    if all(type(event) is dp_accounting.GaussianDpEvent for event, _ in priced):
        return None
    smallest = min((multiplier for event, count in priced
                    if (multiplier := _effective_multiplier(event, count)) is not None), default=math.inf)
    if smallest < PLD_MIN_NOISE_MULTIPLIER:
        return UnpricedError(f"PLD accounting is impractical for sigma = {smallest:g} < {PLD_MIN_NOISE_MULTIPLIER}",
                             f"a noise multiplier of at least {PLD_MIN_NOISE_MULTIPLIER} (for PLD)")
    releases = sum(count for _, count in priced)
    if releases > PLD_MAX_RELEASES:
        return UnpricedError(f"PLD accounting is impractical for {releases:.3g} releases (more than "
                             f"{PLD_MAX_RELEASES:.0e})", f"at most {PLD_MAX_RELEASES:.0e} releases (for PLD)")
    return None


def _pld_unpriced(obstacle: UnpricedError, history: History, relation: str) -> PrivacyError:
    """The error for a history PLD cannot price: use RDP instead, or, where RDP cannot price it either, both
    reasons (:func:`neither_prices`)."""
    try:
        rdp_total(tuple((priced_event(event, "rdp", relation), count) for event, count in history))
    except UnpricedError as rdp:
        return neither_prices([obstacle, rdp])
    return UnpricedError(obstacle.reason, obstacle.remedy, f"use the RDP accountant ({ACCOUNTANT_SETTING})")


def pure_epsilon(history: History, relation: str = DEFAULT_RELATION) -> float | None:
    """Basic composition of a history of pure-DP releases under ``relation``: the sum of each release's pure
    epsilon, an upper bound at every delta (Dwork & Roth 2014, Thm 3.16); None where some release is not pure DP.

    Laplace of multiplier ``b`` (scale over l1 sensitivity) is ``1/b``-DP; under replace-one
    :func:`priced_event` halves ``b`` (doubled sensitivity, sampling dropped).  A Poisson-sampled
    ``epsilon``-DP release at rate ``q`` is ``log(1 + q (e^epsilon - 1))``-DP under add-remove (Li, Qardaji
    & Su 2012; Balle, Barthe & Gaboardi 2018), in both directions: adding the record mixes its
    output density into a fraction ``q`` of the batches, and the likelihood ratio of the mixture is largest,
    ``1 - q + q e^epsilon``, where the record's release is ``e^epsilon`` times as likely."""

    def one(event: dp_accounting.DpEvent) -> float | None:
        if isinstance(event, dp_accounting.NoOpDpEvent):
            return 0.0
        if isinstance(event, dp_accounting.LaplaceDpEvent):
            return 1.0 / event.noise_multiplier
        if isinstance(event, dp_accounting.PoissonSampledDpEvent):
            inner = one(event.event)
            return None if inner is None else math.log1p(event.sampling_probability * math.expm1(inner))
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            inner = one(event.event)
            return None if inner is None else event.count * inner
        if isinstance(event, dp_accounting.ComposedDpEvent):
            parts = [one(part) for part in event.events]
            return None if any(part is None for part in parts) else math.fsum(parts)
        return None

    total = []
    for event, count in history:
        if count > 0:
            try:
                value = one(priced_event(event, "pld", relation))
            except PrivacyError:  # an event without a replace-one rewrite is not priced here either
                return None
            if value is None:
                return None
            total.append(count * value)
    return math.fsum(total)


def _gaussian_epsilon(priced: History, delta: float, relation: str) -> float:
    """Exact epsilon of composed unsampled Gaussian releases: one Gaussian of multiplier
    ``(sum count / sigma^2)^(-1/2)`` (halved under replace-one), whose privacy loss dp_accounting gives in
    closed form; no discretisation, so a large budget at sample rate 1 calibrates in milliseconds."""
    sigma = sum(count / event.noise_multiplier**2 for event, count in priced) ** -0.5
    return gaussian_dp_epsilon((2.0 if relation == "replace-one" else 1.0) / sigma, delta)


def gaussian_dp_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of a ``mu``-Gaussian-DP view (the mean shift of a unit Gaussian,
    Dong, Roth & Su 2019): ``delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``, solved for the
    smallest epsilon that holds, through dp_accounting's closed-form Gaussian privacy loss."""
    if math.isnan(mu) or math.isinf(mu):  # (NaN: nothing bounds the view)
        return math.inf
    if mu <= 0:
        return 0.0
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(1.0 / mu)

    def excess(epsilon: float) -> float:  # delta decreases in epsilon; 0 counts as the smallest positive float
        return math.log(max(loss.get_delta_for_epsilon(epsilon), 5e-324) / delta)

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
    return narrow_bracket(excess, high / 2 if high > 1 else 0.0, high, 1e-9)


def _pld_interval(history: History, delta: float, relation: str) -> float:
    """The PLD discretisation for a history (see :data:`PLD_DISCRETIZATION`), from a rough epsilon: RDP's.

    The width needs only the scale of epsilon, not a bound, so where RDP cannot price the history (replace-one
    with Poisson sampling) the rough epsilon is twice RDP's add-remove one (replace-one moves a record's
    contribution from ``+C`` to ``-C``, twice add-remove's distance; measured 1.2 to 1.9 times the replace-one
    PLD epsilon, so the grid errs on the fine side).  Against the finest grid the PLD epsilon moved by at most
    +0.12 % over 12 histories (+0.05 % for 1000 releases at sigma 1, q 0.02, 20 times faster), within the
    0.25 % target.  The finest grid is kept only where RDP prices the history under neither relation."""
    try:
        rough = epsilon_of_history(history, delta, "rdp", relation)
    except PrivacyError:
        try:
            rough = 2 * epsilon_of_history(history, delta, "rdp", "add-remove")
        except PrivacyError:
            return PLD_DISCRETIZATION
    releases = sum(count for _, count in history)
    return min(PLD_DISCRETIZATION_MAX, max(PLD_DISCRETIZATION, 0.0025 * rough / (4 + 3e-3 * releases)))


def _replace_one_pld_epsilon(priced: History, delta: float, interval: float) -> float:
    """PLD epsilon of a replace-one history: (sampled) Gaussians priced by dp_accounting's native replace-one
    PLDs, Laplace releases (rewritten by :func:`priced_event` with doubled sensitivity) by add-remove PLDs,
    the two distributions composed (dp_accounting has no accountant taking both relations)."""
    laplace = tuple(run for run in priced if isinstance(run[0], dp_accounting.LaplaceDpEvent))
    native = tuple(run for run in priced if not isinstance(run[0], dp_accounting.LaplaceDpEvent))
    parts = [make_accountant("pld", relation, interval).compose(history_event(runs))
             for relation, runs in (("replace-one", native), ("add-remove", laplace)) if runs]
    if len(parts) == 1:
        return float(parts[0].get_epsilon(delta))
    # PLDAccountant offers no public composition of two accountants; its distribution is `_pld`.
    return float(parts[0]._pld.compose(parts[1]._pld).get_epsilon_for_delta(delta))


def _effective_multiplier(event: dp_accounting.DpEvent, count: int) -> float | None:
    """The noise multiplier a PLD is built for: a sampled Gaussian's own; ``count`` unsampled Gaussians are
    composed in closed form as one of multiplier ``sigma / sqrt(count)``; None for other events."""
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        inner = event.event
        return inner.noise_multiplier if isinstance(inner, dp_accounting.GaussianDpEvent) else None
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return event.noise_multiplier / math.sqrt(count)
    return None


def epsilon_spent(
    noise_multiplier: float,
    delta: float,
    sample_rate: float,
    steps: int,
    releases_per_step: int = 1,
    accountant: str = "tight",
    relation: str = DEFAULT_RELATION,
) -> float:
    """Epsilon of ``steps * releases_per_step`` sampled Gaussian releases with the given sigma."""
    check_sampling(sample_rate, steps, releases_per_step)
    if not 0 <= noise_multiplier <= MAX_NOISE_MULTIPLIER:
        raise ConfigError("noise_multiplier", f"must lie in [0, {MAX_NOISE_MULTIPLIER:g}], got {noise_multiplier!r}")
    event = gaussian_event(float(noise_multiplier), float(sample_rate))
    return epsilon_of_history(((event, int(steps * releases_per_step)),), float(delta), accountant, relation)


@lru_cache(maxsize=1024)
def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    releases_per_step: int = 1,
    accountant: str = "tight",
    tolerance: float = 1e-4,
    relation: str = DEFAULT_RELATION,
) -> float:
    """Smallest noise multiplier whose planned releases, ``steps * releases_per_step`` sampled Gaussian
    mechanisms at rate ``sample_rate``, stay within (target_epsilon, delta) under ``relation`` (see
    :func:`calibrate_scale`).  Cached per (epsilon, delta, q, steps, accountant, relation): agents with
    the same budget and rate, and repeated runs in one process, calibrate once."""
    check_epsilon_delta(target_epsilon, delta)
    check_sampling(sample_rate, steps, releases_per_step)
    if math.isinf(target_epsilon):
        return 0.0
    count = int(steps * releases_per_step)
    return calibrate_scale(lambda sigma: gaussian_event(sigma, float(sample_rate)), count, target_epsilon, delta,
                           accountant, tolerance, describe=f"sample rate {sample_rate} over {count} releases",
                           relation=relation)


def calibrate_scale(event_of: Callable[[float], dp_accounting.DpEvent], count: int, target_epsilon: float,
                    delta: float, accountant: str = "tight", tolerance: float = 1e-4, describe: str = "",
                    relation: str = DEFAULT_RELATION) -> float:
    """Smallest noise multiplier ``s`` such that ``count`` releases of ``event_of(s)`` stay within
    (target_epsilon, delta): the calibration of any mechanism whose event grows more private with ``s``.

    A bracketing search (:func:`narrow_bracket`) that always returns the *safe* end of its bracket, so the
    result never overshoots the target under the same accountant (budget enforcement and reporting
    rely on this); within ``tolerance`` (relative) of the exact root.  PLD compositions cost
    milliseconds to tenths of a second each, RDP's microseconds, so for ``tight`` and ``pld`` the
    bracket comes from RDP where RDP can price the event (its sigma is safe for ``tight``, and within
    a few percent of PLD's), leaving a handful of PLD evaluations.
    """
    if math.isinf(target_epsilon):
        return 0.0

    def eps(scale: float) -> float:
        return epsilon_of_history(((event_of(scale), count),), float(delta), accountant, relation)

    def grow(fits: Callable[[float], bool]) -> tuple[float, float]:
        low, high = 0.0, 1.0
        while not fits(high):
            low, high = high, high * 2
            if high > MAX_NOISE_MULTIPLIER:
                raise PrivacyError(
                    f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches epsilon={target_epsilon} at "
                    f"delta={delta} with {describe or f'{count} releases'}; raise epsilon or delta"
                )
        return low, high

    def fits(scale: float) -> bool:
        return eps(scale) <= target_epsilon

    low, high = None, None
    if accountant != "rdp":
        with contextlib.suppress(PrivacyError):  # RDP cannot price it (e.g. replace-one with sampling)
            rdp_high = calibrate_scale(event_of, count, target_epsilon, delta, "rdp", tolerance, describe, relation)
            if fits(rdp_high):  # always so for tight; for PLD almost always (PLD is the tighter bound)
                low, high = rdp_high, rdp_high
                while fits(low):
                    high, low = low, low * 0.95
    if high is None:
        low, high = grow(fits)
    # (an epsilon of exactly 0, a noise far beyond the target's, counts as the smallest positive float)
    return narrow_bracket(lambda scale: math.log(max(eps(scale), 5e-324) / target_epsilon), low, high, tolerance)


def narrow_bracket(excess: Callable[[float], float], low: float, high: float, tolerance: float) -> float:
    """Shrink ``[low, high]`` (``excess(low) > 0 >= excess(high)``, decreasing) to ``tolerance * high`` and
    return its safe end ``high``.  Regula falsi with the Illinois correction on log epsilon, which is
    nearly linear in sigma there: about five accountant calls instead of a bisection's dozen.  Each
    step lands at least half a tolerance inside the bracket, so that a step next to the root crosses
    it and closes the bracket.  An excess that is NaN counts as over the target (``not value <= 0``), so the
    bracket never closes on a point nothing bounds."""
    while low <= 0 and high - low > tolerance * high:  # no finite excess at 0: bisect away from it first
        middle = (low + high) / 2
        if not excess(middle) <= 0:
            low = middle
        else:
            high = middle
    f_low, f_high = excess(low), excess(high)
    side = 0
    while high - low > tolerance * high:
        if math.isfinite(f_low) and f_low > f_high:
            middle = high - f_high * (high - low) / (f_high - f_low)
        else:
            middle = (low + high) / 2
        margin = tolerance * high / 2
        middle = min(max(middle, low + margin), high - margin)
        value = excess(middle)
        if not value <= 0:
            low, f_low = middle, value
            if side == -1:
                f_high /= 2
            side = -1
        else:
            high, f_high = middle, value
            if side == 1:
                f_low /= 2
            side = 1
    return high
