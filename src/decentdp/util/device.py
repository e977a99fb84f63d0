"""The device a run computes on: ``engine.device`` resolved against the machine it runs on.

The config only checks the spelling (``auto``, ``cpu``, ``cuda`` or ``cuda:k``), so that a config
written for a GPU machine still validates elsewhere (``decentdp run --dry-run``); whether the device
exists is decided here, when a run is built, with one message naming ``engine.device``.
"""

from __future__ import annotations

import re

import torch

from decentdp.errors import ConfigError

#: The spellings ``engine.device`` accepts.
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


def resolve_device(spec: str) -> torch.device:
    """``auto``: the current CUDA device when CUDA is present, else the CPU; ``cpu``; ``cuda[:k]``.

    Raises :class:`ConfigError` (``engine.device``) for an unknown spelling, CUDA on a machine
    without it, or a device index out of range."""
    if not re.match(DEVICE_PATTERN, spec):
        raise ConfigError("engine.device", f"unknown device {spec!r}; use 'auto', 'cpu', 'cuda' or 'cuda:K'")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("engine.device", f"{spec!r} asks for CUDA, but torch sees no CUDA device on this "
                                           "machine (torch.cuda.is_available() is False); use 'cpu' or 'auto'")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if spec in ("auto", "cuda") else int(spec.split(":")[1])
    if index >= count:
        raise ConfigError("engine.device", f"{spec!r}: this machine has {count} CUDA device(s), "
                                           f"numbered 0..{count - 1}")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): for timings, never inside a round."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
