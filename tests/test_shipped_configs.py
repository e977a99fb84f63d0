"""Every config shipped under ``experiments/`` is valid: a generator edited without regenerating its
configs, or a setting renamed in the library, fails here rather than in a user's run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from decentdp.audit.settings import AuditSection, load_audit_config
from decentdp.config import ExperimentConfig, load_config
from decentdp.tuning.sweep import Sweep, load_sweep

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def _kind(path: Path) -> str:
    """How a shipped TOML is read: a run, an audit (``experiments/audits/``, or an ``[audit]`` table elsewhere, e.g.
    ``dpdl/inversion/``), a sweep (a ``[sweep]`` table, e.g. ``experiments/sweeps/`` or a study's ``tuning/``
    folder), or a table of paper values (``paper*.toml``)."""
    if path.name.startswith("paper"):
        return "paper values"
    raw = tomllib.loads(path.read_text())
    if "sweep" in raw:
        return "sweep"
    return "audit" if "audit" in raw or path.relative_to(EXPERIMENTS).parts[0] == "audits" else "run"


def _is_result(path: Path) -> bool:
    """A run's own copy of its config, kept beside its ``summary.json`` as a record of what ran (e.g.
    ``experiments/consensus/results/``): checked when it ran, not a config to ship."""
    return path.name == "config.toml" and (path.parent / "summary.json").is_file()


CONFIGS = sorted(path for path in EXPERIMENTS.rglob("*.toml") if _kind(path) != "paper values" and not _is_result(path))


def test_every_kind_of_shipped_config_is_covered() -> None:
    kinds = {_kind(path) for path in CONFIGS}
    assert kinds == {"run", "audit", "sweep"} and len(CONFIGS) > 300


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: str(path.relative_to(EXPERIMENTS)))
def test_a_shipped_config_loads(path: Path) -> None:
    """Loading validates (a bad config raises); what comes back is the kind of object its command runs."""
    kind = _kind(path)
    if kind == "run":
        config = load_config(path)
        assert isinstance(config, ExperimentConfig) and config.experiment.rounds >= 1
    elif kind == "audit":
        config, audit = load_audit_config(path)
        assert isinstance(config, ExperimentConfig) and isinstance(audit, AuditSection)
    else:
        sweep = load_sweep(path)
        assert isinstance(sweep, Sweep) and sweep.space and sweep.trials >= 1
