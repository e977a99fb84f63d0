"""Command-line options that several ``decentdp`` commands share, defined once so that they mean the same.

``--threads N`` is the shortcut for ``--set engine.threads=N`` of ``decentdp run``, ``audit`` and ``attack``:
it is appended after the ``--set`` overrides, so it wins over a ``--set`` of the same field.  This module
imports nothing heavy: the parser (and ``--help``) stays fast.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, or argparse's one-line usage error naming the option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (see the module docstring) to a command's parser."""
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="compute threads; shortcut for --set engine.threads=N (default: the cores this "
                             "process may use)")


def with_threads(overrides: list[str], threads: int | None) -> list[str]:
    """The ``--set`` overrides with ``--threads`` last (it wins), unchanged without ``--threads``."""
    return [*overrides, f"engine.threads={threads}"] if threads is not None else list(overrides)
