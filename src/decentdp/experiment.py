"""From a validated config to a results folder: build every component, run, record.

Data flow (see ``docs/architecture.md``)::

    config -> dataset + partition -> AgentData ----------------+
           -> topology (graph, W) -> SimulatedNetwork ---------+
           -> model -> FlatModel (+ initial params, stacked) ---+--> Simulator.run -> metrics,
           -> privacy: sigma_i calibrated for planned releases  |    checkpoints, ledger,
              -> PrivacyLedger + GradientOracle ----------------+    summary, plots
           -> algorithm (registry) ---------------------------/

Everything that can fail because of user input (data files, graph, calibration) is built before
the output folder is touched, so a failing run leaves nothing half-written.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from decentdp.algorithms import build_algorithm
from decentdp.algorithms.base import Algorithm, State
from decentdp.config import ExperimentConfig
from decentdp.data.datasets import Dataset, load_dataset
from decentdp.data.partition import class_histograms, partition
from decentdp.util.allocator import retain_freed_memory
from decentdp.runtime.evaluation import Evaluator, evaluation_chunk
from decentdp.gradients.flat_model import FlatModel
from decentdp.gradients.memory import MemoryPlan, available_memory, padded_batch, plan_memory, state_bytes
from decentdp.runtime.network import SimulatedNetwork
from decentdp.util.profiling import NO_TIMER, PhaseTimer, TimedNetwork, format_report, operator_table
from decentdp.runtime.rng import AgentRandom
from decentdp.runtime.sampling import AgentData, PoissonSampler
from decentdp.runtime.schedules import Schedule
from decentdp.runtime.simulator import Simulator
from decentdp.gradients.stacked_model import gradient_model
from decentdp.errors import ConfigError
from decentdp.models import build_model, classification_loss, validate_for_dp
from decentdp.privacy.accounting import calibrate_noise_multiplier
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanism import GaussianSpec, GradientOracle, round_up_to_float32
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
from decentdp.topology import Topology, build_topology


@dataclass
class Experiment:
    """Every component of a run, built and validated, before anything is written."""

    config: ExperimentConfig
    dataset: Dataset
    data: AgentData
    topology: Topology
    model: FlatModel
    algorithm: Algorithm
    ledger: PrivacyLedger
    oracle: GradientOracle
    simulator: Simulator
    evaluator: Evaluator
    noise_multipliers: torch.Tensor
    sample_rates: torch.Tensor
    histograms: np.ndarray
    memory: MemoryPlan
    setup: dict[str, Any] = field(default_factory=dict)

    def initial_state(self) -> State:
        params = self.model.initial_parameters()
        return self.algorithm.init_state(params.unsqueeze(0).repeat(self.data.n_agents, 1))


def _agent_budgets(config: ExperimentConfig, n_agents: int) -> list[float]:
    privacy = config.privacy
    budgets = list(privacy.agent_epsilons) if privacy.agent_epsilons is not None else [privacy.epsilon] * n_agents
    return [min(budgets)] if config.pools_data else budgets


def _calibrate(budgets: list[float], rates: list[float], config: ExperimentConfig, releases: int) -> list[float]:
    """sigma_i for each agent's planned ``rounds * releases`` releases at rate q_i (cached per pair)."""
    cache: dict[tuple[float, float], float] = {}
    sigmas = []
    for epsilon, rate in zip(budgets, rates, strict=True):
        if (epsilon, rate) not in cache:
            cache[(epsilon, rate)] = calibrate_noise_multiplier(
                epsilon, config.privacy.delta, rate, config.experiment.rounds, releases, config.privacy.accountant)
        sigmas.append(float(round_up_to_float32(torch.tensor(cache[(epsilon, rate)], dtype=torch.float64))))
    return sigmas


def _plan_memory(config: ExperimentConfig, model: FlatModel, algorithm: Algorithm, data: AgentData,
                 rates: list[float]) -> MemoryPlan:
    """Estimate the run's peak memory and how many agents' gradients fit in one pass (or refuse)."""
    n_agents = data.n_agents
    state = state_bytes(algorithm.init_state(torch.empty(n_agents, model.dim, device="meta")))
    sizes = [len(owned) for owned in data.indices]
    width = max(padded_batch(rate * size, size) for rate, size in zip(rates, sizes, strict=True))
    sample = data.x[data.indices[0][0]]
    per_sample = model.activation_bytes_per_sample(sample, data.y[data.indices[0][0]])
    batch = n_agents * width * (sample.numel() * sample.element_size() + 8 + 4)  # inputs, labels, mask
    limit = config.engine.memory_limit_gb
    return plan_memory(n_agents, model.dim, state, batch, per_sample, width,
                       int(limit * 2**30) if limit is not None else available_memory(),
                       config.engine.agents_per_pass, algorithm.round_temporaries)


