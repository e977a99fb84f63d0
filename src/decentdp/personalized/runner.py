"""A personalized run from a config with a ``[personalized]`` section: data, problem, schedule, privacy,
the chosen method, evaluation, and the results folder (``decentdp run CONFIG --json``).

Everything that depends on user input (data files, graph, calibration) is built and checked before
the results folder is touched.  The summary's keys: ``rmse_mean`` (regression: per-agent test RMSE
averaged over agents, as the paper reports) or ``accuracy_mean`` (classification), ``epsilon_max``
(``privacy.accountant``), ``epsilon_max_pld``, ``epsilon_max_rdp``, ``epsilon_max_paper`` (Theorem 1's
Kairouz et al. composition of the same releases), ``wall_seconds``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decentdp.config import ExperimentConfig
from decentdp.config.personalized import PersonalizedSection, warm_start_overspend
from decentdp.data.movielens import load_movielens
from decentdp.data.personal import PersonalData, bound_features
from decentdp.data.synthetic_linear import synthetic_linear
from decentdp.errors import ConfigError, PrivacyError
from decentdp.personalized.admm import gossip_admm
from decentdp.personalized.local import local_models, output_perturbation
from decentdp.personalized.objective import Problem, build_problem, objective
from decentdp.personalized.privacy import (
    UpdateNoise,
    calibrate_updates,
    fit_to_accountant,
    kairouz_epsilon,
    optimal_profile,
)
from decentdp.personalized.schedule import WakeupPlan, plan_wakeups, poisson_ticks
from decentdp.personalized.solver import PrivateUpdates, coordinate_descent, model_propagation
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.report import privacy_statement
from decentdp.results.files import check_creatable, epsilon_json, provenance, write_json, write_jsonl, write_toml
from decentdp.rng import agent_random


def load_personal_data(settings: PersonalizedSection, data_dir: str | Path | None, seed: int) -> PersonalData:
    """The dataset a ``[personalized]`` section names."""
    if settings.dataset == "movielens-100k":
        return load_movielens(data_dir, seed, test_fraction=settings.test_fraction, validation=settings.validation,
                              rank=settings.als_rank, als_reg=settings.als_reg,
                              als_iterations=settings.als_iterations, neighbours=settings.neighbours)
    return synthetic_linear(settings.agents, settings.dim, min_points=settings.min_points,
                            max_points=settings.max_points, test_points=settings.test_points,
                            label_noise=settings.label_noise, gamma=settings.gamma, seed=seed)


def evaluate(data: PersonalData, theta: torch.Tensor) -> dict[str, float]:
    """Per-agent test RMSE (regression) or accuracy (classification), averaged over agents with test data."""
    x = torch.as_tensor(data.x_test, dtype=torch.float64, device=theta.device)
    owner = torch.as_tensor(data.owner_test, device=theta.device)
    y = torch.as_tensor(data.y_test, dtype=torch.float64, device=theta.device)
    prediction = torch.einsum("rp,rp->r", x, theta[owner])
    counts = torch.bincount(owner, minlength=data.n_agents).double()
    # classification predicts +1 on a zero margin (torch.sign would give 0, wrong for either label: an agent
    # that never woke from Theta(0) = 0 would score 0 rather than its label balance)
    per_row = (prediction - y) ** 2 if data.task == "regression" else \
        (torch.where(prediction >= 0, 1.0, -1.0) == y).double()
    totals = torch.zeros(data.n_agents, dtype=torch.float64, device=theta.device).index_add_(0, owner, per_row)
    present = counts > 0
    per_agent = totals[present] / counts[present]
    if data.task == "regression":
        rmse = per_agent.sqrt()
        return {"rmse_mean": float(rmse.mean()), "rmse_min": float(rmse.min()), "rmse_max": float(rmse.max())}
    return {"accuracy_mean": float(per_agent.mean()), "accuracy_min": float(per_agent.min()),
            "accuracy_max": float(per_agent.max())}


@dataclass
class PersonalizedRun:
    """Everything a run needs, built and checked before anything is written."""

    config: ExperimentConfig
    data: PersonalData
    problem: Problem
    plan: WakeupPlan | None
    noise: UpdateNoise | None
    ledger: PrivacyLedger
    setup: dict[str, Any] = field(default_factory=dict)


def update_budget(config: ExperimentConfig) -> float:
    """What the private updates may spend: epsilon-bar less the private warm start's pure epsilon, which
    composes with them (basic composition of an epsilon_w-DP and an (epsilon, delta)-DP release).  A warm start
    that does not fit the budget is refused (:func:`~decentdp.config.personalized.warm_start_overspend`: config
    validation refuses it first; this guards configs changed after it)."""
    settings = config.personalized
    assert settings is not None
    budget = config.privacy.epsilon or math.inf
    if settings.warm_start and config.privacy.private:
        overspend = warm_start_overspend(settings, budget)
        if overspend is not None:
            raise ConfigError("personalized.warm_start_epsilon", overspend)
        budget -= settings.warm_start_epsilon
    return budget


def _noise(settings: PersonalizedSection, config: ExperimentConfig, problem: Problem,
           plan: WakeupPlan) -> tuple[UpdateNoise, np.ndarray]:
    """Per-update noise multipliers for the updates' budget (:func:`update_budget`) and allocation (see
    :mod:`decentdp.personalized.privacy`), fitted to what the run's ledger admits
    (:func:`~decentdp.personalized.privacy.fit_to_accountant`); and each agent's fitting factor (1: as calibrated)."""
    planned = settings.wakeups
    has_data = (problem.counts > 0).cpu().numpy()
    if settings.allocation == "equal":
        shape = np.ones((problem.n_agents, planned))
    else:
        contraction = 1.0 - problem.strong_convexity / (problem.n_agents * float(problem.block_lipschitz.max()))
        shape = optimal_profile(plan.update_ticks(planned), contraction)
    shape[~has_data] = 0.0
    privacy = config.privacy
    budget = update_budget(config)
    try:
        noise = calibrate_updates(settings.mechanism, settings.calibration, budget, privacy.delta, shape,
                                  privacy.accountant, privacy.neighbouring)
        return fit_to_accountant(noise, budget, privacy.delta, privacy.accountant, privacy.neighbouring)
    except PrivacyError as error:
        raise ConfigError("privacy.epsilon", str(error)) from None


