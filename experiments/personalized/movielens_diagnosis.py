"""Where our MovieLens-100K Table 1 differs from Bellet et al. (2018), measured (docs/reproduction.md).
Every number comes from a run made here, per seed (``experiment.seed``: split, ALS features, graph,
clocks and noise), in the sound setting of the shipped configs (targets rating - 3 with a constant
feature, public step sizes for private runs; their tuned (T_i, mu), C = 10):

* the purely local models with lambda_i = 1/m_i (the paper's setting, eq. (1): averaged loss), with
  lambda_i = 1/m_i^2 (the same lambda on a *summed* loss, sum_k l + lambda ||theta||^2) and with
  lambda_i ~ 0 (least squares; minimum-norm where m_i < p): which regularisation the paper's local
  baseline (1.2834) sits nearest to;
* Q_L's minimiser (:func:`~decentdp.personalized.solver.minimiser`) at the non-private config's mu, where
  non-private CD is heading, under the averaged loss and under the summed reading (mu c_i becomes mu c_i m_i);
* the per-sample gradients' l1 norms against C = 10, at Theta = 0 (where CD starts) and at the
  minimiser (the paper: C = 10 "is large enough that gradients are almost never clipped");
* private CD at the configs' (T_i, mu) with the tight calibration and with the paper's (Theorem 1's
  composition, more noise);
* the same private runs on targets centred by each user's own mean training rating (the paper's
  preprocessing), with everything else unchanged: **not DP** at the stated epsilon (one changed rating
  moves every target of its user, see :mod:`decentdp.data.movielens`), nothing extra charged; it measures
  what the paper's free per-user means are worth;
* private CD at larger budgets eps-bar in {4, 16} (T_i = 800, mu in {0.02, 0.2} chosen on the validation
  split): the budget our sound mechanism needs to beat the purely local models;
* ``--clip-scan``, a separate pass: validation RMSE for several C at eps-bar = 1 and 16, whether the
  paper's C = 10 still suits targets that are no longer centred user-wise (larger gradients: more clipping);
  and two test-split references: non-private CD with the private runs' public steps, and private CD at
  eps-bar = 1000 (clipping, almost no noise) with the non-private row's mu = 1, T_i = 100;
* ``--paper-calibration``, a separate pass: only the private CD rows with the paper's calibration (the rows
  re-measured after that calibration's fix, docs/reproduction.md);
* ``--literal``, a separate pass: the paper's noise (Theorem 1's Laplace scale 2 C / (eps_i m_i)) on
  per-sample gradients clipped in **l2** norm at C, as Abadi et al.'s clipping (which the paper cites)
  does: the l1 sensitivity of such a gradient is up to sqrt(p) times 2 C, so this is **not** DP (nothing
  is charged); it shows what the stated "almost never clipped" reading would give.

    OMP_NUM_THREADS=1 python experiments/personalized/movielens_diagnosis.py --data-dir ../shared/data \
        --out results/personalized-movielens-diagnosis --seeds 0 1 2 [--literal | --clip-scan | --paper-calibration]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from decentdp.config import load_config
from decentdp.data.movielens import load_movielens
from decentdp.data.personal import PersonalData
from decentdp.personalized.local import local_models
from decentdp.personalized.objective import Problem, build_problem
from decentdp.personalized.runner import build_run, evaluate, run_personalized
from decentdp.personalized.solver import PrivateUpdates, coordinate_descent, minimiser
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.rng import agent_random

HERE = Path(__file__).parent
CLIP = 10.0
NONPRIVATE = "movielens-nonprivate"
PRIVATE = {1.0: "movielens-eps1", 0.5: "movielens-eps0.5", 0.1: "movielens-eps0.1"}
LARGER_EPSILONS = (4.0, 16.0)
LARGER_MUS = (0.02, 0.2)
LARGER_WAKEUPS = 800
#: ``--clip-scan``: C at eps-bar = 1 (the config's T_i and mu) and at eps-bar = 16 (T_i = 800, mu = 0.2).
CLIPS = {1.0: (5.0, 10.0, 20.0, 40.0), 16.0: (10.0, 40.0)}
#: lambda_i of the "least squares" local models (a ridge this small is the minimum-norm solution where m_i < p).
TINY_REG = 1e-12


def config_mu(name: str) -> float:
    """The mu a shipped config was tuned to."""
    settings = load_config(HERE / f"{name}.toml").personalized
    assert settings is not None
    return settings.mu


def gradient_norms(problem: Any, theta: torch.Tensor, order: int = 1) -> dict[str, float]:
    """l_order norms of the per-sample gradients 2 (theta . x - r) x at ``theta``: fraction above C, median / C."""
    margin = torch.einsum("rp,rp->r", problem.x, theta[problem.owner])
    norms = (2.0 * (margin - problem.y)).abs() * torch.linalg.vector_norm(problem.x, ord=order, dim=1)
    return {"clipped_fraction": float((norms > CLIP).double().mean()), "median_over_C": float(norms.median() / CLIP)}


def private_rmse(name: str, data_dir: str, seed: int, overrides: list[str]) -> float:
    """Test (or, with the override, validation) RMSE of config ``name`` for ``seed`` with ``overrides``."""
    config = load_config(HERE / f"{name}.toml", [f"experiment.seed={seed}", *overrides])
    return run_personalized(config, data_dir=data_dir, log=lambda _line: None)[0]["rmse_mean"]


class L2ClippedLaplace(PrivateUpdates):
    """Laplace noise at the paper's scale on l2-clipped gradients (``--literal``; not DP)."""

    @property
    def norm(self) -> int:
        return 2


