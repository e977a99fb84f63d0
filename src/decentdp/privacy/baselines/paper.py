"""The accounting each TOP-DP-era paper states for itself, implemented as labelled baselines.

These formulas are what the papers (or the baselines as TOP-DP ran them, specs section C) use to
choose their noise.  A run that uses one still records the events its mechanism released, so the
ledger reports our tight epsilon beside the paper's claim; where the two differ, the paper's is the
loose one.  Noise multipliers here are relative to the sensitivity ``C`` of a clipped-gradient sum
(the noise on an agent's released sum is ``multiplier * C``), the unit of every mechanism.

* TOP-DP, Theorem 1 (eq. 7): ``sigma_0 >= 8 sqrt(T log(1/delta) log(1.25/delta)) / (epsilon |D_i|)``
  (Abadi et al.'s bound with one sample per step; the proof ignores the time-aware decay, "since it
  does not incur any additional privacy loss", and every per-receiver reuse of noise).
* Li et al. 2018 (Li18): Laplace noise with per-iteration budget ``epsilon_step``; as a baseline on
  reused data, advanced composition ``epsilon_step = epsilon / sqrt(8 T ln(1/delta))`` (specs C.1).
* Li18 + moments accountant: Gaussian noise whose RDP is converted with the classical bound
  ``epsilon = min_a RDP(a) + log(1/delta) / (a - 1)`` (Abadi et al. 2016; Mironov 2017, Prop. 3).
* UDP (Wei et al.): ``sigma = Delta_s sqrt(2 q T ln(1/delta)) / epsilon`` with ``Delta_s = 2 eta C / m``
  on the model update, ``q`` the fraction of participating users (specs C.2).
* Optimal (Asoodeh et al.): RDP with the improved conversion, which is dp_accounting's own: the
  run's accountant with ``rdp`` (specs C.3), so it needs no formula here.
"""

from __future__ import annotations

import math

import numpy as np

from decentdp.privacy.accounting import RDP_ORDERS, calibrate_scale, narrow_bracket, rdp_curve
from decentdp.privacy.events import gaussian_event


def theorem1_noise_multiplier(epsilon: float, delta: float, rounds: int, size: int) -> float:
    """TOP-DP eq. 7: the initial noise multiplier the paper prescribes for (epsilon, delta) over ``rounds``."""
    return 8 * math.sqrt(rounds * math.log(1 / delta) * math.log(1.25 / delta)) / (epsilon * size)


def theorem1_epsilon(noise_multiplier: float, delta: float, rounds: int, size: int) -> float:
    """The epsilon TOP-DP's Theorem 1 claims for a run that used ``noise_multiplier`` (eq. 7 solved for epsilon)."""
    return 8 * math.sqrt(rounds * math.log(1 / delta) * math.log(1.25 / delta)) / (noise_multiplier * size)


def li18_step_epsilon(epsilon: float, delta: float, rounds: int) -> float:
    """Li18's per-iteration budget under advanced composition over ``rounds`` steps (specs C.1)."""
    return epsilon / math.sqrt(8 * rounds * math.log(1 / delta))


def advanced_composition_epsilon(step_epsilon: float, delta: float, rounds: int) -> float:
    """Dwork, Rothblum and Vadhan's bound for ``rounds`` pure ``step_epsilon``-DP steps at extra ``delta``:
    sqrt(2 T ln(1/delta)) eps_0 + T eps_0 (e^eps_0 - 1).  Li18's step budget makes the first term epsilon / 2, so
    its claimed epsilon holds only while the second stays below epsilon / 2 (small eps_0)."""
    return (math.sqrt(2 * rounds * math.log(1 / delta)) * step_epsilon
            + rounds * step_epsilon * math.expm1(step_epsilon))


def udp_noise_multiplier(epsilon: float, delta: float, rounds: int, sample_rate: float, participation: float) -> float:
    """Wei et al.'s sigma, in units of the clipped sum's sensitivity: the update ``eta * S / L`` carries noise
    ``Delta_s sqrt(2 q T ln(1/delta)) / epsilon`` with ``Delta_s = 2 eta C / m``, so the sum carries
    ``(L / eta) * that = 2 (L / m) sqrt(2 q T ln(1/delta)) / epsilon`` times ``C`` (``L / m`` = the batch rate)."""
    return 2 * sample_rate * math.sqrt(2 * participation * rounds * math.log(1 / delta)) / epsilon


#: Relative precision of the moments accountant's sigma (what a 40-step bisection from [0, 1] reached before).
MOMENTS_TOLERANCE = 1e-10


def moments_accountant_epsilon(rdp: np.ndarray, delta: float) -> float:
    """The moments accountant's classical RDP conversion: ``min_a RDP(a) + log(1/delta) / (a - 1)``."""
    usable = RDP_ORDERS > 1
    with np.errstate(invalid="ignore"):
        values = rdp[usable] + math.log(1 / delta) / (RDP_ORDERS[usable] - 1)
    values = values[np.isfinite(values)]
    return float(values.min()) if len(values) else math.inf


def moments_accountant_noise_multiplier(epsilon: float, delta: float, sample_rate: float, releases: int) -> float:
    """Smallest sigma whose ``releases`` sampled Gaussian releases meet (epsilon, delta) by the moments accountant,
    to ``MOMENTS_TOLERANCE`` (relative), always from the safe side.  Each trial sigma costs one RDP curve (tenths
    of a second), so the root is narrowed by regula falsi (:func:`narrow_bracket`, about 12 curves) rather than
    bisected (about 40)."""

    def excess(sigma: float) -> float:
        spent = moments_accountant_epsilon(releases * rdp_curve(gaussian_event(sigma, sample_rate)), delta)
        return math.log(max(spent, 5e-324) / epsilon)

    low, high = 0.0, 1.0
    while excess(high) > 0:
        low, high = high, 2 * high
    return narrow_bracket(excess, low, high, MOMENTS_TOLERANCE)


def optimal_noise_multiplier(epsilon: float, delta: float, sample_rate: float, releases: int) -> float:
    """Asoodeh et al.'s "Optimal": RDP composed, converted with the improved bound (dp_accounting's)."""
    return calibrate_scale(lambda sigma: gaussian_event(sigma, sample_rate), releases, epsilon, delta, "rdp")
