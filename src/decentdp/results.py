"""The results folder of a run: resolved config, provenance, metrics, privacy ledger, plots.

Files are written atomically (to a temporary name, then renamed), so an interrupted run never
leaves a truncated file behind; the checkpoint lets it resume exactly where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import tomli_w

CONFIG_FILE = "config.toml"
PROVENANCE_FILE = "provenance.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PRIVACY_FILE = "privacy.json"
SETUP_FILE = "setup.json"
CHECKPOINT_FILE = "checkpoint.pt"
PROFILE_FILE = "profile.json"

_PACKAGES = ("decentdp", "torch", "numpy", "scipy", "networkx", "dp-accounting", "pydantic", "scikit-learn")


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(text.encode() if isinstance(text, str) else text)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(strict_json(data), indent=2, sort_keys=True, default=_jsonable) + "\n")


def write_toml(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, tomli_w.dumps(data))


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(strict_json(row), default=_jsonable) + "\n" for row in rows))


def strict_json(value: Any) -> Any:
    """``value`` with non-finite floats spelled as strings ("inf"), since JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if hasattr(value, "tolist"):
        return strict_json(value.tolist())
    return value


def epsilon_json(value: Any) -> Any:
    """Epsilons as results files store them: a number, or ``null`` where it is infinite (a non-private
    release); lists and arrays element by element.  One encoding everywhere, documented in the README."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [epsilon_json(item) for item in value]
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def git_commit() -> str | None:
    """The commit of the decentdp checkout in use, if it is one (``None`` for an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance(seed: int) -> dict[str, Any]:
    """What is needed to reproduce a run: seed, package versions, git commit, machine."""
    versions = {}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "seed": seed,
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "packages": versions,
        "platform": platform.platform(),
        "processor": platform.machine(),
        "command": sys.argv,
    }


def plot_metrics(rows: Sequence[dict[str, Any]], out_dir: Path, title: str = "") -> list[Path]:
    """PNG plots of accuracy (mean with min-max band) and consensus distance against round, titled with
    ``title`` (the run's name, algorithm and epsilon)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [row["round"] for row in rows]
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rounds, [row["accuracy_mean"] for row in rows], label="mean over agents")
    ax.fill_between(rounds, [row["accuracy_min"] for row in rows], [row["accuracy_max"] for row in rows],
                    alpha=0.25, label="min-max over agents")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out_dir / "accuracy.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rounds, [max(row["consensus_distance"], 1e-12) for row in rows])
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("consensus distance  sqrt(mean ||θ_i − θ̄||²)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, out_dir / "consensus.png"))
    plt.close(fig)
    return written


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path
