"""Peak-memory planning: before a run starts, estimate what it needs and fit it to the machine.

A round of the simulator holds, at its peak,

* the algorithm's state: ``(N, d)`` parameters, optimizer state, trackers, duals;
* per-round ``(N, d)`` temporaries: the clipped-gradient sums (the noise is added in place), the
  mixing output and whatever else the algorithm's update creates (DSGT's tracker update, an
  optimizer's result): ``Algorithm.round_temporaries`` of them, and the round's padded batch;
* the activations of one batch of the agents whose gradients are being computed: what autograd
  saves in the forward pass plus the output gradients of the backward pass, for a padded Poisson
  batch of each agent.

Only the last term can shrink without changing the algorithm: gradients are computed for at most
``agents_per_pass`` agents at a time.  :func:`plan_memory` picks the largest such group that fits
the limit (by default the memory the operating system reports as available) and refuses, naming
the setting to change, when not even the state and one agent fit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from scipy import stats

from decentdp.errors import ConfigError

_GIB = 2**30
#: :func:`padded_batch` pads to a width that an agent's Poisson batch exceeds with at most this probability.
BATCH_TAIL = 1e-9


def format_bytes(size: float) -> str:
    """``size`` in the largest binary unit that keeps it at least 1 (B, KiB, MiB, GiB), so that small
    limits still show their numbers."""
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(size)} B"


def available_memory(device: torch.device | None = None) -> int | None:
    """Bytes a run on ``device`` can use now: a CUDA device's free memory (torch's unused cache
    included), else what the operating system can give this process (Linux ``MemAvailable``), if known."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def padded_batch(expected: float, records: int) -> int:
    """A Poisson batch width that the round's largest batch exceeds with negligible probability.

    An agent's batch is ``Binomial(|D_i|, q_i)`` with ``q_i = expected / |D_i|``; the width is that
    distribution's exact ``1 - 1e-9`` quantile (:data:`BATCH_TAIL`), so that the batch exceeds it with
    probability at most 1e-9 per agent and round.  (``mean + 6 sd + 1``, the normal approximation, is
    exceeded with probability up to 1.1e-6, at expected batches near 1, and above 1e-9 for any expected
    batch below a few thousand.)  A rare larger batch only costs that round a little more memory.
    """
    if records <= 0:
        return 0
    return _binomial_quantile(records, min(1.0, max(0.0, expected / records)))


@functools.lru_cache(maxsize=4096)
def _binomial_quantile(records: int, rate: float) -> int:
    """The smallest ``w`` with ``P(Binomial(records, rate) > w) <= BATCH_TAIL`` (cached: agents of one split
    mostly share their sizes and rates, and scipy takes about 0.4 ms a call)."""
    return int(stats.binom.isf(BATCH_TAIL, records, rate))


@dataclass(frozen=True)
class MemoryPlan:
    """The estimated peak of a run and how many agents' gradients are computed at once."""

    n_agents: int
    state_bytes: int
    round_bytes: int
    activation_bytes_per_sample: int
    batch_width: int
    agents_per_pass: int
    limit_bytes: int | None

    @property
    def activation_bytes_per_agent(self) -> int:
        """Activations of one agent's padded batch."""
        return self.activation_bytes_per_sample * self.batch_width

    @property
    def peak_bytes(self) -> int:
        """Estimated peak: state and round temporaries plus one pass's activations."""
        return self.state_bytes + self.round_bytes + self.agents_per_pass * self.activation_bytes_per_agent

    def as_dict(self) -> dict[str, int | None]:
        """The plan's figures, for ``setup.json``."""
        return {"peak_bytes": self.peak_bytes, "state_bytes": self.state_bytes, "round_bytes": self.round_bytes,
                "activation_bytes_per_sample": self.activation_bytes_per_sample, "batch_width": self.batch_width,
                "agents_per_pass": self.agents_per_pass, "limit_bytes": self.limit_bytes}

    def describe(self) -> str:
        """One line for the run log."""
        limit = format_bytes(self.limit_bytes) if self.limit_bytes is not None else "an unknown amount"
        passes = math.ceil(self.n_agents / self.agents_per_pass)
        return (f"memory: estimated peak {format_bytes(self.peak_bytes)} (state {format_bytes(self.state_bytes)}, "
                f"round temporaries {format_bytes(self.round_bytes)}, activations "
                f"{format_bytes(self.agents_per_pass * self.activation_bytes_per_agent)}) of {limit} available; "
                f"gradients of {self.agents_per_pass} agent(s) per pass, {passes} pass(es) per release")


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes held by an algorithm state (works on ``meta`` tensors, which allocate nothing)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def plan_memory(n_agents: int, dim: int, state: int, batch_bytes: int, activation_bytes_per_sample: int,
                batch_width: int, limit_bytes: int | None, agents_per_pass: int | None = None,
                temporaries: int = 3) -> MemoryPlan:
    """Choose how many agents' gradients to compute at once so that the run fits ``limit_bytes``.

    ``state`` is the algorithm state's size, ``batch_bytes`` that of all agents' padded batches
    (inputs, labels, masks), ``batch_width`` the padded batch, ``temporaries`` the number of
    ``(N, d)`` matrices a round allocates besides the state.  ``agents_per_pass`` forces the
    group size (it is still checked against the limit).  Raises :class:`ConfigError` when the run
    cannot fit: the state and temporaries alone exceed the limit (too many agents or parameters),
    or not even one agent's batch fits beside them.
    """
    round_bytes = temporaries * n_agents * dim * 4 + batch_bytes
    fixed = state + round_bytes
    per_agent = activation_bytes_per_sample * batch_width
    if limit_bytes is not None and fixed > limit_bytes:
        raise ConfigError(
            "topology.agents",
            f"{n_agents} agents x {dim} parameters need about {format_bytes(fixed)} for the algorithm's state, "
            f"one round's temporaries and batches, more than the {format_bytes(limit_bytes)} available "
            "(engine.memory_limit_gb); use fewer agents or a smaller model")
    fitting = n_agents if limit_bytes is None else min(n_agents, (limit_bytes - fixed) // max(1, per_agent))
    if agents_per_pass is not None:
        if agents_per_pass > fitting and limit_bytes is not None:
            raise ConfigError(
                "engine.agents_per_pass",
                f"{agents_per_pass} agents per pass need about {format_bytes(fixed + agents_per_pass * per_agent)}, "
                f"more than the {format_bytes(limit_bytes)} available; at most {fitting} fit")
        fitting = agents_per_pass
    if fitting < 1:
        raise ConfigError(
            "algorithm.batch_size",
            f"one agent's batch of up to {batch_width} samples needs about {format_bytes(per_agent)} of "
            f"activations beside {format_bytes(fixed)} of state, more than the "
            f"{format_bytes(limit_bytes or 0)} available; use a smaller batch or model")
    return MemoryPlan(n_agents, state, round_bytes, activation_bytes_per_sample, batch_width,
                      int(min(fitting, n_agents)), limit_bytes)
