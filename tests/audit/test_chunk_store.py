"""An audit's chunk folder (``--chunk-dir``): folders written before a config field existed still read (the shipped
Table 5 folders among them), a real difference is refused naming the key, a process that trains nothing writes
nothing, chunks are flushed to the disk and a killed writer's temporary file is cleaned up."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from decentdp.audit.blocks import Chunk, ChunkStore, _host, audit_spec, audit_spec_defaults
from decentdp.audit.settings import AuditSection
from decentdp.cli.main import main
from decentdp.config import ExperimentConfig, validate_config
from decentdp.errors import ConfigError

REPOSITORY = Path(__file__).resolve().parents[2]

#: The keys added to the config and the audit settings after the shipped chunk folders were written.
_ADDED_SINCE = (("config", "data", "batches"), ("config", "data", "sampling"), ("config", "data", "validation_split"),
                ("audit_settings", "trained_rounds"))


def _config(**privacy: float) -> ExperimentConfig:
    return validate_config({"experiment": {"name": "audit", "rounds": 1}, "data": {"dataset": "digits"},
                            "topology": {"agents": 2}, "model": {"name": "linear"},
                            "algorithm": {"name": "dp-dsgd", "lr": 0.1, "batch_size": 16},
                            "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": 1.0, **privacy}})


def _chunk() -> Chunk:
    return Chunk(np.arange(4.0), np.array([True, False, True, False]), 1.0, 2.0, 3.5)


def _older(spec: dict) -> dict:
    """``spec`` as an audit of an older version wrote it: without the keys added since, and with the cosmetic
    experiment settings it then held (another name and evaluation interval)."""
    older = copy.deepcopy(spec)
    for *sections, key in _ADDED_SINCE:
        place = older
        for section in sections:
            place = place[section]
        del place[key]
    older["config"]["experiment"].update(name="another-name", eval_every=7, checkpoint_every=0)
    return older


def test_a_folder_written_before_fields_were_added_reads_where_they_are_at_their_defaults(tmp_path: Path) -> None:
    """A key absent from the folder's spec.json equals this audit's value when that value is the field's default;
    a new key at another value, and a changed key, are refused naming the key; the stamped chunks still read (they
    carry the digest of the folder's own spec.json) and spec.json is left as it was."""
    config, settings = _config(), AuditSection(models=100, chunk=100)
    spec, defaults = audit_spec(config, settings, "messages", 1), audit_spec_defaults(config, settings)
    folder = tmp_path / "chunks"
    writer = ChunkStore(folder)
    writer.open(_older(spec), 1)
    writer.save(0, 7, _chunk())
    written = (folder / "spec.json").read_bytes()
    reader = ChunkStore(folder, range(0, 0))
    reader.open(spec, 1, defaults)
    chunk = reader.load(0, 7)
    assert chunk is not None and np.array_equal(chunk.scores, _chunk().scores) and chunk.seconds == 3.5
    assert (folder / "spec.json").read_bytes() == written
    trained_rounds = AuditSection(models=100, chunk=100, trained_rounds=5)
    other = _config(epsilon=2.0)
    for changed, named in ((audit_spec(config, trained_rounds, "messages", 1), "audit_settings.trained_rounds"),
                           (audit_spec(other, settings, "messages", 1), "config.privacy.epsilon")):
        with pytest.raises(ConfigError) as error:
            ChunkStore(folder, range(0, 0)).open(changed, 1, defaults)
        assert error.value.field == "--chunk-dir" and named in str(error.value)
        assert "experiment" not in str(error.value)  # the name and evaluation interval are no audit's concern


def test_the_shipped_table_5_folder_gives_the_documented_bound(tmp_path: Path, shared_data: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """docs/reproduction.md's Table 5 command read DP-DSGD's shipped chunks (written before data.batches,
    data.sampling, data.validation_split and audit.trained_rounds existed): it was refused as "another audit".
    It reads a copy (nothing is written into the repository) and gives the documented row: bound 0.010, 607 of
    4,000 members and 476 of 4,000 non-members flagged; the chunks predate stored timings, so no time is claimed."""
    folder = tmp_path / "mia-dp-dsgd"
    shutil.copytree(REPOSITORY / "experiments" / "audits" / "full" / "mia-dp-dsgd", folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    assert main(["audit", "mia", str(REPOSITORY / "experiments" / "audits" / "mia-dp-dsgd.toml"), "--models", "5000",
                 "--set", "audit.chunk=500", "--data-dir", str(shared_data), "--chunk-dir", str(folder),
                 "--chunks", "0:0", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["chunks"] == "10 of 10" and summary["models"] == 5000
    assert summary["epsilon_lower_bound"] == pytest.approx(0.0102, abs=5e-5)
    assert (summary["true_positives"], summary["false_positives"]) == (607, 476)
    assert (round(summary["loss_member_mean"], 1), round(summary["loss_non_member_mean"], 1)) == (38.4, 44.3)
    assert summary["wall_seconds"] is None and summary["seconds_per_model"] is None
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_a_process_that_trains_nothing_creates_nothing(tmp_path: Path) -> None:
    """`--chunks 0:0 --chunk-dir typo-dir` left typo-dir/spec.json behind, so a later audit with other settings was
    refused there; a process given chunks to train creates the folder before the first one trains."""
    config, settings = _config(), AuditSection(models=100, chunk=50)
    spec = audit_spec(config, settings, "messages", 2)
    ChunkStore(tmp_path / "typo-dir", range(0, 0)).open(spec, 2)
    ChunkStore(tmp_path / "beyond", range(5, 9)).open(spec, 2)  # chunks the audit does not have
    assert not (tmp_path / "typo-dir").exists() and not (tmp_path / "beyond").exists()
    ChunkStore(tmp_path / "trains", range(1, 2)).open(spec, 2)
    assert json.loads((tmp_path / "trains" / "spec.json").read_text()) == spec


def test_a_chunk_is_flushed_to_the_disk_before_it_is_renamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """np.savez then os.replace without fsync: after a power loss the chunk could be an empty file under its final
    name, refused as damaged at the next read."""
    import decentdp.results.files as files

    flushed: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (flushed.append(fd), real_fsync(fd))[1])
    store = ChunkStore(tmp_path / "chunks")
    store.open({"audit": "messages", "chunks": 1}, 1)
    flushed.clear()
    store.save(0, 7, _chunk())
    assert len(flushed) >= 2  # the file's contents, then the folder's entry
    assert [path.name for path in (tmp_path / "chunks").iterdir() if path.name.startswith(".")] == []


def test_temporary_files_of_killed_writers_are_removed_on_open(tmp_path: Path) -> None:
    """A process killed while writing a chunk left ``.chunk-*.PID.npz`` behind for good; opening the folder removes
    those of this machine's processes that no longer run, and keeps a running process's and another machine's."""
    folder = tmp_path / "chunks"
    ChunkStore(folder).open({"audit": "messages", "chunks": 1}, 1)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead, alive = int(finished.stdout), os.getppid()
    host = _host()
    names = {"stale": f".chunk-00000.{host}.{dead}.npz", "stale_legacy": f".chunk-00001.{dead}.npz",
             "running": f".chunk-00002.{host}.{alive}.npz", "elsewhere": f".chunk-00003.another-host.{dead}.npz"}
    for name in names.values():
        (folder / name).write_bytes(b"partial")
    ChunkStore(folder, range(0, 0)).open({"audit": "messages", "chunks": 1}, 1)
    left = {path.name for path in folder.iterdir()}
    assert names["stale"] not in left and names["stale_legacy"] not in left
    assert names["running"] in left and names["elsewhere"] in left
