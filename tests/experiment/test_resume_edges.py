"""Resume edge cases from a review of the run loop: a start killed before its first checkpoint, a kill between
the checkpoint and metrics.jsonl, a failed checkpoint write, a resume naming the device it ran on, a resume
whose setup.json cannot be read, one whose stored config no longer validates, and a Ray run's shard files around a
failed or killed checkpoint (the workers stood in for by a simulator that writes shard files)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment import record
from decentdp.experiment.loop import run_experiment
from decentdp.runtime.simulator import Simulator

from conftest import tiny_config


def _quiet() -> dict:
    return {"progress": False, "log": lambda line: None}


def test_a_start_killed_before_its_first_checkpoint_may_start_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = validate_config(tiny_config())

    def killed(self: Simulator, state: dict) -> dict:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Simulator, "setup", killed)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, tmp_path / "run", **_quiet())
    assert {p.name for p in (tmp_path / "run").iterdir()} == {".started", "config.toml", "provenance.json",
                                                             "setup.json"}
    assert run_experiment(config, tmp_path / "run", **_quiet()).summary["finished"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already holds files"):
        run_experiment(config, tmp_path / "other", **_quiet())


def test_a_kill_between_the_last_checkpoint_and_metrics_leaves_complete_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = validate_config(tiny_config(experiment={"rounds": 5, "eval_every": 2}))
    write = record.write_jsonl

    def killed(path: Path, rows: list) -> None:
        if rows[-1]["round"] == 5:
            raise KeyboardInterrupt
        write(path, rows)

    with monkeypatch.context() as patch:
        patch.setattr(record, "write_jsonl", killed)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, tmp_path / "run", **_quiet())
    run_experiment(config, tmp_path / "run", resume=True, **_quiet())
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["round"] for row in rows] == [0, 2, 4, 5]


def test_a_checkpoint_that_cannot_be_written_is_one_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = validate_config(tiny_config())

    def full(payload: dict, path: Path) -> None:
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(record.torch, "save", full)
    with pytest.raises(ConfigError, match="cannot write the checkpoint of round 0"):
        run_experiment(config, tmp_path / "run", **_quiet())
    assert not (tmp_path / "run" / ".checkpoint.pt.tmp").exists()


def test_a_resume_may_name_the_device_auto_chose(tmp_path: Path) -> None:
    config = validate_config(tiny_config())
    run_experiment(config, tmp_path / "run", stop_after=2, **_quiet())
    pinned = validate_config(tiny_config(engine={"device": "cpu"}))
    assert run_experiment(pinned, tmp_path / "run", resume=True, **_quiet()).summary["finished"]


def test_a_resume_whose_code_plans_other_noise_is_refused(tmp_path: Path) -> None:
    """A review: a calibration changed between a run's start and its resume (as TOP-DP's did twice), and the resume
    went on with the new sigma without a word: setup.json and summary.json then named different mechanisms.  The
    run's start is simulated as written by an older code, with other multipliers in its setup.json."""
    config = validate_config(tiny_config(experiment={"rounds": 5}))
    run_experiment(config, tmp_path / "run", stop_after=2, **_quiet())
    setup_file = tmp_path / "run" / "setup.json"
    setup = json.loads(setup_file.read_text())
    setup["noise_multipliers"][1] *= 0.8
    setup_file.write_text(json.dumps(setup))
    with pytest.raises(ConfigError, match=r"other noise_multipliers than this code plans \(agent 1\)"):
        run_experiment(config, tmp_path / "run", resume=True, **_quiet())
    setup["noise_multipliers"][1] /= 0.8
    setup_file.write_text(json.dumps(setup))
    assert run_experiment(config, tmp_path / "run", resume=True, **_quiet()).summary["finished"]


