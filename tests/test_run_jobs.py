"""``experiments/run_jobs.py``, which ran the reproductions' grids side by side on the lent GPU: jobs run in the
list's order, a finished job is skipped the next time, a failed one is tried again, the deadline stops what is
running (and its children), and a malformed list is refused with its line number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import tomli_w

from conftest import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "run_jobs.py"


@pytest.fixture(scope="module")
def run_jobs() -> ModuleType:
    return load_script(SCRIPT, "run_jobs")


def _jobs(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "jobs.tsv"
    path.write_text("# a comment\n\n" + "\n".join(lines) + "\n")
    return path


def test_jobs_run_once_and_a_failure_is_tried_again(run_jobs: ModuleType, tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    jobs = _jobs(tmp_path, [f"first\techo run >> {out}/first", f"broken\techo tried >> {out}/broken; exit 3",
                            f"second\techo $OMP_NUM_THREADS > {out}/second"])
    for _ in range(2):
        run_jobs.main([str(jobs), "--workers", "2", "--log-dir", str(logs)])
    assert (out / "first").read_text() == "run\n"            # done: skipped the second time
    assert (out / "broken").read_text() == "tried\ntried\n"  # failed: tried again
    assert (out / "second").read_text() == "1\n"             # one thread per job
    assert sorted(path.name for path in logs.glob("*.done")) == ["first.done", "second.done"]
    assert '"returncode": 3' in (logs / "broken.failed").read_text()


def _ended(pid: int, wait: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie waiting for its new parent to reap it)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_the_deadline_stops_running_jobs_and_their_children(run_jobs: ModuleType, tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    jobs = _jobs(tmp_path, [f"slow\tsleep 30 & echo $! > {child}; wait", "waiting\ttrue"])
    started = time.monotonic()
    run_jobs.main([str(jobs), "--workers", "1", "--deadline", "1.5", "--log-dir", str(tmp_path / "logs")])
    assert time.monotonic() - started < 10
    assert _ended(int(child.read_text()))  # the job's own child is stopped too, not only its shell
    assert not (tmp_path / "logs" / "slow.done").exists()
    assert not (tmp_path / "logs" / "waiting.log").exists()  # never started


def test_a_generated_run_line_resumes_a_stopped_run_and_skips_a_finished_one(
        run_jobs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The line the experiments' generators write (``run_line``) continues a run that a deadline stopped, whose
    folder holds its checkpoint, instead of refusing the folder; the result is the uninterrupted run's.  A folder
    without a checkpoint is started again from nothing."""
    from decentdp.config import load_config
    from decentdp.experiment.loop import run_experiment

    from conftest import tiny_config

    config = tmp_path / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_config(experiment={"rounds": 6, "eval_every": 2, "checkpoint_every": 2})))
    quiet = {"progress": False, "log": lambda _line: None}
    out = tmp_path / "run"
    run_experiment(load_config(config, ["experiment.seed=1", "engine.threads=1"]), out, stop_after=2, **quiet)
    assert (out / "checkpoint.pt").exists() and not (out / "summary.json").exists()
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # where `decentdp` lives
    jobs = _jobs(tmp_path, [run_jobs.run_line("tiny", str(config), 1, str(tmp_path), str(out))])
    run_jobs.main([str(jobs), "--log-dir", str(tmp_path / "logs")])
    assert (tmp_path / "logs" / "tiny-s1.done").exists(), (tmp_path / "logs" / "tiny-s1.log").read_text()
    whole = run_experiment(load_config(config, ["experiment.seed=1", "engine.threads=1"]), tmp_path / "whole", **quiet)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_mean"] == whole.summary["accuracy_mean"]
    assert summary["epsilon_per_agent"] == whole.summary["epsilon_per_agent"]
    (tmp_path / "logs" / "tiny-s1.done").unlink()  # forgotten by the runner: the finished folder still skips it
    run_jobs.main([str(jobs), "--log-dir", str(tmp_path / "logs")])
    assert json.loads((out / "summary.json").read_text()) == summary
    assert not (tmp_path / "logs" / "tiny-s1.done").exists()  # not even started
    # A folder left without its checkpoint (stopped before the first one, or copied without it) starts afresh.
    (out / "summary.json").unlink()
    (out / "checkpoint.pt").unlink()
    run_jobs.main([str(jobs), "--log-dir", str(tmp_path / "logs")])
    assert (tmp_path / "logs" / "tiny-s1.done").exists(), (tmp_path / "logs" / "tiny-s1.log").read_text()
    assert json.loads((out / "summary.json").read_text())["accuracy_mean"] == whole.summary["accuracy_mean"]


