"""Shared fixtures: the workplace's real datasets (skipped where absent) and small configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the repository; tests needing it skip on a user's clone."""
    if not (SHARED_DATA / "mnist.npz").is_file():
        pytest.skip(f"real MNIST not found at {SHARED_DATA} (only present in the project's workplace)")
    return SHARED_DATA


def tiny_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A digits experiment small enough for unit tests, with per-section overrides."""
    raw: dict[str, Any] = {
        "experiment": {"name": "tiny", "seed": 0, "rounds": 4, "eval_every": 2},
        "data": {"dataset": "digits", "partition": "iid"},
        "topology": {"graph": "ring", "agents": 4},
        "model": {"name": "linear"},
        "algorithm": {"name": "dp-dsgt", "lr": 0.1, "batch_size": 16},
        "privacy": {"epsilon": 5.0, "delta": 1e-5, "clip": 1.0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw
