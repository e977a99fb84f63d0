"""Experiment tracking: a run logged to TensorBoard or MLflow as well as to its results folder (``[tracking]``).

What is logged, for either backend: the resolved config as parameters (dotted fields), every evaluation's
metrics at its round (accuracy, loss, consensus distance, ``epsilon_max``...), each agent's epsilon spent
so far (``epsilon/agent_<i>``, the run's accountant), and at the end the summary; MLflow also stores the
results folder's files as the run's artifacts (TensorBoard has no artifact store: its default log
directory lies inside the results folder instead).  A sweep's trials nest under one MLflow run of the
sweep (:func:`open_sweep_run`); their TensorBoard logs sit in their own trial folders.

Both libraries are optional (``pip install 'decentdp[tracking]'``) and imported only when asked.  MLflow's
telemetry is switched off before it loads: nothing a run starts talks to the outside, unless the user's own
``tracking.uri`` names a server.  The embedded default store is MLflow's local database
(``sqlite:///mlflow.db`` in the current directory, artifacts in ``mlartifacts/`` beside it; MLflow 3 keeps
its older ``mlruns/`` file store in maintenance mode only).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np

from decentdp.config import ExperimentConfig, TrackingSection, flat_fields
from decentdp.errors import ConfigError
from decentdp.experiment.record import DIAGNOSTICS_FILE, LOCK_FILE, TENSORBOARD_DIR, TRACKING_FILE
from decentdp.results.files import write_atomic

#: Files of a results folder that are never artifacts: the resumable states (large: ``*.pt``), the writer's
#: lock, this file, and the operator diagnostics, which are computed from raw private data (not DP) and must
#: not leave the machine.
NOT_ARTIFACTS = (LOCK_FILE, TRACKING_FILE, DIAGNOSTICS_FILE)
#: MLflow's limits: characters of a parameter's value, entries of one ``log_batch`` call.
MLFLOW_PARAM_CHARS, MLFLOW_BATCH = 6000, 1000


class Tracker(Protocol):
    """Where a run's evaluations go besides its results folder."""

    def log(self, row: Mapping[str, Any], epsilons: np.ndarray) -> None:
        """One evaluation: its metrics row (at ``row['round']``) and each agent's epsilon spent."""

    def finish(self, summary: Mapping[str, Any], folder: Path | None, status: str) -> None:
        """The run ended (``status``: ``FINISHED``, ``FAILED`` or ``KILLED``): its summary and files."""


class NoTracker:
    """``tracking.backend = "none"``: nothing is logged anywhere else."""

    def log(self, row: Mapping[str, Any], epsilons: np.ndarray) -> None:
        """Nothing to log."""

    def finish(self, summary: Mapping[str, Any], folder: Path | None, status: str) -> None:
        """Nothing to close."""


def open_tracker(config: ExperimentConfig, folder: Path | None, resume: bool) -> Tracker:
    """The run's tracker (``config.tracking``), started, its run id kept in ``folder`` for a resumed run."""
    section = config.tracking
    if section.backend == "tensorboard":
        log_dir = Path(section.log_dir) if section.log_dir else (
            folder / TENSORBOARD_DIR if folder is not None else Path("runs") / config.experiment.name)
        return TensorBoardTracker(log_dir, config)
    if section.backend == "mlflow":
        saved = _saved_run(folder) if resume else None
        return MlflowTracker(section, config, folder, saved)
    return NoTracker()


