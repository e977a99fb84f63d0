"""The run: build, resume or start the results folder, the setup phase, the rounds, evaluation, the end.

``run_experiment`` is what ``decentdp run`` calls.  It builds every component first
(:mod:`decentdp.experiment.build`), so bad input fails before anything is written; then it runs the
algorithm's setup phase (if any) and the rounds through the simulator, evaluates every
``eval_every`` rounds, checkpoints, and records the results (:mod:`decentdp.experiment.record`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from decentdp.algorithms.base import RunFacts, State
from decentdp.config import ExperimentConfig, checked_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import Experiment, build_experiment
from decentdp.experiment.record import ResultsFolder, refuse_config_inside, summary
from decentdp.experiment.tracking import Tracker, check_tracking, open_tracker
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.results.files import epsilon_json, epsilon_text
from decentdp.rng import SIMULATION_NOTICE
from decentdp.runtime.averaging import AVERAGE, evaluated_parameters
from decentdp.runtime.distributed.sharded import ShardWriteError
from decentdp.util.allocator import retain_freed_memory
from decentdp.util.profiling import NO_TIMER, PhaseTimer, TimedNetwork, format_report, operator_table
from decentdp.util.threads import ThreadChoice, apply_threads


@dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    state: State
    out_dir: Path | None


def _restore(experiment: Experiment, checkpoint: dict[str, Any]) -> None:
    """Put the ledger, scheduler and pass sizes of a checkpoint back (bit-exact resumes)."""
    experiment.oracle.ledger = type(experiment.ledger).from_state_dict(checkpoint["ledger"])
    if "scheduler" in checkpoint:  # checkpoints of earlier versions ran synchronous rounds only
        experiment.simulator.scheduler.load_state_dict(checkpoint["scheduler"])
    if "passes" in checkpoint:  # checkpoints written before the memory plan existed have none
        experiment.oracle.agents_per_pass = checkpoint["passes"]["agents_per_pass"]
        experiment.evaluator.chunk = checkpoint["passes"]["evaluation_chunk"]


def _check_device(experiment: Experiment, checkpoint: dict[str, Any]) -> None:
    """A simulation-mode run resumes on the kind of device it ran on: CPU and CUDA generators draw
    different numbers for one key, so rounds replayed after the checkpoint would release new noise on
    batches an interrupted run may already have released (secure-mode draws do not depend on the device).
    Checked before Ray starts: its workers compute on the CPU only, so a run written on CUDA can only continue
    on the simulator backend (``engine.device`` cannot name CUDA with Ray)."""
    saved = torch.device(checkpoint.get("device", "cpu"))  # checkpoints before engine.device ran on the CPU
    if saved.type == experiment.device.type or experiment.oracle.rng.secure:
        return
    streams = "their random streams differ, so rounds replayed after the checkpoint would draw new noise"
    if experiment.config.engine.backend == "ray":
        raise ConfigError("engine.backend", f"the checkpoint was written on {saved.type} and Ray's workers compute "
                                            f"on the CPU: {streams}; this run can only continue on the simulator "
                                            f"backend with {saved.type}: resume with --set engine.backend=simulator "
                                            f"--set engine.device={saved.type}")
    raise ConfigError("engine.device", f"the checkpoint was written on {saved.type} and this run would go on "
                                       f"on {experiment.device.type}: {streams}; resume with --set "
                                       f"engine.device={saved.type}")


def run_experiment(config: ExperimentConfig | str | Path, out_dir: str | Path | None = None, *,
                   data_dir: str | Path | None = None, resume: bool = False, stop_after: int | None = None,
                   progress: bool = True, log: Callable[[str], None] | None = None,
                   profile: bool = False, diagnostics: bool = False) -> RunResult:
    """Build and run an experiment, writing its results folder (if ``out_dir`` is given).

    ``config`` is validated again as a whole first (:func:`~decentdp.config.checked_config`), so a config changed
    after loading gets every check a loaded one does; a path is loaded.
    ``stop_after`` ends the run after that many rounds (as if killed right after a checkpoint),
    leaving a resumable folder; ``resume`` continues a run from its folder's checkpoint.
    ``diagnostics`` adds operator statistics computed from the raw private data (not differentially
    private): ``diagnostics.json`` (class histograms) and a labelled ``diagnostics`` entry in every
    metrics row (the fraction of clipped gradients); shareable results hold none of them by default.
    ``profile`` times every phase of the rounds and records torch's busiest operators over a few
    rounds (see :mod:`decentdp.util.profiling`); the report is logged and saved as ``profile.json``.
    """
    if isinstance(config, (str, Path)) and out_dir is not None and not resume:
        refuse_config_inside(config, Path(out_dir))
    config = checked_config(config)  # changed after loading, or a path: validated again as a whole
    retain_freed_memory()
    # A count the user set holds from the start (the build's reductions run on it too); otherwise the round's
    # work and the free cores decide it once the model is built (below, in _run).
    threads = apply_threads(config.engine.threads, sample_load=False)
    if config.personalized is not None:  # Bellet et al.: per-agent models, asynchronous updates (own runner)
        for option, asked in (("--profile", profile), ("--diagnostics", diagnostics)):
            if asked:
                raise ConfigError(option, "times and diagnoses the rounds of a network run; a personalized run "
                                          "has none of its phases (it takes seconds): run it without")
        return _run_personalized(config, out_dir, data_dir, resume, log, threads.threads)
    folder = ResultsFolder(Path(out_dir)) if out_dir is not None else None
    try:
        return _run(config, folder, data_dir, resume, stop_after, progress, log, profile, diagnostics, threads)
    finally:
        if folder is not None:
            folder.close()  # the folder's lock; a folder left empty by a failed start is removed


def _run(config: ExperimentConfig, folder: ResultsFolder | None, data_dir: str | Path | None, resume: bool,
         stop_after: int | None, progress: bool, log: Callable[[str], None] | None, profile: bool,
         diagnostics: bool, threads: ThreadChoice) -> RunResult:
    """:func:`run_experiment` once its results folder (if any) is known: open (locked), build, run, record."""
    checkpoint = folder.open(config, resume) if folder is not None else None  # paths checked before the build
    check_tracking(config)  # the tracker's library and store, before the data loads
    experiment = build_experiment(config, data_dir)
    if not threads.explicit and checkpoint is not None and "threads" in checkpoint:
        # the count the run computed with, not today's load: float sums split over other threads end otherwise
        threads = replace(apply_threads(checkpoint["threads"]), source="as the run before its checkpoint")
    elif not threads.explicit:
        threads = apply_threads(config.engine.threads, round_flops=experiment.round_flops)
    if checkpoint is not None:
        _check_device(experiment, checkpoint)  # (before Ray starts: a resume it cannot continue is refused at once)
    if config.engine.backend == "ray":  # agents sharded over Ray worker processes (the optional `ray` extra)
        from decentdp.runtime.distributed.ray_backend import distribute
        experiment.simulator = distribute(experiment.simulator, config.engine, config.experiment.checkpoint_interval,
                                          log, None if checkpoint is None else checkpoint.get("per_agent"))

    path = folder.path if folder is not None else None
    tracker = open_tracker(config, path, resume=checkpoint is not None)
    try:
        outcome = _train(experiment, folder, checkpoint, stop_after, progress, log, profile, diagnostics, threads,
                         tracker)
    except BaseException as error:
        tracker.finish({}, path, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        raise
    finally:  # also where no round ran (a finished run resumed, a refusal): Ray's workers and instance stop
        experiment.simulator.close()
    tracker.finish(outcome.summary, path, "FINISHED" if outcome.summary["finished"] else "KILLED")
    return outcome


def _train(experiment: Experiment, folder: ResultsFolder | None, checkpoint: dict[str, Any] | None,
           stop_after: int | None, progress: bool, log: Callable[[str], None] | None, profile: bool,
           diagnostics: bool, threads: ThreadChoice, tracker: Tracker) -> RunResult:
    """The rounds of a built run, from its start or its checkpoint, and the record of their results (in the
    results folder, if any, and the tracker)."""
    config = experiment.config
    state = experiment.initial_state()
    metrics: list[dict[str, Any]] = []
    start, elapsed = 0, 0.0
    if checkpoint is not None:
        state = {key: value.to(experiment.device) for key, value in checkpoint["state"].items()}
        start, elapsed = checkpoint["round"], checkpoint["wall_seconds"]
        metrics = checkpoint["metrics"]
        _restore(experiment, checkpoint)
        if folder is not None:
            folder.restore_keys(experiment, checkpoint)  # (a secure run's fingerprint is keyed by them)
            folder.check_same_data(experiment)
            folder.check_same_noise(experiment)
    elif folder is not None:
        folder.start(experiment)
    if folder is not None and diagnostics:
        folder.diagnostics(experiment)

    cfg = config.experiment
    rounds = cfg.rounds
    last = min(rounds, stop_after) if stop_after is not None else rounds
    checkpoint_every = cfg.checkpoint_interval
    emit = log or (lambda message: tqdm.write(message))
    _announce(experiment, emit)
    emit(threads.describe())
    timer = _attach_timer(experiment) if profile else NO_TIMER
    operators = _operator_profiler(last - start) if profile else None
    if operators is not None:
        operators.start()
    # A bar only on a terminal: elsewhere (a log file, a pipe) its redraws would interleave with the rows.
    bar = tqdm(total=rounds, initial=start, disable=not progress or not sys.stderr.isatty(), desc=cfg.name,
               unit="round", leave=False)
    clock = time.perf_counter()
    completed = start  # rounds done so far: what the run has released (a stop may fall between evaluations)

    def save(round_done: int, current: State) -> None:
        if folder is not None:
            with timer.phase("checkpoint"):
                folder.checkpoint(experiment, round_done, current, metrics,  # a sharded engine's workers
                                  elapsed + time.perf_counter() - clock)                # write their own rows

    def evaluate(done: int, current: State) -> None:
        with timer.phase("evaluation"):
            evaluation = experiment.evaluator(evaluated_parameters(current)).summary()
            if AVERAGE in current:  # the last iterates too, so that the average's gain is measured in every run
                evaluation["last_iterate_accuracy_mean"] = \
                    experiment.evaluator(current["params"]).summary()["accuracy_mean"]
        spent = experiment.ledger.epsilon(config.privacy.accountant)   # each agent's, so far
        row = {"round": done, "lr": experiment.simulator.schedule(max(done - 1, 0)), **evaluation,
               "epsilon_max": epsilon_json(float(spent.max())),
               "epsilon_accountant": config.privacy.accountant,
               "wall_seconds": elapsed + time.perf_counter() - clock}
        if diagnostics:  # computed from raw data, not released privately: only when asked, and labelled
            row["diagnostics"] = {"clipped_fraction": experiment.oracle.last_clipped_fraction}
        metrics.append(row)
        tracker.log(row, spent)
        emit(f"round {done:>5}/{rounds}  acc {row['accuracy_mean']:.4f} "
             f"(min {row['accuracy_min']:.4f}, max {row['accuracy_max']:.4f})  "
             f"consensus {row['consensus_distance']:.3g}  eps({row['epsilon_accountant']}) "
             f"{epsilon_text(row['epsilon_max'], significant=3)}")

    def after_round(done: int, current: State) -> bool:
        nonlocal completed
        completed = done
        bar.update(1)
        if operators is not None:
            operators.step()
        if done % cfg.eval_every == 0 or done == rounds:
            evaluate(done, current)
        if done % checkpoint_every == 0 or done == last:
            save(done, current)
        return done < last

    try:
        if checkpoint is None:
            state = experiment.simulator.setup(state)  # the setup phase's releases come before round 0
            evaluate(0, state)  # curves start where training starts
            save(0, state)  # resumable from the very start
        if start < last:
            state = experiment.simulator.run(state, start, rounds, after_round)
    except ShardWriteError as error:  # Ray workers that could not write a checkpoint round's rows (a full disk)
        if folder is None:
            raise  # (its own one-line message: the workers' temporary folder)
        raise folder.unwritten(error.round_index, Path(error.directory), error.reason) from None
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
        if folder is not None:
            folder.profile(report)
    result = summary(experiment, metrics, wall, finished=last == rounds, rounds_run=completed) | \
        {"threads": threads.threads}
    # An algorithm's own figures (e.g. Muffliato's pairwise DP) price the rounds run; a run stopped before its first
    # round has released nothing for them to price.
    extras = experiment.algorithm.privacy_results(state, run_facts(experiment, completed)) if completed > 0 \
        else AlgorithmPrivacy()
    result |= extras.summary()
    refused = experiment.ledger.refused
    if refused.any():
        emit(f"warning: {int((refused > 0).sum())} agent(s) ran out of privacy budget and skipped "
             f"{int(refused.sum())} release(s) in total (see privacy.json)")
    if folder is not None and last == rounds:
        folder.finish(experiment, result, metrics, extras)
    if not config.privacy.private:
        emit(NOT_PRIVATE)
    return RunResult(result, metrics, state, folder.path if folder is not None else None)


def run_facts(experiment: Experiment, rounds: int) -> RunFacts:
    """What is public about a run that ran ``rounds`` rounds, for its algorithm's own privacy results."""
    return RunFacts(rounds, experiment.graphs.at, experiment.schedule, experiment.noise_multipliers.double().numpy(),
                    experiment.oracle.expected_batch.double().numpy(), experiment.config.privacy.delta,
                    experiment.config.privacy.neighbouring, experiment.ledger.reported_epsilon()[0],
                    experiment.sample_rates.double().numpy(), experiment.config.privacy.colluding,
                    experiment.config.privacy.accountant)


