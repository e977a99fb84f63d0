"""``experiments/stale_calibration.py`` names the runs whose recorded noise the current code would calibrate
differently (after a calibration fix), and moves exactly those aside for the grid to re-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import fake_run, load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "stale_calibration.py"


def test_only_runs_whose_recorded_noise_differs_from_todays_calibration_are_stale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = load_script(SCRIPT, "stale_calibration")
    runs = {name: fake_run(tmp_path / "results" / name, 0.9) for name in ("current-s0", "old-s0")}
    for name, scale in (("current-s0", 1.0), ("old-s0", 1.1)):
        (runs[name] / "setup.json").write_text(json.dumps({"noise_multipliers": [0.0]}))
        _, today = stale.recorded_and_current(runs[name], "unused")
        assert today.min() > 0  # a private run: its calibration gives every agent noise
        (runs[name] / "setup.json").write_text(json.dumps({"noise_multipliers": (today * scale).tolist()}))
    assert stale.main([str(runs["current-s0"]), str(runs["old-s0"]), "--move-to", str(tmp_path / "aside")]) == 0
    report = capsys.readouterr().out
    assert "| old-s0 |" in report and "1 of 2 runs are stale" in report
    assert (tmp_path / "aside" / "old-s0" / "config.toml").exists() and not runs["old-s0"].exists()
    assert runs["current-s0"].exists() and not (tmp_path / "aside" / "current-s0").exists()
