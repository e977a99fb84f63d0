"""Privacy of Bellet et al.'s private updates: noise per wake-up, its calibration and three accountings.

Agent i's k-th update releases (through its broadcast) its clipped local gradient plus noise
(eq. (6)).  In library terms it releases the clipped *sum* ``S_i = sum_k clip(grad l_k)`` with noise of
scale ``z_ik C`` (``C`` = ``privacy.clip``, which replaces L_0 as in the paper's MovieLens setup), then
divides by m_i: the mean gets noise ``z_ik C / m_i``.  Under replace-one neighbouring (the paper's
relation) the l1 (Laplace) or l2 (Gaussian) sensitivity of the sum is 2C, so

* Laplace: s_i = 2C / (eps_i(t) m_i) (Theorem 1 with Lemma 1) is ``z = 2 / eps_i(t)``;
* Gaussian: s_i = 2C sqrt(2 ln(2/delta_i(t))) / (eps_i(t) m_i) is ``z = 2 sqrt(2 ln(2/delta_i(t))) / eps_i(t)``.
  Remark 2 (Remark 4 of the supplementary) prints s_i *without* 1/m_i; Lemma 1's argument gives
  2C/m_i, so the printed formula is a typo and we implement the corrected one (specs D.3).

Under add-remove the sensitivity is C and the factor 2 becomes 1.  Each release is one
``dp_accounting`` event (:func:`~decentdp.privacy.events.laplace_event` or ``gaussian_event``) of the
multiplier z as released, charged to the agent's ledger row; a release the budget does not allow is
refused and the agent stops.  The neighbouring relation (``privacy.neighbouring``) goes to the
accountants, which price it themselves (:func:`~decentdp.privacy.accounting.priced_event`: under
replace-one a Laplace release of multiplier z costs what add-remove Laplace of z/2 does).

Per-update budgets (``allocation``): equal over the T_i planned wake-ups, or Proposition 2's
eps_i(t) proportional to C^{t/3}, C = 1 - sigma / (n L_max), over the ticks t at which agent i wakes.
Calibration: ``tight`` takes the smallest z whose composition, priced by ``privacy.accountant``
(PLD, RDP, or the smaller), stays within (eps-bar, delta-bar); ``paper`` uses Theorem 1's Kairouz
et al. (2015) composition (:func:`kairouz_epsilon`), which is looser.  Either is then fitted to the
ledger (:func:`fit_to_accountant`): where ``privacy.accountant`` prices an agent's planned releases
above the budget (Theorem 1's sum of Laplace epsilons is exact, PLD's discretisation rounds it up; the
Gaussian's classical scale fails at eps_t >= 1), its epsilons are scaled down until the ledger admits
every planned release, so that no agent stops short of its schedule for the pricing alone.  Whatever
the calibration, the spent epsilon is reported three ways: the paper's formula, PLD and RDP; the
paper's formula is withheld (null, with a note) for Gaussian updates at eps_t >= 1, where it bounds
nothing.  For the Gaussian variant the paper's per-update delta_i(t) is delta-bar / T_i (the paper
leaves it open), so its total delta is 1 - (1 - delta-bar) prod_t (1 - delta_i(t)), about 2 delta-bar.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import dp_accounting
import numpy as np

from decentdp.errors import PrivacyError
from decentdp.privacy.accounting import calibrate_scale, epsilon_of_history, narrow_bracket
from decentdp.privacy.events import gaussian_event, laplace_event
from decentdp.privacy.ledger import PrivacyLedger


def kairouz_terms(epsilons: np.ndarray, delta: float) -> np.ndarray:
    """Theorem 1's epsilon-bar for the per-update epsilons in the last axis (zeros: no update):

    min{ sum eps, sum (e^eps - 1) eps / (e^eps + 1) + sqrt(2 sum eps^2 log(e + sqrt(sum eps^2) / delta)),
         sum (e^eps - 1) eps / (e^eps + 1) + sqrt(2 sum eps^2 log(1 / delta)) }  (Kairouz et al. 2015)."""
    eps = np.asarray(epsilons, dtype=np.float64)
    total = eps.sum(axis=-1)
    drift = (np.tanh(eps / 2) * eps).sum(axis=-1)  # (e^eps - 1) / (e^eps + 1) = tanh(eps / 2): no overflow
    square = (eps * eps).sum(axis=-1)
    second = drift + np.sqrt(2.0 * square * np.log(math.e + np.sqrt(square) / delta))
    third = drift + np.sqrt(2.0 * square * math.log(1.0 / delta))
    return np.minimum(total, np.minimum(second, third))


def kairouz_epsilon(epsilons: np.ndarray, delta: float) -> np.ndarray:
    """:func:`kairouz_terms`, with infinity for any infinite (non-private) update."""
    eps = np.asarray(epsilons, dtype=np.float64)
    infinite = np.isinf(eps).any(axis=-1)
    return np.where(infinite, np.inf, kairouz_terms(np.where(np.isinf(eps), 0.0, eps), delta))


def optimal_profile(update_ticks: np.ndarray, contraction: float) -> np.ndarray:
    """Proposition 2's shape C^{t/3} at each agent's update ticks (``-1``: no update, weight 0)."""
    root = contraction ** (1.0 / 3.0)
    return np.where(update_ticks >= 0, root ** np.maximum(update_ticks, 0).astype(np.float64), 0.0)


@dataclass(frozen=True)
class UpdateNoise:
    """Each agent's noise multipliers for its updates, and what they are under the paper's accounting.

    ``multipliers[i, k]`` is z of agent i's k-th update (0 = no noise); ``paper_epsilons[i, k]`` and
    ``paper_delta`` the per-update (eps, delta) Theorem 1 (or Remark 2) attributes to it."""

    mechanism: str
    multipliers: np.ndarray
    paper_epsilons: np.ndarray
    paper_delta: float

    def event(self, multiplier: float) -> dp_accounting.DpEvent:
        """The dp_accounting event of one update with noise multiplier ``multiplier``, as released (the
        accountant applies the neighbouring relation)."""
        return _event(self.mechanism, multiplier)


def _event(mechanism: str, multiplier: float) -> dp_accounting.DpEvent:
    return (laplace_event if mechanism == "laplace" else gaussian_event)(multiplier)


def _reciprocal(mechanism: str, factor: float, per_update_delta: float) -> Callable[[np.ndarray], np.ndarray]:
    """z from a per-update epsilon, and back (the map is its own inverse): factor / eps (Laplace),
    factor sqrt(2 ln(2/delta)) / eps (Gaussian); 0 stays 0 (no update)."""
    scale = factor if mechanism == "laplace" else factor * math.sqrt(2.0 * math.log(2.0 / per_update_delta))
    return lambda eps: np.where(eps > 0, scale / np.where(eps > 0, eps, 1.0), 0.0)


def calibrate_updates(mechanism: str, calibration: str, budget: float, delta: float, shape: np.ndarray,
                      accountant: str, relation: str) -> UpdateNoise:
    """Noise multipliers for updates whose per-update budgets follow ``shape`` (``(n, T)``: the allocation,
    zero where no update is planned), scaled so that each agent's composition meets (budget, delta).

    ``tight`` with an equal allocation calibrates one z for T releases with :func:`calibrate_scale`
    under ``accountant``; ``paper`` scales each agent's shape so that :func:`kairouz_epsilon` equals
    the budget: per agent, the scale doubles while it fits, then a bisection between the last scale that
    fits and the first that does not returns the largest that fits (vectorised over agents; an agent with
    no planned update gets scale 0 and holds back no other).  What the run's accountant then charges for
    these releases may still exceed the budget: :func:`fit_to_accountant` scales them down where it does."""
    planned = shape.shape[1]
    factor = 2.0 if relation == "replace-one" else 1.0
    per_update_delta = delta / planned
    invert = _reciprocal(mechanism, factor, per_update_delta)  # eps -> z and z -> eps alike
    if math.isinf(budget):
        zeros = np.zeros_like(shape, dtype=np.float64)
        return UpdateNoise(mechanism, zeros, np.where(shape > 0, np.inf, 0.0), per_update_delta)
    if calibration == "tight":
        if not np.all((shape == 0) | (shape == shape.max())):
            raise PrivacyError("tight calibration supports the equal allocation only")
        z = calibrate_scale(lambda scale: _event(mechanism, scale), planned, budget, delta, accountant,
                            describe=f"{planned} {mechanism} updates", relation=relation)
        multipliers = np.where(shape > 0, z, 0.0)
        return UpdateNoise(mechanism, multipliers, invert(multipliers), per_update_delta)
    planned_rows = shape.sum(axis=1) > 0  # an agent without data (or never woken) spends nothing: scale 0
    # half the basic composition's split (sum eps = budget / 2) fits whatever the rounding; each row's scale
    # doubles while the doubled one still fits (the advanced terms may allow more than sum eps = budget), so
    # that [low, 2 low] brackets the largest scale that fits, row by row
    low = np.where(planned_rows, budget / np.where(planned_rows, shape.sum(axis=1), 1.0) / 2, 0.0)
    while True:
        grow = planned_rows & (kairouz_terms(shape * (2 * low)[:, None], delta) <= budget)
        if not grow.any():
            break
        low = np.where(grow, 2 * low, low)
    high = 2 * low  # the first doubling that does not fit
    for _ in range(80):
        middle = (low + high) / 2
        fits = kairouz_terms(shape * middle[:, None], delta) <= budget
        low, high = np.where(fits, middle, low), np.where(fits, high, middle)
    epsilons = shape * low[:, None]  # the feasible end of each bracket
    return UpdateNoise(mechanism, invert(epsilons), epsilons, per_update_delta)


#: Relative width to which :func:`fit_to_accountant` narrows the factor of an agent whose planned releases
#: do not fit: the per-update epsilons it returns are within about this share of the largest the ledger admits.
FIT_TOLERANCE = 1e-6
#: The smallest factor :func:`fit_to_accountant` tries before it gives up (no realistic budget gets near it).
SMALLEST_FACTOR = 1e-12


def ledger_admits(mechanism: str, multipliers: np.ndarray, budget: float, delta: float, accountant: str,
                  relation: str) -> bool:
    """Whether a run's ledger (:class:`~decentdp.privacy.ledger.PrivacyLedger` with this budget, delta,
    accountant and relation) admits every one of an agent's planned releases, the updates of multipliers
    ``multipliers`` (``(T,)``, 0 where none is planned) in order: the ledger's own decisions, not a formula."""
    ledger = PrivacyLedger(1, budget, delta, budget_accountant=accountant, relation=relation)
    for number, multiplier in enumerate(multipliers[multipliers > 0].tolist()):
        event = ledger.intern(_event(mechanism, multiplier))
        if not ledger.charge(number, np.array([event]))[0]:
            return False
    return True