@pytest.mark.parametrize("damage", ["{garbage", "[1, 2]", ""])
def test_a_resume_with_an_unreadable_setup_file_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    """A review: setup.json that did not parse counted as an older folder's (nothing to compare), and the resume went
    on without the data and noise checks; only a missing file, or one lacking the newer fields, is an older
    folder's."""
    config = validate_config(tiny_config(experiment={"rounds": 5}))
    run_experiment(config, tmp_path / "run", stop_after=2, **_quiet())
    setup_file = tmp_path / "run" / "setup.json"
    setup = json.loads(setup_file.read_text())
    setup_file.write_text(damage)
    with pytest.raises(ConfigError) as error:
        run_experiment(config, tmp_path / "run", resume=True, **_quiet())
    assert error.value.field == "--resume" and str(setup_file) in error.value.message
    assert "restore the file" in error.value.message
    older = {key: value for key, value in setup.items() if key not in (*record.NOISE_SETUP_FIELDS, "data_fingerprint")}
    setup_file.write_text(json.dumps(older))  # an older folder's: no fields to compare
    assert not run_experiment(config, tmp_path / "run", resume=True, stop_after=3, **_quiet()).summary["finished"]
    setup_file.unlink()  # older still: no setup.json at all
    assert run_experiment(config, tmp_path / "run", resume=True, **_quiet()).summary["finished"]


def test_a_stored_config_that_no_longer_validates_is_named_as_the_checkpoints(tmp_path: Path) -> None:
    """A review: when the config stored in checkpoint.pt no longer validated (a key an older version wrote), the
    resume named that key as if it were in the user's config, which does not have it.  The message says the key is
    in checkpoint.pt's stored config, naming the file."""
    import torch

    config = validate_config(tiny_config())
    run_experiment(config, tmp_path / "run", stop_after=2, **_quiet())
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    saved = torch.load(checkpoint, weights_only=True)
    saved["config"]["algorithm"]["retired_option"] = 1  # (as a version with that option would have written it)
    torch.save(saved, checkpoint)
    with pytest.raises(ConfigError, match=rf"^--resume: the config stored in {checkpoint} .* does not validate .*"
                                          r"The keys named are in that stored config, not in yours:\n  "
                                          r"algorithm.retired_option: unknown key") as error:
        run_experiment(config, tmp_path / "run", resume=True, **_quiet())
    assert error.value.field == "--resume"


def test_an_epsilon_shown_to_people_is_rounded_up() -> None:
    """A review: the CLI's last line showed 3.89634 as 3.896 and the per-round log 4.32056 as 4.32, below the
    bound they stand for."""
    from decentdp.results.files import epsilon_text

    assert epsilon_text(3.89634) == "3.897" and epsilon_text(3.896) == "3.896"
    assert epsilon_text(4.32056, significant=3) == "4.33" and epsilon_text(999.2, significant=3) == "1000"
    assert epsilon_text(0.000123456, significant=3) == "0.000124" and epsilon_text(None) == "inf"
    assert epsilon_text(83.94200000000001) == "83.943"   # a review: the product rounded first, and it read 83.942
    from decimal import Decimal

    for value in [*np.random.default_rng(0).lognormal(0, 3, 2000), *(k / 1000 + 1e-14 for k in range(1, 99999, 7))]:
        for text in (epsilon_text(value), epsilon_text(value, significant=3)):
            assert float(text) >= value and Decimal(text) >= Decimal(repr(float(value))), (value, text)
    assert epsilon_text(4.2) == "4.200"   # not 4.201 from the binary value's tail