def test_a_stopped_runner_stops_its_jobs(tmp_path: Path) -> None:
    """SIGTERM to the runner (a session's end, ``pkill``) reaches the jobs, which run in sessions of their own."""
    child = tmp_path / "child.pid"
    jobs = _jobs(tmp_path, [f"slow\tsleep 30 & echo $! > {child}; wait"])
    runner = subprocess.Popen([sys.executable, str(SCRIPT), str(jobs), "--log-dir", str(tmp_path / "logs")])
    end = time.monotonic() + 20
    while not child.exists() and time.monotonic() < end:
        time.sleep(0.1)
    runner.terminate()
    assert runner.wait(timeout=30) == 0
    assert _ended(int(child.read_text()))


@pytest.mark.parametrize(("line", "message"), [("no tab here", "jobs.tsv:3: expected NAME<TAB>COMMAND"),
                                               ("name\t ", "jobs.tsv:3: expected NAME<TAB>COMMAND")])
def test_a_malformed_line_is_refused_with_its_number(run_jobs: ModuleType, tmp_path: Path, line: str,
                                                     message: str) -> None:
    with pytest.raises(SystemExit) as stop:
        run_jobs.read_jobs(_jobs(tmp_path, [line]))
    assert str(stop.value).endswith(message)


def test_repeated_names_are_refused(run_jobs: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        run_jobs.read_jobs(_jobs(tmp_path, ["a\ttrue", "a\tfalse"]))
    assert "job names repeat: a" in str(stop.value)


def test_a_job_that_tests_for_its_result_runs_again_when_the_result_is_gone(run_jobs: ModuleType,
                                                                            tmp_path: Path) -> None:
    """A job whose command starts with its own completion test (``[ -f FILE ] || ...``) is finished exactly when
    FILE exists: a ``.done`` record left by an earlier run of the same name (its results moved away, as when a
    table's cells are listed again at another step) does not skip it, and an existing FILE skips it without one."""
    logs, ran = tmp_path / "logs", tmp_path / "ran"
    logs.mkdir()
    result = tmp_path / "cell" / "summary.json"
    jobs = _jobs(tmp_path, [f"cell-s0\t[ -f {result} ] || {{ echo cell >> {ran}; mkdir -p {result.parent}; "
                            f"touch {result}; }}", f"other-s0\t[ -f {tmp_path}/kept ] || echo other >> {ran}"])
    (logs / "cell-s0.done").write_text("{}")       # stale: the earlier run's results are gone
    (tmp_path / "kept").touch()                     # finished, though the runner has no record of it
    assert not run_jobs.finished(run_jobs.read_jobs(jobs)[0], logs)
    run_jobs.main([str(jobs), "--log-dir", str(logs)])
    assert ran.read_text() == "cell\n" and result.exists()
    assert not (logs / "other-s0.log").exists()     # never started
    run_jobs.main([str(jobs), "--log-dir", str(logs)])
    assert ran.read_text() == "cell\n"             # finished now: skipped


def test_status_counts_finished_runs_by_group_and_seed_and_runs_nothing(run_jobs: ModuleType, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--status`` counts a run as finished by its ``--out`` folder's ``summary.json`` (present on any machine with
    the results), a command without ``--out`` by its ``.done`` record, and starts no job."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    (out / "fig3-a-s0").mkdir(parents=True)
    (out / "fig3-a-s0" / "summary.json").write_text("{}")
    (out / "fig3-a-s1").mkdir()                               # a stopped run: its folder but no summary
    logs.mkdir()
    (logs / "sweep-x.done").write_text("{}")
    jobs = _jobs(tmp_path, [f"fig3-a-s0\ttouch {tmp_path}/ran --out {out}/fig3-a-s0",
                            f"fig3-a-s1\ttouch {tmp_path}/ran --out {out}/fig3-a-s1",
                            f"fig4-b-s0\ttouch {tmp_path}/ran --out {out}/fig4-b-s0",
                            f"sweep-x\ttouch {tmp_path}/ran", f"sweep-y\ttouch {tmp_path}/ran"])
    run_jobs.main([str(jobs), "--status", "--log-dir", str(logs)])
    table = capsys.readouterr().out
    assert "| group | - | s0 | s1 | all |" in table                # seeds in order, jobs without one under "-"
    assert "| fig3 |  | 1 / 1 | 0 / 1 | 1 / 2 |" in table
    assert "| fig4 |  | 0 / 1 |  | 0 / 1 |" in table
    assert "| sweep | 1 / 2 |  |  | 1 / 2 |" in table
    assert "2 of 5 jobs finished, 3 left" in table
    assert not (tmp_path / "ran").exists()
    run_jobs.main([str(jobs), "--status", "--log-dir", str(logs), "--group", "fig3-a|sweep-x"])
    table = capsys.readouterr().out
    assert "| fig3-a |  | 1 / 1 | 0 / 1 | 1 / 2 |" in table and "| sweep-y | 0 / 1 |" in table
