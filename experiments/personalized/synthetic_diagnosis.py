"""Why private coordinate descent stays at chance on the synthetic problem of Bellet et al. (2018),
Figure 2, and what it would take to reach the figure (docs/reproduction.md, "Synthetic linear
classification").  Every number comes from a run made here; nothing is read off the paper.

Variants of the private update, each run from Theta(0) = 0 for eps-bar in {0.15, 0.55, 1.05} and
T/n in {1, 2, 4, 8} on ``--seeds`` problem instances of ``synthetic.toml`` (p = 100):

* ``laplace``: the shipped mechanism (Theorem 1 made sound): per-sample gradients clipped to l1
  norm C = 1, Laplace noise of scale z C on the clipped sum, z from the tight accountant.
* ``gaussian``: Remark 2 made sound: l2 clipping at C = 1, Gaussian noise, tight accountant.
* ``paper-literal`` (**not differentially private**): the noise the paper states, Laplace of scale
  2 L0 / (eps_i m_i) with L0 = 1 and eps_i from Theorem 1's composition, added to the *unclipped*
  gradient.  The logistic loss is 1-Lipschitz only for ||x|| <= 1, while the generator's features
  (x ~ N(0, I_p / 2)) have ||x||_1 ~ 56 at p = 100, so this noise is ~28x too small for the
  sensitivity it claims to cover; it is the most favourable reading of the paper's settings.
* ``laplace`` at large budgets (eps-bar in {10, 30, 100}): where the sound mechanism reaches the
  purely local models.

Non-private CD at T/n in {4, 32, 1000} from zero, the local models and their propagation (is its
accuracy Q_L's optimum or early stopping?), and Proposition 2's contraction (how far its allocation
is from the equal one); the local models, non-private and private CD at p = 20 and 50 (Figure 2(c)'s
axis).  And the private warm start (output perturbation, Chaudhuri et al. 2011, then model propagation)
for eps in {0.05, 0.5, 5, 50, inf}: accuracy of the propagated models (Theta(0) of Figure 2(b)),
and the ratio ||noise|| / ||theta_loc|| per agent beside its lower bound 2 p / (m_i eps): the
local model satisfies 2 lambda_i theta = -(mean clipped gradient), so ||theta_loc|| <= C / (2 lambda_i),
while the noise norm has mean p C / (m_i lambda_i eps), whatever lambda_i is.

    OMP_NUM_THREADS=1 python experiments/personalized/synthetic_diagnosis.py \
        --out results/personalized-synthetic-diagnosis --seeds 2
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from decentdp.config import ExperimentConfig, load_config  # noqa: E402
from decentdp.personalized.local import local_models, output_perturbation  # noqa: E402
from decentdp.personalized.runner import build_run, evaluate, run_personalized  # noqa: E402
from decentdp.personalized.solver import PrivateUpdates, coordinate_descent, model_propagation  # noqa: E402
from decentdp.privacy.ledger import PrivacyLedger  # noqa: E402
from decentdp.rng import AgentRandom, agent_random  # noqa: E402

CONFIG = Path(__file__).parent / "synthetic.toml"
EPSILONS = (0.15, 0.55, 1.05)
LARGE_EPSILONS = (10.0, 30.0, 100.0)
WAKEUPS = (1, 2, 4, 8)
WARM_EPSILONS = (0.05, 0.5, 5.0, 50.0, math.inf)
#: Clip bound that no per-sample gradient reaches (the paper-literal variant does not clip).
NO_CLIP = 1e12


def _rng(config: ExperimentConfig, n_agents: int, device: torch.device) -> AgentRandom:
    """The run's randomness, as every run builds it (:func:`decentdp.rng.agent_random`)."""
    return agent_random(config.experiment.seed, config.privacy.noise == "secure", config.engine.noise_streams,
                        n_agents, device)


