"""Errors a user can cause, each carrying a readable message that names the offending field.

The CLI catches :class:`DecentDPError` and prints its message without a traceback; anything else
is a bug in decentdp and is allowed to surface with a traceback.
"""

from __future__ import annotations


class DecentDPError(Exception):
    """Base class of every error caused by user input (configs, data, graphs, budgets)."""


class ConfigError(DecentDPError):
    """An invalid configuration value; ``field`` is its dotted path, e.g. ``privacy.epsilon``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


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