def _run_personalized(config: ExperimentConfig, out_dir: str | Path | None, data_dir: str | Path | None,
                      resume: bool, log: Callable[[str], None] | None, threads: int) -> RunResult:
    """A ``[personalized]`` run (:mod:`decentdp.personalized.runner`): it finishes in seconds, so it keeps
    no checkpoint and cannot be resumed."""
    from decentdp.personalized.runner import run_personalized

    if resume:
        raise ConfigError("--resume", "personalized runs keep no checkpoint (they take seconds); run again")
    summary, metrics, theta = run_personalized(config, out_dir, data_dir=data_dir, log=log)
    return RunResult(summary | {"threads": threads}, metrics, {"params": theta},
                     Path(out_dir) if out_dir is not None else None)


def summary_line(result: dict[str, Any]) -> str:
    """The one-line JSON the CLI prints last with ``--json``."""
    return json.dumps(result, sort_keys=True)


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
    timer = PhaseTimer(experiment.device)
    experiment.oracle.timer = timer
    experiment.simulator.timer = timer
    experiment.simulator.wrap_network = lambda network: TimedNetwork(network, timer)
    return timer


NOT_PRIVATE = ("WARNING: this run is NOT private (privacy.epsilon = inf): every agent's messages reveal its data "
               "without any differential privacy guarantee")
