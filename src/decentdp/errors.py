"""Errors a user can cause, each carrying a readable message that names the offending field.

The CLI catches :class:`DecentDPError` and prints its message without a traceback; anything else
is a bug in decentdp and is allowed to surface with a traceback.
"""

from __future__ import annotations

from pathlib import Path


class DecentDPError(Exception):
    """Base class of every error caused by user input (configs, data, graphs, budgets)."""


class ConfigError(DecentDPError):
    """An invalid configuration value; ``field`` is its dotted path, e.g. ``privacy.epsilon``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class ResultsFolderError(ConfigError):
    """A results folder that cannot be written, or whose files cannot be read back: a full disk, a file size limit,
    a checkpoint truncated by a crash, a folder left there by another run.  The input is fine; the folder, or the
    machine it is on, is not, and the same input runs once that is mended.  A :class:`ConfigError` (its message
    names ``--out`` or ``--resume`` as before), told apart by a sweep, which queues such a trial again instead of
    failing it for good (:mod:`decentdp.tuning.sweep`).

    ``damaged`` is the file that cannot be read back (a checkpoint, ``setup.json``), where that is what happened:
    the run cannot continue from that folder, and starting it again in an empty one is the way on."""

    def __init__(self, field: str, message: str, damaged: Path | None = None) -> None:
        super().__init__(field, message)
        self.damaged = damaged


class DataError(DecentDPError):
    """A dataset that cannot be found or read (missing files, wrong format)."""


class GraphError(DecentDPError):
    """A communication graph or mixing matrix that violates what the algorithms assume.

    ``field``, when not empty, is the config field to change, e.g. ``topology.p`` when no connected
    Erdos-Renyi graph was drawn; the message then starts with it, as a :class:`ConfigError`'s does.
    """

    def __init__(self, message: str, field: str = "") -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class PrivacyError(DecentDPError):
    """An infeasible privacy request (e.g. a target epsilon no noise level can reach)."""
