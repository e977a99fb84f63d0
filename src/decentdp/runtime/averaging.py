"""Iterate averaging: each agent evaluates (and keeps) an average of its own past parameters.

Averaging the iterates of a noisy SGD is the DP-SGD literature's cheapest accuracy gain (Polyak and
Juditsky 1992; De et al. 2022 use an exponential moving average for every DP result).  The noise of the
last few steps is averaged out, so a run can keep a larger step size without ending on a noisy iterate.

**Privacy.** An agent's average is a function of its own iterates only: it makes no release, is never sent,
and is exactly as private as the iterates it averages (post-processing).  It is therefore free: the ledger
charges nothing for it.

**Rule.** After round ``k`` (``k = 1, 2, ...`` rounds done) with parameters ``theta_k``::

    n_k = k - start + 1                      # iterates averaged: theta_start .. theta_k
    w_k = 1                                  if n_k <= 1   (before and at ``start`` the average tracks theta)
        = 1 / n_k                            "uniform"     (Polyak-Ruppert tail average)
        = max(1 / n_k, 1 - decay)            "ema"         (uniform until 1/(1-decay) iterates, then exponential)
    average_k = average_{k-1} + w_k (theta_k - average_{k-1})

The ``ema`` weight never falls below the uniform one, so the average carries no bias towards the initial
parameters (what a plain ``decay`` from round 0 would give a short run).  ``uniform`` is ``ema`` with
``decay = 1``.  The average lives in the state under :data:`AVERAGE`, one row per agent like ``params``, so
checkpoints, resumes and the sharded engines carry it without knowing what it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from decentdp.algorithms.base import State

AVERAGE = "params_average"
"""The state entry holding each agent's averaged parameters (rows as in ``params``)."""

AveragingKind = Literal["none", "ema", "uniform"]


@dataclass(frozen=True)
class IterateAverage:
    """The ``[averaging]`` rule: ``kind`` (``ema`` or ``uniform``), ``decay`` (``ema``), ``start`` round."""

    kind: Literal["ema", "uniform"]
    decay: float = 0.999
    start: int = 0

    def weight(self, done: int) -> float:
        """``w_k`` of the module's rule for the iterate after ``done`` rounds."""
        count = done - self.start + 1
        if count <= 1:
            return 1.0
        if self.kind == "uniform":
            return 1.0 / count
        return max(1.0 / count, 1.0 - self.decay)

    def begin(self, state: State) -> State:
        """The state with the average set to the current parameters (the run's start, or after setup)."""
        return {**state, AVERAGE: state["params"].clone()}

    def update(self, average: torch.Tensor, params: torch.Tensor, done: int) -> torch.Tensor:
        """The average after round ``done``: ``average + w (params - average)``, in place of ``average``."""
        weight = self.weight(done)
        if weight == 1.0:
            return average.copy_(params)
        return average.lerp_(params, weight)


def evaluated_parameters(state: State) -> torch.Tensor:
    """The parameters a run evaluates and reports: the agents' averages when the run keeps them."""
    return state[AVERAGE] if AVERAGE in state else state["params"]
