"""The in-process simulator: N agents stacked in tensors, one round a handful of batched kernels.

The simulator owns the round loop and nothing else: it hands the algorithm a
:class:`~decentdp.algorithms.base.RoundContext` (learning rate, network, gradient oracle) and
calls back after each round, so that the experiment runner can evaluate, log and checkpoint.
Rounds are synchronous (Jacobi): every agent computes from the previous round's values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decentdp.algorithms.base import Algorithm, RoundContext, State
from decentdp.runtime.network import Network
from decentdp.util.profiling import NO_TIMER, PhaseTimer
from decentdp.runtime.schedules import Schedule
from decentdp.privacy.mechanism import GradientOracle

RoundHook = Callable[[int, State], bool]
"""Called after round ``k`` (1-based count of completed rounds) with the new state; return False to stop."""


@dataclass
class Simulator:
    """Runs an algorithm's rounds over all agents held in this process."""

    algorithm: Algorithm
    network: Network
    gradient: GradientOracle
    schedule: Schedule
    timer: PhaseTimer = field(default=NO_TIMER)

    def run(self, state: State, start_round: int, rounds: int, after_round: RoundHook) -> State:
        """Run rounds ``start_round .. rounds-1``; stops early when ``after_round`` returns False."""
        with torch.no_grad():
            for k in range(start_round, rounds):
                ctx = RoundContext(round_index=k, lr=self.schedule(k), network=self.network, gradient=self.gradient)
                with self.timer.phase("round"):
                    state = self.algorithm.round(state, ctx)
                self.timer.count_round()
                if not after_round(k + 1, state):
                    break
        return state
