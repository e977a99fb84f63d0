"""No noise: the protocol of eq. 3 without privacy, TOP-DP's upper reference (Section VII-A).

It releases plain mean gradients, so a run must say so: ``privacy.epsilon = 'inf'``.
"""

from __future__ import annotations

from typing import ClassVar

from decentdp.algorithms.components.select_mix import SelectMix
from decentdp.algorithms.registry import register


@register
class NoNoiseSelectMix(SelectMix):
    """Eq. 3 with exact mean gradients."""

    name: ClassVar[str] = "no-noise"
    adds_noise: ClassVar[bool] = False  # the config refuses a finite budget