def private_cd(seed: int, epsilon: float, wakeups: int, variant: str) -> float:
    """Mean test accuracy of private CD from Theta(0) = 0 under ``variant`` (module docstring)."""
    overrides = [f"experiment.seed={seed}", f"personalized.wakeups={wakeups}", f"privacy.epsilon={epsilon}"]
    if variant == "gaussian":
        overrides.append('personalized.mechanism="gaussian"')
    if variant == "paper-literal":
        overrides.append('personalized.calibration="paper"')  # z = 2 / eps_i, eps_i from Theorem 1
    config = load_config(CONFIG, overrides)
    run = build_run(config)
    problem, noise = run.problem, run.noise
    assert noise is not None and run.plan is not None
    ledger = run.ledger
    clip = config.privacy.clip
    if variant == "paper-literal":
        # noise scale (z / NO_CLIP) * NO_CLIP = z * L0 with L0 = 1, on gradients that are never clipped;
        # the ledger would price the shrunken multipliers, so it gets no budget to enforce (not DP)
        noise = replace(noise, multipliers=noise.multipliers / NO_CLIP)
        clip = NO_CLIP
        ledger = PrivacyLedger(problem.n_agents, math.inf, config.privacy.delta)
    rng = _rng(config, problem.n_agents, problem.x.device)
    private = PrivateUpdates(noise, clip, ledger, rng, problem.counts > 0)
    theta = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    stopped = torch.zeros(problem.n_agents, dtype=torch.bool)
    theta = coordinate_descent(problem, theta, run.plan, private=private, stopped=stopped)
    return evaluate(run.data, theta)["accuracy_mean"]


def warm_start(seed: int, epsilon: float) -> dict[str, float]:
    """Accuracy of the propagated private local models at warm-start ``epsilon``, and the noise-to-model
    norm ratio (median over agents) beside its lower bound 2 p / (m_i eps) (median over agents)."""
    config = load_config(CONFIG, [f"experiment.seed={seed}"])
    run = build_run(config)
    problem = run.problem
    clip = config.privacy.clip
    local = local_models(problem, clip)
    private = local if math.isinf(epsilon) else output_perturbation(
        problem, local, clip, epsilon, _rng(config, problem.n_agents, problem.x.device))
    ratio = torch.linalg.vector_norm(private - local, dim=1) / torch.linalg.vector_norm(local, dim=1)
    bound = 2 * problem.dim / (problem.counts.double() * epsilon)
    return {"accuracy_local": evaluate(run.data, private)["accuracy_mean"],
            "accuracy_propagated": evaluate(run.data, model_propagation(problem, private))["accuracy_mean"],
            "noise_to_model_median": float(ratio.median()), "bound_median": float(bound.median()),
            "model_norm_over_cap_max": float((torch.linalg.vector_norm(local, dim=1)
                                              * 2 * problem.reg / clip).max())}


def nonprivate_cd(seed: int, wakeups: int) -> dict[str, float]:
    """Non-private CD accuracy after ``wakeups`` per agent from Theta(0) = 0, from the local models and from
    their propagation: whether its accuracy is Q_L's optimum or early stopping."""
    run = build_run(load_config(CONFIG, [f"experiment.seed={seed}", f"personalized.wakeups={wakeups}",
                                         'privacy.epsilon="inf"']))
    problem = run.problem
    assert run.plan is not None
    local = local_models(problem)
    starts = {"zero": torch.zeros_like(local), "local": local, "propagated": model_propagation(problem, local)}
    return {name: evaluate(run.data, coordinate_descent(problem, theta.clone(), run.plan))["accuracy_mean"]
            for name, theta in starts.items()}


def allocation_spread(seed: int, ticks_per_agent: int = 8) -> dict[str, float]:
    """Proposition 2's contraction C = 1 - sigma / (n L_max) and the spread C^(T/3) of its allocation."""
    problem = build_run(load_config(CONFIG, [f"experiment.seed={seed}"])).problem
    contraction = 1 - problem.strong_convexity / (problem.n_agents * float(problem.block_lipschitz.max()))
    return {"sigma": problem.strong_convexity, "L_max": float(problem.block_lipschitz.max()),
            "contraction": contraction, "spread": contraction ** (ticks_per_agent * problem.n_agents / 3)}


