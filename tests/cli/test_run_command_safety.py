"""``decentdp run``'s handling of its results folder and its own options (a review of the CLI): a start never
removes files it did not write, a resume names its folder, a dry-run refuses what the run would refuse at once,
the Ctrl-C hint can be pasted back, and building the parser loads no torch."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
import torch

from decentdp.cli.main import main
from decentdp.errors import ConfigError
from decentdp.experiment import loop
from decentdp.experiment.loop import run_experiment

from conftest import tiny_config


def _config_file(folder: Path, **sections: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(tomli_w.dumps(tiny_config(**sections)))
    return path


def test_a_run_keeps_the_users_own_files_named_like_a_killed_starts(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "proj"
    config = _config_file(project)
    events = project / "tensorboard" / "old-run" / "events.out"
    events.parent.mkdir(parents=True)
    events.write_text("old logs")
    elsewhere = _config_file(tmp_path / "configs")
    with pytest.raises(ConfigError, match="already holds files.*remove the folder or choose another --out"):
        run_experiment(elsewhere, project, progress=False, log=lambda line: None)
    assert config.is_file() and events.read_text() == "old logs"
    assert main(["run", str(elsewhere), "--out", str(project), "--no-progress"]) == 2
    assert config.is_file() and events.read_text() == "old logs"
    assert "already holds files" in capsys.readouterr().err


def test_a_config_inside_the_results_folder_is_refused_unless_resuming(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "proj"
    config = _config_file(project)
    (project / ".started").write_text("a decentdp run started in this folder\n")  # as if a start was killed
    assert main(["run", str(config), "--out", str(project), "--no-progress"]) == 2
    assert "lies inside the results folder" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lies inside the results folder"):
        run_experiment(config, project, progress=False, log=lambda line: None)
    assert config.is_file()


def test_a_failed_start_leaves_no_folder_behind(tmp_path: Path) -> None:
    config = _config_file(tmp_path / "configs", data={"dataset": "mnist"})
    with pytest.raises(Exception):  # noqa: B017,PT011 (no MNIST files in an empty data directory)
        run_experiment(config, tmp_path / "run", data_dir=tmp_path / "empty", progress=False, log=lambda line: None)
    assert not (tmp_path / "run").exists()


def test_resume_without_out_names_the_missing_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config_file(tmp_path / "configs")
    assert main(["run", str(config), "--resume"]) == 2
    assert "--resume: needs --out" in capsys.readouterr().err.replace("'", "")


def test_the_dry_run_refuses_what_the_run_refuses_at_its_start(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = str(_config_file(tmp_path / "configs"))
    assert main(["run", config, "--dry-run", "--set", "engine.backend=ray", "--set", "engine.workers=20"]) == 2
    assert "engine.workers" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["run", config, "--dry-run", "--set", "engine.device=cuda"]) == 2
        assert "engine.device" in capsys.readouterr().err
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    assert main(["run", config, "--dry-run", "--out", str(finished)]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert main(["run", config, "--dry-run", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "no checkpoint to resume" in capsys.readouterr().err
    assert main(["run", config, "--dry-run", "--out", str(tmp_path / "new")]) == 0
    assert not (tmp_path / "new").exists()


def test_the_interrupt_hint_is_a_command_that_can_be_pasted_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = str(_config_file(tmp_path / "my configs"))
    out = tmp_path / "int q"

    def interrupted(*args: object, **kwargs: object) -> None:
        out.mkdir()
        (out / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run_experiment", interrupted)
    assert main(["run", config, "--set", "experiment.rounds=6", "--out", str(out), "--data-dir", "my data"]) == 130
    hint = capsys.readouterr().err.split("continue with: ")[1].split(" (with no --threads")[0]
    assert shlex.split(hint) == ["decentdp", "run", config, "--set", "experiment.rounds=6", "--resume",
                                 "--out", str(out), "--data-dir", "my data"]


def test_importing_the_command_line_loads_no_torch() -> None:
    loaded = subprocess.run([sys.executable, "-c", "import sys, decentdp.cli.main; print('torch' in sys.modules)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "False"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_existing_read_only_out_is_named_as_unwritable_not_uncreatable(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = str(_config_file(tmp_path / "configs"))
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        assert main(["run", config, "--out", str(read_only), "--no-progress"]) == 2
    finally:
        read_only.chmod(0o755)
    error = capsys.readouterr().err
    assert f"cannot write in {read_only}" in error and "cannot create" not in error
