"""Per-agent privacy ledgers: what each agent actually released, and a budget it cannot exceed.

Following ``dp_accounting``'s design, the ledger stores *events* (what was released), never a
formula computed beforehand; the epsilon we report is computed from those events afterwards.  Each
agent's history is run-length encoded as runs of identical sampled Gaussian releases, which keeps
a 2000-round history a handful of numbers and makes it serialisable into checkpoints.

Budget enforcement (``spend``) uses the same accountant as noise calibration (RDP by default),
so that an agent whose noise was calibrated for its planned releases can make exactly those
releases and no more.  Because epsilon grows monotonically with the number of identical releases,
the check reduces to comparing a count with a cached maximum, which keeps it off the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from decentdp.errors import PrivacyError
from decentdp.privacy.accounting import Run, check_epsilon_delta, epsilon_of_runs

_UNLIMITED = 1 << 40


@dataclass
class ReleaseRun:
    """Consecutive identical releases of one agent: ``count`` sampled Gaussian mechanisms."""

    noise_multiplier: float
    sample_rate: float
    count: int
    first_round: int
    last_round: int

    @property
    def key(self) -> Run:
        return (self.noise_multiplier, self.sample_rate, self.count)


@lru_cache(maxsize=4096)
def _max_count(prefix: tuple[Run, ...], sigma: float, q: float, delta: float, epsilon: float,
               accountant: str) -> int:
    """Largest ``c`` such that ``prefix`` followed by ``c`` releases ``(sigma, q)`` stays within epsilon."""

    def fits(count: int) -> bool:
        return epsilon_of_runs((*prefix, (sigma, q, count)), delta, accountant) <= epsilon

    if not fits(0):
        return -1
    high = 1
    while fits(high):
        if high >= _UNLIMITED:
            return _UNLIMITED
        high *= 2
    low = high // 2  # fits(low) holds, fits(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


class PrivacyLedger:
    """The release history and (epsilon, delta) budget of every agent.

    Parameters
    ----------
    n_agents:
        Number of agents the ledger covers (global agent ids ``0..n_agents-1``).
    epsilon:
        Budget per agent: one number for all, or one per agent; ``math.inf`` means no budget
        (non-private runs record their releases as ``sigma = 0`` and report infinite epsilon).
    delta:
        The delta at which budgets are enforced and epsilon is reported.
    budget_accountant:
        Accountant used to enforce the budget; it should be the one that calibrated the noise.

    Storage, laid out so that :meth:`spend` is a handful of array operations over all agents:
    each agent's *closed* runs (all but the last) are ``ReleaseRun`` objects, and its *current*
    (last) run lives in per-agent arrays (``sigma``, ``q``, ``count``, first and last round).
    Next to it sits a cache of the agent's *headroom*: how many more releases of one ``(sigma, q)``
    fit in its budget after everything recorded so far.  Recording ``r`` releases of that same
    ``(sigma, q)`` lowers the headroom by exactly ``r`` (they extend the current run, or start a new
    one after the same history), so the accountant is consulted only when an agent asks for a
    ``(sigma, q)`` other than the cached one: at its first release, and when its noise or rate
    changes.
    """

    def __init__(self, n_agents: int, epsilon: float | Sequence[float], delta: float,
                 budget_accountant: str = "rdp") -> None:
        budgets = np.broadcast_to(np.asarray(epsilon, dtype=np.float64), (n_agents,)).copy()
        for value in budgets:
            check_epsilon_delta(float(value), delta)
        self.n_agents = n_agents
        self.budgets = budgets
        self.delta = float(delta)
        self.budget_accountant = budget_accountant
        self.refused = np.zeros(n_agents, dtype=np.int64)
        self._closed: list[list[ReleaseRun]] = [[] for _ in range(n_agents)]
        self._closed_releases = np.zeros(n_agents, dtype=np.int64)  # total count of the closed runs
        self._has_run = np.zeros(n_agents, dtype=bool)  # whether the current-run arrays hold a run
        self._sigma = np.zeros(n_agents, dtype=np.float64)
        self._q = np.zeros(n_agents, dtype=np.float64)
        self._count = np.zeros(n_agents, dtype=np.int64)
        self._first_round = np.zeros(n_agents, dtype=np.int64)
        self._last_round = np.zeros(n_agents, dtype=np.int64)
        # Headroom cache: `_room` more releases of (`_room_sigma`, `_room_q`) fit; NaN keys never match.
        self._room_sigma = np.full(n_agents, np.nan)
        self._room_q = np.full(n_agents, np.nan)
        self._room = np.zeros(n_agents, dtype=np.int64)

    def _current(self, agent: int) -> ReleaseRun:
        """The agent's current (last) run as a new ``ReleaseRun``; only valid where ``_has_run``."""
        return ReleaseRun(float(self._sigma[agent]), float(self._q[agent]), int(self._count[agent]),
                          int(self._first_round[agent]), int(self._last_round[agent]))

    def agent_runs(self, agent: int) -> list[ReleaseRun]:
        """The agent's release runs, oldest first (new objects: editing them does not edit the ledger)."""
        closed = [ReleaseRun(**asdict(run)) for run in self._closed[agent]]
        return [*closed, self._current(agent)] if self._has_run[agent] else closed

    @property
    def runs(self) -> list[list[ReleaseRun]]:
        """Every agent's release runs (a snapshot; see :meth:`agent_runs`)."""
        return [self.agent_runs(agent) for agent in range(self.n_agents)]

    def history(self, agent: int) -> tuple[Run, ...]:
        """The agent's releases as ``(sigma, q, count)`` runs, the input of the accountants."""
        closed = tuple(run.key for run in self._closed[agent])
        return (*closed, self._current(agent).key) if self._has_run[agent] else closed

    def releases(self) -> np.ndarray:
        """Total number of noisy releases per agent."""
        return self._closed_releases + np.where(self._has_run, self._count, 0)

    def _headroom(self, agent: int, sigma: float, q: float) -> int:
        """How many more ``(sigma, q)`` releases the agent may make within its budget (from the accountant)."""
        budget = float(self.budgets[agent])
        if math.isinf(budget):
            return _UNLIMITED
        if sigma <= 0:
            return 0
        history = self.history(agent)
        if self._has_run[agent] and (float(self._sigma[agent]), float(self._q[agent])) == (sigma, q):
            prefix, done = history[:-1], int(self._count[agent])
        else:
            prefix, done = history, 0
        return _max_count(prefix, sigma, q, self.delta, budget, self.budget_accountant) - done

    def spend(self, round_index: int, noise_multipliers: np.ndarray, sample_rates: np.ndarray,
              releases: int, agents: np.ndarray | None = None) -> np.ndarray:
        """Record ``releases`` sampled Gaussian releases for every agent whose budget allows them.

        Returns a boolean mask of the agents that were authorised (and recorded).  The caller must
        discard the data-dependent output of every agent not in the mask: such an agent has not
        released anything this round, and its refusal is counted in ``refused``.  ``agents`` (a
        boolean mask) restricts the request to a subset (e.g. the agents awake in an asynchronous
        round); by default all agents ask.

        Array operations over all agents, except for agents whose cached headroom is for another
        ``(sigma, q)`` (the accountant is asked) and agents that start a new run after an old one
        (the old run is stored as a ``ReleaseRun``); both happen only when an agent's mechanism
        changes, never in a steady state.
        """
        n = self.n_agents
        asking = np.ones(n, dtype=bool) if agents is None else np.asarray(agents, dtype=bool)
        sigma = np.asarray(noise_multipliers, dtype=np.float64).reshape(n)
        q = np.asarray(sample_rates, dtype=np.float64).reshape(n)
        releases = int(releases)
        if releases < 0:
            raise ValueError(f"releases must be non-negative, got {releases}")

        stale = asking & ~((sigma == self._room_sigma) & (q == self._room_q))
        for agent in np.flatnonzero(stale):
            self._room[agent] = self._headroom(agent, float(sigma[agent]), float(q[agent]))
            self._room_sigma[agent], self._room_q[agent] = sigma[agent], q[agent]

        allowed = asking & (self._room >= releases)
        self.refused[asking & ~allowed] += 1

        extends = allowed & self._has_run & (self._sigma == sigma) & (self._q == q)
        starts = allowed & ~extends
        for agent in np.flatnonzero(starts & self._has_run):
            self._closed[agent].append(self._current(agent))
        self._closed_releases[starts] += np.where(self._has_run, self._count, 0)[starts]
        self._has_run[starts] = True
        self._sigma[starts], self._q[starts] = sigma[starts], q[starts]
        self._count[starts] = 0
        self._first_round[starts] = round_index

        self._count[allowed] += releases
        self._last_round[allowed] = round_index
        self._room[allowed & np.isfinite(self.budgets)] -= releases  # an infinite budget stays _UNLIMITED
        return allowed

    def epsilon(self, accountant: str = "pld", delta: float | None = None) -> np.ndarray:
        """Epsilon each agent has spent so far, from its recorded releases."""
        at = self.delta if delta is None else float(delta)
        return np.array([epsilon_of_runs(self.history(agent), at, accountant) for agent in range(self.n_agents)])

    def reported_epsilon(self) -> tuple[np.ndarray, str]:
        """Epsilon per agent by PLD (tight), or by RDP where PLD is impractical; with the accountant's name."""
        try:
            return self.epsilon("pld"), "pld"
        except PrivacyError:
            return self.epsilon("rdp"), "rdp"

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (for checkpoints and the results folder)."""
        return {
            "budgets": [float(b) for b in self.budgets],
            "delta": self.delta,
            "budget_accountant": self.budget_accountant,
            "refused": self.refused.tolist(),
            "runs": [[asdict(run) for run in self.agent_runs(agent)] for agent in range(self.n_agents)],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger saved with :meth:`state_dict` (the headroom cache is rebuilt on first use)."""
        ledger = cls(len(state["budgets"]), state["budgets"], state["delta"], state["budget_accountant"])
        ledger.refused = np.asarray(state["refused"], dtype=np.int64).reshape(ledger.n_agents).copy()
        for agent, saved in enumerate(state["runs"]):
            runs = [ReleaseRun(**run) for run in saved]
            if not runs:
                continue
            *closed, current = runs
            ledger._closed[agent] = closed
            ledger._closed_releases[agent] = sum(run.count for run in closed)
            ledger._has_run[agent] = True
            ledger._sigma[agent], ledger._q[agent] = current.noise_multiplier, current.sample_rate
            ledger._count[agent] = current.count
            ledger._first_round[agent], ledger._last_round[agent] = current.first_round, current.last_round
        return ledger
