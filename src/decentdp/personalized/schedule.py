"""Asynchronous wake-ups under Poisson clocks, and their exact batching into levels.

Every agent has a rate-1 Poisson clock; in the superposed process each tick ``t`` wakes one agent,
uniformly at random (the ``poisson-clocks`` schedule of :mod:`decentdp.runtime.scheduler`).  The
whole sequence is one draw from the public stream (seed, SCHEDULE): a seeded schedule, recorded in
the results folder.  (The scheduler keys a generator per round, about 30-70 us a tick: 300 wake-ups
of 943 agents would spend 10-20 s on the schedule alone.)  An agent makes at most ``T_i`` updates;
its later ticks do nothing (Bellet et al.: it stops after T_i updates).

Exact asynchronous semantics, computed in batches: the update at tick t reads its own model and its
neighbours' latest broadcasts, and writes its own.  Give each update the *level*
``1 + max(level of the last update of the agent and of each neighbour)``; updates of one level then
touch disjoint, non-adjacent agents, none reads what another of its level writes, and every read
sees exactly the writes that precede it in tick order.  Running levels in order, each as one
vectorised (Jacobi) step, therefore reproduces the one-agent-at-a-time run exactly, with a few
hundred tensor operations instead of tens of thousands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decentdp.rng import AgentRandom, Stream

#: Sub-step of the schedule stream that draws the wake-up sequence.
WAKEUP_STEP = 1


def poisson_ticks(seed: int, n_agents: int, ticks: int) -> np.ndarray:
    """The agent that wakes at each of ``ticks`` ticks: uniform draws from the public stream (seed, SCHEDULE)."""
    generator = AgentRandom(seed).round_generator(0, Stream.SCHEDULE, WAKEUP_STEP)
    return torch.randint(n_agents, (ticks,), generator=generator).numpy().astype(np.int64)


@dataclass(frozen=True)
class WakeupPlan:
    """The updates a run makes, grouped into levels (module docstring).

    ``agents[u]``, ``ticks[u]``, ``index[u]`` (the agent's update number k, from 0) describe update u;
    updates are sorted by level, then tick, and ``level_starts[l]:level_starts[l + 1]`` is level l.
    """

    agents: np.ndarray
    ticks: np.ndarray
    index: np.ndarray
    level_starts: np.ndarray
    total_ticks: int
    n_agents: int

    @property
    def n_levels(self) -> int:
        return len(self.level_starts) - 1

    def level(self, number: int) -> slice:
        return slice(int(self.level_starts[number]), int(self.level_starts[number + 1]))

    def updates_per_agent(self) -> np.ndarray:
        return np.bincount(self.agents, minlength=self.n_agents)

    def update_ticks(self, max_updates: int) -> np.ndarray:
        """``(n, max_updates)`` tick of each agent's k-th update, -1 where it makes fewer."""
        table = np.full((self.n_agents, max_updates), -1, dtype=np.int64)
        table[self.agents, self.index] = self.ticks
        return table

    def split_at(self, marks: Sequence[int]) -> tuple[WakeupPlan, np.ndarray]:
        """The same updates, leveled so that the run's state after the first k ticks is the state after a level,
        for every k in ``marks`` (increasing); and, for each mark, how many levels of the new plan hold exactly
        the updates of ticks before it.

        A level holds updates of many ticks, so the state after it is generally the state at no tick (some
        earlier updates are in later levels).  Here each level is cut into its updates before the first
        mark, between the first and second, ..., and the pieces run segment by segment, each segment's in
        level order.  Still exact: a piece is a subset of a level (disjoint, non-adjacent agents), and the
        only pairs whose order changes are an update u moved after an update v of a higher level but an
        earlier tick; v neither is nor neighbours u's agent (u, after v in tick order, would then have the
        higher level), so neither reads what the other writes."""
        bounds = np.asarray(marks, dtype=np.int64)
        segment = np.searchsorted(bounds, self.ticks, side="right")       # updates with tick < marks[0]: 0
        level = np.repeat(np.arange(self.n_levels), np.diff(self.level_starts))
        order = np.lexsort((self.ticks, level, segment))
        piece_segment, piece_level = segment[order], level[order]
        new_piece = np.flatnonzero((np.diff(piece_segment) != 0) | (np.diff(piece_level) != 0)) + 1
        starts = np.concatenate([[0], new_piece, [len(order)]] if len(order) else [[0]]).astype(np.int64)
        split = WakeupPlan(self.agents[order], self.ticks[order], self.index[order], starts, self.total_ticks,
                           self.n_agents)
        levels_before = np.searchsorted(piece_segment[starts[:-1]], np.arange(len(bounds)), side="right")
        return split, levels_before


def plan_wakeups(woken: np.ndarray, weights: np.ndarray, max_updates: int) -> WakeupPlan:
    """Drop the ticks of agents past ``max_updates`` updates and level the rest (module docstring)."""
    n = len(weights)
    adjacency = weights > 0
    # plain Python lists: this loop is sequential, and per-tick numpy indexing costs more than the work
    around = [np.flatnonzero(row).tolist() for row in adjacency]
    done = [0] * n
    last = [-1] * n
    agents, ticks, index, levels = [], [], [], []
    for tick, agent in enumerate(woken.tolist()):
        count = done[agent]
        if count >= max_updates:
            continue
        level = max(last[agent], max(map(last.__getitem__, around[agent]), default=-1)) + 1
        last[agent] = level
        agents.append(agent)
        ticks.append(tick)
        index.append(count)
        levels.append(level)
        done[agent] = count + 1
    agents_a, ticks_a, index_a, levels_a = (np.asarray(v, dtype=np.int64) for v in (agents, ticks, index, levels))
    order = np.lexsort((ticks_a, levels_a))
    counts = np.bincount(levels_a, minlength=int(levels_a.max()) + 1 if len(levels_a) else 0)
    starts = np.concatenate([[0], np.cumsum(counts)])
    return WakeupPlan(agents_a[order], ticks_a[order], index_a[order], starts, len(woken), n)
