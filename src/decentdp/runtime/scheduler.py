"""Round schedules: which agents take part in a round, and who pairs with whom.

Only agents a plan marks active sample data, release and are charged (the oracle enforces it), so
offline agents, sampled users and agents that sleep between wake-ups spend nothing.

* ``synchronous``: every online agent is active (Bayrooti et al.; TOP-DP's Algorithm 1).
* ``pairing``: every online agent tries to pair with one neighbour it was not paired with in the
  previous round; agents are visited in a random order, each picks uniformly among its online,
  still unpaired neighbours, and a request is always accepted (TOP-DP's Algorithm 2).  Unpaired
  online agents are active alone.  A round never deadlocks: it is one greedy pass.
* ``poisson-clocks``: every agent has a rate-1 Poisson clock; a round is one tick, at which the
  agent whose clock rings wakes alone (Bellet et al. 2018): uniformly at random for equal rates.  No
  registered algorithm runs under it yet (a network run with it is refused by the config); Bellet et
  al.'s ``[personalized]`` runs draw the same wake-ups themselves (:mod:`decentdp.personalized.schedule`).
* ``sampled``: each online agent takes part with probability ``participation`` (UDP's sampled users).

With ``offline_probability`` p, each agent is independently offline with probability p in each
round (except under Poisson clocks, where sleeping is the schedule itself).  Every choice is drawn
from the public, round-keyed stream ``(seed, round, SCHEDULE)``, one vector over all agents, so a
plan depends only on the seed and the round (and, for pairing, the previous round's pairs, which
are part of the checkpoint).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from decentdp.algorithms.base import Network, RoundPlan
from decentdp.rng import AgentRandom, Stream, round_stream_seed

SCHEDULES: tuple[str, ...] = ("synchronous", "pairing", "poisson-clocks", "sampled")


class Scheduler:
    """Plans each round for the agents an engine holds (a shard keeps the slice of a global plan).

    ``offline_probability`` must be 0 under ``poisson-clocks`` and ``participation`` 1 except under ``sampled``:
    those schedules do not read them, so another value is a ValueError rather than silently ignored.
    """

    def __init__(self, kind: str, rng: AgentRandom, n_total: int, offline_probability: float = 0.0,
                 participation: float = 1.0, device: torch.device | str = "cpu") -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {kind!r}; allowed: {', '.join(SCHEDULES)}")
        if not 0.0 <= offline_probability < 1.0:
            raise ValueError(f"offline_probability must lie in [0, 1), got {offline_probability}")
        if not 0.0 < participation <= 1.0:
            raise ValueError(f"participation must lie in (0, 1], got {participation}")
        if offline_probability and kind == "poisson-clocks":  # (plan() would ignore it: one agent wakes a tick)
            raise ValueError(f"offline_probability={offline_probability} has no effect under 'poisson-clocks', where "
                             "sleeping between wake-ups is the schedule itself; pass 0")
        if participation != 1.0 and kind != "sampled":
            raise ValueError(f"participation={participation} is only read by the 'sampled' schedule, not "
                             f"{kind!r}; pass 1")
        self.kind = kind
        self.rng = rng
        self.n_total = n_total
        self.offline_probability = offline_probability
        self.participation = participation
        self.device = torch.device(device)
        self.previous_partner = np.arange(n_total)  # nobody was paired before round 0
        self._graph_cache: tuple[torch.Tensor, np.ndarray, list[list[int]]] | None = None

    @property
    def everyone_always(self) -> bool:
        """Whether every agent is active in every round (the plan is then trivial)."""
        return self.kind == "synchronous" and self.offline_probability == 0.0

    def _generator(self, round_index: int) -> np.random.Generator:
        # Public choices: keyed by the seed alone, also in secure mode (they protect nothing).
        return np.random.default_rng(round_stream_seed(self.rng.seed, round_index, Stream.SCHEDULE))

    def plan(self, round_index: int, network: Network) -> RoundPlan:
        """The plan of ``round_index`` (rounds must be planned in order: pairing remembers the last one)."""
        n = self.n_total
        draws = self._generator(round_index)
        online = draws.random(n) >= self.offline_probability
        partner = None
        if self.kind == "poisson-clocks":
            online = np.zeros(n, dtype=bool)
            online[draws.integers(n)] = True
        elif self.kind == "sampled":
            online &= draws.random(n) < self.participation
        elif self.kind == "pairing":
            partner = self._pair(online, draws, network)
            self.previous_partner = partner
        rows, _ = self._graph(network)
        return RoundPlan(self._to_device(online[rows]), self._to_device(online), online,
                         partner=None if partner is None else self._to_device(partner[rows]),
                         active_on_host=online[rows], partner_on_host=None if partner is None else partner[rows])

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """A host array on the engine's device, without waiting for the device's queue (the source is
        staged by CUDA before the call returns, so the array may change afterwards)."""
        return torch.from_numpy(values).to(self.device, non_blocking=True)

    def _graph(self, network: Network) -> tuple[np.ndarray, list[list[int]]]:
        """The network's global ids of its rows and every agent's neighbours, on the host, read once per
        graph (a round then reads nothing back from the device).  Keyed by the ``out_edges`` tensor, so
        that views of one graph made per round (a profiler's wrapper, a shard's global graph) share it."""
        if self._graph_cache is None or self._graph_cache[0] is not network.out_edges:
            neighbours: list[list[int]] = [[] for _ in range(self.n_total)]
            for src, dst in network.out_edges.tolist():
                neighbours[src].append(dst)
            self._graph_cache = (network.out_edges, network.agent_ids.cpu().numpy(), neighbours)
        return self._graph_cache[1], self._graph_cache[2]

    def _pair(self, online: np.ndarray, draws: np.random.Generator, network: Network) -> np.ndarray:
        """One greedy pass of TOP-DP's Algorithm 2 over the whole graph (the graph is public: a shard
        passes a view of the global graph here, so that every shard computes the same pairs)."""
        n = self.n_total
        _, neighbours = self._graph(network)
        partner = np.arange(n)
        for agent in draws.permutation(n):
            if not online[agent] or partner[agent] != agent:
                continue
            free = [other for other in neighbours[agent]
                    if online[other] and partner[other] == other and other != self.previous_partner[agent]]
            if free:
                other = free[int(draws.integers(len(free)))]
                partner[agent], partner[other] = other, agent
        return partner

    def state_dict(self) -> dict[str, Any]:
        return {"previous_partner": self.previous_partner.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_partner = np.asarray(state["previous_partner"], dtype=np.int64)