def by_dimension(seed: int, dim: int) -> dict[str, float]:
    """Figure 2(c)'s axis: local models, non-private CD (T/n = 8) and the shipped private CD from Theta(0) = 0
    (best T/n) at eps-bar 0.15 and 1.05, for features of dimension ``dim``."""
    def accuracy(overrides: list[str]) -> float:
        config = load_config(CONFIG, [f"experiment.seed={seed}", f"personalized.dim={dim}", *overrides])
        return run_personalized(config, log=lambda _line: None)[0]["accuracy_mean"]

    row = {"local": accuracy(['personalized.method="local"']),
           "non-private": accuracy(['privacy.epsilon="inf"', "personalized.wakeups=8"])}
    for epsilon in (0.15, 1.05):
        row[f"private {epsilon}"] = max(accuracy([f"privacy.epsilon={epsilon}", f"personalized.wakeups={wakeups}"])
                                        for wakeups in WAKEUPS)
    return row


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(args.seeds)
    results: dict[str, Any] = {"seeds": args.seeds, "private_cd": [], "warm_start": []}

    def cd_row(variant: str, epsilon: float) -> None:
        accuracies = {wakeups: _mean([private_cd(seed, epsilon, wakeups, variant) for seed in seeds])
                      for wakeups in WAKEUPS}
        results["private_cd"].append({"variant": variant, "epsilon_bar": epsilon, "accuracy": accuracies})
        print(f"{variant:>13} eps-bar {epsilon:>6}: " + " ".join(f"T/n={w}: {a:.3f}" for w, a in accuracies.items()),
              flush=True)

    local = _mean([evaluate(run.data, local_models(run.problem))["accuracy_mean"]
                   for run in (build_run(load_config(CONFIG, [f"experiment.seed={seed}"])) for seed in seeds)])
    results["local"] = local
    print(f"purely local models: {local:.3f}", flush=True)
    for variant in ("laplace", "gaussian", "paper-literal"):
        for epsilon in EPSILONS:
            cd_row(variant, epsilon)
    for epsilon in LARGE_EPSILONS:
        cd_row("laplace", epsilon)
    for epsilon in WARM_EPSILONS:
        rows = [warm_start(seed, epsilon) for seed in seeds]
        row = {key: _mean([r[key] for r in rows]) for key in rows[0]}
        results["warm_start"].append({"epsilon": None if math.isinf(epsilon) else epsilon, **row})
        print(f"warm start eps {epsilon}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    for wakeups in (4, 32, 1000):
        rows = [nonprivate_cd(seed, wakeups) for seed in seeds]
        row = {key: _mean([r[key] for r in rows]) for key in rows[0]}
        results.setdefault("nonprivate_cd", []).append({"wakeups": wakeups, **row})
        print(f"non-private CD, T/n = {wakeups}: " + ", ".join(f"from {k} {v:.3f}" for k, v in row.items()),
              flush=True)
    for dim in (20, 50):
        rows = [by_dimension(seed, dim) for seed in seeds]
        row = {key: _mean([r[key] for r in rows]) for key in rows[0]}
        results.setdefault("by_dimension", []).append({"dim": dim, **row})
        print(f"p = {dim}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    results["allocation"] = allocation_spread(0)
    print("Proposition 2 (seed 0): " + ", ".join(f"{k} {v:.6g}" for k, v in results["allocation"].items()))
    (out / "diagnosis.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, out / "diagnosis.png")


def _plot(results: dict[str, Any], path: Path) -> None:
    """(a) best-T/n accuracy of private CD from Theta(0) = 0 against eps-bar, per variant; (b) the warm
    start's propagated accuracy against its epsilon."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, style in (("laplace", "o-"), ("gaussian", "s-"), ("paper-literal", "^--")):
        rows = [row for row in results["private_cd"] if row["variant"] == variant]
        label = f"{variant} (not DP)" if variant == "paper-literal" else f"{variant} (sound)"
        axes[0].plot([row["epsilon_bar"] for row in rows], [max(row["accuracy"].values()) for row in rows], style,
                     label=label)
    axes[0].axhline(results["local"], color="red", linestyle=":", label="purely local models")
    axes[0].set(xscale="log", xlabel="eps-bar", ylabel="test accuracy (best T/n)",
                title="private CD from Theta(0) = 0, p = 100")
    axes[0].legend(fontsize=8)
    warm = [row for row in results["warm_start"] if row["epsilon"] is not None]
    axes[1].plot([row["epsilon"] for row in warm], [row["accuracy_propagated"] for row in warm], "o-",
                 label="private local models, propagated")
    exact = next(row for row in results["warm_start"] if row["epsilon"] is None)
    axes[1].axhline(exact["accuracy_propagated"], color="black", label="exact local models, propagated")
    axes[1].axhline(results["local"], color="red", linestyle=":", label="purely local models")
    axes[1].axvline(0.05, color="grey", linestyle="--", label="the paper's eps = 0.05")
    axes[1].set(xscale="log", xlabel="warm-start eps (output perturbation)", ylabel="test accuracy",
                title="private warm start, Theta(0) of Figure 2(b)")
    axes[1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