def build_run(config: ExperimentConfig, data_dir: str | Path | None = None,
              device: torch.device | str = "cpu") -> PersonalizedRun:
    """Data, problem, schedule and calibrated noise; raises DecentDPError on bad input."""
    settings = config.personalized
    assert settings is not None
    seed = config.experiment.seed
    data = load_personal_data(settings, data_dir if data_dir is not None else config.data.data_dir, seed)
    private = config.privacy.private
    bound, rescaled = settings.feature_bound, 0
    if bound is None and private and settings.method == "cd":  # a private step must not read the records
        bound = data.feature_bound
        if bound is None:
            raise ConfigError("personalized.feature_bound", f"the {settings.dataset} data declares no bound on its "
                                                            "feature norms, and a private run's step sizes need a "
                                                            "public one: set it (rows above it are scaled to it)")
    if bound is not None:
        data, rescaled = bound_features(data, bound)
    problem = build_problem(data, settings.mu, device, bound)
    if settings.warm_start and config.privacy.neighbouring != "replace-one":
        raise ConfigError("personalized.warm_start", "output perturbation's guarantee (Chaudhuri et al. 2011) is "
                                                     "for replace-one neighbours: set privacy.neighbouring = "
                                                     "'replace-one'")
    budget = update_budget(config)  # refuses a warm start that does not fit the budget, whatever the method
    plan = noise = factors = None
    if settings.method in ("cd", "admm"):
        ticks = settings.wakeups * problem.n_agents
        plan = plan_wakeups(poisson_ticks(seed, problem.n_agents, ticks), data.weights, settings.wakeups)
    if settings.method == "cd":
        noise, factors = _noise(settings, config, problem, plan)
    ledger = PrivacyLedger(problem.n_agents, budget if settings.method == "cd" else math.inf, config.privacy.delta,
                           budget_accountant=config.privacy.accountant, relation=config.privacy.neighbouring)
    setup = {"n_agents": problem.n_agents, "dim": problem.dim, "data": data.info, "method": settings.method,
             "agent_sizes": problem.counts.tolist(), "step": problem.step.tolist(),
             "confidence": problem.confidence.tolist(), "mu": settings.mu,
             "step_smoothness": "exact: read from the records (the steps are not private)" if bound is None else
             f"public: l'' sup * B^2 + 2 lambda_i with feature_bound B = {bound:.6g}",
             "feature_bound": bound, "training_rows_scaled_to_bound": rescaled,
             "public_inputs": data.public_inputs,
             "ticks": None if plan is None else plan.total_ticks,
             "levels": None if plan is None else plan.n_levels,
             "updates_per_agent": None if plan is None else plan.updates_per_agent().tolist(),
             **privacy_statement(private and _releases_dp_models(settings), config.privacy.neighbouring,
                                 config.privacy.noise, private_evaluation=settings.validation),
             **({"evaluation_records": "private: each user's held-out ratings (the metrics are not DP releases)"}
                if settings.dataset == "movielens-100k" else {}),
             "warnings": _warnings(config)}
    if noise is not None:
        assert factors is not None
        setup["noise_multipliers_first_update"] = noise.multipliers[:, 0].tolist()
        setup["calibration"] = {"mechanism": noise.mechanism, "calibration": settings.calibration,
                                "allocation": settings.allocation, "accountant": config.privacy.accountant,
                                "relation": config.privacy.neighbouring, "paper_per_update_delta": noise.paper_delta,
                                "accountant_fit_factors": factors.tolist()}
        if (factors < 1).any():
            setup["calibration_notice"] = (
                f"the {settings.calibration} calibration's per-update epsilons were scaled by "
                f"{float(factors.min()):.6g} (the smallest factor of {int((factors < 1).sum())} agent(s)) so that "
                f"privacy.accountant = '{config.privacy.accountant}' admits every planned release within the budget")
    return PersonalizedRun(config, data, problem, plan, noise, ledger, setup)


