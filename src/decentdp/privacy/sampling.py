"""Agents' local datasets and Poisson subsampling of their batches.

Poisson sampling (each record joins the batch independently with probability ``q``) is what the
privacy amplification of the sampled Gaussian mechanism assumes, so batch sizes vary from round to
round.  Agents' batches are padded to the largest one of the round and carry a 0/1 mask, so that
all agents are processed by one batched kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentdp.rng import AgentRandom, Stream


@dataclass(frozen=True)
class AgentData:
    """A shared training set and the indices each agent owns (no per-agent copies of the data)."""

    x: torch.Tensor
    y: torch.Tensor
    indices: tuple[torch.Tensor, ...]

    @property
    def n_agents(self) -> int:
        return len(self.indices)

    @property
    def sizes(self) -> torch.Tensor:
        return torch.tensor([len(idx) for idx in self.indices], dtype=torch.float64)


@dataclass(frozen=True)
class Batch:
    """Padded per-agent batches: ``x`` is ``(N, B, ...)``, ``y`` and ``mask`` are ``(N, B)``."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor

    @property
    def sizes(self) -> torch.Tensor:
        return self.mask.sum(dim=1)


class PoissonSampler:
    """Draws each agent's batch by independent Bernoulli(q_i) selection of its records.

    The agents' index lists are laid end to end once, as *slots* ``0..S-1`` (agent ``i`` owns
    slots ``offsets[i]..offsets[i+1]-1``, in the order of ``data.indices[i]``).  Every round draws
    one float64 uniform per slot from the round-wide stream ``(seed, round, SAMPLING, step)`` and
    keeps a slot when its draw is below its owner's rate, so a round costs a few vector operations
    whatever the number of agents.  Comparing in float64 makes the inclusion probability ``q_i``
    to within ``2**-53``: the rate the accountant is told is the rate that ran.

    Independence of sharding: agent ``i``'s batch depends only on the run's key, the round, the
    step and the *global* slot layout (every agent's dataset size, which all processes know), not on
    which agents a process holds.  A shard draws the whole length-``S`` vector (``S`` uniforms
    is cheap next to one gradient) and keeps the slices of its own agents; it then selects exactly
    the records the simulator selects.
    """

    def __init__(self, data: AgentData, sample_rates: torch.Tensor, rng: AgentRandom) -> None:
        if len(sample_rates) != data.n_agents:
            raise ValueError(f"{len(sample_rates)} sample rates for {data.n_agents} agents")
        if data.n_agents < 1:
            raise ValueError("a sampler needs at least one agent")
        lengths = torch.tensor([len(idx) for idx in data.indices], dtype=torch.long)
        if int(lengths.min()) < 1:
            empty = int(torch.nonzero(lengths == 0)[0, 0])
            raise ValueError(f"agent {empty} owns no records; every agent needs at least one to sample from")
        self.data = data
        self.sample_rates = sample_rates
        self.rng = rng
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])  # (N + 1,)
        self.records = torch.cat([idx.long() for idx in data.indices])  # (S,) record of each slot
        self.owners = torch.repeat_interleave(torch.arange(data.n_agents), lengths)  # (S,) agent of each slot
        self._first = self.records[self.offsets[:-1]]  # each agent's padding record: its first one

    @property
    def n_slots(self) -> int:
        """Total number of owned records ``S`` (the length of a round's uniform draw)."""
        return len(self.records)

    def draws(self, round_index: int, step: int = 0) -> torch.Tensor:
        """The round's ``(S,)`` float64 uniforms, one per slot; agent ``i`` uses ``offsets[i]:offsets[i+1]``."""
        generator = self.rng.round_generator(round_index, Stream.SAMPLING, step)
        return torch.rand(self.n_slots, generator=generator, dtype=torch.float64, device=generator.device)

    def sample(self, round_index: int, step: int = 0) -> Batch:
        """The batches of round ``round_index`` (sub-step ``step`` for algorithms with several per round).

        Row ``i`` holds agent ``i``'s selected records in the order of ``data.indices[i]``, then
        padding that reads the agent's first record with mask 0; the width is the largest batch of
        the round, at least 1.
        """
        n_agents = self.data.n_agents
        rates = self.sample_rates.to(torch.float64)
        chosen = torch.nonzero(self.draws(round_index, step) < rates[self.owners]).squeeze(1)  # ascending slots
        owner = self.owners[chosen]
        counts = torch.bincount(owner, minlength=n_agents)
        width = max(1, int(counts.max()))
        starts = torch.cumsum(counts, 0) - counts  # where each agent's selections begin in `chosen`
        # the rank of each selection within its agent
        position = torch.arange(len(chosen), device=chosen.device) - starts[owner]
        index = self._first[:, None].repeat(1, width)  # padding reads one of the agent's own records
        index[owner, position] = self.records[chosen]
        mask = torch.zeros(n_agents, width, device=index.device)
        mask[owner, position] = 1.0
        flat = index.reshape(-1)
        x = self.data.x.index_select(0, flat).reshape(n_agents, width, *self.data.x.shape[1:])
        y = self.data.y.index_select(0, flat).reshape(n_agents, width, *self.data.y.shape[1:])
        return Batch(x, y, mask)
