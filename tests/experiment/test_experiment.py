"""End-to-end runs through the experiment runner: results, checkpoints and exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decentdp.config import PLACEMENT_FIELDS, RECORDING_FIELDS, validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.loop import run_experiment

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


def test_resume_refuses_other_records_than_the_run_started_on(tmp_path: Path) -> None:
    """The data directory is not part of the config, so a resume compares the records it loads with setup.json's
    fingerprint: the run's noise (replayed from the seed, or its keys) must never continue on other data."""
    import numpy as np

    for name, seed in (("first", 0), ("other", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / "mnist.npz", x_train=rng.integers(0, 256, (40, 28, 28), dtype=np.uint8),
                 y_train=np.arange(40, dtype=np.uint8) % 10, x_test=rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
                 y_test=np.arange(10, dtype=np.uint8))
    config = validate_config(tiny_config(data={"dataset": "mnist"}, experiment={"rounds": 4, "checkpoint_every": 2}))
    run_experiment(config, tmp_path / "run", data_dir=tmp_path / "first", progress=False, stop_after=2)
    fingerprint = json.loads((tmp_path / "run" / "setup.json").read_text())["data_fingerprint"]
    with pytest.raises(ConfigError, match="--data-dir: the records loaded differ"):
        run_experiment(config, tmp_path / "run", data_dir=tmp_path / "other", progress=False, resume=True)
    resumed = run_experiment(config, tmp_path / "run", data_dir=tmp_path / "first", progress=False, resume=True)
    assert resumed.summary["finished"]
    assert json.loads((tmp_path / "run" / "setup.json").read_text())["data_fingerprint"] == fingerprint
    assert fingerprint.startswith("hmac-sha256:")  # keyed by the seed here (a simulation's noise is public too)


def test_a_folder_holding_the_plain_fingerprint_of_earlier_versions_resumes_on_its_records_only(
        tmp_path: Path) -> None:
    """Folders written before the fingerprint was keyed hold the records' plain SHA-256: a resume checks it."""
    from decentdp.data.datasets import load_dataset

    config = validate_config(tiny_config(experiment={"rounds": 4, "checkpoint_every": 2}))
    run_experiment(config, tmp_path / "run", progress=False, stop_after=2)
    setup_file = tmp_path / "run" / "setup.json"
    setup = json.loads(setup_file.read_text())
    setup_file.write_text(json.dumps(setup | {"data_fingerprint": load_dataset("digits").fingerprint(None)}))
    assert run_experiment(config, tmp_path / "run", progress=False, resume=True).summary["finished"]
    run_experiment(config, tmp_path / "other", progress=False, stop_after=2)
    setup_file = tmp_path / "other" / "setup.json"
    setup_file.write_text(json.dumps(json.loads(setup_file.read_text()) | {"data_fingerprint": "0" * 64}))
    with pytest.raises(ConfigError, match="the records loaded differ"):
        run_experiment(config, tmp_path / "other", progress=False, resume=True)


def test_resume_may_evaluate_and_checkpoint_at_another_cadence_and_ends_the_same(tmp_path: Path) -> None:
    """Evaluations and checkpoints draw nothing from the run's streams, so a long grid may resume a stopped run
    evaluating less often (``RECORDING_FIELDS``): the state, ledger and final metrics are the uninterrupted run's."""
    from decentdp.cli.report import IGNORED_FIELDS
    from decentdp.config import RECORDING_FIELDS

    assert set(RECORDING_FIELDS) <= set(IGNORED_FIELDS)  # nor do they split a report's groups
    every = validate_config(tiny_config(experiment={"rounds": 6, "eval_every": 1, "checkpoint_every": 1}))
    sparse = validate_config(tiny_config(experiment={"rounds": 6, "eval_every": 3, "checkpoint_every": 2}))
    whole = run_experiment(every, tmp_path / "whole", progress=False)
    run_experiment(every, tmp_path / "split", progress=False, stop_after=2)
    resumed = run_experiment(sparse, tmp_path / "split", progress=False, resume=True)
    for key, value in whole.state.items():
        assert torch.equal(value, resumed.state[key]), key
    assert [row["round"] for row in resumed.metrics] == [0, 1, 2, 3, 6]
    assert _strip_times(resumed.metrics)[-1] == _strip_times(whole.metrics)[-1]
    privacy = [json.loads((tmp_path / run / "privacy.json").read_text()) for run in ("whole", "split")]
    assert privacy[0] == privacy[1]


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
    assert setup["topology"]["n_agents"] == 4 and "class_histograms" not in setup  # raw data: --diagnostics only


def test_a_run_interrupted_before_its_first_round_can_be_resumed(tmp_path: Path) -> None:
    config = validate_config(tiny_config())
    run_experiment(config, tmp_path / "run", progress=False, stop_after=0)
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    resumed = run_experiment(config, tmp_path / "run", progress=False, resume=True)
    whole = run_experiment(config, tmp_path / "whole", progress=False)
    assert torch.equal(resumed.state["params"], whole.state["params"])


@pytest.mark.parametrize("algorithm,field", [
    ({"name": "dp-dsgt", "momentum": 0.45}, "algorithm.momentum"),  # (0.9 is DPDL's default: dropped as such)
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


def _quiet() -> dict:
    return {"progress": False, "log": lambda _: None}


@pytest.mark.parametrize("out,expected", [
    ("/proc/decentdp-results", "/proc is not writable"),
    ("afile/sub", "is a file, not a directory"),
])
def test_unusable_results_paths_are_refused_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 out: str, expected: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(ConfigError) as info:
        run_experiment(validate_config(tiny_config()), out, **_quiet())
    assert info.value.field == "--out" and expected in info.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written


def test_non_private_runs_say_so_when_they_start_and_end(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_experiment(validate_config(tiny_config(privacy={"epsilon": "inf"})), tmp_path / "out",
                            progress=False, log=lines.append)
    banners = [line for line in lines if "NOT private" in line]
    assert len(banners) == 2 and lines[0] != banners[0] and lines[-1] == banners[1]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["private"] is False and summary["epsilon_max"] is None  # JSON has no infinity: null
    assert all(e is None for e in summary["epsilon_per_agent"]) and result.summary["epsilon_target"] is None
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert privacy["epsilon"] == [None] * 4
    private = run_experiment(validate_config(tiny_config()), tmp_path / "private", progress=False,
                             log=lines.append)
    assert isinstance(private.summary["epsilon_max"], float) and private.summary["private"] is True


def test_summaries_describe_the_run_that_made_them(tmp_path: Path) -> None:
    raw = tiny_config(algorithm={"name": "dp-dsgd", "momentum": 0.5}, experiment={"seed": 3})
    summary = run_experiment(validate_config(raw), tmp_path / "out", **_quiet()).summary
    assert summary | {"wall_seconds": 0} == json.loads((tmp_path / "out" / "summary.json").read_text()) | {
        "wall_seconds": 0}
    assert (summary["seed"], summary["graph"], summary["partition"], summary["model"]) == (3, "ring", "iid", "linear")
    assert (summary["lr"], summary["batch_size"], summary["epsilon_target"], summary["delta"]) == (0.1, 16, 5.0, 1e-5)
    assert summary["algorithm_settings"]["momentum"] == 0.5 and summary["schedule"] == "synchronous"
    assert validate_config(summary["config"]) == validate_config(raw)


def test_a_pooled_run_claims_no_partition_and_says_what_it_did_not_read(tmp_path: Path) -> None:
    """central-dpsgd pools every record into one agent: its summary names no partition that did not happen, and its
    start says the partition and graph it was given change nothing."""
    raw = tiny_config(algorithm={"name": "central-dpsgd"}, data={"partition": "dirichlet"},
                      experiment={"rounds": 2})
    lines: list[str] = []
    summary = run_experiment(validate_config(raw), tmp_path / "out", progress=False, log=lines.append).summary
    assert (summary["partition"], summary["graph"]) == ("pooled", "complete")
    assert any(line.startswith("warning: topology.graph = 'ring', topology.agents = 4, data.partition = 'dirichlet' "
                               "change nothing")
               for line in lines), lines


def test_resume_names_the_changed_fields_and_a_finished_run_explains_why_it_cannot_grow(tmp_path: Path) -> None:
    config = validate_config(tiny_config())
    run_experiment(config, tmp_path / "out", **_quiet())
    changed = validate_config(tiny_config(privacy={"clip": 2.0}, algorithm={"lr": 0.2}))
    with pytest.raises(ConfigError, match=r"in algorithm\.lr, privacy\.clip; resume with the same config") as error:
        run_experiment(changed, tmp_path / "out", resume=True, **_quiet())
    assert all(field in error.value.message for field in PLACEMENT_FIELDS + RECORDING_FIELDS)  # what may change
    longer = validate_config(tiny_config(experiment={"rounds": 8}))
    with pytest.raises(ConfigError, match="finished its 4 rounds and cannot be extended: its noise was calibrated"):
        run_experiment(longer, tmp_path / "out", resume=True, **_quiet())


def test_a_stopped_runs_summary_counts_the_rounds_it_ran(tmp_path: Path) -> None:
    """A review: stopped after 6 rounds between evaluations (every 4), the summary said rounds = 4, the last
    evaluation's, below what the run had released; its accuracies stay the last evaluation's."""
    config = validate_config(tiny_config(experiment={"rounds": 12, "eval_every": 4, "checkpoint_every": 2}))
    stopped = run_experiment(config, tmp_path / "out", stop_after=6, **_quiet())
    assert stopped.summary["rounds"] == 6 and not stopped.summary["finished"]
    assert stopped.metrics[-1]["round"] == 4
    assert stopped.summary["accuracy_mean"] == stopped.metrics[-1]["accuracy_mean"]
    resumed = run_experiment(config, tmp_path / "out", resume=True, stop_after=6, **_quiet())  # nothing more to run
    assert resumed.summary["rounds"] == 6
    assert run_experiment(config, tmp_path / "out", resume=True, **_quiet()).summary["rounds"] == 12


def test_a_delta_that_voids_the_guarantee_is_refused_and_a_weak_one_warned_about(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:  # digits over 4 agents: about 450 records each
        run_experiment(validate_config(tiny_config(privacy={"delta": 0.01})), tmp_path / "a", **_quiet())
    assert info.value.field == "privacy.delta" and "in the clear" in info.value.message
    assert not (tmp_path / "a").exists()
    lines: list[str] = []
    run_experiment(validate_config(tiny_config(privacy={"delta": 1e-3}, algorithm={"batch_size": 1000})),
                   tmp_path / "b", progress=False, log=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert any("privacy.delta = 0.001 is not well below" in line for line in warnings)
    assert any("algorithm.batch_size = 1000 is at least the data of 4 agent(s)" in line for line in warnings)


def test_curves_start_at_round_zero_and_plots_are_titled(tmp_path: Path) -> None:
    result = run_experiment(validate_config(tiny_config()), tmp_path / "out", **_quiet())
    assert [row["round"] for row in result.metrics] == [0, 2, 4]
    assert result.metrics[0]["epsilon_max"] == 0.0  # nothing released before the first round
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 0


def test_without_a_terminal_the_progress_bar_stays_out_of_the_log(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A log file or pipe gets the evaluation rows only: a bar's redraws would interleave with them."""
    run_experiment(validate_config(tiny_config()), tmp_path / "out", progress=True)
    captured = capsys.readouterr()
    assert "round/s" not in captured.err and "it/s" not in captured.err
    assert "round     4/4" in captured.out + captured.err