def _releases_dp_models(settings: PersonalizedSection) -> bool:
    """Whether a private run's method releases only DP outputs: cd's noisy updates, or the warm start's
    output-perturbed local models, kept (``local``) or propagated (``propagation``: eq. (16) combines them with
    public weights, post-processing).  ADMM sends what the records give, without noise."""
    return settings.method == "cd" or (settings.warm_start and settings.method in ("local", "propagation"))


#: Who ``epsilon`` is about: the ledger charges every model update an agent sends, to all its neighbours.
PERSONALIZED_OBSERVER = ("everyone together: every model update the agent sent, every other agent's noise and data "
                         "known")


def _epsilons(run: PersonalizedRun, warm: float) -> dict[str, Any]:
    """Each agent's spent epsilon, keyed as ``privacy.json`` publishes it: ``epsilon`` by the run's accountant,
    ``epsilon_pld`` and ``epsilon_rdp``, and the paper's composition ``paper_epsilon`` (with ``paper_delta``);
    the warm start's is added by composition.  The paper's figure is NaN (``null`` in the files) for an agent
    whose Gaussian updates reached eps_t >= 1, where Remark 4's scale is no longer the classical Gaussian
    mechanism's and the formula is no bound; ``paper_epsilon_note`` then says so."""
    settings, privacy = run.config.personalized, run.config.privacy
    assert settings is not None
    n = run.problem.n_agents
    if settings.method == "local" or (settings.method == "propagation" and warm > 0):
        # nothing sent, or the warm start's DP local models propagated: their pure epsilon (0 without them)
        pure = np.full(n, warm)
        return {"epsilon": pure, "epsilon_pld": pure, "epsilon_rdp": pure, "paper_epsilon": pure, "paper_delta": 0.0}
    if settings.method != "cd" or run.noise is None or not privacy.private:
        infinite = np.full(n, math.inf)
        return {"epsilon": infinite, "epsilon_pld": infinite, "epsilon_rdp": infinite, "paper_epsilon": infinite,
                "paper_delta": 1.0}
    made = run.ledger.releases()
    paper_eps = np.where(np.arange(settings.wakeups)[None, :] < made[:, None], run.noise.paper_epsilons, 0.0)
    per_update_deltas = np.where(np.arange(settings.wakeups)[None, :] < made[:, None], run.noise.paper_delta, 0.0)
    paper_delta = 1 - (1 - privacy.delta) * np.prod(1 - per_update_deltas, axis=1) \
        if settings.mechanism == "gaussian" else np.full(n, privacy.delta)
    spent: dict[str, Any] = {"paper_epsilon": kairouz_epsilon(paper_eps, privacy.delta) + warm,
                             "paper_delta": float(paper_delta.max())}
    if settings.mechanism == "gaussian":
        beyond = (paper_eps >= 1).any(axis=1)
        if beyond.any():
            spent["paper_epsilon"] = np.where(beyond, math.nan, spent["paper_epsilon"])
            spent["paper_epsilon_note"] = (
                f"absent (null) for {int(beyond.sum())} agent(s): Remark 4's Gaussian scale sigma >= 2C "
                f"sqrt(2 ln(2/delta_t)) / eps_t, which the paper's formula assumes, holds only for per-update "
                f"eps_t < 1, and their updates reached eps_t = {float(paper_eps.max()):.6g}; the formula would not "
                "bound their loss (epsilon, by privacy.accountant, does)")
    for name in ("pld", "rdp"):
        try:
            spent[f"epsilon_{name}"] = run.ledger.epsilon(name) + warm
        except PrivacyError:
            spent[f"epsilon_{name}"] = np.full(n, math.nan)
    spent["epsilon"] = run.ledger.epsilon(privacy.accountant) + warm
    return spent


