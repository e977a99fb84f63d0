"""Restructuring changes no result: the demo and one short run per registered algorithm give the same bytes.

For each run this file digests what a run leaves: the checkpoint (state tensors, ledger, scheduler, metrics;
its wall time left out), ``summary.json`` and ``privacy.json`` (wall time and thread count left out), every
metrics row (wall time left out) and the noise ``setup.json`` calibrated.  ``tests/golden/outputs.json`` holds
the digests of the commit that wrote it.  A change that moves no result keeps every digest; a change meant to
move results rewrites the file (``python tests/test_golden_outputs.py --write``) and says why in its commit; a newly
registered algorithm is added alone (``--add NAME``), its entry naming the machine that computed it when that is not
the file's.

Floating-point results are bit-exact only on the same CPU features and torch build (one thread per run
here), so on another machine the runs are compared by their metrics and ledger values to 1e-6 instead."""

from __future__ import annotations

import hashlib
import io
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decentdp.algorithms.registry import algorithm_class, algorithm_names, load_package_algorithms
from decentdp.config import load_config, validate_config
from decentdp.experiment.loop import run_experiment
from decentdp.experiment.record import read_checkpoint
from decentdp.results.files import CHECKPOINT_FILE

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_config  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "outputs.json"
REPO = Path(__file__).resolve().parents[1]
#: Fields that say how long or on how many threads a run took, not what it computed.
TIMING = frozenset({"wall_seconds", "threads"})
load_package_algorithms()
#: The demo and the package's algorithms (tests register toy ones of their own in the same process).
RUNS = ["demo", *sorted(name for name in algorithm_names() if algorithm_class(name).__module__.startswith("decentdp."))]


def machine() -> str:
    """What bit-exact results depend on: the CPU's vector features, the platform and torch's build."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = {flag for flag in line.split(":", 1)[1].split() if flag.startswith(("avx", "fma", "sse4"))}
                break
    return f"{platform.machine()} torch {torch.__version__} {' '.join(sorted(flags))}"


def config_of(name: str) -> Any:
    """The demo (shortened to 4 rounds), or the tests' tiny digits run with algorithm ``name``; one thread."""
    overrides = ["engine.threads=1", "experiment.rounds=4", "experiment.eval_every=2"]
    if name == "demo":
        return load_config(REPO / "experiments" / "demo.toml", overrides)
    raw = tiny_config(algorithm={"name": name}, privacy={"epsilon": "inf" if name == "no-noise" else 2.0},
                      engine={"threads": 1})
    return validate_config(raw)


def _without_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_timing(item) for key, item in value.items() if key not in TIMING}
    if isinstance(value, list):
        return [_without_timing(item) for item in value]
    return value


def _tensor_bytes(value: Any, out: io.BytesIO) -> None:
    """Every tensor and array in ``value`` (dicts in key order) as dtype, shape and raw bytes; the rest as JSON."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            out.write(str(key).encode())
            _tensor_bytes(value[key], out)
    elif isinstance(value, list | tuple):
        for item in value:
            _tensor_bytes(item, out)
    elif isinstance(value, torch.Tensor):
        out.write(f"{value.dtype}{tuple(value.shape)}".encode() + value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, np.ndarray):
        out.write(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    else:
        out.write(json.dumps(value, sort_keys=True, default=str).encode())


def outputs(name: str, folder: Path) -> dict[str, Any]:
    """Run ``name`` into ``folder``: the digest of everything it left, and the values compared elsewhere."""
    run_experiment(config_of(name), folder, progress=False, log=lambda _line: None)
    checkpoint = read_checkpoint(folder / CHECKPOINT_FILE)
    checkpoint.pop("wall_seconds", None)
    checkpoint.pop("key_file", None)
    parts = io.BytesIO()
    _tensor_bytes(_without_timing(checkpoint), parts)
    for file in ("summary.json", "privacy.json"):
        _tensor_bytes(_without_timing(json.loads((folder / file).read_text())), parts)
    rows = [_without_timing(json.loads(line)) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    _tensor_bytes(rows, parts)
    setup = json.loads((folder / "setup.json").read_text())
    _tensor_bytes({key: setup.get(key) for key in ("noise_multipliers", "sample_rates", "planned_releases")}, parts)
    privacy = json.loads((folder / "privacy.json").read_text())
    return {"digest": hashlib.sha256(parts.getvalue()).hexdigest(),
            "accuracy_mean": [row["accuracy_mean"] for row in rows],
            "epsilon": privacy.get("epsilon")}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} is missing: write it with python tests/test_golden_outputs.py --write")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", RUNS)
def test_results_ledgers_and_checkpoints_are_unchanged(name: str, golden: dict[str, Any], tmp_path: Path) -> None:
    assert name in golden["runs"], f"no golden outputs for {name!r}: rewrite {GOLDEN} (see this file's docstring)"
    expected, now = golden["runs"][name], outputs(name, tmp_path / name)
    if expected.get("machine", golden["machine"]) == machine():  # a run added later names its own machine
        assert now["digest"] == expected["digest"], f"{name}: its results, ledger or checkpoint changed"
    else:  # another CPU or torch build: values, not bits
        assert np.allclose(now["accuracy_mean"], expected["accuracy_mean"], rtol=1e-6, atol=1e-9)
        assert np.allclose(np.asarray(now["epsilon"], dtype=float), np.asarray(expected["epsilon"], dtype=float),
                           rtol=1e-6, equal_nan=True)  # a non-private run's epsilon is None (nan) on both sides


def write(folder: Path) -> None:
    """Rewrite the golden file from this checkout's runs."""
    runs = {name: outputs(name, folder / name) for name in RUNS}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: {len(runs)} runs on {machine()}")


def add(folder: Path, name: str) -> None:
    """Add one run (a newly registered algorithm) to the golden file, naming the machine that computed it; the
    other runs keep their digests."""
    golden = json.loads(GOLDEN.read_text())
    if name in golden["runs"]:
        sys.exit(f"{name} is already in {GOLDEN}: rewrite the whole file with --write")
    golden["runs"][name] = {**outputs(name, folder / name), **({"machine": machine()}
                                                                if machine() != golden["machine"] else {})}
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"added {name} to {GOLDEN} on {machine()}")


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--write"] and (len(sys.argv) != 3 or sys.argv[1] != "--add"):
        sys.exit("usage: python tests/test_golden_outputs.py --write | --add ALGORITHM")
    with tempfile.TemporaryDirectory() as temporary:
        if sys.argv[1] == "--write":
            write(Path(temporary))
        else:
            add(Path(temporary), sys.argv[2])
