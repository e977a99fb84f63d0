"""``experiments/stage_finished.py`` stages a results folder only once its run has written its last file, so a
commit made while the grids run never carries a running run's partial metrics."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "stage_finished.py"


def test_only_runs_that_wrote_their_last_file_count_as_finished(tmp_path: Path) -> None:
    stage = load_script(SCRIPT, "stage_finished")
    for folder, files in {"paper/results/run-s0": ["metrics.jsonl", "summary.json"],
                          "paper/results/running-s0": ["metrics.jsonl", "checkpoint.pt"],
                          "paper/sub/results-study-step/old-s0": ["summary.json"],
                          "paper/inversion/results/attack": ["inversion.json"],
                          "paper/configs/not-a-run": ["summary.json"]}.items():
        (tmp_path / folder).mkdir(parents=True)
        for name in files:
            (tmp_path / folder / name).write_text("{}")
    runs = stage.run_folders(tmp_path)
    assert [run.relative_to(tmp_path).as_posix() for run in runs] == [
        "paper/inversion/results/attack", "paper/results/run-s0", "paper/results/running-s0",
        "paper/sub/results-study-step/old-s0"]
    assert [run.name for run in runs if stage.is_finished(run)] == ["attack", "run-s0", "old-s0"]


def test_no_committed_run_folder_is_unfinished() -> None:
    """Every run folder in git holds the file its run writes last: a commit that carried a running run's partial
    metrics (``git add`` of a whole results folder while a grid runs) fails here."""
    stage = load_script(SCRIPT, "stage_finished")
    repo = SCRIPT.parents[1]
    listed = subprocess.run(["git", "ls-files", "experiments"], cwd=repo, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    tracked = {repo / path for path in listed.stdout.splitlines()}
    runs = {path.parent for path in tracked if path.parent.parent.name.startswith("results")}
    unfinished = sorted(str(run.relative_to(repo)) for run in runs
                        if not any(run / name in tracked for name in stage.LAST_WRITTEN))
    assert not unfinished, f"committed without their last file: {unfinished}"
