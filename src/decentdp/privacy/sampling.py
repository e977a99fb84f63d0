"""Agents' local datasets, Poisson subsampling of their batches, and cyclic participation.

Poisson sampling (each record joins the batch independently with probability ``q``) is what the
privacy amplification of the sampled Gaussian mechanism assumes, so batch sizes vary from round to
round.  Agents' batches are padded to the largest one of the round and carry a 0/1 mask, so that
all agents are processed by one batched kernel.

On a GPU the padding width is the one value a round must bring back to the host (it is a tensor
shape).  The sampler reads it without stalling the device: each selection is made one batch ahead
and its per-agent counts are copied back asynchronously, so that when the batch is asked for, its
counts have long arrived.  The batches are the same, bit for bit, as when drawn on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from decentdp.rng import AgentRandom, below_on_grid, record_hash


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
        """``(N,)`` float64 record counts, on the host (known before any round)."""
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


@dataclass(frozen=True)
class _Selection:
    """One batch's Bernoulli selection over the slots, before it is gathered into a padded batch.

    ``starts[i]`` is the number of slots selected before agent ``i``'s first one; ``counts`` are the
    agents' batch sizes, on the host once ``ready`` (a CUDA event, or None) has passed."""

    keep: torch.Tensor    # (S,) bool, device
    starts: torch.Tensor  # (N,) int64, device
    counts: torch.Tensor  # (N,) int64, host
    ready: torch.cuda.Event | None

    def sizes(self) -> tuple[int, int]:
        """The largest batch (at least 1) and the total, waiting only for this selection's copy to arrive."""
        if self.ready is not None:
            self.ready.synchronize()
        return max(1, int(self.counts.max())), int(self.counts.sum())