def fit_to_accountant(noise: UpdateNoise, budget: float, delta: float, accountant: str,
                      relation: str) -> tuple[UpdateNoise, np.ndarray]:
    """``noise`` with each agent's per-update epsilons scaled down, where needed, until the run's ledger
    admits all of its planned releases; and each agent's factor (1 where they fit as calibrated).

    Theorem 1's calibration (``calibration = "paper"``) spends the budget under the Kairouz et al.
    composition, and the ledger enforces it with ``accountant``, which may price the same releases higher:
    the classical Gaussian mechanism's sigma >= 2C sqrt(2 ln(2/delta_t)) / eps_t holds only for eps_t < 1, and
    ``pld`` prices one Laplace release at pure epsilon 1 at 1.00016 (its discretisation rounds up; ``tight``
    charges Laplace releases their exact sum where that is smaller).  The
    agent's last planned release would then be refused (every release at T_i = 1) and its model would stop
    early, silently.  The epsilons scale by a factor f and the multipliers by s = 1 / f (both mechanisms'
    multipliers are inversely proportional to eps_t).  For an agent whose releases :func:`ledger_admits` refuses,
    s is the smallest whose whole planned history the ledger's own pricing (:func:`epsilon_of_history` under
    ``accountant``) keeps within the budget: doubled until it does, then narrowed to :data:`FIT_TOLERANCE`
    (:func:`~decentdp.privacy.accounting.narrow_bracket`, a handful of compositions, its safe end); then raised
    by that tolerance until the ledger, which also prices every prefix, admits every release.  Agents with the
    same planned multipliers share one search."""
    factors = np.ones(len(noise.multipliers))
    if math.isinf(budget):
        return noise, factors
    rows, inverse = np.unique(noise.multipliers, axis=0, return_inverse=True)

    def admits(multipliers: np.ndarray) -> bool:
        return ledger_admits(noise.mechanism, multipliers, budget, delta, accountant, relation)

    def excess(multipliers: np.ndarray) -> float:
        """log(price / budget) of the whole planned history: > 0 where it does not fit (0 counts as tiny)."""
        history = tuple((_event(noise.mechanism, z), 1) for z in multipliers[multipliers > 0].tolist())
        return math.log(max(epsilon_of_history(history, delta, accountant, relation), 5e-324) / budget)

    def give_up() -> PrivacyError:
        return PrivacyError(f"no scaling of the {noise.mechanism} updates' epsilons down to {SMALLEST_FACTOR:g} "
                            f"fits epsilon = {budget:g} at delta = {delta:g} under the {accountant} accountant; "
                            "raise privacy.epsilon or privacy.delta")

    for number, row in enumerate(rows):
        if not (row > 0).any() or admits(row):
            continue
        scale = 1.0
        if excess(row) > 0:
            high = 2.0
            while excess(row * high) > 0:
                high *= 2
                if high > 1 / SMALLEST_FACTOR:
                    raise give_up()
            scale = narrow_bracket(lambda s, row=row: excess(row * s), high / 2, high, FIT_TOLERANCE)
        while not admits(row * scale):
            scale /= 1 - FIT_TOLERANCE
            if scale > 1 / SMALLEST_FACTOR:
                raise give_up()
        factors[inverse.reshape(-1) == number] = 1 / scale
    scaled = UpdateNoise(noise.mechanism, noise.multipliers / factors[:, None], noise.paper_epsilons * factors[:, None],
                         noise.paper_delta)
    return scaled, factors
