"""Tests of the ``decentdp`` command line: privacy questions, experiment runs and error reporting.

Most tests call :func:`decentdp.cli.main.main` in-process; one runs the installed console script to
check the entry point itself.  Runs use the bundled ``digits`` data and a few rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, get_args

import pytest
import tomli_w
from pydantic import BaseModel, Field

from decentdp.algorithms import algorithm_class, algorithm_names, registry
from decentdp.algorithms.base import AlgorithmSettings
from decentdp.algorithms.components.optim import OPTIMIZERS
from decentdp.cli.main import _build_parser, main
from decentdp.config import load_config, validate_config
from decentdp.data.datasets import DATASETS
from decentdp.data.partition import PARTITIONS
from decentdp.experiment.build import build_experiment
from decentdp.models import MODELS
from decentdp.privacy.accounting import ACCOUNTANTS
from decentdp.runtime.scheduler import SCHEDULES
from decentdp.topology import GRAPH_KINDS, MIXING_KINDS

from conftest import tiny_config as tiny_config_raw

REPO = Path(__file__).resolve().parents[2]
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
    code, stdout, stderr = _call(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--accountant", "rdp", "--json"])
    assert code == 0, stderr
    return float(_last_json(stdout)["sigma"])


def test_privacy_sigma_json_matches_paper(capsys: pytest.CaptureFixture[str]) -> None:
    # The paper calibrated with RDP (as Opacus does); the tight default needs less noise.
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--accountant", "rdp", "--json"]) == 0
    captured = capsys.readouterr()
    result = _last_json(captured.out)
    assert {"sigma", "epsilon", "delta", "accountant"} <= set(result)
    assert result["sigma"] == pytest.approx(PAPER_SIGMA, rel=0.01)
    assert result["epsilon"] == 1.0
    assert result["delta"] == 1e-5
    assert result["accountant"] == "rdp" and result["neighbouring"] == "add-remove"
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--json"]) == 0
    tight = _last_json(capsys.readouterr().out)
    assert tight["accountant"] == "tight" and tight["sigma"] < 0.95 * result["sigma"]
    assert tight["epsilon_reached"] <= 1.0
    assert result["steps"] == 2000
    assert result["releases_per_step"] == 1
    assert captured.err == ""


def test_privacy_replace_one_prices_a_swapped_record(paper_sigma: float, capsys: pytest.CaptureFixture[str]) -> None:
    """Under replace-one a record's swap moves the sum by up to 2C, so the same sigma spends more epsilon than
    under add-remove, and the same epsilon needs more noise; both answers say which relation they assumed."""
    epsilon = ["privacy", "epsilon", "--sigma", repr(paper_sigma), *SIGMA_ARGS, "--json"]
    assert main(epsilon) == 0
    added = _last_json(capsys.readouterr().out)
    assert main([*epsilon, "--neighbouring", "replace-one"]) == 0
    swapped = _last_json(capsys.readouterr().out)
    assert swapped["neighbouring"] == "replace-one" and added["neighbouring"] == "add-remove"
    assert swapped["epsilon"] > 1.5 * added["epsilon"]
    sigma = ["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--json"]
    assert main(sigma) == 0
    added = _last_json(capsys.readouterr().out)
    assert main([*sigma, "--neighbouring", "replace-one"]) == 0
    assert _last_json(capsys.readouterr().out)["sigma"] > 1.5 * added["sigma"]


def test_privacy_sigma_human_readable_names_accountant(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--accountant", "rdp"]) == 0
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

    assert main(argv) == 0  # the epsilon question reports the tight accountant by default: here PLD's value
    default = _last_json(capsys.readouterr().out)
    assert default["accountant"] == "tight"
    assert default["epsilon"] == min(pld["epsilon"], rdp["epsilon"])


def test_privacy_epsilon_human_readable_names_accountant(paper_sigma: float,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "epsilon", "--sigma", repr(paper_sigma), *SIGMA_ARGS]) == 0
    out = capsys.readouterr().out
    assert "spends epsilon = " in out
    assert "accountant: the smaller of PLD and RDP" in out and "neighbouring: add-remove" in out


def test_privacy_under_replace_one_with_sampling_names_pld_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """RDP has no replace-one bound for Poisson-sampled releases, so the tight answer is PLD's: the label says so
    (it said "the smaller of PLD and RDP"); at sample rate 1 RDP prices replace-one, and the label is the usual."""
    assert main(["privacy", "epsilon", "--sigma", "2", *SIGMA_ARGS, "--neighbouring", "replace-one"]) == 0
    out = capsys.readouterr().out
    assert "accountant: PLD (dp_accounting PLDAccountant; RDP has no replace-one bound" in out
    assert "smaller of PLD and RDP" not in out
    assert main(["privacy", "epsilon", "--sigma", "20", "--delta", "1e-5", "--sample-rate", "1", "--steps", "10",
                 "--neighbouring", "replace-one"]) == 0
    assert "accountant: the smaller of PLD and RDP" in capsys.readouterr().out


def test_privacy_releases_no_accountant_prices_get_one_coherent_message(capsys: pytest.CaptureFixture[str]) -> None:
    """sigma 0.05 (below PLD's 0.1) with Poisson-sampled replace-one (no RDP bound): every accountant says that
    neither can price them and what would let one, naming the setting as a run and this command spell it; the
    tight answer used to join PLD's "use the RDP accountant" with RDP's "use privacy.accountant = 'tight' or
    'pld'"."""
    for accountant in ("tight", "pld", "rdp"):
        code = main(["privacy", "epsilon", "--sigma", "0.05", "--delta", "1e-5", "--sample-rate", "0.5", "--steps",
                     "3", "--neighbouring", "replace-one", "--accountant", accountant])
        err = capsys.readouterr().err
        _assert_user_error(code, err, "decentdp: error: neither accountant can price these releases: PLD")
        assert "use the RDP accountant" not in err and "tight' or 'pld'" not in err
        assert "noise multiplier of at least 0.1 (for PLD)" in err and "--neighbouring" in err
    code = main(["privacy", "epsilon", "--sigma", "1", "--delta", "1e-5", "--sample-rate", "0.5", "--steps", "3",
                 "--neighbouring", "replace-one", "--accountant", "rdp"])  # PLD prices this one: use it
    _assert_user_error(code, capsys.readouterr().err, "the RDP accountant has no replace-one bound for "
                       "Poisson-sampled releases; use the tight or PLD accountant (privacy.accountant, or --accountant")


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
    assert [row["round"] for row in rows] == [0, 2, 4]  # one row per evaluation, round 0 before training
    assert all({"accuracy_mean", "consensus_distance", "epsilon_max"} <= set(row) for row in rows)
    assert 0.0 == rows[0]["epsilon_max"] < rows[1]["epsilon_max"] < rows[2]["epsilon_max"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary == _last_json(finished_run["stdout"])

    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["delta"] == 1e-5
    assert len(privacy["epsilon"]) == 4
    assert max(privacy["epsilon"]) == pytest.approx(summary["epsilon_max"])
    assert all(e_pld <= e_rdp for e_pld, e_rdp in zip(privacy["epsilon"], privacy["epsilon_rdp"], strict=True))
    assert all(e <= 5.0 for e in privacy["epsilon"])  # the budget holds for the tight epsilon it is enforced on

    setup = json.loads((out / "setup.json").read_text())
    assert setup["n_agents"] == 4
    assert setup["noise_multipliers"] == pytest.approx(summary["noise_multipliers"])



def _git(folder: Path, *arguments: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *arguments], cwd=folder, check=True,
                          capture_output=True, text=True).stdout.strip()


def _git_commit_of(module: Path) -> str | None:
    """``git_commit`` as a copy of ``results/files.py`` lying at ``module`` computes it (from its own place)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"files_copy_{abs(hash(module))}", module)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy.git_commit()


def test_provenance_names_no_commit_of_a_project_decentdp_is_installed_in(tmp_path: Path) -> None:
    """decentdp in a project's .venv lies inside the project's git repository: that project's HEAD (dirty from its
    own changes) is not decentdp's commit, and provenance says none; decentdp's own checkout (its pyproject.toml at
    the top, the package under src/) names its commit."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    import decentdp.results.files as files

    project = tmp_path / "project"
    project.mkdir()
    _git(project, "init", "-q")
    (project / "analysis.py").write_text("print('mine')\n")
    _git(project, "add", "analysis.py")
    _git(project, "commit", "-qm", "user's work")
    (project / "analysis.py").write_text("print('changed')\n")  # the user's uncommitted change
    installed = project / ".venv" / "lib" / "python3" / "site-packages" / "decentdp" / "results" / "files.py"
    installed.parent.mkdir(parents=True)
    shutil.copy(files.__file__, installed)
    assert _git_commit_of(installed) is None

    checkout = tmp_path / "decentdp"
    module = checkout / "src" / "decentdp" / "results" / "files.py"
    module.parent.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "decentdp"\n')
    _git(checkout, "init", "-q")
    _git(checkout, "add", "pyproject.toml")
    _git(checkout, "commit", "-qm", "start")
    shutil.copy(files.__file__, module)  # (a module not yet added still belongs to the checkout)
    assert _git_commit_of(module) == _git(checkout, "rev-parse", "HEAD")
    _git(checkout, "add", "src")
    _git(checkout, "commit", "-qm", "the package")
    (module.parent / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text('[project]\nname = "decentdp"\nversion = "2"\n')
    assert _git_commit_of(module) == _git(checkout, "rev-parse", "HEAD") + "+dirty"

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
    assert summary["epsilon_max"] is None  # results spell an infinite epsilon null (JSON has no infinity)
    assert summary["epsilon_per_agent"] == [None] * 4
    assert summary["noise_multipliers"] == [0.0] * 4
    assert summary["rounds"] == 2
    assert "max inf  [inf, inf, inf, inf]" in non_private_run["stdout"]
    out: Path = non_private_run["out"]
    stored = tomllib.loads((out / "config.toml").read_text())
    assert stored["privacy"]["epsilon"] == "inf"
    assert json.loads((out / "summary.json").read_text())["epsilon_max"] is None


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
    ok = subprocess.run([script, "privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--accountant", "rdp", "--json"],
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


# ----------------------------------------------------------------------------- help


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Every option, positional argument and subcommand of ``parser`` (recursively) that has no help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            documented = {choice.dest for choice in action._choices_actions if choice.help}
            missing += [f"{parser.prog} {name}" for name in action.choices if name not in documented]
            for sub in action.choices.values():
                missing += _undocumented(sub)
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_command_has_help() -> None:
    assert _undocumented(_build_parser()) == []


def test_the_help_check_finds_an_undocumented_option() -> None:
    parser = argparse.ArgumentParser(prog="p")
    commands = parser.add_subparsers(dest="command")
    sub = commands.add_parser("sub", help="a documented command")
    sub.add_argument("--documented", help="fine")
    sub.add_argument("--silent")
    commands.add_parser("bare")
    assert sorted(_undocumented(parser)) == ["p bare", "p command", "p sub --silent"]


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width


def test_run_help_says_where_allowed_values_are(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["run"], capsys)
    assert "`decentdp list`" in text
    for option in ("--dry-run", "--threads N", "engine.threads=N", "--set KEY=VALUE"):
        assert option in text


@pytest.mark.parametrize(("question", "default"), [("sigma", "tight"), ("epsilon", "tight")])
def test_privacy_help_shows_default_accountant_and_both_sampling_forms(
        question: str, default: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["privacy", question], capsys)
    assert f"(default: {default})" in text
    for option in ("--sample-rate", "--steps", "--batch-size", "--dataset-size", "--epochs"):
        assert option in text
    assert "ceil(E * N / B)" in text


# ----------------------------------------------------------------------------- list


@pytest.fixture(scope="module")
def listing() -> dict[str, Any]:
    code, stdout, stderr = _call(["list", "--json"])
    assert code == 0, stderr
    return json.loads(stdout)


def _listed(listing: dict[str, Any], category: str) -> list[Any]:
    return [entry["name"] for entry in listing[category]]


def test_list_json_agrees_with_the_code(listing: dict[str, Any]) -> None:
    assert set(listing) >= {"algorithms", "datasets", "partitions", "graphs", "mixings", "models", "schedules",
                            "accountants", "optimizers"}
    # the config schema's choices, checked against the modules that implement them
    assert _listed(listing, "algorithms") == list(algorithm_names())
    assert _listed(listing, "datasets") == list(DATASETS)
    assert _listed(listing, "partitions") == list(PARTITIONS)
    assert _listed(listing, "graphs") == list(GRAPH_KINDS)
    assert _listed(listing, "mixings") == list(MIXING_KINDS)
    assert sorted(_listed(listing, "models")) == sorted(MODELS)
    assert _listed(listing, "schedules") == ["auto", *SCHEDULES]
    assert _listed(listing, "accountants") == list(ACCOUNTANTS)
    assert _listed(listing, "optimizers") == list(OPTIMIZERS)


def test_list_algorithms_with_their_own_settings(listing: dict[str, Any]) -> None:
    for entry in listing["algorithms"]:
        fields = algorithm_class(entry["name"]).Settings.model_fields
        assert [setting["name"] for setting in entry["settings"]] == list(fields)
        assert all(setting["default"] == fields[setting["name"]].default for setting in entry["settings"])
        assert entry["description"]
    dinno = {s["name"]: s for s in next(e for e in listing["algorithms"] if e["name"] == "dp-dinno")["settings"]}
    assert dinno["primal_steps"] == {"name": "primal_steps", "type": "int", "default": 1, "required": False,
                                     "constraints": [">= 1"], "description": "T noisy primal steps per round"}
    assert dinno["optimizer"]["type"] == "sgd | adam"
    assert dinno["optimizer"]["default"] == "sgd"
    assert dinno["momentum"]["constraints"] == [">= 0.0", "< 1.0"]


def test_list_graphs_name_the_parameter_each_needs(listing: dict[str, Any]) -> None:
    needs = {entry["name"]: entry["needs"] for entry in listing["graphs"]}
    assert {graph: params for graph, params in needs.items() if params} == {
        "erdos-renyi": ["p"], "geometric": ["radius"], "fiedler": ["fiedler"], "k-regular": ["k"],
        "partial-mesh": ["p"]}


def test_list_models_with_their_options(listing: dict[str, Any]) -> None:
    options = {entry["name"]: entry["options"] for entry in listing["models"]}
    assert options["mlp"] == {"hidden": 100}
    assert options["lenet5"] == {"activation": "tanh"}
    assert options["convnet"] == {"activation": "mish", "norm": "none"}
    assert options["cifar-cnn"] == {}


def test_list_follows_the_registry(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class KnobSettings(AlgorithmSettings):
        knob: int = Field(3, ge=0, description="a knob only this algorithm has")

    fake = type("Knobbed", (algorithm_class("dp-dsgd"),), {"name": "knobbed", "Settings": KnobSettings,
                                                           "__doc__": "An algorithm with a knob.",
                                                           "__module__": "not_an_imported_module"})
    monkeypatch.setitem(registry._REGISTRY, "knobbed", fake)
    assert main(["list", "algorithms", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed) == {"algorithms"}
    entry = next(e for e in listed["algorithms"] if e["name"] == "knobbed")
    assert entry["description"] == "An algorithm with a knob."
    assert entry["settings"] == [{"name": "knob", "type": "int", "default": 3, "required": False,
                                  "constraints": [">= 0"], "description": "a knob only this algorithm has"}]
    assert main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    assert "knobbed" in out and "knob" in out and "a knob only this algorithm has" in out


def test_list_one_category_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "graphs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graphs (topology.graph)")
    line = next(line for line in out.splitlines() if "erdos-renyi" in line)
    assert "topology.p" in line
    assert "algorithms" not in out
    assert main(["list", "graph"]) == 0  # the singular is accepted
    assert capsys.readouterr().out == out


def test_list_everything_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for header in ("algorithms (algorithm.name)", "datasets (data.dataset)", "models (model.name)",
                   "optimizers (algorithm.optimizer)", "accountants (privacy.accountant)"):
        assert header in out
    assert "primal_steps" in out and "T noisy primal steps per round" in out


def test_list_unknown_category_exits_2_listing_the_categories(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["list", "colours"])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, "WHAT", "'colours'", "algorithms", "graphs", "optimizers")
    assert captured.out == ""


# ----------------------------------------------------------------------------- privacy: Opacus-style sampling

OPACUS_ARGS = ["--batch-size", "256", "--dataset-size", "60000", "--epochs", "10"]


def test_privacy_opacus_form_is_rate_and_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", "--delta", "1e-5", *OPACUS_ARGS, "--json"]) == 0
    captured = capsys.readouterr()
    opacus = _last_json(captured.out)
    assert opacus["sample_rate"] == 256 / 60000
    assert opacus["steps"] == 2344  # ceil(10 * 60000 / 256) = ceil(2343.75)
    assert (opacus["batch_size"], opacus["dataset_size"], opacus["epochs"]) == (256, 60000, 10)
    assert "ceil(10 * 60000 / 256) = 2344" in captured.out
    direct = ["--sample-rate", repr(256 / 60000), "--steps", "2344"]
    assert main(["privacy", "sigma", "--epsilon", "1", "--delta", "1e-5", *direct, "--json"]) == 0
    assert _last_json(capsys.readouterr().out)["sigma"] == opacus["sigma"]

    assert main(["privacy", "epsilon", "--sigma", "1", "--delta", "1e-5", *OPACUS_ARGS, "--json"]) == 0
    by_opacus = _last_json(capsys.readouterr().out)
    assert main(["privacy", "epsilon", "--sigma", "1", "--delta", "1e-5", *direct, "--json"]) == 0
    assert by_opacus["epsilon"] == _last_json(capsys.readouterr().out)["epsilon"]


def test_privacy_opacus_steps_are_exact(capsys: pytest.CaptureFixture[str]) -> None:
    assert math.ceil(1.1 * 100 / 1) == 111  # what float arithmetic would say
    argv = ["privacy", "epsilon", "--sigma", "1", "--delta", "1e-5", "--batch-size", "1", "--dataset-size", "100",
            "--epochs", "1.1", "--accountant", "rdp", "--json"]
    assert main(argv) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["steps"] == 110
    assert result["sample_rate"] == 0.01


@pytest.mark.parametrize(("sampling", "fragments"), [
    ([], ("no sampling given", "--sample-rate and --steps", "--batch-size, --dataset-size and --epochs")),
    (["--sample-rate", "0.1", "--steps", "10", "--batch-size", "10"], ("--sample-rate and --steps", "--batch-size",
                                                                         "not both")),
    (["--steps", "10", "--epochs", "1"], ("--steps", "--epochs", "not both")),
    (["--sample-rate", "0.1"], ("decentdp: error: --steps: missing", "--sample-rate")),
    (["--steps", "10"], ("decentdp: error: --sample-rate: missing",)),
    (["--batch-size", "10", "--dataset-size", "100"], ("decentdp: error: --epochs: missing",)),
    (["--epochs", "2"], ("decentdp: error: --batch-size: missing", "--dataset-size")),
    (["--batch-size", "0", "--dataset-size", "100", "--epochs", "1"], ("decentdp: error: --batch-size: ",)),
    (["--batch-size", "200", "--dataset-size", "100", "--epochs", "1"], ("decentdp: error: --batch-size: ",
                                                                          "--dataset-size = 100")),
    (["--batch-size", "1", "--dataset-size", "0", "--epochs", "1"], ("decentdp: error: --dataset-size: ",)),
    (["--batch-size", "1", "--dataset-size", "100", "--epochs", "0"], ("decentdp: error: --epochs: ",)),
    (["--batch-size", "1", "--dataset-size", "100", "--epochs", "inf"], ("decentdp: error: --epochs: ",)),
    (["--batch-size", "1", "--dataset-size", "100", "--epochs", "nan"], ("decentdp: error: --epochs: ",)),
])
@pytest.mark.parametrize("question", [["sigma", "--epsilon", "1"], ["epsilon", "--sigma", "1"]])
def test_privacy_exactly_one_sampling_form(question: list[str], sampling: list[str], fragments: tuple[str, ...],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["privacy", *question, "--delta", "1e-5", *sampling])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, *fragments)
    assert captured.out == ""


@pytest.mark.parametrize("accountant", ["tight", "rdp", "pld"])
def test_privacy_sigma_reports_the_epsilon_it_reaches(accountant: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", *SIGMA_ARGS, "--accountant", accountant, "--json"]) == 0
    out = capsys.readouterr().out
    result = _last_json(out)
    assert {"sigma", "epsilon", "delta", "accountant", "sample_rate", "steps", "releases_per_step"} <= set(result)
    assert result["epsilon"] == 1.0
    assert result["epsilon_reached"] <= 1.0
    assert result["epsilon_reached"] == pytest.approx(1.0, rel=0.01)
    assert "epsilon reached with this sigma" in out
    # the same accountant, asked the other question about the printed sigma (the returned one rounded up), gives
    # the same answer
    assert result["sigma_printed"] >= result["sigma"]
    assert main(["privacy", "epsilon", "--sigma", repr(result["sigma_printed"]), *SIGMA_ARGS, "--accountant",
                 accountant, "--json"]) == 0
    assert _last_json(capsys.readouterr().out)["epsilon"] == result["epsilon_reached"]


def test_privacy_sigma_for_no_budget_reaches_infinity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "inf", *SIGMA_ARGS, "--json"]) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["sigma"] == 0.0
    assert result["epsilon_reached"] == "inf"