class PoissonSampler:
    """Draws each agent's batch by independent Bernoulli(q_i) selection of its records.

    The agents' index lists are laid end to end once, as *slots* ``0..S-1`` (agent ``i`` owns
    slots ``offsets[i]..offsets[i+1]-1``, in the order of ``data.indices[i]``).  Every round draws
    one float64 uniform per slot (:meth:`~decentdp.rng.AgentRandom.record_uniforms`: in simulation
    mode from the round-wide stream ``(seed, round, SAMPLING, step)``, in secure mode each agent's
    slice from its own secret key) and keeps a slot when its draw is below its owner's rate, so a
    round costs a few vector operations whatever the number of agents.  The draw is compared with the rate
    rounded down onto the uniforms' ``2^-53`` grid (:func:`~decentdp.rng.below_on_grid`), so a record's inclusion
    probability is at most ``q_i``, the rate the accountant is told (compared with ``q_i`` itself it could be
    up to ``2^-53`` above).

    Independence of sharding: agent ``i``'s batch depends only on the run's key, the round, the
    step and the *global* slot layout (every agent's dataset size, which all processes know), not on
    which agents a process holds.  A shard draws the whole length-``S`` vector (``S`` uniforms
    is cheap next to one gradient) and keeps the slices of its own agents; it then selects exactly
    the records the simulator selects.

    ``lookahead`` (default: on CUDA) makes each batch's selection when the previous one is sampled,
    so that its width is read without a device synchronisation (see the module's docstring).
    ``sample_rates`` stay on the host; the sampler keeps its own copy on the data's device.
    """

    def __init__(self, data: AgentData, sample_rates: torch.Tensor, rng: AgentRandom,
                 lookahead: bool | None = None) -> None:
        if len(sample_rates) != data.n_agents:
            raise ValueError(f"{len(sample_rates)} sample rates for {data.n_agents} agents")
        if data.n_agents < 1:
            raise ValueError("a sampler needs at least one agent")
        lengths = torch.tensor([len(idx) for idx in data.indices], dtype=torch.long)
        self.lengths = lengths.tolist()
        if int(lengths.min()) < 1:
            empty = int(torch.nonzero(lengths == 0)[0, 0])
            raise ValueError(f"agent {empty} owns no records; every agent needs at least one to sample from")
        device = data.x.device
        self.data = data
        self.sample_rates = sample_rates
        self.rng = rng
        self.device = device
        self.lookahead = device.type == "cuda" if lookahead is None else lookahead
        owners = torch.repeat_interleave(torch.arange(data.n_agents), lengths)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).to(device)  # (N+1,)
        self.records = torch.cat([idx.long().to(device) for idx in data.indices])  # (S,) record of each slot
        self.owners = owners.to(device)  # (S,) agent of each slot
        thresholds = torch.from_numpy(below_on_grid(sample_rates.double().cpu().numpy()))
        self._slot_rates = thresholds[owners].to(device)  # (S,) each slot owner's rate, on the uniforms' grid
        self._first = self.records[self.offsets[:-1]]  # each agent's padding record: its first one
        self._ahead: dict[tuple[int, int], _Selection] = {}  # the next batch's selection (lookahead)
        self._steps = 1  # batches per round seen so far: which batch comes next

    @property
    def expected_batches(self) -> torch.Tensor:
        """``(N,)`` float32 ``L_i = q_i |D_i|``, on the host: what a release is divided by."""
        return (self.sample_rates.double() * self.data.sizes).float()

    @property
    def n_slots(self) -> int:
        """Total number of owned records ``S`` (the length of a round's uniform draw)."""
        return len(self.records)

    def draws(self, round_index: int, step: int = 0) -> torch.Tensor:
        """The round's ``(S,)`` float64 uniforms, one per slot; agent ``i`` uses ``offsets[i]:offsets[i+1]``."""
        return self.rng.record_uniforms(round_index, step, self.lengths)

    def _select(self, round_index: int, step: int) -> _Selection:
        """Slot ``s`` is kept when its uniform is below its owner's rate; counts by a prefix sum (fixed
        shapes: nothing here waits for the device; on CUDA the counts come back asynchronously)."""
        keep = self.draws(round_index, step) < self._slot_rates
        taken = torch.cumsum(keep, 0)  # selected slots up to and including each slot
        before = torch.cat([taken.new_zeros(1), taken])[self.offsets]  # (N + 1,) selected before each agent
        counts = before[1:] - before[:-1]
        if not self.lookahead or self.device.type != "cuda":
            return _Selection(keep, before[:-1], counts.cpu(), None)
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Selection(keep, before[:-1], host, ready)

    def sample(self, round_index: int, step: int = 0) -> Batch:
        """The batches of round ``round_index`` (sub-step ``step`` for algorithms with several per round).

        Row ``i`` holds agent ``i``'s selected records in the order of ``data.indices[i]``, then
        padding that reads the agent's first record with mask 0; the width is the largest batch of
        the round, at least 1.
        """
        n_agents = self.data.n_agents
        selection = self._ahead.pop((round_index, step), None) or self._select(round_index, step)
        if self.lookahead:  # the batch asked for next: this round's next one, or the next round's first
            self._steps = max(self._steps, step + 1)
            following = (round_index, step + 1) if step + 1 < self._steps else (round_index + 1, 0)
            self._ahead = {following: self._select(*following)}
        width, total = selection.sizes()  # host values: the shapes below need no device read
        chosen = torch.nonzero_static(selection.keep, size=total).squeeze(1)  # ascending slots
        owner = self.owners[chosen]
        position = torch.arange(total, device=chosen.device) - selection.starts[owner]  # rank within its agent
        index = self._first[:, None].repeat(1, width)  # padding reads one of the agent's own records
        index[owner, position] = self.records[chosen]
        mask = torch.zeros(n_agents, width, device=index.device)
        mask[owner, position] = 1.0
        flat = index.reshape(-1)
        x = self.data.x.index_select(0, flat).reshape(n_agents, width, *self.data.x.shape[1:])
        y = self.data.y.index_select(0, flat).reshape(n_agents, width, *self.data.y.shape[1:])
        return Batch(x, y, mask)


def cyclic_batches(records: np.ndarray, period: int, seed: int) -> np.ndarray:
    """The batch (``0 .. period-1``) of each record, from a keyed hash of the record's index in the training set
    and ``seed`` alone (:func:`~decentdp.rng.record_hash`): a record's batch does not depend on which other
    records exist, so adding, removing or replacing one record changes only the batch it is (or was) in."""
    return (record_hash(records, seed) % np.uint64(period)).astype(np.int64)


