"""The results folder of a run: what is written, when, and how a run resumes from it.

Files (see the README's table): ``config.toml`` (the resolved config), ``provenance.json``, ``setup.json``
(what was calibrated and planned), ``metrics.jsonl`` (one row per evaluation), ``checkpoint.pt``
(written atomically; the run resumes from it bit for bit), and at the end ``privacy.json`` (every
agent's ledger and epsilon, and the pairwise view when messages went to single receivers),
``summary.json``, plots and, with ``--profile``, ``profile.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import secrets
import shutil
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decentdp.algorithms.base import State
from decentdp.config import PLACEMENT_FIELDS, RECORDING_FIELDS, ExperimentConfig, config_differences, validate_config
from decentdp.data.datasets import FINGERPRINT_PREFIX
from decentdp.errors import ConfigError, ResultsFolderError
from decentdp.experiment.build import Experiment
from decentdp.privacy.network_dp import plot_pairwise
from decentdp.privacy.report import AGENT_VIEW, AlgorithmPrivacy, privacy_report, privacy_statement
from decentdp.results.files import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    PRIVACY_FILE,
    PROFILE_FILE,
    PROVENANCE_FILE,
    SETUP_FILE,
    SUMMARY_FILE,
    check_creatable,
    epsilon_json,
    epsilon_text,
    plot_metrics,
    provenance,
    strict_json,
    write_atomic,
    write_durably,
    write_failure,
    write_json,
    write_jsonl,
    write_toml,
)
from decentdp.rng import AgentKeys, SecureRandom
from decentdp.runtime.distributed.sharded import (
    SHARD_CHECKPOINT_FORMAT,
    SHARD_STORE,
    ShardCheckpointWriter,
    ShardWriteError,
    read_shard_checkpoints,
    remove_round_folder,
    remove_shard_checkpoints,
)


def key_directory(config: ExperimentConfig) -> Path:
    """Where a secure run keeps its key file: ``privacy.key_dir``, else ``$DECENTDP_KEY_DIR``, else
    ``$XDG_STATE_HOME/decentdp/keys`` (``~/.local/state/decentdp/keys``)."""
    if config.privacy.key_dir:
        return Path(config.privacy.key_dir).expanduser()
    if os.environ.get("DECENTDP_KEY_DIR"):
        return Path(os.environ["DECENTDP_KEY_DIR"]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "decentdp" / "keys"


DIAGNOSTICS_FILE = "diagnostics.json"
#: Where a results folder remembers its tracked MLflow run, so that ``--resume`` continues the same one
#: (:mod:`decentdp.experiment.tracking`).
TRACKING_FILE = "tracking.json"
#: The folder of a run's TensorBoard logs when ``tracking.log_dir`` names none.
TENSORBOARD_DIR = "tensorboard"
#: ``setup.json`` fields that fix a run's mechanism: a resume must plan them as the run's start did.
NOISE_SETUP_FIELDS = ("noise_multipliers", "sample_rates", "planned_releases")
#: What a results folder holds when its run was killed before its first checkpoint (nothing to resume): such a
#: folder may be started again (and these entries replaced).  The tracker opens before the first checkpoint, so its
#: run file and log folder are among them; removing ``tracking.json`` lets the new start create a new MLflow run
#: instead of continuing the killed one.  So is the store of a Ray run's shard files (``shards``): its workers write
#: the first checkpoint's rows there before ``checkpoint.pt`` names them, and a run killed in between leaves files
#: that no checkpoint names (its round folders are removed; anything else in it stays).
STARTED_ONLY = frozenset({CONFIG_FILE, PROVENANCE_FILE, SETUP_FILE, DIAGNOSTICS_FILE, TRACKING_FILE, TENSORBOARD_DIR,
                          SHARD_STORE, f".{CHECKPOINT_FILE}.tmp",
                          *(f".{name}.tmp" for name in (CONFIG_FILE, PROVENANCE_FILE, SETUP_FILE, DIAGNOSTICS_FILE,
                                                        TRACKING_FILE))})
#: Written (atomically) by a run's start once it holds the folder's lock, before anything
#: else: only a folder holding it was made by a start, so only there are :data:`STARTED_ONLY` entries leftovers to
#: replace.  Without it those names may be the user's own (a config.toml, old TensorBoard logs): nothing is removed.
STARTED_FILE = ".started"
DIAGNOSTICS_WARNING = ("operator diagnostics computed from the raw private data, NOT differentially private: "
                       "do not share this file or the 'diagnostics' entries of metrics.jsonl")

def refuse_config_inside(config_file: str | Path, out: Path) -> None:
    """Refuse to start a run (not a resume) whose config file lies inside its results folder ``out``: a start
    replaces what an earlier start left there (``config.toml`` among it), so it could remove the very file it was
    started from, and a finished run's folder is refused anyway."""
    if Path(config_file).resolve().is_relative_to(out.resolve()):
        raise ConfigError("--out", f"the config {config_file} lies inside the results folder {out}, which a new run "
                                   "fills (and clears of an earlier start's files): copy the config elsewhere, or "
                                   "choose another --out; to continue the run there, pass --resume")


