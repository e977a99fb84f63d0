"""Bellet et al. (2018), Figures 1-2 and supplementary Figures 3-4 on the synthetic linear classification
problem (specs D.7, ``synthetic.toml``; mu tuned by ``synthetic_mu.py``).  Every point is its own run,
averaged over ``--seeds`` problem instances (seeds 0, 1, ...; the paper averages 5).  Parts (``--parts``):

* ``fig1``: non-private coordinate descent against the decentralized ADMM of Vanhaesebrouck et al.,
  both from the purely local models (p = 100): objective and test accuracy against T/n (iterations / n)
  and against the p-dimensional vectors sent (CD: an update is broadcast to each neighbour; ADMM: an
  activated edge's two agents send each other two vectors, their model and their copy of the other's).
  CD is one run recorded along the way (its exact state at each T/n); ADMM, whose state is not exposed
  mid-run, one run per T/n.  The table at the paper's T/n is printed.
  Q_L's minimiser (:func:`~decentdp.personalized.solver.minimiser`) marks where both are heading.
* ``fig2ab``: private CD at each eps-bar and T/n in {1, 2, 4, 8}, from Theta(0) = 0 (Figure 2(a)) and
  from the private warm start at eps = 0.05 (Figure 2(b), spent inside eps-bar), objective and accuracy
  recorded at every T/n, beside non-private CD from the same starts (p = 100).
* ``fig2c``: final accuracy against p: purely local models, non-private CD (Q_L's minimiser, its limit)
  and private CD with the warm start (and, beside it, from Theta(0) = 0), whose T/n is chosen on
  validation instances (seeds 100, 101, ...) as the paper says; at p = 100 also each agent's
  accuracy, binned by its m_i (supplementary Figure 3).
* ``fig4``: the local-DP baseline (supplementary D.1, Figure 4): purely local models learned from data
  released under eps local DP (:func:`~decentdp.personalized.local.local_dp_release`, features bounded
  by their expected l1 norm p / sqrt(pi), which the public distribution N(0, I/2) fixes), and non-private
  CD on that released data from those local models, T/n = 8 (the paper: collaboration on it does not help;
  Q_L's minimiser is out of reach here, the noisy features make it too ill-conditioned for L-BFGS).

Results go to ``OUT/<part>.json``; figures to ``--figures`` (``personalized-synthetic-<part>.png``).

    OMP_NUM_THREADS=1 python experiments/personalized/synthetic_figures.py --out results/personalized-synthetic \
        --seeds 5 --figures docs/figures
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from decentdp.config import ExperimentConfig, load_config  # noqa: E402
from decentdp.data.personal import PersonalData  # noqa: E402
from decentdp.personalized.admm import gossip_admm  # noqa: E402
from decentdp.personalized.local import local_dp_release, local_models  # noqa: E402
from decentdp.personalized.objective import build_problem, objective  # noqa: E402
from decentdp.personalized.runner import build_run, evaluate, run_personalized  # noqa: E402
from decentdp.personalized.schedule import poisson_ticks  # noqa: E402
from decentdp.personalized.solver import coordinate_descent, minimiser  # noqa: E402

CONFIG = Path(__file__).parent / "synthetic.toml"
EPSILONS = (0.15, 0.55, 1.05)  # the paper's eps-bar (Figure 2(c), supplementary Figure 3)
CURVE_EPSILONS = (0.5, 0.55)  # Figure 2(a)'s legend reads 0.5, 2(b)'s 0.55
WAKEUPS = (1, 2, 4, 8)  # the paper's T/n
FIG1_WAKEUPS = (1, 2, 4, 8, 15)  # Figure 1 runs 1500 iterations with n = 100
DIMS = (20, 40, 60, 80, 100)
LOCAL_DP_EPSILONS = (1.0, 0.5, 0.1)
SIZE_BINS = tuple(range(10, 101, 10))  # supplementary Figure 3: 10-20, ..., 90-100
VALIDATION_SEED = 100
#: Starts of the private runs of Figure 2(c): the paper's private warm start, and Theta(0) = 0 beside it.
STARTS = {"": ["personalized.warm_start=true"], " from 0": ["personalized.warm_start=false"]}
#: Vectors an ADMM activation sends: each of the edge's two agents sends its model and its copy of the other's.
ADMM_VECTORS_PER_TICK = 4


def config(seed: int, overrides: list[str]) -> ExperimentConfig:
    """``synthetic.toml`` for problem instance ``seed`` with ``overrides``."""
    return load_config(CONFIG, [f"experiment.seed={seed}", *overrides])


def accuracy(overrides: list[str], seed: int) -> tuple[float, torch.Tensor, list[dict[str, Any]]]:
    """One run of ``synthetic.toml`` with ``overrides``: mean test accuracy, final models, metrics."""
    summary, metrics, theta = run_personalized(config(seed, overrides), log=lambda _line: None)
    return summary["accuracy_mean"], theta, metrics


def per_agent_accuracy(data: PersonalData, theta: torch.Tensor) -> np.ndarray:
    """Each agent's test accuracy (a zero margin predicts +1, as :func:`evaluate`)."""
    x, owner = torch.as_tensor(data.x_test), torch.as_tensor(data.owner_test)
    correct = (torch.where(torch.einsum("rp,rp->r", x, theta[owner]) >= 0, 1.0, -1.0)
               == torch.as_tensor(data.y_test)).double()
    totals = torch.zeros(data.n_agents, dtype=torch.float64).index_add_(0, owner, correct)
    return (totals / torch.bincount(owner, minlength=data.n_agents)).numpy()


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation over instances (0 for a single one)."""
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def cd_curve(problem: Any, data: PersonalData, plan: Any, start: torch.Tensor,
             every: int = 25) -> list[dict[str, float]]:
    """Non-private CD from ``start``: objective and accuracy of the run's exact state after every ``every`` ticks
    and at its end (the plan's levels cut at those ticks, :meth:`~decentdp.personalized.schedule.WakeupPlan.split_at`),
    against ticks / n and the vectors broadcast so far (one per neighbour per update made)."""
    degree = (problem.weights > 0).sum(dim=1).numpy()

    def point(ticks: int, theta: torch.Tensor) -> dict[str, float]:
        made = plan.ticks < ticks
        return {"wakeups": ticks / problem.n_agents, "vectors": float(degree[plan.agents[made]].sum()),
                "objective": objective(problem, theta), "accuracy": evaluate(data, theta)["accuracy_mean"]}

    marks = list(range(every, plan.total_ticks, every))
    split, levels_before = plan.split_at(marks)
    curve = [point(0, start)]
    due = 0

    def record_due(levels_done: int, theta: torch.Tensor) -> None:
        nonlocal due
        while due < len(marks) and levels_before[due] <= levels_done:
            curve.append(point(marks[due], theta))
            due += 1

    record_due(0, start)
    theta = coordinate_descent(problem, start.clone(), split,
                               after_level=lambda level, current: record_due(level + 1, current))
    curve.append(point(plan.total_ticks, theta))
    return curve


def figure1(seeds: list[int]) -> dict[str, Any]:
    """Non-private CD and ADMM from the local models, p = 100 (module docstring)."""
    cd: list[list[dict[str, float]]] = []
    admm: dict[int, list[dict[str, float]]] = {}
    optimum: list[dict[str, float]] = []
    for seed in seeds:
        run = build_run(config(seed, ['privacy.epsilon="inf"', f"personalized.wakeups={max(FIG1_WAKEUPS)}"]))
        problem, data, plan = run.problem, run.data, run.plan
        assert plan is not None
        local = local_models(problem)
        curve = cd_curve(problem, data, plan, local)
        cd.append(curve)
        best = minimiser(problem, local)
        optimum.append({"objective": objective(problem, best), "accuracy": evaluate(data, best)["accuracy_mean"]})
        for wakeups in FIG1_WAKEUPS:
            ticks = wakeups * problem.n_agents
            theta = gossip_admm(problem, local, poisson_ticks(seed, problem.n_agents, ticks), seed)
            admm.setdefault(wakeups, []).append({"objective": objective(problem, theta),
                                                 "accuracy": evaluate(data, theta)["accuracy_mean"],
                                                 "vectors": float(ADMM_VECTORS_PER_TICK * ticks)})
        print(f"fig1 seed {seed}: CD {curve[-1]['accuracy']:.3f}, ADMM {admm[max(FIG1_WAKEUPS)][-1]['accuracy']:.3f}, "
              f"local {curve[0]['accuracy']:.3f}, optimum {optimum[-1]['accuracy']:.3f}", flush=True)
    return {"cd": cd, "admm": {str(w): rows for w, rows in admm.items()}, "optimum": optimum}


def figure1_table(result: dict[str, Any]) -> str:
    """Figure 1 at the paper's T/n as a markdown table: CD's exact state at those ticks and ADMM's runs, mean
    ± std over the instances (accuracy), means (objective, vectors sent)."""
    points = (0, *FIG1_WAKEUPS)

    def cd(wakeups: int, key: str) -> list[float]:
        return [next(row[key] for row in curve if row["wakeups"] == wakeups) for curve in result["cd"]]

    def admm(wakeups: int, key: str) -> list[float]:
        return [row[key] for row in result["admm"][str(wakeups)]] if wakeups else cd(0, key)

    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else \
            f"{values[0]:.3f}"

    rows = ["| T/n | " + " | ".join(str(w) for w in points) + " |", "|---|" + "---|" * len(points),
            "| CD, test accuracy | " + " | ".join(spread(cd(w, "accuracy")) for w in points) + " |",
            "| ADMM, test accuracy | " + " | ".join(spread(admm(w, "accuracy")) for w in points) + " |",
            "| CD / ADMM, objective | " + " | ".join(
                f"{statistics.mean(cd(w, 'objective')):.0f} / {statistics.mean(admm(w, 'objective')):.0f}"
                for w in points) + " |",
            "| CD / ADMM, vectors sent | " + " | ".join(
                f"{statistics.mean(cd(w, 'vectors')):,.0f} / {statistics.mean(admm(w, 'vectors')):,.0f}"
                for w in points) + " |"]
    optimum = result["optimum"]
    rows.append(f"\nQ_L's minimiser: accuracy {spread([o['accuracy'] for o in optimum])}, objective "
                f"{statistics.mean(o['objective'] for o in optimum):.0f}")
    return "\n".join(rows)


def figure2ab(seeds: list[int]) -> dict[str, Any]:
    """Private CD curves per eps-bar, T/n and start; non-private CD from the same starts (p = 100)."""
    rows = []
    for warm in (False, True):
        for epsilon in (*sorted({*EPSILONS, *CURVE_EPSILONS}), None):
            for wakeups in WAKEUPS:
                curves = []
                for seed in seeds:
                    _, _, metrics = accuracy([f"personalized.warm_start={'true' if warm else 'false'}",
                                              f"personalized.wakeups={wakeups}",
                                              'privacy.epsilon="inf"' if epsilon is None
                                              else f"privacy.epsilon={epsilon}"], seed)
                    curves.append([{key: row[key] for key in ("wakeups_per_agent", "objective", "accuracy_mean")}
                                   for row in metrics])
                final = mean_std([curve[-1]["accuracy_mean"] for curve in curves])
                rows.append({"warm_start": warm, "epsilon_bar": epsilon, "wakeups": wakeups, "final": final,
                             "curves": curves})
                print(f"fig2ab warm={warm!s:5} eps={epsilon} T/n={wakeups}: {final['mean']:.3f} ± {final['std']:.3f}",
                      flush=True)
    return {"runs": rows}


def figure2c(seeds: list[int], validation: list[int], dims: tuple[int, ...]) -> dict[str, Any]:
    """Accuracy against p; at p = 100 per agent, binned by m_i (module docstring)."""
    results: dict[str, Any] = {"dims": {}, "sizes": {}}
    for dim in dims:
        shape = [f"personalized.dim={dim}"]
        row: dict[str, Any] = {}
        per_agent: dict[str, list[np.ndarray]] = {}
        instances = {}
        for seed in seeds:
            run = build_run(config(seed, [*shape, 'privacy.epsilon="inf"']))
            instances[seed] = run.data
            local = local_models(run.problem)
            best = minimiser(run.problem, local)
            for name, theta in (("local", local), ("non-private", best)):
                per_agent.setdefault(name, []).append(per_agent_accuracy(run.data, theta))
            per_agent.setdefault("sizes", []).append(run.data.train_counts)
        for (start, overrides), epsilon in itertools.product(STARTS.items(), EPSILONS):
            settings = [*shape, *overrides, f"privacy.epsilon={epsilon}"]
            scores = {wakeups: statistics.mean(accuracy([*settings, f"personalized.wakeups={wakeups}"], seed)[0]
                                               for seed in validation) for wakeups in WAKEUPS}
            chosen = max(scores, key=scores.__getitem__)
            for seed in seeds:
                theta = accuracy([*settings, f"personalized.wakeups={chosen}"], seed)[1]
                per_agent.setdefault(f"private {epsilon}{start}", []).append(per_agent_accuracy(instances[seed], theta))
            row[f"private {epsilon}{start} wakeups"] = {"validation": scores, "chosen": chosen}
        for name, values in per_agent.items():
            if name != "sizes":
                row[name] = mean_std([float(v.mean()) for v in values])
        results["dims"][str(dim)] = row
        print(f"fig2c p={dim}: " + ", ".join(f"{k} {v['mean']:.3f}" for k, v in row.items() if "mean" in v),
              flush=True)
        if dim == max(dims):
            sizes = np.concatenate(per_agent["sizes"])
            which = np.digitize(sizes, SIZE_BINS[1:-1])  # bin b holds 10 (b + 1) <= m < 10 (b + 2); 100 in the last
            bins = range(len(SIZE_BINS) - 1)
            results["sizes"] = {name: [float(np.concatenate(values)[which == b].mean()) for b in bins]
                                for name, values in per_agent.items() if name != "sizes"}
            results["sizes"]["agents_per_bin"] = [int((which == b).sum()) for b in bins]
    return results


def figure4(seeds: list[int], dims: tuple[int, ...]) -> dict[str, Any]:
    """Local models from locally-DP data, and CD on it (module docstring)."""
    results: dict[str, Any] = {}
    for dim in dims:
        row: dict[str, list[float]] = {}
        for seed in seeds:
            run = build_run(config(seed, [f"personalized.dim={dim}", 'privacy.epsilon="inf"']))
            assert run.plan is not None
            row.setdefault("local", []).append(evaluate(run.data, local_models(run.problem))["accuracy_mean"])
            for k, epsilon in enumerate(LOCAL_DP_EPSILONS):
                released = local_dp_release(run.data, epsilon, dim / math.sqrt(math.pi),
                                            np.random.default_rng((seed, dim, k)))
                problem = build_problem(released, run.problem.mu)
                local = local_models(problem)
                row.setdefault(f"local-dp {epsilon}", []).append(evaluate(released, local)["accuracy_mean"])
                joint = coordinate_descent(problem, local.clone(), run.plan)
                row.setdefault(f"local-dp {epsilon} + CD", []).append(evaluate(released, joint)["accuracy_mean"])
        results[str(dim)] = {name: mean_std(values) for name, values in row.items()}
        print(f"fig4 p={dim}: " + ", ".join(f"{k} {v['mean']:.3f}" for k, v in results[str(dim)].items()), flush=True)
    return results


def average_curve(curves: list[list[dict[str, float]]], x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``y_key`` over curves recorded at different ``x_key`` points, on a grid up to the shortest's end."""
    grid = np.linspace(0.0, min(curve[-1][x_key] for curve in curves), 100)
    ys = [np.interp(grid, [row[x_key] for row in curve], [row[y_key] for row in curve]) for curve in curves]
    return grid, np.mean(ys, axis=0)


def plot_figure1(result: dict[str, Any], path: Path) -> None:
    """Objective and accuracy of CD (averaged curves) and ADMM (points) against T/n and against vectors sent."""
    figure, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for column, (key, label) in enumerate((("objective", "objective Q_L"), ("accuracy", "test accuracy"))):
        for offset, x_key in ((0, "wakeups"), (2, "vectors")):
            axis = axes[column + offset]
            xs, ys = average_curve(result["cd"], x_key, key)
            axis.plot(xs, ys, label="CD (ours)")
            admm = result["admm"]
            wakeups = sorted(admm, key=int)
            axis.plot([0] + [float(np.mean([r[x_key] if x_key == "vectors" else int(w) for r in admm[w]]))
                             for w in wakeups],
                      [ys[0]] + [float(np.mean([r[key] for r in admm[w]])) for w in wakeups], "s--", label="ADMM")
            axis.axhline(float(np.mean([row[key] for row in result["optimum"]])), color="black", linestyle=":",
                         label="Q_L's minimiser")
            axis.set(xlabel="T/n (iterations / n)" if x_key == "wakeups" else "vectors sent", ylabel=label)
            axis.legend(fontsize=7)
    figure.suptitle("Figure 1: CD against ADMM from the local models (p = 100, non-private)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_figure2(ab: dict[str, Any] | None, c: dict[str, Any] | None, path: Path) -> None:
    """(a), (b): objective and accuracy along the iterations per T/n; (c) final accuracy against p."""
    figure, axes = plt.subplots(1, 5, figsize=(22, 3.8))
    if ab is not None:
        for index, (warm, epsilon) in enumerate(((False, CURVE_EPSILONS[0]), (True, CURVE_EPSILONS[1]))):
            chosen = [(run, f"priv. CD eps = {epsilon}, T/n = {run['wakeups']}", {}) for run in ab["runs"]
                      if run["warm_start"] == warm and run["epsilon_bar"] == epsilon]
            chosen += [(run, "non-private CD", {"color": "black", "linestyle": "--"}) for run in ab["runs"]
                       if run["warm_start"] == warm and run["epsilon_bar"] is None and run["wakeups"] == max(WAKEUPS)]
            for axis, key in zip(axes[2 * index:2 * index + 2], ("objective", "accuracy_mean"), strict=True):
                for run, label, style in chosen:
                    xs, ys = average_curve(run["curves"], "wakeups_per_agent", key)
                    axis.plot(100 * xs, ys, label=label, **style)
                axis.set(xlabel="iteration number", ylabel="objective" if key == "objective" else "test accuracy",
                         yscale="log" if key == "objective" else "linear",
                         title=f"({'b' if warm else 'a'}) " + ("private init (eps = 0.05)" if warm else "Theta(0) = 0"))
                axis.legend(fontsize=6)
    if c is not None:
        dims = sorted(c["dims"], key=int)
        names = ("local", "non-private", *(f"private {e}{start}" for start in STARTS for e in reversed(EPSILONS)))
        for name in names:
            axes[4].errorbar([int(d) for d in dims], [c["dims"][d][name]["mean"] for d in dims],
                             yerr=[c["dims"][d][name]["std"] for d in dims], marker="o", capsize=2, label=name,
                             linestyle=":" if "from 0" in name else "-")
        axes[4].set(xlabel="dimension p", ylabel="test accuracy", title="(c) overall results (private: warm start)")
        axes[4].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_sizes(c: dict[str, Any], path: Path) -> None:
    """Supplementary Figure 3: mean accuracy per m_i bin, one bar per method."""
    figure, axis = plt.subplots(figsize=(8, 3.8))
    names = [name for name in c["sizes"] if name != "agents_per_bin"]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        axis.bar(np.arange(len(SIZE_BINS) - 1) + k * width, c["sizes"][name], width, label=name)
    axis.set_xticks(np.arange(len(SIZE_BINS) - 1) + 0.4,
                    [f"{a}-{b}" for a, b in zip(SIZE_BINS, SIZE_BINS[1:], strict=False)])
    axis.set(xlabel="size of local dataset", ylabel="test accuracy", ylim=(0.4, 1.0),
             title="Supplementary Figure 3: accuracy per local dataset size (p = 100)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_figure4(result: dict[str, Any], path: Path) -> None:
    """Supplementary Figure 4: accuracy against p of local models on locally-DP data (and CD on it)."""
    figure, axis = plt.subplots(figsize=(7, 3.8))
    dims = sorted(result, key=int)
    for name in result[dims[0]]:
        axis.errorbar([int(d) for d in dims], [result[d][name]["mean"] for d in dims],
                      yerr=[result[d][name]["std"] for d in dims], marker="o", capsize=2,
                      linestyle="--" if "CD" in name else "-", label=name)
    axis.set(xlabel="dimension p", ylabel="test accuracy",
             title="Supplementary Figure 4: local models on locally-DP data")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--figures", help="folder of the PNGs (default: --out)")
    parser.add_argument("--seeds", type=int, default=5, help="problem instances averaged (the paper: 5)")
    parser.add_argument("--validation-seeds", type=int, default=3, help="instances that choose T/n in fig2c")
    parser.add_argument("--parts", nargs="*", default=["fig1", "fig2ab", "fig2c", "fig4"],
                        help="parts to run (none: only redraw the figures from OUT's results)")
    args = parser.parse_args()
    out = Path(args.out)
    figures = Path(args.figures or args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seeds))
    validation = list(range(VALIDATION_SEED, VALIDATION_SEED + args.validation_seeds))
    torch.set_num_threads(1)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "fig1": lambda: figure1(seeds), "fig2ab": lambda: figure2ab(seeds),
        "fig2c": lambda: figure2c(seeds, validation, DIMS), "fig4": lambda: figure4(seeds, DIMS)}
    for part in args.parts:
        (out / f"{part}.json").write_text(json.dumps(parts[part](), indent=2) + "\n")
    done = {part: json.loads((out / f"{part}.json").read_text()) for part in parts if (out / f"{part}.json").exists()}
    if "fig1" in done:
        plot_figure1(done["fig1"], figures / "personalized-synthetic-fig1.png")
        print(figure1_table(done["fig1"]))
    if "fig2ab" in done or "fig2c" in done:
        plot_figure2(done.get("fig2ab"), done.get("fig2c"), figures / "personalized-synthetic.png")
    if "fig2c" in done:
        plot_sizes(done["fig2c"], figures / "personalized-synthetic-sizes.png")
    if "fig4" in done:
        plot_figure4(done["fig4"], figures / "personalized-synthetic-local-dp.png")


if __name__ == "__main__":
    main()
