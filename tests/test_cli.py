"""Tests of the ``decentdp`` command line: privacy questions, experiment runs and error reporting.

Most tests call :func:`decentdp.cli.main` in-process; one runs the installed console script to
check the entry point itself.  Runs use the bundled ``digits`` data and a few rounds.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from decentdp.cli import main
from decentdp.config import load_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIGMA_ARGS = ["--delta", "1e-5", "--sample-rate", "0.0416667", "--steps", "2000"]
# The consensus paper reports sigma = 7.66 (Opacus) for epsilon = 1, delta = 1e-5, q = 1/24, 2000 steps;
# dp_accounting's RDP calibration lands at ~7.61-7.66.
PAPER_SIGMA = 7.63

TINY_CONFIG = """\
[experiment]
name = "tiny"
rounds = 4
eval_every = 2

[data]
dataset = "digits"

[topology]
graph = "ring"
agents = 4

[model]
name = "mlp"

[algorithm]
name = "dp-dsgt"
batch_size = 16

[privacy]
epsilon = 5.0
"""

RESULT_FILES = ("config.toml", "provenance.json", "metrics.jsonl", "summary.json", "privacy.json", "setup.json",
                "accuracy.png", "consensus.png")
SUMMARY_KEYS = ("accuracy_mean", "accuracy_min", "accuracy_max", "epsilon_max", "delta", "rounds", "wall_seconds")


def _call(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr captured (usable from module-scoped fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _last_json(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


def _assert_user_error(code: int, stderr: str, *fragments: str) -> None:
    assert code == 2
    assert stderr.startswith("decentdp: error: ")
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in stderr, f"{fragment!r} not in {stderr!r}"


# ----------------------------------------------------------------------------- privacy


@pytest.fixture(scope="module")
def paper_sigma() -> float:
    code, stdout, stderr = _call(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--json"])
    assert code == 0, stderr
    return float(_last_json(stdout)["sigma"])


def test_privacy_sigma_json_matches_paper(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--json"]) == 0
    captured = capsys.readouterr()
    result = _last_json(captured.out)
    assert {"sigma", "epsilon", "delta", "accountant"} <= set(result)
    assert result["sigma"] == pytest.approx(PAPER_SIGMA, rel=0.01)
    assert result["epsilon"] == 1.0
    assert result["delta"] == 1e-5
    assert result["accountant"] == "rdp"  # calibration defaults to RDP
    assert result["steps"] == 2000
    assert result["releases_per_step"] == 1
    assert captured.err == ""


def test_privacy_sigma_human_readable_names_accountant(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS]) == 0
    out = capsys.readouterr().out
    assert "noise multiplier sigma = 7.6" in out
    assert "accountant: RDP" in out
    assert "2000 sampled Gaussian releases" in out
    assert "{" not in out  # no JSON without --json


def test_privacy_epsilon_rdp_recovers_target(paper_sigma: float, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["privacy", "epsilon", "--sigma", repr(paper_sigma), *SIGMA_ARGS, "--json"]
    assert main([*argv, "--accountant", "rdp"]) == 0
    rdp = _last_json(capsys.readouterr().out)
    assert rdp["accountant"] == "rdp"
    assert rdp["sigma"] == paper_sigma
    # Calibration returns the safe end of its bracket: never above the target, within 1 % of it.
    assert rdp["epsilon"] <= 1.0
    assert rdp["epsilon"] == pytest.approx(1.0, rel=0.01)

    assert main([*argv, "--accountant", "pld"]) == 0
    pld = _last_json(capsys.readouterr().out)
    assert pld["accountant"] == "pld"
    assert 0 < pld["epsilon"] < rdp["epsilon"]

    assert main(argv) == 0  # the epsilon question reports PLD by default
    default = _last_json(capsys.readouterr().out)
    assert default["accountant"] == "pld"
    assert default["epsilon"] == pld["epsilon"]


def test_privacy_epsilon_human_readable_names_accountant(paper_sigma: float,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "epsilon", "--sigma", repr(paper_sigma), *SIGMA_ARGS]) == 0
    out = capsys.readouterr().out
    assert "spends epsilon = " in out
    assert "accountant: PLD" in out


def test_more_releases_per_step_need_more_noise(paper_sigma: float, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--releases-per-step", "2", "--json"]) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["releases_per_step"] == 2
    assert result["sigma"] > paper_sigma * 1.1


def test_privacy_infinite_budget_needs_no_noise(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "inf", *SIGMA_ARGS, "--json"]) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["sigma"] == 0.0
    assert result["epsilon"] == "inf"
    assert main(["privacy", "epsilon", "--sigma", "0", *SIGMA_ARGS, "--json"]) == 0
    assert _last_json(capsys.readouterr().out)["epsilon"] == "inf"


@pytest.mark.parametrize(("question", "replace", "option"), [
    ("sigma", ("--epsilon", "-1"), "--epsilon"),
    ("sigma", ("--epsilon", "0"), "--epsilon"),
    ("sigma", ("--epsilon", "nan"), "--epsilon"),
    ("sigma", ("--delta", "0"), "--delta"),
    ("sigma", ("--delta", "1.5"), "--delta"),
    ("sigma", ("--delta", "1"), "--delta"),
    ("sigma", ("--sample-rate", "0"), "--sample-rate"),
    ("sigma", ("--sample-rate", "2"), "--sample-rate"),
    ("sigma", ("--steps", "0"), "--steps"),
    ("sigma", ("--steps", "-5"), "--steps"),
    ("sigma", ("--releases-per-step", "0"), "--releases-per-step"),
    ("epsilon", ("--sigma", "-1"), "--sigma"),
    ("epsilon", ("--delta", "0"), "--delta"),
    ("epsilon", ("--sample-rate", "2"), "--sample-rate"),
    ("epsilon", ("--steps", "0"), "--steps"),
])
def test_privacy_invalid_inputs_exit_2_naming_the_option(question: str, replace: tuple[str, str], option: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    values = {"--delta": "1e-5", "--sample-rate": "0.04", "--steps": "100"}
    values["--epsilon" if question == "sigma" else "--sigma"] = "1"
    values[replace[0]] = replace[1]
    argv = ["privacy", question, *[part for item in values.items() for part in item]]
    code = main(argv)
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, f"decentdp: error: {option}: ")
    assert captured.out == ""


def test_privacy_non_numeric_option_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["privacy", "sigma", "--epsilon", "one", *SIGMA_ARGS])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--epsilon" in err
    assert "expected a number, got 'one'" in err


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_privacy_epsilon_with_infinite_sigma_is_no_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["privacy", "epsilon", "--sigma", "inf", *SIGMA_ARGS, "--json"])
    _assert_user_error(code, capsys.readouterr().err, "--sigma")


# ----------------------------------------------------------------------------- run


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.toml"
    path.write_text(TINY_CONFIG, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def finished_run(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("runs") / "tiny"
    code, stdout, stderr = _call(["run", str(tiny_config), "--out", str(out), "--json", "--no-progress"])
    return {"code": code, "stdout": stdout, "stderr": stderr, "out": out}


def test_run_exits_zero_and_prints_summary_json(finished_run: dict[str, Any]) -> None:
    assert finished_run["code"] == 0, finished_run["stderr"]
    summary = _last_json(finished_run["stdout"])
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["rounds"] == 4
    assert summary["n_agents"] == 4
    assert summary["finished"] is True
    assert summary["delta"] == 1e-5
    assert 0.0 <= summary["accuracy_min"] <= summary["accuracy_mean"] <= summary["accuracy_max"] <= 1.0
    # Calibration targets epsilon = 5 under RDP; the reported PLD epsilon is a tighter bound.
    assert 0 < summary["epsilon_max"] <= 5.0
    assert len(summary["epsilon_per_agent"]) == 4
    assert summary["wall_seconds"] > 0
    assert all(sigma > 0 for sigma in summary["noise_multipliers"])
    stdout = finished_run["stdout"]
    assert "final test accuracy over 4 agents" in stdout
    assert f"results in {finished_run['out']}" in stdout
    # Progress lines go to stderr, the results to stdout.
    assert "round     2/4" in finished_run["stderr"]
    assert "round     4/4" in finished_run["stderr"]


def test_run_writes_results_folder(finished_run: dict[str, Any], tiny_config: Path) -> None:
    out: Path = finished_run["out"]
    for name in RESULT_FILES:
        assert (out / name).is_file(), name
    for name in ("accuracy.png", "consensus.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert not list(out.glob(".*.tmp*")), "temporary files left behind"

    # The resolved config reproduces the one that ran.
    assert load_config(out / "config.toml") == load_config(tiny_config)

    provenance = json.loads((out / "provenance.json").read_text())
    assert "git_commit" in provenance
    assert provenance["seed"] == 0
    assert provenance["packages"]["torch"]
    assert "dp-accounting" in provenance["packages"]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [2, 4]  # one row per evaluation
    assert all({"accuracy_mean", "consensus_distance", "epsilon_max"} <= set(row) for row in rows)
    assert rows[0]["epsilon_max"] < rows[1]["epsilon_max"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary == _last_json(finished_run["stdout"])

    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["delta"] == 1e-5
    assert len(privacy["epsilon"]) == 4
    assert max(privacy["epsilon"]) == pytest.approx(summary["epsilon_max"])
    assert all(e_pld <= e_rdp for e_pld, e_rdp in zip(privacy["epsilon"], privacy["epsilon_rdp"], strict=True))
    assert all(e_rdp <= 5.0 for e_rdp in privacy["epsilon_rdp"])

    setup = json.loads((out / "setup.json").read_text())
    assert setup["n_agents"] == 4
    assert setup["noise_multipliers"] == pytest.approx(summary["noise_multipliers"])


def test_run_refuses_a_finished_out_dir_without_resume(finished_run: dict[str, Any], tiny_config: Path) -> None:
    out: Path = finished_run["out"]
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    code, stdout, stderr = _call(["run", str(tiny_config), "--out", str(out), "--no-progress"])
    _assert_user_error(code, stderr, "--out", "--resume")
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == before


def test_run_invalid_config_exits_2_without_creating_out(tiny_config: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    code = main(["run", str(tiny_config), "--out", str(out), "--set", "privacy.delta=2", "--no-progress"])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, "privacy.delta", "less than 1")
    assert not out.exists()


def test_run_bad_set_syntax_exits_2(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    code = main(["run", str(tiny_config), "--out", str(out), "--set", "privacy.epsilon"])
    _assert_user_error(code, capsys.readouterr().err, "--set", "KEY=VALUE")
    assert not out.exists()


def test_run_missing_config_exits_2_without_creating_out(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    code = main(["run", str(tmp_path / "missing.toml"), "--out", str(out)])
    _assert_user_error(code, capsys.readouterr().err, "no such config file", "missing.toml")
    assert not out.exists()


def test_run_non_utf8_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "binary.toml"
    config.write_bytes(b"\xff\xfe[experiment]\n")
    out = tmp_path / "never"
    code = main(["run", str(config), "--out", str(out)])
    _assert_user_error(code, capsys.readouterr().err, "CONFIG", "UTF-8")
    assert not out.exists()


def test_run_missing_data_exits_2_without_creating_out(tiny_config: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "data"
    empty.mkdir()
    out = tmp_path / "never"
    code = main(["run", str(tiny_config), "--out", str(out), "--set", "data.dataset=mnist",
                 "--data-dir", str(empty), "--no-progress"])
    _assert_user_error(code, capsys.readouterr().err, "not found in data directory", str(empty / "mnist.npz"))
    assert not out.exists()


def test_run_graph_error_exits_2_without_creating_out(tiny_config: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    code = main(["run", str(tiny_config), "--out", str(out), "--set", "topology.graph=erdos-renyi",
                 "--set", "topology.p=0.01", "--set", "topology.agents=20", "--no-progress"])
    _assert_user_error(code, capsys.readouterr().err, "erdos-renyi", "p is too small")
    assert not out.exists()


@pytest.fixture(scope="module")
def non_private_run(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("runs") / "nonprivate"
    code, stdout, stderr = _call(["run", str(tiny_config), "--out", str(out), "--set", 'privacy.epsilon="inf"',
                                  "--set", "experiment.rounds=2", "--set", "experiment.eval_every=2", "--json",
                                  "--no-progress"])
    return {"code": code, "stdout": stdout, "stderr": stderr, "out": out}


def test_run_non_private(non_private_run: dict[str, Any]) -> None:
    assert non_private_run["code"] == 0, non_private_run["stderr"]
    summary = _last_json(non_private_run["stdout"])
    assert summary["epsilon_max"] == "inf"
    assert summary["epsilon_per_agent"] == ["inf"] * 4
    assert summary["noise_multipliers"] == [0.0] * 4
    assert summary["rounds"] == 2
    assert "max inf" in non_private_run["stdout"]
    out: Path = non_private_run["out"]
    stored = tomllib.loads((out / "config.toml").read_text())
    assert stored["privacy"]["epsilon"] == "inf"
    assert json.loads((out / "summary.json").read_text())["epsilon_max"] == "inf"


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


@pytest.mark.parametrize("name", ["summary.json", "setup.json", "metrics.jsonl", "privacy.json"])
def test_non_private_results_are_standard_json(non_private_run: dict[str, Any], name: str) -> None:
    assert non_private_run["code"] == 0, non_private_run["stderr"]
    text = (non_private_run["out"] / name).read_text()
    documents = text.splitlines() if name.endswith(".jsonl") else [text]
    assert documents
    for document in documents:
        json.loads(document, parse_constant=_reject_constant)


def test_run_out_that_is_a_file_exits_2(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "a-file"
    out.write_text("not a directory")
    code, _, stderr = _call(["run", str(tiny_config), "--out", str(out), "--set", 'privacy.epsilon="inf"',
                             "--no-progress"])
    _assert_user_error(code, stderr, "--out")
    assert out.read_text() == "not a directory"


# ----------------------------------------------------------------------------- console script


def _console_script() -> str:
    candidate = Path(sys.executable).with_name("decentdp")
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("decentdp")
    if found is None:
        pytest.skip("the decentdp console script is not installed")
    return found


def test_console_script_entry_point(tmp_path: Path) -> None:
    script = _console_script()
    ok = subprocess.run([script, "privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--json"],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    result = _last_json(ok.stdout)
    assert result["sigma"] == pytest.approx(PAPER_SIGMA, rel=0.01)
    assert "Traceback" not in ok.stderr

    bad = subprocess.run([script, "privacy", "sigma", "--epsilon", "-1", *SIGMA_ARGS, "--json"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.startswith("decentdp: error: --epsilon: ")
    assert bad.stdout == ""


def test_run_profile_reports_phases_and_saves_them(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "profiled"
    code, _, stderr = _call(["run", str(tiny_config), "--out", str(out), "--profile", "--no-progress"])
    assert code == 0, stderr
    assert "profile over" in stderr and "gradients" in stderr and "busiest torch operators" in stderr
    report = json.loads((out / "profile.json").read_text())
    assert set(report["phases"]) >= {"gradients", "noise", "communication", "evaluation"}
    assert report["gradient_engine"] == "stacked"


def test_run_announces_engine_and_memory_plan(finished_run: dict[str, Any]) -> None:
    assert "gradients: stacked engine" in finished_run["stderr"]
    assert "memory: estimated peak" in finished_run["stderr"]
