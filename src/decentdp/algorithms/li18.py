"""Li18: Li et al., "Differentially private distributed online learning" (TKDE 2018), Algorithm 1, as a
TOP-DP baseline (specs C.1) in the protocol of eq. 3 (:mod:`decentdp.algorithms.components.select_mix`).

Each agent perturbs what it releases with Laplace noise of per-iteration budget ``epsilon_step``::

    g~_i = (sum_b clip_C(grad l(x~_i; b)) + Lap(b_i)^d) / L_i,   b_i = sqrt(d) C / epsilon_step

(``sqrt(d) C`` bounds the l1 norm of one record's clipped gradient).  Li et al. claim ``epsilon``-DP
overall from fresh data per round; on reused data the rounds compose, and TOP-DP's comparison needs
a total budget, so ``epsilon_step = epsilon / sqrt(8 T ln(1/delta))`` (advanced composition, the
paper-style accounting).  The ledger records each release as an unsampled Laplace event (no amplification,
as Li et al. state it) and reports our tight epsilon beside that claim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import dp_accounting
import torch

from decentdp.algorithms.base import Calibrated, NoisePlan
from decentdp.algorithms.components.select_mix import SelectMix
from decentdp.algorithms.registry import register
from decentdp.privacy.baselines.paper import advanced_composition_epsilon, li18_step_epsilon
from decentdp.privacy.mechanisms import LaplaceMechanism


class UnsampledLaplace(LaplaceMechanism):
    """Li18's Laplace releases, accounted without subsampling amplification, as Li et al. state it (sound;
    the PLD accountant could credit the sampling, RDP only bounds sampled Laplace by the unsampled one)."""

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        return super().agent_event(owner, 1.0, rows)

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        return super().receiver_event(owner, 1.0)


@register
class Li18(SelectMix):
    """Laplace-noised releases with a per-iteration budget (advanced composition over the run)."""

    name: ClassVar[str] = "li18"

    def calibrate(self, plan: NoisePlan) -> Calibrated:
        steps = [li18_step_epsilon(epsilon, plan.delta, plan.rounds) for epsilon in plan.budgets]
        multipliers = [1 / step for step in steps]  # b_i = multiplier * sensitivity: pure epsilon_step-DP
        paper = {"method": "Li18 Laplace, per-iteration epsilon_step by advanced composition (specs C.1)",
                 "claimed_epsilon": list(plan.budgets), "epsilon_step": steps,
                 # the claim's own composition theorem, evaluated: above the claim where eps_step is not small
                 "advanced_composition_epsilon": [advanced_composition_epsilon(step, plan.delta, plan.rounds)
                                                  for step in steps],
                 "l1_sensitivity": math.sqrt(plan.dim) * plan.clip}
        mechanism = UnsampledLaplace(torch.tensor(multipliers, dtype=torch.float64), math.sqrt(plan.dim) * plan.clip)
        return Calibrated(mechanism, multipliers, paper)
