"""Agents' local datasets and Poisson subsampling of their batches.

Poisson sampling (each record joins the batch independently with probability ``q``) is what the
privacy amplification of the sampled Gaussian mechanism assumes, so batch sizes vary from round to
round.  Agents' batches are padded to the largest one of the round and carry a 0/1 mask, so that
all agents are processed by one batched kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentdp.engine.rng import AgentRandom, Stream


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
    """Draws each agent's batch by independent Bernoulli(q_i) selection of its records."""

    def __init__(self, data: AgentData, sample_rates: torch.Tensor, rng: AgentRandom) -> None:
        self.data = data
        self.sample_rates = sample_rates
        self.rng = rng

    def sample(self, round_index: int, step: int = 0) -> Batch:
        """The batches of round ``round_index`` (sub-step ``step`` for algorithms with several per round)."""
        chosen = []
        for agent, owned in enumerate(self.data.indices):
            draws = self.rng.uniform(agent, len(owned), round_index, Stream.SAMPLING, step)
            chosen.append(owned[draws < float(self.sample_rates[agent])])
        width = max(1, max(len(c) for c in chosen))
        index = torch.zeros(len(chosen), width, dtype=torch.long)
        mask = torch.zeros(len(chosen), width)
        for row, selected in enumerate(chosen):
            index[row] = self.data.indices[row][0]  # padding reads one of the agent's own records
            index[row, : len(selected)] = selected
            mask[row, : len(selected)] = 1.0
        return Batch(self.data.x[index], self.data.y[index], mask)
