"""End-to-end runs through the experiment runner: results, checkpoints and exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.run.loop import run_experiment

from conftest import tiny_config


def _strip_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_seconds"} for row in rows]


@pytest.mark.parametrize("algorithm", [
    {"name": "dp-dsgt"},
    {"name": "dp-dsgd", "momentum": 0.9, "weight_decay": 1e-4},
    {"name": "dp-dinno", "optimizer": "adam", "lr": 0.01, "primal_steps": 2, "rho_growth": 1.01},
])
def test_resume_ends_exactly_like_an_uninterrupted_run(tmp_path: Path, algorithm: dict) -> None:
    config = validate_config(tiny_config(experiment={"rounds": 6, "eval_every": 2, "checkpoint_every": 1},
                                         algorithm=algorithm))
    whole = run_experiment(config, tmp_path / "whole", progress=False)
    run_experiment(config, tmp_path / "split", progress=False, stop_after=3)  # "killed" after round 3
    assert not (tmp_path / "split" / "summary.json").exists()
    resumed = run_experiment(config, tmp_path / "split", progress=False, resume=True)

    for key, value in whole.state.items():
        assert torch.equal(value, resumed.state[key]), key
    assert _strip_times(whole.metrics) == _strip_times(resumed.metrics)
    privacy = [json.loads((tmp_path / run / "privacy.json").read_text()) for run in ("whole", "split")]
    assert privacy[0] == privacy[1]
    metrics_file = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in metrics_file] == [0, 2, 4, 6]  # round 0: before training


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    config = validate_config(tiny_config())
    run_experiment(config, tmp_path / "run", progress=False, stop_after=2)
    changed = validate_config(tiny_config(algorithm={"lr": 0.2}))
    with pytest.raises(ConfigError, match="differs"):
        run_experiment(changed, tmp_path / "run", progress=False, resume=True)


def test_a_run_writes_its_results_folder(tmp_path: Path) -> None:
    result = run_experiment(validate_config(tiny_config()), tmp_path / "out", progress=False)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.toml", "provenance.json", "setup.json", "metrics.jsonl", "summary.json", "privacy.json",
            "checkpoint.pt", "accuracy.png", "consensus.png"} <= names
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["rounds"] == 4 and summary["n_agents"] == 4
    assert 0.0 < summary["epsilon_max"] <= 5.0
    setup = json.loads((tmp_path / "out" / "setup.json").read_text())
    assert len(setup["class_histograms"]) == 4 and setup["topology"]["n_agents"] == 4


def test_a_run_interrupted_before_its_first_round_can_be_resumed(tmp_path: Path) -> None:
    config = validate_config(tiny_config())
    run_experiment(config, tmp_path / "run", progress=False, stop_after=0)
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    resumed = run_experiment(config, tmp_path / "run", progress=False, resume=True)
    whole = run_experiment(config, tmp_path / "whole", progress=False)
    assert torch.equal(resumed.state["params"], whole.state["params"])


@pytest.mark.parametrize("algorithm,field", [
    ({"name": "dp-dsgt", "momentum": 0.9}, "algorithm.momentum"),
    ({"name": "dp-dsgd", "primal_steps": 3}, "algorithm.primal_steps"),
    ({"name": "dp-dinno", "optimizer": "adam", "nesterov": True}, "algorithm.nesterov"),
])
def test_settings_the_algorithm_ignores_are_errors(algorithm: dict, field: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config(algorithm=algorithm))
    assert error.value.field == field and "is not used by" in str(error.value)


@pytest.mark.parametrize("section,values,field", [
    ("privacy", {"clip": float("inf")}, "privacy.clip"),
    ("algorithm", {"lr": float("nan")}, "algorithm.lr"),
    ("experiment", {"name": "../../escaped"}, "experiment.name"),
    ("privacy", {"agent_epsilons": []}, "privacy.agent_epsilons"),
])
def test_values_that_would_break_the_guarantee_or_escape_the_folder_are_rejected(
        section: str, values: dict, field: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config(**{section: values}))
    assert error.value.field == field