class CyclicSampler:
    """Cyclic participation (``data.sampling = 'cyclic'``): each agent's records are split once into ``period``
    (``b``) fixed batches, and round ``t`` uses batch ``t mod b`` of every agent (the authors' ``data_utils.py:
    8-45`` of MAFALDA-SGD; Choquette-Choo et al.'s b-min-sep participation).

    Each record's batch comes from a keyed hash of its index (:func:`cyclic_batches`), so a record's presence
    moves no other record: one record takes part in the rounds ``t = c mod b`` of its batch ``c`` and in no
    other, under add/remove and replace-one alike.  Batch sizes vary (about ``|D_i| / b`` each), as Poisson
    batches do; a release is divided by the expected batch ``|D_i| / b``.  No amplification is claimed: every
    release is an unsampled mechanism (``sample_rates`` are 1), and a record's ``ceil(T / b)`` releases at most
    are composed (the oracle charges each agent once per pass over its batches: :class:`~decentdp.privacy.
    oracle.DataOracle`).  ``record_ids`` (default ``data.indices``) are the records' indices in the training set
    (a shard's local copy keeps them)."""

    def __init__(self, data: AgentData, period: int, seed: int,
                 record_ids: tuple[torch.Tensor, ...] | None = None) -> None:
        if period < 1:
            raise ValueError(f"cyclic sampling needs at least one batch, got {period}")
        ids = data.indices if record_ids is None else record_ids
        empty = [agent for agent, owned in enumerate(data.indices) if len(owned) == 0]
        if empty:
            raise ValueError(f"agent {empty[0]} owns no records; every agent needs at least one to sample from")
        self.data = data
        self.period = int(period)
        self.seed = int(seed)
        self.record_ids = ids
        self.device = data.x.device
        self.sample_rates = torch.ones(data.n_agents, dtype=torch.float64)
        self.rng: Any = None  # no randomness of its own (set by a shard's resume like the Poisson sampler's)
        classes = [cyclic_batches(identity.cpu().numpy(), self.period, self.seed) for identity in ids]
        #: (N, b) records of each agent in each batch.
        self.batch_sizes = np.array([np.bincount(c, minlength=self.period) for c in classes], dtype=np.int64
                                    ).reshape(data.n_agents, self.period)
        self._index: list[torch.Tensor] = []
        self._mask: list[torch.Tensor] = []
        for batch in range(self.period):
            width = max(1, int(self.batch_sizes[:, batch].max()))
            index = torch.empty(data.n_agents, width, dtype=torch.long)
            mask = torch.zeros(data.n_agents, width)
            for agent, (owned, c) in enumerate(zip(data.indices, classes, strict=True)):
                chosen = owned.cpu().long()[torch.from_numpy(np.flatnonzero(c == batch))]
                index[agent] = owned[0].cpu().long()  # padding reads one of the agent's own records, masked
                index[agent, :len(chosen)] = chosen
                mask[agent, :len(chosen)] = 1.0
            self._index.append(index.to(self.device))
            self._mask.append(mask.to(self.device))

    @property
    def expected_batches(self) -> torch.Tensor:
        """``(N,)`` float32 ``L_i = |D_i| / b``, on the host: what a release is divided by."""
        return (self.data.sizes / self.period).float()

    def sample(self, round_index: int, step: int = 0) -> Batch:
        """Batch ``round_index mod b`` of every agent (the same for every step of a round)."""
        batch = round_index % self.period
        index, mask = self._index[batch], self._mask[batch]
        n_agents, width = index.shape
        flat = index.reshape(-1)
        x = self.data.x.index_select(0, flat).reshape(n_agents, width, *self.data.x.shape[1:])
        y = self.data.y.index_select(0, flat).reshape(n_agents, width, *self.data.y.shape[1:])
        return Batch(x, y, mask)

    def shard(self, lo: int, hi: int) -> CyclicSampler:
        """The sampler of agents ``lo .. hi-1`` over a copy of their records only (a process of a sharded run):
        the same batches, since a record's batch depends on its index in the training set alone."""
        owned = self.data.indices[lo:hi]
        records = torch.cat([index.long() for index in owned])
        starts = np.cumsum([0, *[len(index) for index in owned]])
        local = tuple(torch.arange(start, stop, device=records.device)
                      for start, stop in zip(starts[:-1], starts[1:], strict=True))
        data = AgentData(self.data.x[records], self.data.y[records], local)
        return CyclicSampler(data, self.period, self.seed, self.record_ids[lo:hi])
