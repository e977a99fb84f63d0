"""Shared fixtures: the workplace's real datasets (skipped where absent), small configs and CIFAR batches."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import tomli_w

# Under pytest-xdist (`make test` runs one worker per core) each worker process gets one thread: the
# workers already fill the cores, and a run's thread choice (decentdp.util.threads) follows this
# variable. Set before torch is imported, so torch's own pool starts at one thread too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

from decentdp.config import validate_config  # noqa: E402

#: Real datasets for the tests that need them: ``$DECENTDP_DATA_DIR`` if set (a user's own copy of
#: MNIST and the rest), else ``../shared/data`` beside the repository (the project's workplace).
SHARED_DATA = Path(os.environ.get("DECENTDP_DATA_DIR")
                   or Path(__file__).resolve().parents[1].parent / "shared" / "data")


@pytest.fixture
def shared_data() -> Path:
    """The real datasets' directory; tests needing it skip, saying where they looked, when it is absent."""
    if not (SHARED_DATA / "mnist.npz").is_file() and not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"real MNIST not found in {SHARED_DATA}: set DECENTDP_DATA_DIR to a directory holding "
                    "mnist.npz (or the IDX files) to run these tests")
    return SHARED_DATA


#: The devices engine, oracle and algorithm tests run on: the CPU always, CUDA where torch sees it.
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device here: the CUDA path is tested where torch "
                                                     "sees one (CI is CPU-only)"))]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device a test runs on (a test taking it runs once per device; the CPU run is the plain test)."""
    return torch.device(request.param)


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



def fake_run(folder: Path, accuracy: float, *, seed: int = 0, epsilon: float = 5.0, spent: float | None = 4.2,
             finished: bool = True, curve: tuple[float, ...] = (0.1, 0.5), **sections: dict[str, Any]) -> Path:
    """A results folder as `decentdp run` writes it (resolved config, summary, metrics), without training."""
    raw = tiny_config(**sections)
    raw["experiment"]["seed"] = seed
    raw["privacy"]["epsilon"] = epsilon
    config = validate_config(raw).to_toml_dict()
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(tomli_w.dumps(config))
    summary = {"name": config["experiment"]["name"], "finished": finished, "rounds": 4, "accuracy_mean": accuracy,
               "accuracy_min": accuracy - 0.01, "epsilon_max": spent, "epsilon_target": epsilon if
               math.isfinite(epsilon) else None, "epsilon_accountant": "pld", "delta": 1e-5, "wall_seconds": 1.0,
               "config": config}
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"round": 2 * k, "accuracy_mean": value} for k, value in enumerate((*curve, accuracy))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def load_script(path: Path, name: str) -> ModuleType:
    """An experiment script (``experiments/*.py``, not a package module) imported by its path as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (a dataclass in it looks its module up there)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group marks into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``), run the Ray tests in one worker, one after another:
    each starts a local Ray cluster, and two at once would compete for the same cores and ports.

    They go first, then the other ``slow`` tests (a stable sort: the rest keep their order), so that the
    longest unit of work, the Ray group (about six minutes of one worker), does not start late and leave the
    other workers idle at the end; the scheduler hands out work in collection order."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
    items.sort(key=lambda item: (not item.get_closest_marker("ray"), not item.get_closest_marker("slow")))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` (``pyproject.toml``'s default), fail a Ray test that pytest-xdist did not put in
    the Ray group, rather than let two clusters run at once (another ``--dist`` mode is the caller's choice):
    xdist groups by a suffix it writes into each node id, which pytest 9.2 no longer lets it write
    (pytest-dev/pytest-xdist#1386; ``pyproject.toml`` keeps pytest below 9.2).  A worker's own ``dist`` option
    reads "no"; xdist tells it of loadgroup through ``option.loadgroup``."""
    if ("PYTEST_XDIST_WORKER" in os.environ and getattr(item.config.option, "loadgroup", False)
            and item.get_closest_marker("ray") and not item.nodeid.endswith("@ray")):
        pytest.fail("pytest-xdist did not group the Ray tests on one worker (no '@ray' suffix in the node id): this "
                    "pytest breaks --dist loadgroup; install the test extra's pytest (< 9.2)", pytrace=False)


def cifar_batch(n: int, rng: np.random.Generator, label_key: bytes, n_classes: int) -> dict[bytes, object]:
    """A batch dict as in the official python pickles: bytes keys, uint8 (n, 3072) data, list labels."""
    batch: dict[bytes, object] = {
        b"batch_label": b"testing batch",
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        label_key: rng.integers(0, n_classes, size=n).tolist(),
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }
    if label_key == b"fine_labels":
        batch[b"coarse_labels"] = rng.integers(0, 20, size=n).tolist()
    return batch
