"""Per-agent random streams that make runs reproducible, resumable and independent of sharding.

Every random draw an agent makes is keyed by ``(run seed, agent id, round, purpose)``: a fresh
``torch.Generator`` is seeded from a hash of that key.  Consequences:

* a run is bit-for-bit reproducible on CPU for a given seed;
* resuming from a checkpoint needs no generator state: round ``k`` draws the same numbers whether
  or not the run was interrupted before it;
* agent ``i``'s draws do not depend on how many agents share its process, so a multi-machine
  engine holding a shard of agents reproduces the simulator exactly.
"""

from __future__ import annotations

import hashlib
from enum import IntEnum

import torch


class Stream(IntEnum):
    """What a draw is for; distinct purposes never share random numbers."""

    SAMPLING = 1
    NOISE = 2


def stream_seed(seed: int, agent: int, round_index: int, stream: Stream, step: int = 0, secret: bytes = b"") -> int:
    """A 63-bit seed derived from the key (and an optional secret) by SHA-256."""
    key = f"{seed}/{agent}/{round_index}/{int(stream)}/{step}".encode()
    return int.from_bytes(hashlib.sha256(secret + key).digest()[:8], "little") >> 1


class AgentRandom:
    """Factory of per-agent generators for one run; holds only its key, so it has no state.

    Privacy note: noise that anyone can recompute protects nothing.  With only the public run seed
    (the default) the simulator reproduces the mechanism's *distribution* exactly, which is what a
    simulation needs; with ``secret`` (``privacy.secure_noise``) the streams are also keyed by 32
    bytes from the operating system's CSPRNG, kept only in the checkpoint (the agents' private
    state) and never in configs, metrics or summaries, as a deployment requires.  The generator
    behind each stream is torch's Mersenne Twister, which is not a cryptographic generator: a real
    deployment should draw its noise from a vetted source.
    """

    def __init__(self, seed: int, secret: bytes = b"") -> None:
        self.seed = int(seed)
        self.secret = secret

    def generator(self, agent: int, round_index: int, stream: Stream, step: int = 0) -> torch.Generator:
        """The generator agent ``agent`` uses for ``stream`` in round ``round_index`` (sub-step ``step``)."""
        generator = torch.Generator()
        generator.manual_seed(stream_seed(self.seed, agent, round_index, stream, step, self.secret))
        return generator

    def normal(self, agents: list[int], dim: int, round_index: int, stream: Stream, step: int = 0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal draws of shape ``(len(agents), dim)``, row ``r`` from agent ``agents[r]``'s stream."""
        out = torch.empty(len(agents), dim, dtype=dtype)
        for row, agent in enumerate(agents):
            out[row].normal_(generator=self.generator(agent, round_index, stream, step))
        return out

    def uniform(self, agent: int, size: int, round_index: int, stream: Stream, step: int = 0) -> torch.Tensor:
        """Uniform draws on [0, 1) of length ``size`` from one agent's stream."""
        return torch.rand(size, generator=self.generator(agent, round_index, stream, step))