def metric_values(row: Mapping[str, Any], epsilons: np.ndarray) -> Iterator[tuple[str, float]]:
    """The numbers of a metrics row as ``(name, value)`` (nested tables dotted, ``None`` (an infinite
    epsilon) as ``inf``; ``round``, text and the non-private ``diagnostics`` left out), then
    ``epsilon/agent_<i>``."""
    def walk(data: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
        for key, value in data.items():
            if key == "diagnostics":
                continue
            if isinstance(value, Mapping):
                yield from walk(value, f"{prefix}{key}.")
            elif key.startswith("epsilon") and value is None:
                yield f"{prefix}{key}", float("inf")
            elif isinstance(value, int | float) and not isinstance(value, bool) and key != "round":
                yield f"{prefix}{key}", float(value)

    yield from walk(row, "")
    for agent, epsilon in enumerate(np.asarray(epsilons, dtype=float).tolist()):
        yield f"epsilon/agent_{agent}", epsilon


def _missing(library: str) -> ConfigError:
    return ConfigError("tracking.backend", f"needs {library}, which is not installed: pip install "
                                           "'decentdp[tracking]'")


class TensorBoardTracker:
    """Scalars at each evaluation's round, the config and the summary as text (``torch.utils.tensorboard``)."""

    def __init__(self, log_dir: Path, config: ExperimentConfig) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard") from None
        self.log_dir = log_dir
        try:
            self._writer = SummaryWriter(log_dir=str(log_dir))
        except OSError as error:
            raise ConfigError("tracking.log_dir", f"cannot write TensorBoard logs to {log_dir}: "
                                                  f"{error.strerror or error}") from None
        table = "\n".join(f"| {key} | {value} |" for key, value in flat_fields(config).items())
        self._writer.add_text("config", f"| field | value |\n|---|---|\n{table}")

    def log(self, row: Mapping[str, Any], epsilons: np.ndarray) -> None:
        """Every number of the row as a scalar at its round."""
        for name, value in metric_values(row, epsilons):
            self._writer.add_scalar(name, value, global_step=int(row["round"]))
        self._writer.flush()

    def finish(self, summary: Mapping[str, Any], folder: Path | None, status: str) -> None:
        """The summary as text; the log is closed."""
        self._writer.add_text("summary", f"status {status}\n\n```json\n{json.dumps(dict(summary), indent=2)}\n```")
        self._writer.close()


def resolved_uri(section: TrackingSection) -> str:
    """The MLflow tracking URI a run logs to: ``tracking.uri``, else the local database in the current
    directory (an absolute path, so that a sweep's trials in other processes find the same one)."""
    return section.uri or f"sqlite:///{Path.cwd().absolute() / 'mlflow.db'}"


def check_tracking(config: ExperimentConfig) -> None:
    """Fail fast, before a run loads its data: the tracking library is installed and, for MLflow, its store
    answers (a server named by ``tracking.uri`` is reached within :data:`CONNECT_SECONDS`, instead of after
    MLflow's minutes of retries) and holds the experiment (created if new)."""
    section = config.tracking
    if section.backend == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise _missing("tensorboard") from None
    elif section.backend == "mlflow":
        uri = resolved_uri(section)
        address = urlsplit(uri)
        if address.scheme in ("http", "https"):
            port = address.port or (443 if address.scheme == "https" else 80)
            try:
                socket.create_connection((address.hostname or "", port), timeout=CONNECT_SECONDS).close()
            except OSError as error:
                raise ConfigError("tracking.uri", f"no MLflow server answers at {uri}: "
                                                  f"{error.strerror or error}") from None
        client, _ = _mlflow_client(uri)
        _experiment_id(client, section, uri)


#: Seconds a run waits for an MLflow server named by ``tracking.uri`` to accept a connection.
CONNECT_SECONDS = 5.0


def _mlflow_client(uri: str) -> tuple[Any, str]:
    """An MLflow client for ``uri``, telemetry off."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise _missing("mlflow") from None
    logging.getLogger("mlflow").setLevel(logging.WARNING)      # its database set-up chatter
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)         # its retry warnings: the error says it
    try:
        return MlflowClient(tracking_uri=uri), uri
    except Exception as error:  # e.g. MLflow 3 refusing its old file store
        raise _store_error(uri, error) from None


def _experiment_id(client: Any, section: TrackingSection, uri: str) -> str:
    """The id of MLflow experiment ``section.experiment``, created if new; with a local database its artifacts
    go to ``mlartifacts/`` beside it (MLflow's own default is ``./mlruns`` wherever the process runs)."""
    try:
        found = client.get_experiment_by_name(section.experiment)
        if found is not None:
            return str(found.experiment_id)
        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" / section.experiment).as_uri()
        return str(client.create_experiment(section.experiment, artifact_location=location))
    except Exception as error:  # MLflow's own errors (an unsupported store, a server that does not answer)
        raise _store_error(uri, error) from None


def _store_error(uri: str, error: Exception) -> ConfigError:
    """MLflow's error about its store, as one line naming ``tracking.uri``."""
    text = str(error).strip()
    reason = text.split(". ")[0] if text else type(error).__name__
    return ConfigError("tracking.uri", f"MLflow cannot use {uri}: {reason}")


def _batches(items: list[Any]) -> Iterator[list[Any]]:
    for start in range(0, len(items), MLFLOW_BATCH):
        yield items[start:start + MLFLOW_BATCH]


class MlflowTracker:
    """One MLflow run: the config as parameters, metrics by step (the round), the folder as artifacts."""

    def __init__(self, section: TrackingSection, config: ExperimentConfig, folder: Path | None,
                 saved: str | None) -> None:
        self._client, uri = _mlflow_client(resolved_uri(section))
        from mlflow.entities import Param

        if saved is not None:   # a resumed run continues the run it started
            self.run_id = saved
            self._client.update_run(saved, status="RUNNING")
            return
        experiment = _experiment_id(self._client, section, uri)
        tags = {"mlflow.parentRunId": section.parent_run} if section.parent_run else {}
        run = self._client.create_run(experiment, run_name=config.experiment.name, tags=tags)
        self.run_id = str(run.info.run_id)
        params = [Param(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
                  for key, value in flat_fields(config).items()]
        for batch in _batches([Param(p.key, p.value[:MLFLOW_PARAM_CHARS]) for p in params]):
            self._client.log_batch(self.run_id, params=batch)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            _remember_run(folder, self.run_id, uri)

    def log(self, row: Mapping[str, Any], epsilons: np.ndarray) -> None:
        """Every number of the row as a metric at step ``round``."""
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(name, value, stamp, int(row["round"])) for name, value in metric_values(row, epsilons)]
        for batch in _batches(metrics):
            self._client.log_batch(self.run_id, metrics=batch)

    def finish(self, summary: Mapping[str, Any], folder: Path | None, status: str) -> None:
        """The results folder's files (not the checkpoint) as artifacts; the run marked ``status``."""
        if folder is not None and folder.is_dir():
            for file in sorted(folder.rglob("*")):
                relative = file.relative_to(folder)
                if file.is_file() and file.name not in NOT_ARTIFACTS and file.suffix != ".pt":
                    parent = str(relative.parent) if relative.parent != Path(".") else None
                    self._client.log_artifact(self.run_id, str(file), parent)
        self._client.set_terminated(self.run_id, status=status)


def _remember_run(folder: Path, run_id: str, uri: str) -> None:
    """Write ``folder``'s :data:`TRACKING_FILE` naming its MLflow run (atomically: a kill leaves the old file or the
    whole new one, never a part that a resume would refuse as damaged)."""
    write_atomic(folder / TRACKING_FILE, json.dumps({"backend": "mlflow", "run_id": run_id, "uri": uri}) + "\n")


def _saved_run(folder: Path | None) -> str | None:
    """The MLflow run a results folder's earlier start logged to, if any."""
    file = folder / TRACKING_FILE if folder is not None else None
    if file is None or not file.is_file():
        return None
    try:
        return str(json.loads(file.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError("--resume", f"{file} is damaged: it should name the tracked run; remove it to log the "
                                      "rest of the run as a new one") from None


def open_sweep_run(config: ExperimentConfig, name: str, out: Path, space: Mapping[str, Any]) -> str | None:
    """A sweep's own MLflow run (its trials' parent), reused when the sweep resumes; ``None`` unless the base
    config tracks to MLflow.  Its parameters: the search space."""
    if config.tracking.backend != "mlflow":
        return None
    saved = _saved_run(out)
    client, uri = _mlflow_client(resolved_uri(config.tracking))
    if saved is not None:
        return saved
    run = client.create_run(_experiment_id(client, config.tracking, uri), run_name=name,
                            tags={"decentdp.kind": "sweep"})
    run_id = str(run.info.run_id)
    from mlflow.entities import Param

    params = [Param(key, json.dumps(value)[:MLFLOW_PARAM_CHARS]) for key, value in space.items()]
    for batch in _batches(params):
        client.log_batch(run_id, params=batch)
    out.mkdir(parents=True, exist_ok=True)
    _remember_run(out, run_id, uri)
    return run_id


def finish_sweep_run(config: ExperimentConfig, run_id: str, best: Mapping[str, float], status: str) -> None:
    """The sweep's run: the best trial's objective values as metrics, marked ``status``."""
    from mlflow.entities import Metric

    client, _ = _mlflow_client(resolved_uri(config.tracking))
    stamp = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(f"best_{key}", float(value), stamp, 0) for key, value in best.items()])
    client.set_terminated(run_id, status=status)
