"""The results folder of a run: what is written, when, and how a run resumes from it.

Files (see the README's table): ``config.toml`` (the resolved config), ``provenance.json``, ``setup.json``
(what was calibrated and planned), ``metrics.jsonl`` (one row per evaluation), ``checkpoint.pt``
(written atomically; the run resumes from it bit for bit), and at the end ``privacy.json`` (every
agent's ledger and epsilon, and the pairwise view when messages went to single receivers),
``summary.json``, plots and, with ``--profile``, ``profile.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from decentdp.algorithms.base import State
from decentdp.config import ExperimentConfig, config_differences, validate_config
from decentdp.errors import ConfigError
from decentdp.results import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    PRIVACY_FILE,
    PROFILE_FILE,
    PROVENANCE_FILE,
    SETUP_FILE,
    SUMMARY_FILE,
    epsilon_json,
    plot_metrics,
    provenance,
    strict_json,
    write_json,
    write_jsonl,
    write_toml,
)
from decentdp.run.build import Experiment


def _check_creatable(path: Path) -> None:
    """Refuse, before anything runs, a results folder that cannot be created: one below a file, or below
    a directory this process may not write (such as /proc)."""
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError("--out", f"cannot create {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK) or _read_only_mount(ancestor):
        raise ConfigError("--out", f"cannot create {path}: {ancestor} is not writable")


def _read_only_mount(directory: Path) -> bool:
    """Whether ``directory`` is on a read-only or pseudo file system (os.access says yes to root there)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY) or str(directory.resolve()).startswith(
            ("/proc", "/sys"))
    except OSError:
        return True


class ResultsFolder:
    """Writes one run's results folder ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, config: ExperimentConfig, resume: bool) -> dict[str, Any] | None:
        """Check the folder before anything is written; with ``resume``, the checkpoint to continue from."""
        checkpoint = self.path / CHECKPOINT_FILE
        if resume:
            if not checkpoint.is_file():
                raise ConfigError("--resume", f"no checkpoint to resume in {self.path}")
            saved = torch.load(checkpoint, weights_only=True)
            changed = config_differences(validate_config(saved["config"]), config)
            if changed == ["experiment.rounds"] and saved["round"] == saved["config"]["experiment"]["rounds"]:
                raise ConfigError("--resume", f"this run finished its {saved['round']} rounds and cannot be extended: "
                                              "its noise was calibrated for exactly the releases it planned, so "
                                              "more rounds would exceed the budget; start a new run with the "
                                              "rounds you want (or a larger budget)")
            if changed:
                raise ConfigError("--resume", "the config differs from the one the checkpoint was made with, in "
                                              f"{', '.join(changed)}; resume with the same config and overrides")
            return saved
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError("--out", f"{self.path} exists and is not a directory")
        if self.path.exists() and any(self.path.iterdir()):
            raise ConfigError("--out", f"{self.path} already holds files; pass --resume to continue that run "
                                       "or choose an empty directory")
        _check_creatable(self.path)
        return None

    def start(self, experiment: Experiment) -> None:
        """The files known before the first round: resolved config, provenance, the run's setup."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--out", f"cannot create the results folder {self.path}: {exc.strerror}") from None
        write_toml(self.path / CONFIG_FILE, experiment.config.to_toml_dict())
        write_json(self.path / PROVENANCE_FILE, provenance(experiment.config.experiment.seed))
        write_json(self.path / SETUP_FILE, experiment.setup)

    def checkpoint(self, experiment: Experiment, round_done: int, state: State, metrics: list[dict[str, Any]],
                   wall_seconds: float) -> None:
        """Everything a resume needs, written atomically, and the metrics so far."""
        payload = {"round": round_done, "state": state, "metrics": metrics,
                   "config": experiment.config.to_toml_dict(),
                   "secret": experiment.oracle.rng.secret.hex(),
                   "passes": {"agents_per_pass": experiment.oracle.agents_per_pass,
                              "evaluation_chunk": experiment.evaluator.chunk},
                   "scheduler": experiment.simulator.scheduler.state_dict(),
                   "ledger": experiment.ledger.state_dict(), "wall_seconds": wall_seconds}
        tmp = self.path / f".{CHECKPOINT_FILE}.tmp"
        torch.save(payload, tmp)
        tmp.replace(self.path / CHECKPOINT_FILE)
        write_jsonl(self.path / METRICS_FILE, metrics)

    def finish(self, experiment: Experiment, summary: dict[str, Any], metrics: list[dict[str, Any]]) -> None:
        """``privacy.json``, ``summary.json`` and the plots of a finished run."""
        ledger = experiment.ledger
        epsilons, accountant = ledger.reported_epsilon()
        privacy: dict[str, Any] = {
            "delta": experiment.config.privacy.delta,
            "epsilon": epsilon_json(epsilons),
            "epsilon_accountant": accountant,
            "epsilon_rdp": epsilon_json(ledger.epsilon("rdp")),
            "releases": ledger.releases().tolist(),
            "refused_releases": ledger.refused.tolist(),
            "ledger": ledger.state_dict(),
        }
        if ledger.has_receiver_releases:
            privacy["epsilon_pairwise_rdp"] = epsilon_json(ledger.pairwise_epsilon("rdp"))
        write_json(self.path / PRIVACY_FILE, privacy)
        write_json(self.path / SUMMARY_FILE, summary)
        if metrics:
            eps = summary["epsilon_max"]
            spent = "inf (not private)" if eps is None else format(eps, ".3g")
            plot_metrics(metrics, self.path, f"{summary['name']}: {summary['algorithm']}, {summary['n_agents']} "
                                             f"agents, epsilon {spent} at delta {summary['delta']:g}")

    def profile(self, report: dict[str, Any]) -> None:
        write_json(self.path / PROFILE_FILE, report)


def summary(experiment: Experiment, metrics: list[dict[str, Any]], wall: float, finished: bool) -> dict[str, Any]:
    config = experiment.config
    last = metrics[-1] if metrics else {}
    epsilons, accountant = experiment.ledger.reported_epsilon()
    return strict_json({
        "name": config.experiment.name,
        "algorithm": config.algorithm.name,
        "dataset": config.data.dataset,
        "n_agents": experiment.data.n_agents,
        "rounds": int(last.get("round", 0)),
        "finished": finished,
        "accuracy_mean": last.get("accuracy_mean"),
        "accuracy_std": last.get("accuracy_std"),
        "accuracy_min": last.get("accuracy_min"),
        "accuracy_max": last.get("accuracy_max"),
        "consensus_distance": last.get("consensus_distance"),
        "private": config.privacy.private,
        "epsilon_max": epsilon_json(float(epsilons.max())),
        "epsilon_per_agent": epsilon_json(epsilons),
        "epsilon_accountant": accountant,
        "epsilon_target": epsilon_json(min(config.privacy.budgets)),
        "refused_releases": int(experiment.ledger.refused.sum()),
        "delta": config.privacy.delta,
        "clip": config.privacy.clip,
        "noise_multipliers": experiment.noise_multipliers.tolist(),
        # The settings that define a row of a table, so that no table needs to join other files:
        "seed": config.experiment.seed,
        "graph": "complete" if config.pools_data else config.topology.graph,
        "partition": config.data.partition,
        "model": config.model.name,
        "lr": config.algorithm.lr,
        "lr_schedule": config.algorithm.lr_schedule,
        "batch_size": config.algorithm.batch_size,
        "schedule": config.schedule_kind,
        "algorithm_settings": config.algorithm.settings.model_dump(),
        "config": config.to_toml_dict(),
        "wall_seconds": wall,
    })