def centred_by_user_mean(data: PersonalData, problem: Problem) -> tuple[PersonalData, Problem]:
    """The same data with every target less its user's mean training target (the paper's centring), so that
    a prediction plus the user's mean is compared with the rating: the RMSE keeps its meaning."""
    owners = torch.as_tensor(data.owner_train)
    targets = torch.as_tensor(data.y_train, dtype=torch.float64)
    counts = torch.bincount(owners, minlength=data.n_agents).double()
    means = (torch.zeros(data.n_agents, dtype=torch.float64).index_add_(0, owners, targets)
             / counts.clamp(min=1)).numpy()
    assert torch.equal(problem.y.cpu(), targets)  # the problem's rows are the data's, in the same order
    centred = replace(data, y_train=data.y_train - means[data.owner_train],
                      y_test=data.y_test - means[data.owner_test])
    return centred, replace(problem, y=torch.as_tensor(centred.y_train, dtype=torch.float64,
                                                       device=problem.y.device))


def uncharged_rmse(name: str, data_dir: str, seed: int, overrides: list[str], *, l2_clip: bool = False,
                   user_means: bool = False) -> float:
    """Test RMSE of ``name``'s private CD made in a way that is not DP at its epsilon, nothing charged: with
    ``l2_clip`` on l2-clipped gradients (``--literal``), with ``user_means`` on targets centred user-wise."""
    config = load_config(HERE / f"{name}.toml", [f"experiment.seed={seed}", *overrides])
    run = build_run(config, data_dir)
    data, problem = centred_by_user_mean(run.data, run.problem) if user_means else (run.data, run.problem)
    assert run.noise is not None and run.plan is not None
    ledger = PrivacyLedger(problem.n_agents, math.inf, config.privacy.delta)
    rng = agent_random(config.experiment.seed, config.privacy.noise == "secure", config.engine.noise_streams,
                       problem.n_agents, problem.x.device)  # as every run builds its randomness
    updates = L2ClippedLaplace if l2_clip else PrivateUpdates
    private = updates(run.noise, config.privacy.clip, ledger, rng, problem.counts > 0)
    theta = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    return evaluate(data, coordinate_descent(problem, theta, run.plan, private=private))["rmse_mean"]


def literal_seed(data_dir: str, seed: int) -> dict[str, Any]:
    """The ``--literal`` pass for one seed: l2 norms of the gradients against C, and the l2-clipped runs."""
    problem = build_problem(load_movielens(data_dir, seed), config_mu(NONPRIVATE))
    zero = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    row: dict[str, Any] = {"l2 gradients at 0": gradient_norms(problem, zero, 2),
                           "l2 gradients at optimum": gradient_norms(problem, minimiser(problem, zero), 2)}
    for epsilon, name in PRIVATE.items():
        row[f"eps {epsilon} l2-clipped, paper's scale (not DP)"] = uncharged_rmse(
            name, data_dir, seed, ['personalized.calibration="paper"'], l2_clip=True)
    print(f"seed {seed}: {row}", flush=True)
    return row


def paper_calibration_seed(data_dir: str, seed: int) -> dict[str, Any]:
    """The ``--paper-calibration`` pass for one seed: private CD at the configs' (T_i, mu) with Theorem 1's
    calibration, as :func:`one_seed` runs it."""
    row = {f"eps {epsilon} paper calibration": private_rmse(name, data_dir, seed, ['personalized.calibration="paper"'])
           for epsilon, name in PRIVATE.items()}
    print(f"seed {seed}: {row}", flush=True)
    return row


