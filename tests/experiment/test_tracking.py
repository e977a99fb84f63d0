"""Experiment tracking (experiment/tracking.py): what a run and a sweep log, read back through each library's reader.

TensorBoard's logs are read with its own ``EventAccumulator``, MLflow's runs with ``MlflowClient`` (params,
metric histories, artifacts, parent tags); nothing here checks that files merely exist.  MLflow logs to a
local SQLite store under ``tmp_path``; nothing talks to the outside (telemetry is off)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from decentdp.cli.main import main
from decentdp.config import flat_fields, validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.loop import run_experiment
from decentdp.experiment.tracking import metric_values

from conftest import tiny_config


def _client(uri: str):
    tracking = pytest.importorskip("mlflow.tracking")
    return tracking.MlflowClient(tracking_uri=uri)


def _mlflow_config(tmp_path: Path, **tracking: object) -> dict:
    return tiny_config(tracking={"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", **tracking})


def test_mlflow_run_logs_config_metrics_per_agent_epsilon_and_files(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    config = validate_config(_mlflow_config(tmp_path, experiment="digits"))
    result = run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None)
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == config.experiment.name
    fields = flat_fields(config)
    assert run.data.params["algorithm.lr"] == str(fields["algorithm.lr"])
    assert run.data.params["privacy.epsilon"] == str(fields["privacy.epsilon"])
    assert set(run.data.params) == set(fields)
    history = client.get_metric_history(run.info.run_id, "accuracy_mean")
    assert [(m.step, m.value) for m in history] == [(row["round"], pytest.approx(row["accuracy_mean"]))
                                                    for row in result.metrics]
    spent = json.loads((tmp_path / "run" / "privacy.json").read_text())
    for agent in range(config.topology.agents):
        final = client.get_metric_history(run.info.run_id, f"epsilon/agent_{agent}")[-1]
        assert final.step == config.experiment.rounds and final.value > 0
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "epsilon_max")) == \
        pytest.approx(result.summary["epsilon_max"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "privacy.json", "metrics.jsonl", "config.toml"} <= artifacts
    assert not any(path.endswith(".pt") for path in artifacts)  # the checkpoint stays local
    assert spent  # privacy.json was written and uploaded


def test_mlflow_run_resumes_into_the_same_run(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    config = validate_config(_mlflow_config(tmp_path))
    run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None, stop_after=2)
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (stopped,) = client.search_runs([client.get_experiment_by_name("decentdp").experiment_id])
    assert stopped.info.status == "KILLED"
    run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None, resume=True)
    (run,) = client.search_runs([client.get_experiment_by_name("decentdp").experiment_id])
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "accuracy_mean")]
    assert steps[-1] == config.experiment.rounds and len(steps) == len(set(steps))


def test_tensorboard_run_logs_scalars_at_each_evaluation(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    config = validate_config(tiny_config(tracking={"backend": "tensorboard"}))
    result = run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None)
    events = accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("accuracy_mean")] == \
        [(row["round"], pytest.approx(row["accuracy_mean"], rel=1e-6)) for row in result.metrics]
    assert {f"epsilon/agent_{a}" for a in range(config.topology.agents)} <= set(events.Tags()["scalars"])
    assert "config/text_summary" in events.Tags()["tensors"]   # add_text is stored as a tensor summary


def test_a_sweeps_trials_nest_under_the_sweeps_own_mlflow_run(tmp_path: Path, capsys) -> None:
    pytest.importorskip("optuna")
    pytest.importorskip("mlflow")
    base = tiny_config(privacy={"epsilon": 5.0, "accountant": "rdp"},
                       tracking={"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    (tmp_path / "base.toml").write_text(tomli_w.dumps(base))
    sweep = {"sweep": {"config": "base.toml", "method": "random", "trials": 2, "validation_fraction": 0.2}}
    path = tmp_path / "sweep.toml"
    path.write_text(tomli_w.dumps(sweep) + '\n[space]\n"algorithm.lr" = { low = 0.05, high = 0.5, log = true }\n')
    assert main(["sweep", str(path), "--out", str(tmp_path / "sweep"), "--no-progress", "--json"]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["best"]
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("decentdp").experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get("decentdp.kind") == "sweep"]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and len(runs) == 3 and parent.info.status == "FINISHED"
    assert sorted(float(run.data.params["algorithm.lr"]) for run in children) == \
        sorted(t["params"]["algorithm.lr"] for t in best)
    assert parent.data.metrics["best_accuracy_mean"] == pytest.approx(best[0]["value"])


@pytest.mark.parametrize(("tracking", "field"), [
    ({"backend": "wandb"}, "tracking.backend"),
    ({"backend": "tensorboard", "uri": "sqlite:///x.db"}, "tracking.uri"),
    ({"backend": "mlflow", "log_dir": "logs"}, "tracking.log_dir"),
    ({"backend": "none", "parent_run": "abc"}, "tracking.parent_run"),
    ({"backend": "mlflow", "experiment": ""}, "tracking.experiment"),
    ({"backend": "mlflow", "colour": "red"}, "tracking.colour"),
])
def test_bad_tracking_settings_name_the_field(tracking: dict, field: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config(tracking=tracking))
    assert field in str(error.value)


def test_a_personalized_run_refuses_a_tracker_it_would_not_use() -> None:
    raw = {"privacy": {"epsilon": 1.0}, "tracking": {"backend": "tensorboard"},
           "personalized": {"dataset": "synthetic", "agents": 12, "dim": 4, "wakeups": 3}}
    with pytest.raises(ConfigError) as error:
        validate_config(raw)
    assert error.value.field == "tracking.backend"


def test_a_missing_tracking_library_is_one_clear_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys) -> None:
    """The CLI says which extra to install, names the field, prints no traceback and leaves no folder."""
    import builtins

    real_import = builtins.__import__

    def without_mlflow(name: str, *args, **kwargs):
        if name.startswith("mlflow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_mlflow)
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(_mlflow_config(tmp_path)))
    assert main(["run", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tracking.backend" in err and "decentdp[tracking]" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_metric_values_leave_out_text_round_and_private_diagnostics() -> None:
    row = {"round": 3, "accuracy_mean": 0.5, "epsilon_accountant": "pld", "epsilon_max": None,
           "diagnostics": {"clipped_fraction": 0.9}, "nested": {"value": 2}}
    values = dict(metric_values(row, np.array([0.1, 0.2])))
    assert values == {"accuracy_mean": 0.5, "epsilon_max": math.inf, "nested.value": 2.0,
                      "epsilon/agent_0": 0.1, "epsilon/agent_1": 0.2}


def test_an_unusable_mlflow_store_is_one_message_naming_the_uri(tmp_path: Path, capsys) -> None:
    """MLflow 3 refuses its old file store: the run says so in one line naming tracking.uri, before training."""
    pytest.importorskip("mlflow")
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(_mlflow_config(tmp_path, uri=(tmp_path / "mlruns").as_uri())))
    assert main(["run", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tracking.uri" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3
    assert not (tmp_path / "out").exists()


def test_a_tensorboard_log_dir_that_is_a_file_is_refused_naming_the_field(tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorboard")
    (tmp_path / "logs").write_text("a file, not a directory")
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tiny_config(tracking={"backend": "tensorboard",
                                                          "log_dir": str(tmp_path / "logs")})))
    assert main(["run", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tracking.log_dir" in err and "Traceback" not in err and not (tmp_path / "out").exists()


def test_an_mlflow_server_that_does_not_answer_is_refused_at_once(tmp_path: Path, capsys) -> None:
    """A tracking URI on a loopback port nobody listens on: refused before the data loads, naming the field
    (MLflow itself would retry for minutes)."""
    pytest.importorskip("mlflow")
    import socket

    with socket.socket() as probe:          # a free loopback port, closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(_mlflow_config(tmp_path, uri=f"http://127.0.0.1:{port}")))
    assert main(["run", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tracking.uri" in err and "no MLflow server answers" in err and "Traceback" not in err


def test_a_resume_with_a_damaged_tracking_file_names_it(tmp_path: Path) -> None:
    """tracking.json cut short: the resume says which file and what to do, and trains nothing."""
    pytest.importorskip("mlflow")
    config = validate_config(_mlflow_config(tmp_path))
    run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None, stop_after=2)
    (tmp_path / "run" / "tracking.json").write_text("{damaged")
    with pytest.raises(ConfigError) as error:
        run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None, resume=True)
    assert error.value.field == "--resume" and "tracking.json" in error.value.message
    assert "remove it" in error.value.message


def test_a_run_may_resume_logging_elsewhere(tmp_path: Path) -> None:
    """Where a run logs is not what it computes: a run started untracked resumes into TensorBoard."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_experiment(validate_config(tiny_config()), tmp_path / "run", progress=False, log=lambda _line: None,
                   stop_after=2)
    tracked = validate_config(tiny_config(tracking={"backend": "tensorboard"}))
    result = run_experiment(tracked, tmp_path / "run", progress=False, log=lambda _line: None, resume=True)
    events = accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("accuracy_mean")] == [row["round"] for row in result.metrics
                                                                  if row["round"] > 2]


