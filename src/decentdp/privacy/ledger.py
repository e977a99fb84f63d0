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
        self.runs: list[list[ReleaseRun]] = [[] for _ in range(n_agents)]
        self.refused = np.zeros(n_agents, dtype=np.int64)

    def history(self, agent: int) -> tuple[Run, ...]:
        """The agent's releases as ``(sigma, q, count)`` runs, the input of the accountants."""
        return tuple(run.key for run in self.runs[agent])

    def releases(self) -> np.ndarray:
        """Total number of noisy releases per agent."""
        return np.array([sum(run.count for run in runs) for runs in self.runs], dtype=np.int64)

    def _headroom(self, agent: int, sigma: float, q: float) -> int:
        """How many more ``(sigma, q)`` releases the agent may make within its budget."""
        budget = float(self.budgets[agent])
        if math.isinf(budget):
            return _UNLIMITED
        if sigma <= 0:
            return 0
        runs = self.runs[agent]
        if runs and (runs[-1].noise_multiplier, runs[-1].sample_rate) == (sigma, q):
            prefix, done = self.history(agent)[:-1], runs[-1].count
        else:
            prefix, done = self.history(agent), 0
        return _max_count(prefix, sigma, q, self.delta, budget, self.budget_accountant) - done

    def spend(self, round_index: int, noise_multipliers: np.ndarray, sample_rates: np.ndarray,
              releases: int, agents: np.ndarray | None = None) -> np.ndarray:
        """Record ``releases`` sampled Gaussian releases for every agent whose budget allows them.

        Returns a boolean mask of the agents that were authorised (and recorded).  The caller must
        discard the data-dependent output of every agent not in the mask: such an agent has not
        released anything this round.  ``agents`` restricts the request to a subset (e.g. the agents
        awake in an asynchronous round); by default all agents ask.
        """
        asking = np.ones(self.n_agents, dtype=bool) if agents is None else np.asarray(agents, dtype=bool)
        allowed = np.zeros(self.n_agents, dtype=bool)
        for agent in np.flatnonzero(asking):
            sigma, q = float(noise_multipliers[agent]), float(sample_rates[agent])
            if self._headroom(agent, sigma, q) < releases:
                self.refused[agent] += 1
                continue
            allowed[agent] = True
            runs = self.runs[agent]
            if runs and (runs[-1].noise_multiplier, runs[-1].sample_rate) == (sigma, q):
                runs[-1].count += releases
                runs[-1].last_round = round_index
            else:
                runs.append(ReleaseRun(sigma, q, releases, round_index, round_index))
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
            "runs": [[asdict(run) for run in runs] for runs in self.runs],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger saved with :meth:`state_dict`."""
        ledger = cls(len(state["budgets"]), state["budgets"], state["delta"], state["budget_accountant"])
        ledger.refused = np.asarray(state["refused"], dtype=np.int64)
        ledger.runs = [[ReleaseRun(**run) for run in runs] for runs in state["runs"]]
        return ledger