def one_seed(data_dir: str, seed: int) -> dict[str, Any]:
    """Every measurement of the module docstring but ``--literal`` for one seed."""
    data = load_movielens(data_dir, seed)
    problem = build_problem(data, config_mu(NONPRIVATE))
    counts = problem.counts.double()
    row: dict[str, Any] = {}
    for label, reg in (("local 1/m", problem.reg), ("local 1/m^2 (summed)", 1.0 / counts**2),
                       ("local ~0", torch.full_like(counts, TINY_REG))):
        row[label] = evaluate(data, local_models(replace(problem, reg=reg)))["rmse_mean"]
    zero = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    best = minimiser(problem, zero)
    row["optimum"] = evaluate(data, best)["rmse_mean"]
    summed = replace(problem, confidence=problem.confidence * counts)
    row["optimum summed"] = evaluate(data, minimiser(summed, zero))["rmse_mean"]
    row["gradients at 0"] = gradient_norms(problem, zero)
    row["gradients at optimum"] = gradient_norms(problem, best)
    for epsilon, name in PRIVATE.items():
        row[f"eps {epsilon} tight"] = private_rmse(name, data_dir, seed, [])
        row[f"eps {epsilon} paper calibration"] = private_rmse(name, data_dir, seed,
                                                               ['personalized.calibration="paper"'])
        row[f"eps {epsilon} user-wise centring (not DP)"] = uncharged_rmse(name, data_dir, seed, [], user_means=True)
    for epsilon in LARGER_EPSILONS:
        overrides = [f"privacy.epsilon={epsilon}", f"personalized.wakeups={LARGER_WAKEUPS}"]
        validation = {mu: private_rmse("movielens-eps1", data_dir, seed, [*overrides, "personalized.validation=true",
                                                                          f"personalized.mu={mu}"])
                      for mu in LARGER_MUS}
        chosen = min(validation, key=validation.__getitem__)
        row[f"eps {epsilon} mu"] = {"chosen": chosen}
        row[f"eps {epsilon}"] = private_rmse("movielens-eps1", data_dir, seed,
                                             [*overrides, f"personalized.mu={chosen}"])
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
          flush=True)
    return row


def clip_seed(data_dir: str, seed: int) -> dict[str, Any]:
    """The ``--clip-scan`` pass for one seed: validation RMSE for each C of :data:`CLIPS`."""
    row: dict[str, Any] = {}
    for epsilon, clips in CLIPS.items():
        settings = [] if epsilon == 1.0 else [f"privacy.epsilon={epsilon}", f"personalized.wakeups={LARGER_WAKEUPS}",
                                              "personalized.mu=0.2"]
        for clip in clips:
            row[f"eps {epsilon} C {clip:g} (validation)"] = private_rmse(
                "movielens-eps1", data_dir, seed, [*settings, f"privacy.clip={clip}", "personalized.validation=true"])
    bound = load_movielens(data_dir, seed).feature_bound
    row["non-private, public steps (test)"] = private_rmse(NONPRIVATE, data_dir, seed,
                                                           [f"personalized.feature_bound={bound}"])
    row["eps 1000, mu 1, T_i 100: clipping, almost no noise (test)"] = private_rmse(
        "movielens-eps1", data_dir, seed, ["privacy.epsilon=1000", "personalized.mu=1.0", "personalized.wakeups=100"])
    print(f"seed {seed}: {row}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    passes = parser.add_mutually_exclusive_group()
    passes.add_argument("--literal", action="store_true", help="only the l2-clipped pass (module docstring)")
    passes.add_argument("--clip-scan", action="store_true", help="only the scan over C (module docstring)")
    passes.add_argument("--paper-calibration", action="store_true",
                        help="only the private rows with Theorem 1's calibration (module docstring)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    one_pass = literal_seed if args.literal else clip_seed if args.clip_scan else \
        paper_calibration_seed if args.paper_calibration else one_seed
    rows = {seed: one_pass(args.data_dir, seed) for seed in args.seeds}
    summary: dict[str, Any] = {}
    for key, value in rows[args.seeds[0]].items():
        if isinstance(value, float):
            values = [rows[seed][key] for seed in args.seeds]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            summary[key] = {"mean": statistics.mean(values), "std": spread}
        else:
            summary[key] = {field: statistics.mean(rows[seed][key][field] for seed in args.seeds) for field in value}
    for key, value in summary.items():
        print(f"{key:>32}: " + ", ".join(f"{k} {v:.4f}" for k, v in value.items()), flush=True)
    name = "literal.json" if args.literal else "clip-scan.json" if args.clip_scan else \
        "paper-calibration.json" if args.paper_calibration else "diagnosis.json"
    (out / name).write_text(json.dumps({"per_seed": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
