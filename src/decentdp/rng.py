"""Keyed random streams that make runs reproducible, resumable and independent of sharding.

Every random draw is keyed by ``(run seed, agent id, round, purpose, step)``: a ``torch.Generator``
is seeded from a SHA-256 hash of that key (and of the run's secret, if any).  Consequences:

* a run is bit-for-bit reproducible on CPU for a given seed;
* resuming from a checkpoint needs no generator state: round ``k`` draws the same numbers whether
  or not the run was interrupted before it;
* agent ``i``'s draws do not depend on how many agents share its process, so a multi-machine
  engine holding a shard of agents reproduces the simulator exactly.

Two kinds of stream exist.  *Per-agent* streams (:meth:`AgentRandom.generator`,
:meth:`AgentRandom.normal`) are what an agent draws for itself, e.g. its privacy noise: a shard
needs only its own agents' keys.  A *round-wide* stream (:meth:`AgentRandom.round_generator`) is
one generator for a whole round and purpose, used where one vectorised draw over every agent is
much cheaper than one generator per agent (Poisson sampling).  A round-wide stream stays
independent of sharding as long as every shard draws the *whole* vector and keeps its agents'
slices (see :class:`~decentdp.privacy.sampling.PoissonSampler`); its key uses the agent placeholder
``*``, which no per-agent key (an integer agent id) can equal, so the two kinds never collide.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import IntEnum

import torch


class Stream(IntEnum):
    """What a draw is for; distinct purposes never share random numbers."""

    SAMPLING = 1
    NOISE = 2
    SCHEDULE = 3  #: public choices of the scheduler (who is online, who pairs with whom)
    PUBLIC = 4    #: public choices of an algorithm (e.g. a random neighbour)


#: The agent field of round-wide keys; per-agent keys hold a decimal integer there instead.
ROUND_WIDE = "*"


def _key_seed(seed: int, agent: int | str, round_index: int, stream: Stream, step: int, secret: bytes,
              slot: int | None = None) -> int:
    """The 63-bit seed of one key: the first 8 bytes of SHA-256(secret + key), shifted to 63 bits.

    ``slot`` (e.g. the receiver of a per-edge message) extends the key only when given, so keys
    without one are those of earlier versions and runs stay reproducible across versions."""
    key = f"{seed}/{agent}/{round_index}/{int(stream)}/{step}" + ("" if slot is None else f"/{slot}")
    return int.from_bytes(hashlib.sha256(secret + key.encode()).digest()[:8], "little") >> 1


def stream_seed(seed: int, agent: int, round_index: int, stream: Stream, step: int = 0, secret: bytes = b"",
                slot: int | None = None) -> int:
    """A 63-bit seed derived from the key (and an optional secret) by SHA-256."""
    return _key_seed(seed, int(agent), round_index, stream, step, secret, slot)


def round_stream_seed(seed: int, round_index: int, stream: Stream, step: int = 0, secret: bytes = b"") -> int:
    """The seed of the round-wide stream of ``(round, stream, step)``; never equal to a per-agent key."""
    return _key_seed(seed, ROUND_WIDE, round_index, stream, step, secret)


class AgentRandom:
    """Factory of keyed generators for one run; holds only its key, so it has no state.

    Privacy note: noise that anyone can recompute protects nothing.  With only the public run seed
    (the default) the simulator reproduces the mechanism's *distribution* exactly, which is what a
    simulation needs; with ``secret`` (``privacy.secure_noise``) the streams are also keyed by 32
    bytes from the operating system's CSPRNG, kept only in the checkpoint (the agents' private
    state) and never in configs, metrics or summaries, as a deployment requires.  The generator
    behind each stream is torch's Mersenne Twister, which is not a cryptographic generator: a real
    deployment should draw its noise from a vetted source.
    """

    def __init__(self, seed: int, secret: bytes = b"", device: torch.device | str = "cpu") -> None:
        self.seed = int(seed)
        self.secret = secret
        self.device = torch.device(device)

    def generator(self, agent: int, round_index: int, stream: Stream, step: int = 0) -> torch.Generator:
        """The generator agent ``agent`` uses for ``stream`` in round ``round_index`` (sub-step ``step``)."""
        generator = torch.Generator(self.device)
        generator.manual_seed(stream_seed(self.seed, agent, round_index, stream, step, self.secret))
        return generator

    def round_generator(self, round_index: int, stream: Stream, step: int = 0) -> torch.Generator:
        """The round-wide generator of ``stream`` in round ``round_index`` (sub-step ``step``), shared by all agents.

        Only for draws made as one vector over every agent of the run, of which each agent (or
        shard) uses a fixed slice; see the module docstring.
        """
        generator = torch.Generator(self.device)
        generator.manual_seed(round_stream_seed(self.seed, round_index, stream, step, self.secret))
        return generator

    def normal(self, agents: Sequence[int], dim: int, round_index: int, stream: Stream, step: int = 0,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
               workers: int = 1, slots: Sequence[int] | None = None, uniform: bool = False) -> torch.Tensor:
        """Standard normal draws of shape ``(len(agents), dim)``, row ``r`` from agent ``agents[r]``'s stream.

        Row ``r`` equals ``torch.empty(dim).normal_(generator=self.generator(agents[r], ...))``,
        so a shard holding any subset of agents draws the same rows.  One generator object is
        re-seeded for every row instead of creating one per agent (re-seeding resets all of its
        state, cached normal samples included), which removes most of the per-agent overhead.
        ``out``, if given, is a ``(len(agents), dim)`` tensor that receives the draws (and is
        returned), so that the caller can draw straight into a buffer; its dtype wins over ``dtype``.
        ``workers > 1`` fills contiguous groups of rows in that many threads (torch's sampling
        kernels release the GIL and are single-threaded); the draws are the same.  ``slots[r]``, if
        given, extends row ``r``'s key (per-edge noise: one stream per (sender, receiver)).
        ``uniform`` draws from U[0, 1) instead (the source of Laplace noise).
        """
        if out is None:
            out = torch.empty(len(agents), dim, dtype=dtype, device=self.device)
        elif out.shape != (len(agents), dim) or (dim > 1 and out.stride(1) != 1):
            # Rows must be contiguous: normal_ fills a strided row by another path, with other values.
            raise ValueError(f"out: expected shape {(len(agents), dim)} with contiguous rows, "
                             f"got shape {tuple(out.shape)} with strides {out.stride()}")
        keys = [None] * len(agents) if slots is None else list(slots)
        seeds = [stream_seed(self.seed, agent, round_index, stream, step, self.secret, slot)
                 for agent, slot in zip(agents, keys, strict=True)]

        def fill(rows: range) -> None:
            generator = torch.Generator(out.device)
            for row in rows:
                generator.manual_seed(seeds[row])
                if uniform:
                    out[row].uniform_(generator=generator)
                else:
                    out[row].normal_(generator=generator)

        groups = min(workers, len(seeds))
        if groups <= 1:
            fill(range(len(seeds)))
            return out
        bounds = [len(seeds) * k // groups for k in range(groups + 1)]
        with ThreadPoolExecutor(groups) as pool:
            list(pool.map(fill, [range(bounds[k], bounds[k + 1]) for k in range(groups)]))
        return out
