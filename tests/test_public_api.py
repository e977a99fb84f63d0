"""The public API: three calls from a config file to results, and an ``import decentdp`` that loads nothing
heavy (the OpenMP settings in ``decentdp/__init__.py`` must come before torch loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

import decentdp

from conftest import tiny_config


def test_three_calls_run_an_experiment_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tiny_config()))
    config = decentdp.load_config(path, overrides=["experiment.rounds=3", "privacy.epsilon=2.0"])
    assert config.experiment.rounds == 3 and config.privacy.epsilon == 2.0
    result = decentdp.run(config, tmp_path / "out", progress=False, log=lambda _line: None)
    assert result.summary["finished"] and 0.0 <= result.summary["accuracy_mean"] <= 1.0
    assert result.summary["epsilon_max"] <= 2.0 and (tmp_path / "out" / "summary.json").is_file()
    built = decentdp.assemble(config)
    assert built.topology.n_agents == config.topology.agents and built.simulator is not None


def test_import_decentdp_loads_neither_torch_nor_the_library() -> None:
    code = "import sys, decentdp; print(sorted(m for m in sys.modules if m.startswith(('torch', 'decentdp.'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'train'"):
        decentdp.train  # noqa: B018
    assert {"load_config", "run", "assemble"} <= set(dir(decentdp))
