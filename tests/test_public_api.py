"""The public API: three calls from a config file to results, and an ``import decentdp`` that loads nothing
heavy (the OpenMP settings in ``decentdp/__init__.py`` must come before torch loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w

import decentdp
from decentdp.errors import ConfigError

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


@pytest.mark.parametrize(("change", "field"), [
    (lambda c: setattr(c.schedule, "kind", "pairing"), "schedule.kind"),
    (lambda c: setattr(c.algorithm, "lr_schedule", "cosine"), "algorithm.lr_final"),
    (lambda c: setattr(c.privacy, "agent_epsilons", [1.0, 2.0]), "privacy.agent_epsilons"),
])
def test_run_and_assemble_check_a_config_changed_after_loading(tmp_path: Path, change: Any, field: str) -> None:
    """A section re-checks an assigned field alone; the checks across sections run again at run and assemble."""
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tiny_config()))
    config = decentdp.load_config(path)
    change(config)
    for call in (lambda: decentdp.run(config, progress=False, log=lambda _line: None),
                 lambda: decentdp.assemble(config)):
        with pytest.raises(ConfigError, match=field):
            call()


def test_run_and_assemble_take_a_path_and_refuse_other_objects(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tiny_config(experiment={"rounds": 2})))
    assert decentdp.run(str(path), progress=False, log=lambda _line: None).summary["finished"]
    assert decentdp.assemble(path).topology.n_agents == 4
    with pytest.raises(TypeError, match="ExperimentConfig"):
        decentdp.assemble({"privacy": {"epsilon": 1.0}})


def test_load_config_refuses_one_override_string(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tiny_config()))
    with pytest.raises(TypeError, match=r"overrides must be a list .*'experiment.rounds=5'"):
        decentdp.load_config(path, overrides="experiment.rounds=5")  # type: ignore[arg-type]


def test_a_config_checked_again_keeps_its_dropped_keys_notices(tmp_path: Path) -> None:
    """A key dropped at load (another algorithm's setting, at its default) is still said by the assembled run."""
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tiny_config(algorithm={"correlation": 3.0})))  # decor's default
    config = decentdp.load_config(path)
    assert config.algorithm.ignored_notices
    assert any("algorithm.correlation" in line for line in decentdp.assemble(config).warnings)


def test_assemble_refuses_a_personalized_config() -> None:
    config = decentdp.load_config(Path(__file__).parents[1] / "experiments" / "personalized" / "demo-synthetic.toml")
    with pytest.raises(ConfigError, match=r"personalized.*decentdp\.run"):
        decentdp.assemble(config)
