"""The results folder of a run: what is written, when, and how a run resumes from it.

Files (see the README's table): ``config.toml`` (the resolved config), ``provenance.json``, ``setup.json``
(what was calibrated and planned), ``metrics.jsonl`` (one row per evaluation), ``checkpoint.pt``
(written atomically; the run resumes from it bit for bit), and at the end ``privacy.json`` (every
agent's ledger and epsilon, and the pairwise view when messages went to single receivers),
``summary.json``, plots and, with ``--profile``, ``profile.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from decentdp.algorithms.base import State
from decentdp.config import ExperimentConfig, validate_config
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
    plot_metrics,
    provenance,
    strict_json,
    write_json,
    write_jsonl,
    write_toml,
)
from decentdp.run.build import Experiment


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
            if validate_config(saved["config"]).to_toml_dict() != config.to_toml_dict():
                raise ConfigError("--resume", "the config differs from the one the checkpoint was made with")
            return saved
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError("--out", f"{self.path} exists and is not a directory")
        if self.path.exists() and any(self.path.iterdir()):
            raise ConfigError("--out", f"{self.path} already holds files; pass --resume to continue that run "
                                       "or choose an empty directory")
        return None

    def start(self, experiment: Experiment) -> None:
        """The files known before the first round: resolved config, provenance, the run's setup."""
        self.path.mkdir(parents=True, exist_ok=True)
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
            "epsilon": epsilons.tolist(),
            "epsilon_accountant": accountant,
            "epsilon_rdp": ledger.epsilon("rdp").tolist(),
            "releases": ledger.releases().tolist(),
            "refused_releases": ledger.refused.tolist(),
            "ledger": ledger.state_dict(),
        }
        if ledger.has_receiver_releases:
            privacy["epsilon_pairwise_rdp"] = ledger.pairwise_epsilon("rdp").tolist()
        write_json(self.path / PRIVACY_FILE, privacy)
        write_json(self.path / SUMMARY_FILE, summary)
        if metrics:
            plot_metrics(metrics, self.path)

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
        "epsilon_max": float(epsilons.max()),
        "epsilon_per_agent": epsilons.tolist(),
        "epsilon_accountant": accountant,
        "refused_releases": int(experiment.ledger.refused.sum()),
        "delta": config.privacy.delta,
        "noise_multipliers": experiment.noise_multipliers.tolist(),
        "wall_seconds": wall,
    })