def _interrupt_before_the_first_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the folder's start files and the tracker are written, before round 0's checkpoint."""
    import decentdp.experiment.loop as loop

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_announce", interrupted)


def test_a_tensorboard_run_killed_before_its_first_checkpoint_may_start_again(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed start's logs are no results: the folder starts again (as the CLI's message says), and the logs
    hold the new start's evaluations only."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    config = validate_config(tiny_config(tracking={"backend": "tensorboard"}))
    with monkeypatch.context() as patch:
        _interrupt_before_the_first_checkpoint(patch)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None)
    assert (tmp_path / "run" / "tensorboard").is_dir() and not (tmp_path / "run" / "checkpoint.pt").exists()
    result = run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None)
    assert result.summary["finished"]
    events = accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("accuracy_mean")] == [row["round"] for row in result.metrics]


def test_an_mlflow_run_killed_before_its_first_checkpoint_starts_again_as_a_new_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed start's MLflow run is left KILLED; the new start logs to a run of its own (not the stale one
    tracking.json named), and tracking.json names it."""
    pytest.importorskip("mlflow")
    config = validate_config(_mlflow_config(tmp_path))
    with monkeypatch.context() as patch:
        _interrupt_before_the_first_checkpoint(patch)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None)
    killed = json.loads((tmp_path / "run" / "tracking.json").read_text())["run_id"]
    run_experiment(config, tmp_path / "run", progress=False, log=lambda _line: None)
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {run.info.run_id: run.info.status
            for run in client.search_runs([client.get_experiment_by_name("decentdp").experiment_id])}
    started = json.loads((tmp_path / "run" / "tracking.json").read_text())["run_id"]
    assert started != killed and runs == {killed: "KILLED", started: "FINISHED"}
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(client.get_metric_history(started, "accuracy_mean")) == len(rows)
