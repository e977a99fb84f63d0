"""What a new user meets (issue 37): damaged files, closed pipes and shared results folders get one message
naming the file or the folder, no traceback and nothing half-written; the run names one accountant."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from tests.conftest import tiny_config

from decentdp import cli
from decentdp.cli import EXIT_USER_ERROR, main
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.results import CHECKPOINT_FILE
from decentdp.run.record import LOCK_FILE, ResultsFolder


def _call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A config file and the results folder of its finished run."""
    folder = tmp_path_factory.mktemp("run")
    config = folder / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_config()), encoding="utf-8")
    code, _, err = _call(["run", str(config), "--out", str(folder / "out"), "--no-progress"])
    assert code == 0, err
    return config, folder / "out"


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda data: b"", "is empty"),
    (lambda data: data[: len(data) // 2], "cannot be read"),
    (lambda data: b"not a checkpoint at all" * 40, "cannot be read"),
])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_writes_nothing(finished: tuple[Path, Path],
                                                                            tmp_path: Path, damage, expected) -> None:
    config, out = finished
    copy = tmp_path / "out"
    copy.mkdir()
    for file in out.iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    checkpoint = copy / CHECKPOINT_FILE
    checkpoint.write_bytes(damage(checkpoint.read_bytes()))
    before = {file.name: file.read_bytes() for file in copy.iterdir()}
    code, _, err = _call(["run", str(config), "--out", str(copy), "--resume", "--no-progress"])
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert str(checkpoint) in err and expected in err and "--resume" in err
    assert {file.name: file.read_bytes() for file in copy.iterdir()} == before


def test_a_closed_pipe_ends_the_output_quietly(finished: tuple[Path, Path]) -> None:
    """``decentdp report ... --json | head``: the reader leaves early; no BrokenPipeError traceback.  The
    report here prints more than a pipe holds (a short one fits in the pipe and never meets the closed end)."""
    _, out = finished
    program = ("import sys; from decentdp import cli; "
               "cli._COMMANDS['report'] = lambda args: [print('x' * 1000) for _ in range(2000)] and 0; "
               f"sys.exit(cli.main(['report', {str(out)!r}, '--json']))")
    result = subprocess.run(["sh", "-c", f"'{sys.executable}' -c \"{program}\" | head -c 5"], capture_output=True,
                            text=True, timeout=120)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_the_resume_hint_after_an_interrupt_can_be_pasted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           finished: tuple[Path, Path]) -> None:
    """The printed command carries the --data-dir the run was given (without it, pasting it fails)."""
    config, _ = finished
    out = tmp_path / "out"

    def interrupted(*args, **kwargs):
        out.mkdir()
        (out / CHECKPOINT_FILE).write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr("decentdp.run.loop.run_experiment", interrupted)
    code, _, err = _call(["run", str(config), "--out", str(out), "--data-dir", "/data/here", "--no-progress"])
    assert code == 130 and f"--resume --out {out} --data-dir /data/here" in err


def test_a_large_run_summarises_its_epsilons_on_one_line() -> None:
    """943 agents' epsilons are not printed one by one: their range and median, the values in summary.json."""
    line = cli._per_agent([1.0] * 940 + [0.5, None, 2.0])
    assert line == "943 agents: min 0.500, median 1.000, max inf; each in summary.json"
    assert cli._per_agent([1.0, None]) == "1.000, inf"


def test_one_writer_per_results_folder(tmp_path: Path) -> None:
    """A second run on a folder another run is writing is refused, naming the writer's process, and so is
    --resume of it; once the first ends, the folder is free and holds no lock file."""
    config = validate_config(tiny_config())
    out = tmp_path / "out"
    first = ResultsFolder(out)
    first.open(config, resume=False)
    with pytest.raises(ConfigError, match=rf"being written by another run \(process {os.getpid()}\)"):
        ResultsFolder(out).open(config, resume=False)
    (out / CHECKPOINT_FILE).write_bytes(b"")
    with pytest.raises(ConfigError, match="being written by another run"):
        ResultsFolder(out).open(config, resume=True)
    first.close()
    assert not (out / LOCK_FILE).exists()


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path: Path) -> None:
    """The folder is created (and locked) before the build; a build that fails removes it again."""
    config = tmp_path / "bad.toml"
    config.write_text(tomli_w.dumps(tiny_config(data={"dataset": "mnist", "partition": "iid"})), encoding="utf-8")
    out = tmp_path / "results" / "never"
    code, _, err = _call(["run", str(config), "--out", str(out), "--data-dir", str(tmp_path / "nothing"),
                          "--no-progress"])
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert not out.exists()