def run_personalized(config: ExperimentConfig, out_dir: str | Path | None = None, *,
                     data_dir: str | Path | None = None, log: Callable[[str], None] | None = None,
                     device: torch.device | str = "cpu") -> tuple[dict[str, Any], list[dict[str, Any]], torch.Tensor]:
    """Build, run and record one personalized experiment; returns (summary, metrics, final models)."""
    emit = log or print
    folder = Path(out_dir) if out_dir is not None else None
    if folder is not None and folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError("--out", f"{folder} already holds files or is not a directory; choose an empty directory")
    if folder is not None:
        check_creatable(folder)  # before the build: a folder below a file or in a read-only place
    clock = time.perf_counter()
    run = build_run(config, data_dir, device)
    settings, privacy = config.personalized, config.privacy
    assert settings is not None
    problem, data = run.problem, run.data
    emit(f"personalized {settings.method} on {settings.dataset}: {problem.n_agents} agents, p = {problem.dim}, "
         f"{int(problem.counts.sum())} training records"
         + ("" if run.plan is None else f", {run.plan.total_ticks} ticks in {run.plan.n_levels} levels"))
    for warning in run.setup["warnings"]:
        emit(f"warning: {warning}")
    if run.setup["private"] and "noise_notice" in run.setup:
        emit(f"privacy: {run.setup['noise_notice']}")
    if "calibration_notice" in run.setup:
        emit(f"privacy: {run.setup['calibration_notice']}")
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--out", f"cannot create the results folder {folder}: {exc.strerror}") from None
        write_toml(folder / "config.toml", config.to_toml_dict())
        write_json(folder / "provenance.json", provenance(config.experiment.seed))
        write_json(folder / "setup.json", run.setup)
        if run.plan is not None:  # the recorded schedule: tick, agent and update number of every update
            np.savez_compressed(folder / "schedule.npz", ticks=run.plan.ticks, agents=run.plan.agents,
                                index=run.plan.index)

    device = problem.x.device
    rng = _rng(config, problem.n_agents, device)
    warm = 0.0
    theta = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64, device=device)
    if settings.method in ("local", "propagation", "admm") or settings.warm_start:
        private_local = settings.warm_start and privacy.private
        local = local_models(problem, privacy.clip if private_local else None)
        if private_local:
            local = output_perturbation(problem, local, privacy.clip, settings.warm_start_epsilon, rng)
            warm = settings.warm_start_epsilon
        theta = local if settings.method in ("local", "admm") else model_propagation(problem, local)
    metrics: list[dict[str, Any]] = []

    def record(ticks: int, current: torch.Tensor) -> None:
        row = {"ticks": ticks, "wakeups_per_agent": ticks / problem.n_agents, "objective": objective(problem, current),
               **evaluate(data, current), "wall_seconds": time.perf_counter() - clock}
        metrics.append(row)

    record(0, theta)
    if run.plan is not None:
        plan = run.plan
        if settings.method == "cd":
            # a row every eval_every wake-ups per agent, each the exact state after the first `mark` ticks: the
            # plan's levels are cut at the marks (WakeupPlan.split_at), and every update still reads what it reads
            # one agent at a time
            every = config.experiment.eval_every * problem.n_agents
            marks = list(range(every, plan.total_ticks, every))
            split, levels_before = plan.split_at(marks)
            due = 0

            def record_due(levels_done: int, current: torch.Tensor) -> None:
                nonlocal due
                while due < len(marks) and levels_before[due] <= levels_done:
                    record(marks[due], current)
                    due += 1

            private = None
            if privacy.private:
                assert run.noise is not None
                private = PrivateUpdates(run.noise, privacy.clip, run.ledger, rng, problem.counts > 0)
            stopped = torch.zeros(problem.n_agents, dtype=torch.bool, device=device)
            record_due(0, theta)
            theta = coordinate_descent(problem, theta, split, private=private, stopped=stopped,
                                       after_level=lambda level, current: record_due(level + 1, current))
        else:
            theta = gossip_admm(problem, theta, poisson_ticks(config.experiment.seed, problem.n_agents,
                                                              plan.total_ticks), config.experiment.seed,
                                rho=settings.admm_rho, local_steps=settings.admm_local_steps)
        record(plan.total_ticks, theta)
    wall = time.perf_counter() - clock
    warnings = [*run.setup["warnings"], *_refusal_warnings(run)]
    for warning in warnings[len(run.setup["warnings"]):]:
        emit(f"warning: {warning}")
    spent = _epsilons(run, warm)
    final = metrics[-1]
    summary = {"method": settings.method, "dataset": settings.dataset, "n_agents": problem.n_agents,
               **{key: value for key, value in final.items() if key not in ("ticks", "wall_seconds")},
               "epsilon_max": epsilon_json(float(np.max(spent["epsilon"]))),
               "epsilon_accountant": privacy.accountant, "epsilon_observer": PERSONALIZED_OBSERVER,
               "epsilon_max_pld": epsilon_json(float(np.max(spent["epsilon_pld"]))),
               "epsilon_max_rdp": epsilon_json(float(np.max(spent["epsilon_rdp"]))),
               "paper_epsilon_max": epsilon_json(float(np.max(spent["paper_epsilon"]))),
               **({"paper_epsilon_note": spent["paper_epsilon_note"]} if "paper_epsilon_note" in spent else {}),
               "paper_delta": spent["paper_delta"], "delta": privacy.delta,
               "epsilon_budget": epsilon_json(privacy.epsilon), "warm_start_epsilon": warm,
               "private": run.setup["private"], "noise": privacy.noise,
               "epsilon_per_agent": epsilon_json(spent["epsilon"]),
               "updates_per_agent_mean": float(run.ledger.releases().mean()) if settings.method == "cd" else None,
               "refused_releases": int(run.ledger.refused.sum()), "warnings": warnings,
               "wall_seconds": wall, "finished": True}
    if folder is not None:
        write_jsonl(folder / "metrics.jsonl", metrics)
        statement = {key: run.setup[key] for key in ("private", "neighbouring", "neighbouring_assumption", "noise",
                                                      "evaluation_records", "noise_notice", "evaluation_notice",
                                                      "public_inputs", "step_smoothness") if key in run.setup}
        write_json(folder / "privacy.json", {**{key: value if key in ("paper_delta", "paper_epsilon_note")
                                                else epsilon_json(value) for key, value in spent.items()},
                                             "epsilon_accountant": privacy.accountant,
                                             "epsilon_observer": PERSONALIZED_OBSERVER, **statement})
        write_json(folder / "summary.json", summary)
    headline = (f"RMSE mean {final['rmse_mean']:.4f}" if "rmse_mean" in final
                else f"accuracy mean {final['accuracy_mean']:.4f}")
    paper = "absent (Remark 4's Gaussian scale holds only for eps_t < 1: paper_epsilon_note)" \
        if "paper_epsilon_note" in summary else summary["paper_epsilon_max"]
    emit(f"{headline}; epsilon max {summary['epsilon_max']} ({privacy.accountant}), paper's formula {paper}; "
         f"{wall:.1f} s")
    return summary, metrics, theta