def test_a_resume_that_sets_no_thread_count_computes_on_the_checkpoints(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: with no thread count set, a resume chose its count from the machine's load of the moment, and a
    count other than the first half's changed the run's last bits (while an explicit other --threads was refused).
    Now the resume takes the checkpoint's count, and an explicit one is accepted."""
    import torch

    from decentdp.experiment import loop
    from decentdp.util.threads import ThreadChoice

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    chosen = {"count": 1}
    apply = loop.apply_threads

    def by_load(requested: int | None, **kwargs: object) -> ThreadChoice:
        if requested is not None:
            return apply(requested)
        torch.set_num_threads(chosen["count"])
        return ThreadChoice(chosen["count"], "cpu affinity", 2, None)

    monkeypatch.setattr(loop, "apply_threads", by_load)
    before = torch.get_num_threads()
    try:
        config = validate_config(tiny_config(experiment={"rounds": 5}))
        run_experiment(config, tmp_path / "run", stop_after=2, **_quiet())
        chosen["count"] = 2   # the machine is quieter now
        assert run_experiment(config, tmp_path / "run", resume=True, **_quiet()).summary["threads"] == 1
        run_experiment(config, tmp_path / "other", stop_after=2, **_quiet())
        pinned = validate_config(tiny_config(experiment={"rounds": 5}, engine={"threads": 2}))
        assert run_experiment(pinned, tmp_path / "other", resume=True, **_quiet()).summary["threads"] == 2
    finally:
        torch.set_num_threads(before)


def test_results_files_are_on_the_disk_before_they_replace_the_old(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: the checkpoint and the results files were renamed into place unflushed, so after a power loss the
    rename could survive and the bytes not (an empty checkpoint.pt: a run that cannot resume).  Now the file is
    flushed before the rename and the directory after it, for the JSON files and the checkpoint alike."""
    import os
    import stat

    from decentdp.results import files

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def flushed(descriptor: int) -> None:
        events.append(("fsync", "directory" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file"))
        fsync(descriptor)

    def renamed(source: str | Path, target: str | Path) -> None:
        events.append(("replace", Path(target).name))
        replace(source, target)

    monkeypatch.setattr(files.os, "fsync", flushed)
    monkeypatch.setattr(files.os, "replace", renamed)
    files.write_json(tmp_path / "summary.json", {"a": 1})
    assert events == [("fsync", "file"), ("replace", "summary.json"), ("fsync", "directory")]
    events.clear()
    run_experiment(validate_config(tiny_config()), tmp_path / "run", stop_after=1, **_quiet())
    at = events.index(("replace", "checkpoint.pt"))
    assert events[at - 1] == ("fsync", "file") and events[at + 1] == ("fsync", "directory")


def test_a_lock_taken_on_a_lock_file_its_holder_just_removed_is_taken_again(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: a run that opened .lock just before the holder's release removed it would lock the removed file,
    while a third run created and locked a new one: two writers.  The lock is now checked to be the named file."""
    import fcntl

    folder = tmp_path / "run"
    folder.mkdir()
    swaps = {"left": 1}
    lock = fcntl.flock

    def holder_released_meanwhile(descriptor: int, operation: int) -> None:
        lock(descriptor, operation)
        if swaps["left"]:   # the holder's release: its file removed, a new run's file in its place
            swaps["left"] -= 1
            (folder / record.LOCK_FILE).unlink()
            (folder / record.LOCK_FILE).write_text("")

    monkeypatch.setattr(record.fcntl, "flock", holder_released_meanwhile)
    results = record.ResultsFolder(folder)
    results._acquire(created=False)
    named = (folder / record.LOCK_FILE).stat()
    held = record.os.fstat(results._lock.descriptor)
    assert (named.st_ino, swaps["left"]) == (held.st_ino, 0)
    results.close()


class _WorkersWriting(Simulator):
    """A simulator that is a :class:`ShardCheckpointWriter`: its ``write_shards`` stands in for Ray's workers, writing
    one shard file into a new round folder of the results folder's ``shards/`` and returning the manifest naming it,
    as :meth:`RaySimulator.write_shards` does before the driver writes ``checkpoint.pt``."""

    def write_shards(self, results: Path, round_done: int) -> dict:
        from decentdp.runtime.distributed.sharded import SHARD_STORE, shard_file, shard_manifest

        directory = results / SHARD_STORE / f"round-{round_done:06d}-0badc0de"
        directory.mkdir(parents=True)
        (directory / shard_file(0, 1)).write_bytes(b"rows")
        entry = {"file": shard_file(0, 1), "agents": [0, self.oracle.n_agents], "bytes": 4}
        return shard_manifest(str(directory.relative_to(results)), self.oracle.n_agents, [entry])


def _shards_written_by(monkeypatch: pytest.MonkeyPatch, kind: type[Simulator]) -> None:
    """Runs built from now on run on a simulator of class ``kind`` (one that writes shard files)."""
    from decentdp.experiment import loop

    build = loop.build_experiment

    def built(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        experiment = build(*args, **kwargs)
        experiment.simulator.__class__ = kind
        return experiment

    monkeypatch.setattr(loop, "build_experiment", built)


def _checkpoint_write_fails(monkeypatch: pytest.MonkeyPatch, error: BaseException, rounds: set[int]) -> None:
    """``checkpoint.pt`` cannot be written (``error``) after the rounds ``rounds``; other files can."""
    write = record.write_durably
    round_of = {"done": 0}
    checkpoint = record.ResultsFolder.checkpoint

    def counted(self: record.ResultsFolder, experiment, round_done: int, *args) -> None:  # noqa: ANN001
        round_of["done"] = round_done
        checkpoint(self, experiment, round_done, *args)

    def failing(path: Path, *args) -> None:  # noqa: ANN002
        if path.name == "checkpoint.pt" and round_of["done"] in rounds:
            raise error
        write(path, *args)

    monkeypatch.setattr(record.ResultsFolder, "checkpoint", counted)
    monkeypatch.setattr(record, "write_durably", failing)


def test_a_sharded_start_whose_first_checkpoint_failed_starts_again(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: a Ray run's workers write the first checkpoint's shard files before the driver writes the
    checkpoint.pt that names them; when that write failed (a full disk), the folder kept shards/, and the same
    command was refused ("already holds files") while --resume was too ("no checkpoint").  The failed write now
    removes the files nothing names, and the same command starts the run again."""
    import errno

    config = validate_config(tiny_config())
    with monkeypatch.context() as patch:
        _shards_written_by(patch, _WorkersWriting)
        _checkpoint_write_fails(patch, OSError(errno.ENOSPC, "No space left on device"), {0})
        with pytest.raises(ConfigError, match=r"cannot write the checkpoint of round 0 in .*run \(No space left on "
                                              r"device\); no checkpoint was written: free space and start again"):
            run_experiment(config, tmp_path / "run", **_quiet())
    left = {path.name for path in (tmp_path / "run").iterdir()}
    assert left == {".started", "config.toml", "provenance.json", "setup.json"}
    assert run_experiment(config, tmp_path / "run", **_quiet()).summary["finished"]


def test_a_sharded_start_killed_before_its_first_checkpoint_starts_again(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the workers wrote the first checkpoint's shard files and before checkpoint.pt named them: the
    folder holds shards/ beside the start's files, nothing to resume, and the same command starts the run again
    (the round folders go; a file of the user's in shards/ stays)."""
    config = validate_config(tiny_config())
    with monkeypatch.context() as patch:
        _shards_written_by(patch, _WorkersWriting)
        _checkpoint_write_fails(patch, KeyboardInterrupt(), {0})
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, tmp_path / "run", **_quiet())
    assert [path.name for path in (tmp_path / "run" / "shards").iterdir()] == ["round-000000-0badc0de"]
    (tmp_path / "run" / "shards" / "notes.txt").write_text("mine")
    assert run_experiment(config, tmp_path / "run", **_quiet()).summary["finished"]
    assert [path.name for path in (tmp_path / "run" / "shards").iterdir()] == ["notes.txt"]


def test_a_failed_sharded_checkpoint_keeps_the_previous_ones_files(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint.pt of round 4 cannot be written (torch's RuntimeError for a full disk): round 4's shard files,
    which nothing names, go; round 2's, which the kept checkpoint.pt names, stay."""
    config = validate_config(tiny_config(experiment={"rounds": 6, "eval_every": 2}))
    with monkeypatch.context() as patch:
        _shards_written_by(patch, _WorkersWriting)
        _checkpoint_write_fails(patch, RuntimeError("PytorchStreamWriter failed writing file data/0: file write "
                                                    "failed"), {4})
        with pytest.raises(ConfigError, match=r"cannot write the checkpoint of round 4 .*\(PytorchStreamWriter "
                                              r"failed .*\); the previous checkpoint is kept"):
            run_experiment(config, tmp_path / "run", **_quiet())
    saved = record.read_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert saved["round"] == 2 and saved["shards"]["directory"] == "shards/round-000002-0badc0de"
    kept = {path.name for path in (tmp_path / "run" / "shards").iterdir()}  # (the stand-in prunes no older ones)
    assert "round-000002-0badc0de" in kept and "round-000004-0badc0de" not in kept


def test_shard_files_that_cannot_be_written_are_one_message_naming_them(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: a full disk while Ray's workers wrote their shard files ended the run with a RuntimeError and the
    worker's traceback, since write_shards ran outside the code that turns a failed write into the one message.
    The workers' failed write (a ShardWriteError naming the folder) is that message now, naming the shard folder."""
    from decentdp.runtime.distributed.sharded import ShardWriteError

    class DiskFull(Simulator):
        def write_shards(self, results: Path, round_done: int) -> dict:
            raise ShardWriteError(str(results / "shards" / "round-000000-0badc0de"), "No space left on device", 0)

    _shards_written_by(monkeypatch, DiskFull)
    with pytest.raises(ConfigError, match=r"^--out: cannot write the checkpoint of round 0 in .*run/shards/"
                                          r"round-000000-0badc0de \(No space left on device\); no checkpoint was "
                                          r"written: free space and start again$"):
        run_experiment(validate_config(tiny_config()), tmp_path / "run", **_quiet())