def build_experiment(config: ExperimentConfig, data_dir: str | Path | None = None) -> Experiment:
    """Load data, build graph, model, privacy and algorithm; raises DecentDPError on bad input."""
    cfg_data, topo_cfg, algo_cfg = config.data, config.topology, config.algorithm
    seed = config.experiment.seed
    dataset = load_dataset(cfg_data.dataset, data_dir if data_dir is not None else cfg_data.data_dir,
                           image_size=cfg_data.image_size)
    labels = dataset.y_train.numpy()
    algorithm = build_algorithm(config)
    if algorithm.pools_data:
        parts = [np.arange(len(labels), dtype=np.int64)]
        topology = build_topology("complete", 1, mixing="metropolis-hastings", seed=seed)
    else:
        parts = partition(labels, topo_cfg.agents, cfg_data.partition, seed=seed, t=cfg_data.overlap_t,
                          alpha=cfg_data.dirichlet_alpha, size_skew=cfg_data.size_skew)
        graph_params = {key: getattr(topo_cfg, key) for key in ("p", "radius", "k", "fiedler", "rows")
                        if getattr(topo_cfg, key) is not None}
        topology = build_topology(topo_cfg.graph, topo_cfg.agents, mixing=topo_cfg.mixing, seed=seed,
                                  fiedler_tol=topo_cfg.fiedler_tol, **graph_params)
    data = AgentData(dataset.x_train, dataset.y_train, tuple(torch.from_numpy(p) for p in parts))

    module = build_model(config.model.name, dataset.input_shape, dataset.num_classes, seed=seed,
                         **config.model.options)
    private = config.privacy.private
    if private:
        validate_for_dp(module)
    model = gradient_model(module, classification_loss, config.engine.gradients)

    sizes = [len(p) for p in parts]
    rates = [min(1.0, algo_cfg.batch_size / n) for n in sizes]
    budgets = _agent_budgets(config, len(parts))
    sigmas = _calibrate(budgets, rates, config, algorithm.releases_per_round) if private else [0.0] * len(parts)
    ledger = PrivacyLedger(len(parts), budgets, config.privacy.delta, budget_accountant=config.privacy.accountant)
    rng = AgentRandom(seed, secrets.token_bytes(32) if config.privacy.secure_noise else b"")
    sample_rates = torch.tensor(rates, dtype=torch.float64)
    noise_multipliers = torch.tensor(sigmas, dtype=torch.float32)
    sampler = PoissonSampler(data, sample_rates, rng)
    spec = GaussianSpec(noise_multipliers, config.privacy.clip) if private else None
    memory = _plan_memory(config, model, algorithm, data, rates)
    oracle = GradientOracle(model, sampler, ledger, rng, spec, agents_per_pass=memory.agents_per_pass)
    network = SimulatedNetwork(topology)
    schedule = Schedule(algo_cfg.lr_schedule, algo_cfg.lr, algo_cfg.lr_final or algo_cfg.lr, config.experiment.rounds)
    simulator = Simulator(algorithm, network, oracle, schedule)
    evaluator = Evaluator(model, dataset.x_test, dataset.y_test,
                          chunk=evaluation_chunk(memory.agents_per_pass * memory.activation_bytes_per_agent,
                                                 memory.activation_bytes_per_sample, len(parts)))
    histograms = class_histograms(labels, parts, dataset.num_classes)
    setup = {
        "n_agents": len(parts),
        "parameters": model.dim,
        "agent_sizes": sizes,
        "sample_rates": rates,
        "noise_multipliers": sigmas,
        "epsilon_budgets": budgets,
        "releases_per_round": algorithm.releases_per_round,
        "calibration_accountant": config.privacy.accountant,
        "class_histograms": histograms.tolist(),
        "topology": topology.report.as_dict(),
        "mixing_warnings": list(topology.warnings),
        "gradient_engine": model.backend,
        "gradient_engine_fallback_reason": model.fallback_reason,
        "memory_plan": memory.as_dict(),
    }
    return Experiment(config, dataset, data, topology, model, algorithm, ledger, oracle, simulator, evaluator,
                      noise_multipliers, sample_rates, histograms, memory, setup)


@dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    state: State
    out_dir: Path | None