def _refusal_warnings(run: PersonalizedRun) -> list[str]:
    """What the ledger refused during a ``cd`` run, said when it ends: the calibration fits every planned release
    (:func:`~decentdp.personalized.privacy.fit_to_accountant`), so a refusal means an agent stopped short of
    the schedule the run was configured for, and its user must know."""
    refused = run.ledger.refused
    if run.plan is None or not refused.any():
        return []
    skipped = int((run.plan.updates_per_agent() - run.ledger.releases())[refused > 0].sum())
    return [f"{int((refused > 0).sum())} agent(s) ran out of privacy budget before their last planned update "
            f"(privacy.accountant = '{run.config.privacy.accountant}' priced their releases above the budget) and "
            f"skipped {skipped} planned update(s) in total (summary.json: refused_releases, updates_per_agent_mean)"]


def _warnings(config: ExperimentConfig) -> list[str]:
    """What a personalized config does that its user may not expect, said when the run starts."""
    settings = config.personalized
    assert settings is not None
    warnings = []
    if config.privacy.private and not _releases_dp_models(settings) and settings.method != "local":
        warnings.append(f"personalized.method = '{settings.method}' adds no noise: this run is NOT private "
                        f"(privacy.epsilon = {config.privacy.epsilon:g} is ignored; its epsilon is reported as "
                        "infinite); use method = 'cd' for a private run")
    if settings.validation:
        warnings.append("personalized.validation: the metrics are measured on held-out private ratings, not "
                        "on a public test set; choosing settings by them spends privacy that no epsilon here counts")
    return warnings


def _rng(config: ExperimentConfig, n_agents: int, device: torch.device) -> Any:
    """The run's keyed randomness (simulation or secure), as every other run builds it."""
    return agent_random(config.experiment.seed, config.privacy.noise == "secure", config.engine.noise_streams,
                        n_agents, device)