# ----------------------------------------------------------------------------- run --dry-run, --threads


def _must_not_run(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a dry run must not build or train anything")


def test_run_dry_run_prints_resolved_config_and_writes_nothing(
        tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("decentdp.experiment.loop.run_experiment", _must_not_run)
    monkeypatch.setattr("decentdp.experiment.build.build_experiment", _must_not_run)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "never"
    overrides = ["--set", "privacy.epsilon=2", "--set", "experiment.rounds=7"]
    code = main(["run", str(tiny_config), *overrides, "--out", str(out), "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""
    resolved = tomllib.loads(captured.out)
    expected = load_config(tiny_config, ["privacy.epsilon=2", "experiment.rounds=7"])
    assert resolved == expected.to_toml_dict()
    assert validate_config(resolved) == expected
    assert resolved["algorithm"]["weight_decay"] == 0.0  # the algorithm's own settings, defaults included
    assert not out.exists()
    assert list(cwd.iterdir()) == []  # no results/ folder either


def test_run_dry_run_loads_no_data(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "data"
    empty.mkdir()
    code = main(["run", str(tiny_config), "--set", "data.dataset=mnist", "--data-dir", str(empty), "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0, captured.err  # a real run stops at the missing mnist.npz
    assert tomllib.loads(captured.out)["data"]["dataset"] == "mnist"


def test_run_dry_run_invalid_config_exits_2(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(tiny_config), "--set", "privacy.delta=2", "--dry-run"])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, "privacy.delta", "less than 1")
    assert captured.out == ""


@pytest.mark.parametrize(("overrides", "fragments"), [
    (["topology.graph=erdos-renyi", "topology.agents=10", "topology.p=0.05"],
     ["decentdp: error: topology.p: no connected erdos-renyi graph", "raise it"]),
    (["topology.graph=fiedler", "topology.fiedler=0.45", "topology.fiedler_tol=0.001"],
     ["decentdp: error: topology.fiedler: no geometric graph on 4 agents", "topology.fiedler_tol"]),
    (["topology.graph=fiedler", "topology.agents=10", "topology.fiedler=0.95"],
     ["topology.fiedler: normalized Fiedler value 0.95", "(N-2)/N = 0.8"]),
    (["topology.graph=k-regular", "topology.agents=9", "topology.k=3"], ["topology.k: n_agents * k must be even"]),
    (["topology.graph=torus", "topology.agents=10"], ["topology.agents: a torus needs at least 3 rows"]),
    (["topology.graph=grid", "topology.agents=13"], ["topology.agents: a grid needs", "13 is prime"]),
])
def test_run_dry_run_refuses_a_graph_the_run_could_not_build(tiny_config: Path, overrides: list[str],
                                                             fragments: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The graph's deterministic checks run in validation and the dry-run draws the first graph, so a random search
    that finds no connected draw (or none on the Fiedler target) fails it, naming the field to change, not only the
    run's start (a review: all six passed --dry-run)."""
    code = main(["run", str(tiny_config), *(part for item in overrides for part in ("--set", item)), "--dry-run"])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, *fragments)
    assert "max_tries" not in captured.err
    assert captured.out == ""


def test_run_dry_run_says_what_a_run_would_warn_of_the_config(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-written key that is another algorithm's default is dropped, and fields a pooled run does not read are
    accepted: a run says both when it starts, and --dry-run on stderr (stdout stays the resolved TOML)."""
    path = tmp_path / "pooled.toml"
    path.write_text("[algorithm]\nname = 'central-dpsgd'\ncorrelation = 3.0\n[topology]\ngraph = 'erdos-renyi'\n"
                    "agents = 7\np = 0.5\nredraw_every = 2\n[data]\npartition = 'dirichlet'\n"
                    "[privacy]\nepsilon = 1.0\n", encoding="utf-8")
    assert main(["run", str(path), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert tomllib.loads(captured.out)["algorithm"]["name"] == "central-dpsgd"
    lines = captured.err.splitlines()
    assert any(line.startswith("warning: algorithm.correlation = 3.0 is not a setting of 'central-dpsgd'")
               for line in lines), captured.err
    unread = next(line for line in lines if "change nothing" in line)
    for field in ("topology.graph = 'erdos-renyi'", "topology.agents = 7", "topology.p = 0.5",
                  "topology.redraw_every = 2", "data.partition = 'dirichlet'"):
        assert field in unread
    assert "topology.mixing" not in unread and "data.dirichlet_alpha" not in unread  # (at their defaults)
    assert load_config(path).notices == [line.removeprefix("warning: ") for line in lines]


def test_fields_a_run_does_not_read_are_said_where_its_agents_never_communicate() -> None:
    local = validate_config(tiny_config_raw(algorithm={"name": "local"},
                                            topology={"graph": "ring", "agents": 5, "mixing": "average"}))
    assert local.notices == ["topology.graph = 'ring', topology.mixing = 'average' change nothing: 'local' trains "
                             "each agent alone and sends no message (no graph)"]
    assert validate_config(tiny_config_raw(topology={"graph": "ring", "agents": 5})).notices == []


def test_list_fields_names_every_schema_field(capsys: pytest.CaptureFixture[str]) -> None:
    """`decentdp list fields` is the config reference (README.md points to it): every field of every section, the
    optional [personalized] included, with its type, default and description."""
    from decentdp.config import ExperimentConfig

    expected = {f"{section}.{key}" for section, field in ExperimentConfig.model_fields.items()
                for kind in (field.annotation, *get_args(field.annotation)) if isinstance(kind, type)
                and issubclass(kind, BaseModel) for key in kind.model_fields}
    assert main(["list", "fields", "--json"]) == 0
    entries = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)["fields"]}
    assert set(entries) == expected and any(name.startswith("personalized.") for name in entries)
    assert entries["engine.noise_streams"]["default"] == "auto" and entries["topology.rows"]["type"] == "int | None"
    assert main(["list", "fields"]) == 0
    text = capsys.readouterr().out
    assert all(f"  {name} " in text for name in expected)
    assert 'data.validation_fraction         float (>= 0.0, <= 0.5); default 0.0  hold out' in text


def test_run_threads_is_engine_threads(tiny_config: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_config), "--threads", "3", "--dry-run"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["engine"]["threads"] == 3
    # the option wins over a --set of the same field, wherever it stands
    assert main(["run", str(tiny_config), "--threads", "2", "--set", "engine.threads=5", "--dry-run"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["engine"]["threads"] == 2

    seen = []

    class Stop(Exception):
        pass

    def capture(config: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(config)
        raise Stop

    monkeypatch.setattr("decentdp.experiment.loop.run_experiment", capture)
    with pytest.raises(Stop):
        main(["run", str(tiny_config), "--threads", "4", "--out", "unused"])
    assert seen[0].engine.threads == 4


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_run_threads_must_be_a_positive_integer(tiny_config: Path, value: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", str(tiny_config), "--threads", value, "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "positive integer" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- init


def test_init_demo_is_experiments_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.toml"
    assert main(["init", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Written by `decentdp init --template demo`")
    assert load_config(out) == load_config(REPO / "experiments" / "demo.toml")


def test_init_names_the_experiment_after_the_file(tmp_path: Path) -> None:
    assert main(["init", str(tmp_path / "mnist-eps1.toml")]) == 0
    assert load_config(tmp_path / "mnist-eps1.toml").experiment.name == "mnist-eps1"
    assert main(["init", str(tmp_path / "no good.toml")]) == 0  # not a valid name: the template's is kept
    assert load_config(tmp_path / "no good.toml").experiment.name == "demo"


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_init_algorithm_templates_pass_dry_run_and_build(algorithm: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Each template passes --dry-run and builds as a run would (data, calibration), which --dry-run does not: the
    no-noise template once wrote epsilon = 4.0, which every run refused."""
    out = tmp_path / "sub" / f"{algorithm}.toml"  # missing folders are created
    assert main(["init", str(out), "--template", algorithm]) == 0
    config = load_config(out)
    assert config.algorithm.name == algorithm
    demo = load_config(REPO / "experiments" / "demo.toml")
    if not algorithm_class(algorithm).adds_noise:  # its template says the run is not private
        assert config.privacy.epsilon == math.inf
        demo.privacy.epsilon = math.inf
    if not algorithm_class(algorithm).communicates:  # its template sets no graph, which it would not read
        assert config.topology.agents == demo.topology.agents
        demo.topology = config.topology
    assert (config.data, config.topology, config.privacy, config.model) == (demo.data, demo.topology,
                                                                           demo.privacy, demo.model)
    capsys.readouterr()
    assert main(["run", str(out), "--dry-run"]) == 0
    assert tomllib.loads(capsys.readouterr().out) == config.to_toml_dict()
    assert build_experiment(config).algorithm.name == algorithm


def test_init_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine.toml"
    out.write_text("# my own config\n")
    code = main(["init", str(out)])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, "OUT", str(out), "already exists")
    assert out.read_text() == "# my own config\n"


def test_init_under_a_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OUT's folder is a file: said as such (it was "OUT: mine.toml/x.toml already exists", which it did not)."""
    (tmp_path / "mine.toml").write_text("# my own config\n")
    out = tmp_path / "mine.toml" / "x.toml"
    code = main(["init", str(out)])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, "OUT", f"{tmp_path / 'mine.toml'} is a file, not a folder")
    assert "already exists" not in captured.err
    assert (tmp_path / "mine.toml").read_text() == "# my own config\n"


def test_init_unknown_template_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.toml"
    code = main(["init", str(out), "--template", "dp-sgd-please"])
    _assert_user_error(code, capsys.readouterr().err, "--template", "'dp-sgd-please'", "demo", *algorithm_names())
    assert not out.exists()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_an_interrupt_advises_resume_only_when_there_is_a_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        checkpointed: bool) -> None:
    import decentdp.experiment.loop

    out = tmp_path / "out"

    def interrupted(*args: object, **kwargs: object) -> None:
        if checkpointed:
            out.mkdir()
            (out / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(decentdp.experiment.loop, "run_experiment", interrupted)
    assert main(["run", str(REPO / "experiments" / "demo.toml"), "--out", str(out)]) == 130
    message = capsys.readouterr().err
    if checkpointed:
        assert f"--resume --out {out}" in message
    else:
        assert "nothing to resume" in message and "--resume" not in message


def test_sigterm_stops_a_run_as_ctrl_c_does_and_says_how_to_resume(tmp_path: Path) -> None:
    """A review: SIGTERM (how batch schedulers and run_jobs.py's deadline stop a job) ended `decentdp run` at once
    with 143: no "continue with ... --resume" line, and its MLflow run left RUNNING.  It stops as Ctrl-C does, still
    exiting 128 + 15, and the folder resumes."""
    pytest.importorskip("mlflow")
    import signal
    import time

    import decentdp

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = tmp_path / "long.toml"
    config.write_text(tomli_w.dumps(tiny_config_raw(
        experiment={"rounds": 20000, "eval_every": 20000, "checkpoint_every": 1},
        privacy={"accountant": "rdp"}, tracking={"backend": "mlflow", "uri": uri})))
    out = tmp_path / "run"
    source = str(Path(decentdp.__file__).parents[1])
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (source, os.environ.get("PYTHONPATH")))),
                   "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "decentdp.cli", "run", str(config), "--out", str(out),
                                "--no-progress"], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    end = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() and process.poll() is None and time.monotonic() < end:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert f"terminated (SIGTERM); continue with: decentdp run {config} --resume --out {out}" in err
    assert "Traceback" not in err
    tracking = pytest.importorskip("mlflow.tracking")
    client = tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("decentdp").experiment_id])
    assert run.info.status == "KILLED"
    assert not (out / ".lock").exists()


def test_running_out_of_memory_is_one_message_and_other_errors_still_raise(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """A config whose sizes do not fit (a reviewer's hidden = 10**9, personalized.dim = 10**9) ended in an
    allocator's traceback; it is one line naming what to lower.  A RuntimeError that is not the allocator's is
    a bug and keeps its traceback."""
    from decentdp.cli import main as cli_main

    for error in (MemoryError("Unable to allocate 13.3 TiB"),
                  RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 256000000000 bytes")):
        def fail(_args: object, error: BaseException = error) -> int:
            raise error

        monkeypatch.setitem(cli_main._COMMANDS, "list", fail)
        assert main(["list"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decentdp: error: out of memory") and "Traceback" not in err
    monkeypatch.setitem(cli_main._COMMANDS, "list", lambda _args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["list"])
