"""UDP: Wei et al., user-level DP-SGD (IEEE TMC 2021), as a TOP-DP baseline in the protocol of eq. 3.

Noise on each release from the authors' formula (specs C.2), converted to the clipped sum's units::

    sigma_i = 2 q_i sqrt(2 p T ln(1/delta)) / epsilon            (Delta_s = 2 eta C / m on the update)

with ``q_i = L / |D_i|`` and ``p`` the fraction of agents taking part in a round: Wei et al. sample users, so UDP
also runs under ``schedule.kind = "sampled"`` (each online agent takes part with probability
``schedule.participation``, the ``p`` above).  The ledger records what this noise actually buys (the releases each
agent made, whoever sat out) and reports it beside the claimed epsilon.
"""

from __future__ import annotations

from typing import ClassVar

from decentdp.algorithms.base import Calibrated, NoisePlan
from decentdp.algorithms.components.select_mix import SelectMix, calibrated_gaussian
from decentdp.algorithms.registry import register
from decentdp.privacy.baselines.paper import udp_noise_multiplier


@register
class UDP(SelectMix):
    """Gaussian releases with Wei et al.'s sigma."""

    name: ClassVar[str] = "udp"
    schedules: ClassVar[tuple[str, ...]] = (*SelectMix.schedules, "sampled")

    def calibrate(self, plan: NoisePlan) -> Calibrated:
        return calibrated_gaussian(
            plan, lambda epsilon, rate: udp_noise_multiplier(epsilon, plan.delta, plan.rounds, rate,
                                                             plan.participation),
            "UDP: Wei et al.'s sigma = Delta_s sqrt(2 q T ln(1/delta)) / epsilon (specs C.2)")