def run_privacy_statement(config: ExperimentConfig) -> dict[str, Any]:
    """:func:`~decentdp.privacy.report.privacy_statement` of a config."""
    return privacy_statement(config.privacy.private, config.privacy.neighbouring, config.privacy.noise,
                             private_evaluation=config.data.validation_fraction > 0)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A run's ``checkpoint.pt`` (on the CPU; moved to the run's device later), or one message naming the file
    when it is damaged (truncated by a full disk, empty, or not a checkpoint at all): nothing is written.  The
    error is a :class:`~decentdp.errors.ResultsFolderError` naming the file (``damaged``): starting the run again
    in an empty folder is the way on."""
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as error:
        reason = "it is empty" if path.stat().st_size == 0 else f"it cannot be read ({type(error).__name__})"
        raise ResultsFolderError("--resume", f"{path} is damaged: {reason}; the run cannot continue from it. "
                                             "Restore the file, or start the run again in an empty folder",
                                 damaged=path) from None
    if not isinstance(saved, dict) or not {"round", "config"} <= set(saved):
        raise ResultsFolderError("--resume", f"{path} is not a decentdp checkpoint (no round and config in it); start "
                                             "the run again in an empty folder", damaged=path)
    return saved


def _stored_config(path: Path, saved: dict[str, Any]) -> ExperimentConfig:
    """The config a checkpoint ``path`` (read as ``saved``) was made with, validated; one that no longer validates
    (written by a version of decentdp with other keys or checks) is refused saying that the keys named are in the
    checkpoint's stored config, not in the user's, where they would be looked for in vain."""
    try:
        return validate_config(saved["config"])
    except ConfigError as error:
        problems = str(error).partition("\n")[2] or f"  {error}"  # (its lines after "invalid configuration:")
        raise ConfigError("--resume", f"the config stored in {path} (the run's, as it started) does not validate "
                                      "with this version of decentdp: resume with the version that wrote the "
                                      "checkpoint, or start the run again in an empty folder.  The keys named are "
                                      f"in that stored config, not in yours:\n{problems}") from None


def _merged_shards(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The whole run's state, ledger and scheduler from the shard files a checkpoint's manifest names."""
    if manifest.get("format") != SHARD_CHECKPOINT_FORMAT:
        raise ConfigError("--resume", f"the checkpoint in {path} names shard files of an unknown format "
                                      f"{manifest.get('format')!r}")
    try:
        return read_shard_checkpoints(path / manifest["directory"], manifest["files"], 0, manifest["n_agents"])
    except (ValueError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
        raise ResultsFolderError("--resume", f"cannot read the checkpoint's shard files: {exc}",
                                 damaged=path / manifest["directory"]) from None


#: The lock a run holds on its results folder while it writes it (removed when the run ends).
LOCK_FILE = ".lock"


def _still_named(descriptor: int, path: Path) -> bool:
    """Whether ``path`` still names the file open at ``descriptor`` (a lock on a removed file locks nothing)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _release(descriptor: int, folder: Path, created: bool) -> None:
    """Drop a results folder's lock; a folder this run created and left empty (it failed before writing
    anything but its start's marker, :data:`STARTED_FILE`) goes too, so that a failed start leaves nothing behind."""
    with contextlib.suppress(OSError):
        (folder / LOCK_FILE).unlink()
    os.close(descriptor)
    with contextlib.suppress(OSError):
        if created and {entry.name for entry in folder.iterdir()} <= {STARTED_FILE}:
            (folder / STARTED_FILE).unlink(missing_ok=True)
            folder.rmdir()


class FolderLock:
    """An exclusive lock on a folder (``fcntl.flock`` on its ``LOCK_FILE``, holding this process's id): one writer
    per folder, a run's results folder or a sweep's.  Released by :meth:`close` or when this object is collected;
    a folder that ``created`` says the writer made goes too if it is still empty (:func:`_release`).

    ``writer`` names what writes such folders ("run", "sweep") and ``kind`` the folder ("results folder"), for
    the one message that refuses a second writer, naming the folder and the process that holds it."""

    def __init__(self, folder: Path, created: bool, writer: str = "run", kind: str = "results folder") -> None:
        while True:
            try:
                descriptor = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ResultsFolderError("--out", f"cannot write the {kind} {folder}: {exc.strerror}") from None
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
                os.close(descriptor)
                raise ConfigError("--out", f"{folder} is being written by another {writer} (process {holder}); "
                                           "wait for it to end, or choose another folder") from None
            if _still_named(descriptor, folder / LOCK_FILE):
                break
            os.close(descriptor)  # locked a file its last holder had just removed: a third could lock the new one
        os.ftruncate(descriptor, 0)
        os.write(descriptor, str(os.getpid()).encode())
        self.descriptor = descriptor  # (the locked file: its inode is the one LOCK_FILE names)
        self._release = weakref.finalize(self, _release, descriptor, folder, created)

    def close(self) -> None:
        """Release the lock now."""
        self._release()


class ResultsFolder:
    """Writes one run's results folder ``path`` (and, for a secure run, its key file elsewhere), holding an
    exclusive lock on it from :meth:`open` until the run (or this object) ends: one writer per folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.key_file: Path | None = None  # secure runs: the agents' keys, never inside ``path``
        #: The per-agent state entries of the checkpoint resumed, where it recorded them (a sharded run found them):
        #: carried into the simulator's own checkpoints, since one process cannot tell a replicated table with one
        #: row per agent from per-agent rows, and a later sharded resume splits the state by them.
        self.per_agent: list[str] | None = None
        self._lock: FolderLock | None = None

    def _acquire(self, created: bool) -> None:
        """Lock the folder, or refuse naming the process that holds it (:class:`FolderLock`)."""
        self._lock = FolderLock(self.path, created)

    def close(self) -> None:
        """Release the folder's lock now (it is also released when this object is collected)."""
        if self._lock is not None:
            self._lock.close()

    def check(self, config: ExperimentConfig, resume: bool) -> set[str]:
        """The checks :meth:`open` makes before it writes or locks anything (also ``decentdp run --dry-run``'s): a
        resume needs a checkpoint; a start needs the keys outside the folder, and the folder absent, empty, or
        holding only what a killed start left (:data:`STARTED_FILE` with :data:`STARTED_ONLY` entries).  Returns
        the entries of such a start's that :meth:`open` replaces (none for a resume)."""
        if resume:
            if not (self.path / CHECKPOINT_FILE).is_file():
                raise ConfigError("--resume", f"no checkpoint to resume in {self.path}")
            return set()
        if config.privacy.noise == "secure" and key_directory(config).absolute().is_relative_to(self.path.absolute()):
            raise ConfigError("privacy.key_dir", f"{key_directory(config)} lies inside the results folder "
                                                 f"{self.path}: the agents' keys must never sit with the results")
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError("--out", f"{self.path} exists and is not a directory")
        held = {entry.name for entry in self.path.iterdir()} - {LOCK_FILE} if self.path.is_dir() else set()
        if held and not (STARTED_FILE in held and held <= STARTED_ONLY | {STARTED_FILE}):
            raise ConfigError("--out", f"{self.path} already holds files; pass --resume to continue that run (if it "
                                       "wrote a checkpoint), or to start again remove the folder or choose another "
                                       "--out")
        check_creatable(self.path)
        return held - {STARTED_FILE}  # (the marker is rewritten, before the leftovers go)

    def open(self, config: ExperimentConfig, resume: bool) -> dict[str, Any] | None:
        """Check the folder before anything is written (:meth:`check`); with ``resume``, the checkpoint to continue
        from.  A start marks the folder (:data:`STARTED_FILE`) as soon as it holds the lock, then removes what an
        earlier start killed before its first checkpoint left."""
        checkpoint = self.path / CHECKPOINT_FILE
        held = self.check(config, resume)
        if resume:
            self._acquire(created=False)  # before reading: a run still writing the folder is refused
            saved = read_checkpoint(checkpoint)
            if "shards" in saved:  # written by the workers of a sharded run: their rows merged (for any split)
                saved |= _merged_shards(self.path, saved["shards"])
            self.per_agent = saved.get("per_agent")
            # Where it runs and how often it records may change (other ray workers, fewer evaluations), not what
            # it computes.
            changed = [key for key in config_differences(_stored_config(checkpoint, saved), config)
                       if key not in PLACEMENT_FIELDS + RECORDING_FIELDS]
            if changed == ["experiment.rounds"] and saved["round"] == saved["config"]["experiment"]["rounds"]:
                raise ConfigError("--resume", f"this run finished its {saved['round']} rounds and cannot be extended: "
                                              "its noise was calibrated for exactly the releases it planned, so "
                                              "more rounds would exceed the budget; start a new run with the "
                                              "rounds you want (or a larger budget)")
            if changed:
                raise ConfigError("--resume", "the config differs from the one the checkpoint was made with, in "
                                              f"{', '.join(changed)}; resume with the same config and overrides "
                                              "(only where the run computes and logs, and how often it records "
                                              "itself, may change: "
                                              f"{', '.join(PLACEMENT_FIELDS + RECORDING_FIELDS)})")
            return saved
        created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ResultsFolderError("--out", f"cannot create the results folder {self.path}: {exc.strerror}") \
                from None
        self._acquire(created)
        write_atomic(self.path / STARTED_FILE, "a decentdp run started in this folder\n")
        for name in held:  # (under the lock) a start that never reached its first checkpoint: nothing to resume
            entry = self.path / name
            if name == SHARD_STORE and entry.is_dir() and not entry.is_symlink():
                remove_shard_checkpoints(self.path)  # the shard files no checkpoint names (others there stay)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)  # (the TensorBoard logs of the killed start)
            else:
                entry.unlink(missing_ok=True)
        return None

    def _recorded_setup(self) -> dict[str, Any]:
        """The run's ``setup.json`` as its start wrote it, empty where a folder written before the file existed has
        none; one that cannot be read is refused, naming it: taking it for an older folder would resume without
        the data and noise checks it exists for."""
        file = self.path / SETUP_FILE
        try:
            held = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            reason = getattr(error, "strerror", None) or "it is not JSON"
            raise ResultsFolderError("--resume", f"{file} cannot be read ({reason}): without it the resume cannot "
                                                 "check that the run goes on with the data and noise it started "
                                                 "with; restore the file, or start the run again in an empty folder",
                                     damaged=file) from None
        if not isinstance(held, dict):
            raise ResultsFolderError("--resume", f"{file} is damaged: it holds no JSON object of the run's setup; "
                                                 "restore the file, or start the run again in an empty folder",
                                     damaged=file)
        return held

    def check_same_data(self, experiment: Experiment) -> None:
        """Refuse to resume on other records than the run started on (``setup.json``'s ``data_fingerprint``,
        keyed by the run's seed or, in a secure run, its restored keys; a plain SHA-256 in folders written before
        the key, none in older ones, which are not checked): the run's noise would continue on them."""
        held = self._recorded_setup().get("data_fingerprint")
        if held is None:
            return
        keyed = held.startswith(FINGERPRINT_PREFIX)
        loaded = experiment.setup["data_fingerprint"] if keyed else experiment.dataset.fingerprint(None)
        if held != loaded:
            raise ConfigError("--data-dir", f"the records loaded differ from those the run in {self.path} started "
                                            f"on (setup.json's data_fingerprint): resuming would continue its noise "
                                            "on other data; pass the data directory it started with")

    def check_same_noise(self, experiment: Experiment) -> None:
        """Refuse to resume where today's code plans other noise than the run started with (``setup.json``'s
        noise multipliers, sample rates and planned releases): a calibration changed since, and the rounds after
        the checkpoint would run another mechanism than the ones before it, under a summary that names one."""
        held = self._recorded_setup()
        for name in NOISE_SETUP_FIELDS:  # (fields an older folder lacks are not compared)
            if name not in held or name not in experiment.setup:
                continue
            recorded, now = np.asarray(held[name], dtype=float), np.asarray(experiment.setup[name], dtype=float)
            if recorded.shape != now.shape or not np.allclose(recorded, now, rtol=1e-6, atol=0.0, equal_nan=True):
                where = "" if recorded.shape != now.shape or recorded.ndim == 0 else \
                    f" (agent {int(np.argmax(~np.isclose(recorded, now, rtol=1e-6, atol=0.0, equal_nan=True)))})"
                raise ConfigError("--resume", f"the run in {self.path} started with other {name} than this code "
                                              f"plans{where}: a calibration changed since it started, and resuming "
                                              "would run its last rounds under another mechanism than its first; "
                                              "start it again in an empty folder")

    def start(self, experiment: Experiment) -> None:
        """The files known before the first round: resolved config, provenance, the run's setup."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ResultsFolderError("--out", f"cannot create the results folder {self.path}: {exc.strerror}") \
                from None
        write_toml(self.path / CONFIG_FILE, experiment.config.to_toml_dict())
        write_json(self.path / PROVENANCE_FILE, provenance(experiment.config.experiment.seed))
        write_json(self.path / SETUP_FILE, experiment.setup)
        rng = experiment.oracle.rng
        if isinstance(rng, SecureRandom):
            self.key_file = key_directory(experiment.config) / f"{secrets.token_hex(16)}.keys"
            rng.keys.save(self.key_file)

    def diagnostics(self, experiment: Experiment) -> None:
        """``diagnostics.json`` (``--diagnostics`` only): raw statistics of the private data, labelled so."""
        write_json(self.path / DIAGNOSTICS_FILE, {
            "warning": DIAGNOSTICS_WARNING,
            "class_histograms": experiment.histograms.tolist(),
        })

    def restore_keys(self, experiment: Experiment, checkpoint: dict[str, Any]) -> None:
        """Put a secure run's saved keys back, so that rounds replayed after the checkpoint re-draw the same
        noise (fresh noise there would release those rounds a second time)."""
        rng = experiment.oracle.rng
        if not isinstance(rng, SecureRandom):
            return
        saved = checkpoint.get("key_file")
        if saved is None or not Path(saved).is_file():
            raise ConfigError("--resume", f"the key file of this secure run ({saved}) is gone: resuming with fresh "
                                          "keys would release the rounds after the checkpoint a second time with "
                                          "new noise; start a new run")
        self.key_file = Path(saved)
        rng.keys = AgentKeys.load(self.key_file)
        experiment.setup["data_fingerprint"] = experiment.dataset.fingerprint(rng.fingerprint_key())

    def unwritten(self, round_done: int | None, where: Path, reason: str) -> ResultsFolderError:
        """The one message of a checkpoint (after ``round_done`` rounds, where known) that could not be written
        into ``where`` (the results folder, or the folder of a Ray run's shard files) for ``reason`` (a full
        disk): what is kept, and how to go on."""
        kept = "the previous checkpoint is kept: free space and continue with --resume" \
            if (self.path / CHECKPOINT_FILE).is_file() else "no checkpoint was written: free space and start again"
        which = "a checkpoint" if round_done is None else f"the checkpoint of round {round_done}"
        return ResultsFolderError("--out", f"cannot write {which} in {where} ({reason}); {kept}")

    def checkpoint(self, experiment: Experiment, round_done: int, state: State, metrics: list[dict[str, Any]],
                   wall_seconds: float) -> None:
        """Everything a resume needs, written atomically, and the metrics so far.  An engine whose
        processes write their own shards (``engine.backend = "ray"``) has them write the state, ledger and
        scheduler rows first; ``checkpoint.pt`` then names their files (``shards``) instead of holding them.
        A write that fails (a full disk) ends the run with one message (:meth:`unwritten`), leaving the previous
        checkpoint as it was: the shard files of this one, which no ``checkpoint.pt`` names, are removed."""
        payload = {"round": round_done, "metrics": metrics,
                   "config": experiment.config.to_toml_dict(),
                   "key_file": None if self.key_file is None else str(self.key_file),
                   "passes": {"agents_per_pass": experiment.oracle.agents_per_pass,
                              "evaluation_chunk": experiment.evaluator.chunk},
                   "wall_seconds": wall_seconds, "device": str(experiment.device),
                   "threads": torch.get_num_threads()}  # (a resume that sets none computes with these)
        if isinstance(experiment.simulator, ShardCheckpointWriter):
            try:  # (only a failed write of the workers' files: a lost worker's error is not a full disk's)
                payload["shards"] = experiment.simulator.write_shards(self.path, round_done)
            except ShardWriteError as error:  # (its folder is removed: the workers had not all written it)
                raise self.unwritten(round_done, Path(error.directory), error.reason) from None
        else:
            payload |= {"state": dict(state), "scheduler": experiment.simulator.scheduler.state_dict(),
                        "ledger": experiment.ledger.state_dict()}
            if self.per_agent is not None:
                payload["per_agent"] = self.per_agent
        tmp = self.path / f".{CHECKPOINT_FILE}.tmp"
        named = False  # whether checkpoint.pt names this checkpoint's shard files
        try:
            write_durably(self.path / CHECKPOINT_FILE, lambda handle: torch.save(payload, handle))
            named = True
            write_jsonl(self.path / METRICS_FILE, metrics)
        except (OSError, RuntimeError) as exc:  # torch reports a failed write (ENOSPC, EFBIG) as a RuntimeError
            tmp.unlink(missing_ok=True)
            if "shards" in payload and not named:  # the workers' files of this checkpoint: nothing names them
                remove_round_folder(self.path / payload["shards"]["directory"])
            raise self.unwritten(round_done, self.path, write_failure(exc)) from None
        if "shards" not in payload:  # the state is in checkpoint.pt now: no manifest names a sharded run's files
            remove_shard_checkpoints(self.path)

    def finish(self, experiment: Experiment, summary: dict[str, Any], metrics: list[dict[str, Any]],
               extras: AlgorithmPrivacy | None = None) -> None:
        """``privacy.json``, ``summary.json`` and the plots of a finished run; ``extras`` are the
        algorithm's own privacy results (``Algorithm.privacy_results``), added to ``privacy.json``."""
        privacy = privacy_report(experiment.ledger, experiment.config.privacy.delta, run_privacy_statement(
            experiment.config), experiment.setup.get("paper_accounting"), extras,
            experiment.setup.get("epsilon_observer", AGENT_VIEW))
        if extras is not None and extras.pairwise is not None:
            plot_pairwise(extras.pairwise, self.path / "pairwise_epsilon.png")
        write_jsonl(self.path / METRICS_FILE, metrics)  # (a resume of a finished checkpoint writes no checkpoint)
        write_json(self.path / PRIVACY_FILE, privacy)
        if metrics:
            plot_metrics(metrics, self.path, metrics_title(summary))
        write_json(self.path / SUMMARY_FILE, summary)  # last: a folder with summary.json is complete

    def profile(self, report: dict[str, Any]) -> None:
        write_json(self.path / PROFILE_FILE, report)


def metrics_title(summary: dict[str, Any]) -> str:
    """The title of a run's metric plots: its name, algorithm, agents and epsilon spent; where the epsilon names a
    narrower observer than everyone together (DECOR's pairwise view), towards whom on a second line, as the CLI's
    final summary line says it (an epsilon beside others' without it reads as the same guarantee)."""
    eps = summary["epsilon_max"]
    spent = "inf (not private)" if eps is None else epsilon_text(eps, significant=3)
    observer = str(summary.get("epsilon_observer") or AGENT_VIEW).split(":")[0]
    everyone = AGENT_VIEW.split(":")[0]
    towards = "" if observer == everyone else f"\nepsilon towards {observer}"
    return (f"{summary['name']}: {summary['algorithm']}, {summary['n_agents']} agents, epsilon {spent} at delta "
            f"{summary['delta']:g}{towards}")


def summary(experiment: Experiment, metrics: list[dict[str, Any]], wall: float, finished: bool,
            rounds_run: int) -> dict[str, Any]:
    """A run's ``summary.json``: its ``rounds`` are the rounds it ran (``rounds_run``, what it has released: a run
    stopped between evaluations ran more than its last metrics row's), its accuracies the last evaluation's."""
    config = experiment.config
    last = metrics[-1] if metrics else {}
    epsilons, accountant = experiment.ledger.reported_epsilon()
    return strict_json({
        "name": config.experiment.name,
        "algorithm": config.algorithm.name,
        "dataset": config.data.dataset,
        "n_agents": experiment.data.n_agents,
        "rounds": rounds_run,
        "finished": finished,
        "accuracy_mean": last.get("accuracy_mean"),
        "accuracy_std": last.get("accuracy_std"),
        "accuracy_min": last.get("accuracy_min"),
        "accuracy_max": last.get("accuracy_max"),
        "consensus_distance": last.get("consensus_distance"),
        **({"averaging": config.averaging.kind, "last_iterate_accuracy_mean": last.get("last_iterate_accuracy_mean")}
           if config.averaging.kind != "none" else {}),
        "private": config.privacy.private,
        "epsilon_max": epsilon_json(float(epsilons.max())),
        "epsilon_per_agent": epsilon_json(epsilons),
        "epsilon_accountant": accountant,
        # who the budgets' epsilon is about, where narrower than every observer together (DECOR's pairwise view)
        **({"epsilon_observer": experiment.setup["epsilon_observer"]} if "epsilon_observer" in experiment.setup
           else {}),
        "neighbouring": config.privacy.neighbouring,
        "noise": config.privacy.noise,
        "epsilon_target": epsilon_json(min(config.privacy.budgets)),
        "refused_releases": int(experiment.ledger.refused.sum()),
        "delta": config.privacy.delta,
        "clip": config.privacy.clip,
        "noise_multipliers": experiment.noise_multipliers.tolist(),
        # The settings that define a row of a table, so that no table needs to join other files:
        "seed": config.experiment.seed,
        "graph": "complete" if config.pools_data else config.topology.graph,
        "partition": "pooled" if config.pools_data else config.data.partition,  # (one agent holds every record)
        "model": config.model.name,
        "lr": config.algorithm.lr,
        "lr_schedule": config.algorithm.lr_schedule,
        "batch_size": config.algorithm.batch_size,
        "schedule": config.schedule_kind,
        "algorithm_settings": config.algorithm.settings.model_dump(),
        "config": config.to_toml_dict(),
        "wall_seconds": wall,
    })