"""Printed when a non-private run starts and again when it ends."""


def _announce(experiment: Experiment, emit: Callable[[str], None]) -> None:
    """Print what is about to run: the graph, the model size, the privacy plan, any warnings."""
    config, report, sigmas = experiment.config, experiment.topology.report, experiment.noise_multipliers
    graph = "single agent (pooled data)" if config.pools_data else f"graph '{config.topology.graph}'"
    emit(f"{experiment.data.n_agents} agent(s), {graph}: {report.n_edges} edges, "
         f"normalized Fiedler {report.normalized_fiedler:.3f}, spectral gap {report.spectral_gap:.3f}; "
         f"{experiment.model.dim} parameters per agent")
    budgets = experiment.ledger.budgets
    planned = experiment.planned_releases
    emit(f"privacy: epsilon {budgets.min():g}..{budgets.max():g} per agent at delta {config.privacy.delta:g}, "
         f"sigma {float(sigmas.min()):.4g}..{float(sigmas.max()):.4g} for {planned} planned releases"
         if config.privacy.private else NOT_PRIVATE)
    if config.privacy.private and not experiment.oracle.rng.secure:
        emit(f"privacy: {SIMULATION_NOTICE}")
    emit(f"gradients: {experiment.model.backend} engine on {experiment.device}" + (
        f" (the stacked engine does not support this model: {experiment.model.fallback_reason})"
        if experiment.model.fallback_reason else ""))
    augmentation = experiment.oracle.augmentation
    if augmentation is not None:
        emit(f"augmentation: each sampled record trains as the mean gradient of {augmentation.copies} copies, "
             f"translated by up to {augmentation.shift} pixel(s){' and flipped at random' if augmentation.flip else ''}"
             ", clipped once (same noise and epsilon, about "
             f"{augmentation.copies} times the gradient work)")
    emit(experiment.memory.describe())
    for warning in experiment.warnings:  # the topology's checks of its mixing matrix among them
        emit(f"warning: {warning}")