def test_a_run_names_one_accountant_from_its_log_to_its_summary(tmp_path: Path) -> None:
    """With privacy.accountant = "rdp" the log said eps(rdp) 4 and then (TIGHT) 3.562, and summary.json said
    tight: every epsilon a run prints is now by the accountant it was configured with."""
    config = tmp_path / "rdp.toml"
    config.write_text(tomli_w.dumps(tiny_config(privacy={"epsilon": 5.0, "delta": 1e-5, "clip": 1.0,
                                                         "accountant": "rdp"})), encoding="utf-8")
    code, out, err = _call(["run", str(config), "--out", str(tmp_path / "out"), "--no-progress", "--json"])
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    last_row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().strip().splitlines()[-1])
    assert summary["epsilon_accountant"] == last_row["epsilon_accountant"] == "rdp"
    assert summary["epsilon_max"] == pytest.approx(last_row["epsilon_max"])
    assert "(RDP," in out and "(TIGHT" not in out and "eps(rdp)" in err


def _ratings(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "u.data").write_text("\n".join(lines) + "\n", encoding="latin-1")
    return folder


def test_movielens_files_with_few_users_or_huge_ids_are_refused_before_allocating(tmp_path: Path) -> None:
    """3 users with 10 neighbours asked ended in a RuntimeError deep in the runner, and a huge user id
    allocated 7 GiB and died: the first names personalized.neighbours, the second the file and line."""
    from decentdp.data.movielens import load_movielens
    from decentdp.errors import DataError

    few = _ratings(tmp_path / "few", [f"{u}\t{i}\t{(u + i) % 5 + 1}\t0" for u in (1, 2, 3) for i in range(1, 9)])
    with pytest.raises(ConfigError, match="personalized.neighbours.*has 3 user ids"):
        load_movielens(few, 0, neighbours=10)
    huge = _ratings(tmp_path / "huge", ["1\t1\t5\t0", "2\t2\t4\t0", "900000\t3\t3\t0"])
    with pytest.raises(DataError, match=r"u\.data, line 3: ids are used as indices"):
        load_movielens(huge, 0)


@pytest.mark.parametrize(("assignment", "field"), [("audit.batch_sizes=[0]", "audit.batch_sizes.0"),
                                                   ("audit.batch_sizes=[100000000]", "audit.batch_sizes.0"),
                                                   ("audit.epsilons=[-1.0]", "audit.epsilons.0")])
def test_an_inversion_attack_refuses_impossible_batches_and_budgets(assignment: str, field: str) -> None:
    """A batch of 0 ended in a ZeroDivisionError, a huge one tried to allocate 20 TiB, and a negative epsilon
    was reported as privacy.epsilon: each is refused before anything runs, naming the audit field."""
    config = Path(__file__).resolve().parents[1] / "experiments" / "audits" / "inversion-mnist.toml"
    code, _, err = _call(["attack", "inversion", str(config), "--set", assignment])
    assert code == EXIT_USER_ERROR and field in err and "Traceback" not in err


def test_a_report_over_a_personalized_run_and_a_consensus_run_names_each(finished: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """Issue 37: a report over a digits run and a personalized run claimed "dataset = digits" for both (the
    personalized run's config holds unused defaults), and with --out it crashed on the personalized metrics
    (KeyError: 'round').  Each run now names its own dataset, so the two are refused as one table, saying
    why; the personalized run alone is reported, its files written."""
    demo = Path(__file__).resolve().parents[1] / "experiments" / "personalized" / "demo-synthetic.toml"
    personal = tmp_path / "personal"
    assert _call(["run", str(demo), "--out", str(personal)])[0] == 0
    _, consensus = finished
    code, _, err = _call(["report", str(consensus), str(personal), "--json"])
    assert code == EXIT_USER_ERROR and "digits" in err and "synthetic" in err and "Traceback" not in err
    code, out, err = _call(["report", str(personal), "--out", str(tmp_path / "report"), "--json"])
    assert code == 0 and "Traceback" not in err, err
    shared = json.loads(out.strip().splitlines()[-1])["shared"]
    assert shared["data.dataset"] == "synthetic" and shared["algorithm.name"] == "personalized cd"
    assert "topology.graph" not in shared and "model.name" not in shared   # defaults that never ran