def _prepare_out_dir(out_dir: Path, resume: bool) -> dict[str, Any] | None:
    checkpoint = out_dir / CHECKPOINT_FILE
    if resume:
        if not checkpoint.is_file():
            raise ConfigError("--resume", f"no checkpoint to resume in {out_dir}")
        return torch.load(checkpoint, weights_only=True)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--out", f"{out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError("--out", f"{out_dir} already holds files; pass --resume to continue that run "
                                   "or choose an empty directory")
    return None


def run_experiment(config: ExperimentConfig, out_dir: str | Path | None = None, *,
                   data_dir: str | Path | None = None, resume: bool = False, stop_after: int | None = None,
                   progress: bool = True, log: Callable[[str], None] | None = None,
                   profile: bool = False) -> RunResult:
    """Build and run an experiment, writing its results folder (if ``out_dir`` is given).

    ``stop_after`` ends the run after that many rounds (as if killed right after a checkpoint),
    leaving a resumable folder; ``resume`` continues a run from its folder's checkpoint.
    ``profile`` times every phase of the rounds and records torch's busiest operators over a few
    rounds (see :mod:`decentdp.util.profiling`); the report is logged and saved as ``profile.json``.
    """
    retain_freed_memory()
    experiment = build_experiment(config, data_dir)
    out = Path(out_dir) if out_dir is not None else None
    checkpoint = _prepare_out_dir(out, resume) if out is not None else None
    if checkpoint is not None and checkpoint["config"] != config.to_toml_dict():
        raise ConfigError("--resume", "the config differs from the one the checkpoint was made with")

    state = experiment.initial_state()
    metrics: list[dict[str, Any]] = []
    start, elapsed = 0, 0.0
    if checkpoint is not None:
        state, start, elapsed = checkpoint["state"], checkpoint["round"], checkpoint["wall_seconds"]
        metrics = checkpoint["metrics"]
        experiment.ledger = experiment.ledger.from_state_dict(checkpoint["ledger"])
        experiment.oracle.ledger = experiment.ledger
        experiment.oracle.rng.secret = bytes.fromhex(checkpoint["secret"])
        # Same grouping of agents and test samples as before the interruption: bit-exact resumes
        # (checkpoints written before the memory plan existed have none to restore).
        if "passes" in checkpoint:
            experiment.oracle.agents_per_pass = checkpoint["passes"]["agents_per_pass"]
            experiment.evaluator.chunk = checkpoint["passes"]["evaluation_chunk"]
    elif out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_toml(out / CONFIG_FILE, config.to_toml_dict())
        write_json(out / PROVENANCE_FILE, provenance(config.experiment.seed))
        write_json(out / SETUP_FILE, experiment.setup)

    cfg = config.experiment
    rounds = cfg.rounds
    last = min(rounds, stop_after) if stop_after is not None else rounds
    checkpoint_every = cfg.checkpoint_every or cfg.eval_every
    emit = log or (lambda message: tqdm.write(message))
    _announce(experiment, emit)
    timer = _attach_timer(experiment) if profile else NO_TIMER
    operators = _operator_profiler(last - start) if profile else None
    if operators is not None:
        operators.start()
    bar = tqdm(total=rounds, initial=start, disable=not progress, desc=cfg.name, unit="round", leave=False)
    clock = time.perf_counter()

    def save(round_done: int, current: State) -> None:
        if out is None:
            return
        with timer.phase("checkpoint"):
            _save(round_done, current)

    def _save(round_done: int, current: State) -> None:
        assert out is not None
        payload = {"round": round_done, "state": current, "metrics": metrics, "config": config.to_toml_dict(),
                   "secret": experiment.oracle.rng.secret.hex(),
                   "passes": {"agents_per_pass": experiment.oracle.agents_per_pass,
                              "evaluation_chunk": experiment.evaluator.chunk},
                   "ledger": experiment.ledger.state_dict(), "wall_seconds": elapsed + time.perf_counter() - clock}
        tmp = out / f".{CHECKPOINT_FILE}.tmp"
        torch.save(payload, tmp)
        tmp.replace(out / CHECKPOINT_FILE)
        write_jsonl(out / METRICS_FILE, metrics)

    def after_round(done: int, current: State) -> bool:
        bar.update(1)
        if operators is not None:
            operators.step()
        if done % cfg.eval_every == 0 or done == rounds:
            with timer.phase("evaluation"):
                evaluation = experiment.evaluator(current["params"]).summary()
            row = {"round": done, "lr": experiment.simulator.schedule(done - 1), **evaluation,
                   "epsilon_max": float(experiment.ledger.epsilon(config.privacy.accountant).max()),
                   "epsilon_accountant": config.privacy.accountant,
                   "clipped_fraction": experiment.oracle.last.clipped_fraction if experiment.oracle.last else 0.0,
                   "wall_seconds": elapsed + time.perf_counter() - clock}
            metrics.append(row)
            emit(f"round {done:>5}/{rounds}  acc {row['accuracy_mean']:.4f} "
                 f"(min {row['accuracy_min']:.4f}, max {row['accuracy_max']:.4f})  "
                 f"consensus {row['consensus_distance']:.3g}  eps({row['epsilon_accountant']}) "
                 f"{row['epsilon_max']:.3g}")
        if done % checkpoint_every == 0 or done == last:
            save(done, current)
        return done < last

    if checkpoint is None:
        save(0, state)  # resumable from the very start
    try:
        if start < last:
            state = experiment.simulator.run(state, start, rounds, after_round)
    finally:
        if operators is not None:
            operators.stop()
    bar.close()
    wall = elapsed + time.perf_counter() - clock
    if operators is not None:
        report = {**timer.report(), "gradient_engine": experiment.model.backend,
                  "operators": operator_table(operators)}
        for line in format_report(report, report["operators"], experiment.model.backend):
            emit(line)
        if out is not None:
            write_json(out / PROFILE_FILE, report)
    summary = _summary(experiment, metrics, wall, finished=last == rounds)
    refused = experiment.ledger.refused
    if refused.any():
        emit(f"warning: {int((refused > 0).sum())} agent(s) ran out of privacy budget and skipped "
             f"{int(refused.sum())} release(s) in total (see privacy.json)")
    if out is not None and last == rounds:
        epsilons, accountant = experiment.ledger.reported_epsilon()
        write_json(out / PRIVACY_FILE, {
            "delta": config.privacy.delta,
            "epsilon": epsilons.tolist(),
            "epsilon_accountant": accountant,
            "epsilon_rdp": experiment.ledger.epsilon("rdp").tolist(),
            "releases": experiment.ledger.releases().tolist(),
            "refused_releases": experiment.ledger.refused.tolist(),
            "ledger": experiment.ledger.state_dict(),
        })
        write_json(out / SUMMARY_FILE, summary)
        if metrics:
            plot_metrics(metrics, out)
    return RunResult(summary, metrics, state, out)


#: Rounds whose torch operators ``profile`` records (after one skipped and one warm-up round).
PROFILED_ROUNDS = 3


def _operator_profiler(rounds: int) -> torch.profiler.profile:
    """torch's profiler over :data:`PROFILED_ROUNDS` rounds, after a skipped and a warm-up round when
    the run is long enough (so that one-off costs stay out of the table)."""
    wait = 1 if rounds >= PROFILED_ROUNDS + 2 else 0
    warmup = 1 if rounds >= PROFILED_ROUNDS + 1 else 0
    active = max(1, min(PROFILED_ROUNDS, rounds - wait - warmup))
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1))


