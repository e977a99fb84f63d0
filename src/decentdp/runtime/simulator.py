"""The in-process simulator: N agents stacked in tensors, one round a handful of batched kernels.

The simulator owns the round loop and nothing else.  For each round it takes the round's network
(fixed or redrawn, :class:`~decentdp.runtime.network.GraphSequence`), asks the scheduler who is
active, opens the round at the oracle (which then samples, computes and charges only those agents),
hands the algorithm a :class:`~decentdp.algorithms.base.RoundContext`, and calls back after the
round so that the runner can evaluate, log and checkpoint.  A run may start with a setup phase
(:data:`~decentdp.privacy.oracle.SETUP_ROUND`), e.g. a private warm start, with releases of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decentdp.algorithms.base import Algorithm, RoundContext, RoundPlan, State
from decentdp.algorithms.components.schedules import Schedule
from decentdp.privacy.oracle import SETUP_ROUND, DataOracle
from decentdp.rng import AgentRandom
from decentdp.runtime.averaging import AVERAGE, IterateAverage
from decentdp.runtime.network import GraphSequence
from decentdp.runtime.scheduler import Scheduler
from decentdp.util.profiling import NO_TIMER, PhaseTimer

RoundHook = Callable[[int, State], bool]
"""Called after round ``k`` (1-based count of completed rounds) with the new state; return False to stop."""


def unwrapped(network: object) -> object:
    """The default ``wrap_network``: the network itself (a named function, so that a simulator pickles)."""
    return network


@dataclass
class Simulator:
    """Runs an algorithm's rounds over all agents held in this process."""

    algorithm: Algorithm
    graphs: GraphSequence
    oracle: DataOracle
    scheduler: Scheduler
    schedule: Schedule
    rng: AgentRandom
    timer: PhaseTimer = field(default=NO_TIMER)
    #: Wraps each round's network (the profiler times its calls as communication).
    wrap_network: Callable[[object], object] = field(default=unwrapped)
    #: Each agent's average of its own iterates (``[averaging]``), kept in the state beside ``params``.
    averaging: IterateAverage | None = None

    def context(self, round_index: int) -> RoundContext:
        """Open ``round_index`` (or the setup phase) and build the algorithm's view of it."""
        network = self.graphs.at(round_index)
        plan: RoundPlan | None = None
        if round_index != SETUP_ROUND and not self.scheduler.everyone_always:
            plan = self.scheduler.plan(round_index, network)
        self.oracle.begin(round_index, None if plan is None else
                          plan.active if plan.active_on_host is None else plan.active_on_host)
        lr = self.schedule(max(round_index, 0))
        return RoundContext(round_index, lr, self.wrap_network(network), self.oracle, plan, self.rng)

    def setup(self, state: State) -> State:
        """The algorithm's setup phase (before round 0)."""
        with torch.no_grad():
            state = self.algorithm.setup(state, self.context(SETUP_ROUND))
        return state if self.averaging is None else self.averaging.begin(state)  # a warm start is its first iterate

    def close(self) -> None:
        """Release the engine's processes: none here (an engine that starts workers stops them)."""

    def run(self, state: State, start_round: int, rounds: int, after_round: RoundHook) -> State:
        """Run rounds ``start_round .. rounds-1``; stops early when ``after_round`` returns False."""
        with torch.no_grad():
            for k in range(start_round, rounds):
                ctx = self.context(k)
                with self.timer.phase("round"):
                    state = self._round(state, ctx, k)
                self.timer.count_round()
                if not after_round(k + 1, state):
                    break
        return state

    def _round(self, state: State, ctx: RoundContext, k: int) -> State:
        """Round ``k`` of the algorithm, then each agent's iterate average (which the algorithm never sees)."""
        if self.averaging is None:
            return self.algorithm.round(state, ctx)
        average = state[AVERAGE] if AVERAGE in state else state["params"].clone()  # a caller that skipped setup
        state = self.algorithm.round({key: value for key, value in state.items() if key != AVERAGE}, ctx)
        return {**state, AVERAGE: self.averaging.update(average, state["params"], k + 1)}