def _attach_timer(experiment: Experiment) -> PhaseTimer:
    """Time the oracle's phases, the network's calls and the rounds of ``experiment``."""
    timer = PhaseTimer()
    experiment.oracle.timer = timer
    experiment.simulator.timer = timer
    experiment.simulator.network = TimedNetwork(experiment.simulator.network, timer)
    return timer


def _announce(experiment: Experiment, emit: Callable[[str], None]) -> None:
    """Print what is about to run: the graph, the model size, the privacy plan, any warnings."""
    config, report, sigmas = experiment.config, experiment.topology.report, experiment.noise_multipliers
    graph = "single agent (pooled data)" if config.pools_data else f"graph '{config.topology.graph}'"
    emit(f"{experiment.data.n_agents} agent(s), {graph}: {report.n_edges} edges, "
         f"normalized Fiedler {report.normalized_fiedler:.3f}, spectral gap {report.spectral_gap:.3f}; "
         f"{experiment.model.dim} parameters per agent")
    budgets = experiment.ledger.budgets
    planned = config.experiment.rounds * experiment.algorithm.releases_per_round
    emit(f"privacy: epsilon {budgets.min():g}..{budgets.max():g} per agent at delta {config.privacy.delta:g}, "
         f"sigma {float(sigmas.min()):.4g}..{float(sigmas.max()):.4g} for {planned} planned releases"
         if config.privacy.private else "privacy: none (epsilon = inf)")
    emit(f"gradients: {experiment.model.backend} engine" + (
        f" (the stacked engine does not support this model: {experiment.model.fallback_reason})"
        if experiment.model.fallback_reason else ""))
    emit(experiment.memory.describe())
    for warning in experiment.topology.warnings:
        emit(f"warning: {warning}")


def _summary(experiment: Experiment, metrics: list[dict[str, Any]], wall: float, finished: bool) -> dict[str, Any]:
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


def summary_line(summary: dict[str, Any]) -> str:
    """The one-line JSON the CLI prints last with ``--json``."""
    return json.dumps(summary, sort_keys=True)
