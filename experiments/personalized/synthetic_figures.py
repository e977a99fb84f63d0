"""Bellet et al. (2018), Figures 1-2 on the synthetic linear classification problem (specs D.7): test
accuracy against T/n and against eps-bar, without and with the private warm start, beside purely local
models, non-private coordinate descent and the decentralized ADMM of Vanhaesebrouck et al.

Every point is its own run of ``synthetic.toml`` with overrides (a private run's noise depends on its
T/n, so a point is not read off a longer run's curve), averaged over ``--seeds`` problem instances (the
paper averages 5; each seed draws a new problem).  Results go to ``OUT/synthetic.json`` (every run's
summary) and ``OUT/synthetic.png``.

    OMP_NUM_THREADS=1 python experiments/personalized/synthetic_figures.py --out results/personalized-synthetic
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from decentdp.config import load_config  # noqa: E402
from decentdp.personalized.runner import run_personalized  # noqa: E402

CONFIG = Path(__file__).parent / "synthetic.toml"
EPSILONS = (0.15, 0.55, 1.05)  # the paper's eps-bar
WAKEUPS = (1, 2, 4, 8)  # the paper's T/n


def _run(overrides: list[str]) -> dict[str, Any]:
    summary, _, _ = run_personalized(load_config(CONFIG, overrides), log=lambda _line: None)
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=2, help="problem instances averaged (the paper: 5)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    parser.add_argument("--wakeups", type=int, nargs="+", default=list(WAKEUPS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []

    def point(label: str, warm: bool, epsilon: float | None, wakeups: int | None, extra: list[str]) -> None:
        accuracies = []
        for seed in range(args.seeds):
            overrides = [f"experiment.seed={seed}", f"personalized.warm_start={'true' if warm else 'false'}", *extra]
            if wakeups is not None:
                overrides.append(f"personalized.wakeups={wakeups}")
            overrides.append('privacy.epsilon="inf"' if epsilon is None else f"privacy.epsilon={epsilon}")
            summary = _run(overrides)
            accuracies.append(summary["accuracy_mean"])
            runs.append({"label": label, "warm_start": warm, "epsilon_bar": epsilon, "wakeups": wakeups,
                         "seed": seed, **{key: summary[key] for key in (
                             "accuracy_mean", "epsilon_max", "epsilon_max_paper", "wall_seconds")}})
        print(f"{label:>12} warm={warm!s:5} eps={epsilon} T/n={wakeups}: accuracy {_mean(accuracies):.4f}",
              flush=True)
        (out / "synthetic.json").write_text(json.dumps(runs, indent=2) + "\n")

    point("local", False, 1.0, None, ['personalized.method="local"'])
    for wakeups in args.wakeups:
        point("admm", False, None, wakeups, ['personalized.method="admm"'])
        for warm in (False, True):
            point("non-private", warm, None, wakeups, [])
            for epsilon in args.epsilons:
                point("private", warm, epsilon, wakeups, [])
    _plot(runs, args.epsilons, args.wakeups, out / "synthetic.png")


def _curve(runs: list[dict[str, Any]], **match: Any) -> dict[Any, float]:
    """Mean accuracy per T/n of the runs matching ``match``."""
    by: dict[Any, list[float]] = {}
    for run in runs:
        if all(run[key] == value for key, value in match.items()):
            by.setdefault(run["wakeups"], []).append(run["accuracy_mean"])
    return {key: _mean(values) for key, values in sorted(by.items())}


def _plot(runs: list[dict[str, Any]], epsilons: list[float], wakeups: list[int], path: Path) -> None:
    """(a), (b): accuracy against T/n without and with warm start; (c) the best T/n's accuracy against eps-bar."""
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    local = _curve(runs, label="local")[None]
    for axis, warm in zip(axes[:2], (False, True), strict=True):
        for epsilon in epsilons:
            curve = _curve(runs, label="private", warm_start=warm, epsilon_bar=epsilon)
            axis.plot(list(curve), list(curve.values()), marker="o", label=f"private CD, eps-bar = {epsilon}")
        curve = _curve(runs, label="non-private", warm_start=warm)
        axis.plot(list(curve), list(curve.values()), marker="s", color="black", label="non-private CD")
        curve = _curve(runs, label="admm")
        axis.plot(list(curve), list(curve.values()), marker="^", linestyle="--", color="grey", label="ADMM")
        axis.axhline(local, color="red", linestyle=":", label="local")
        axis.set(xscale="log", xticks=wakeups, xticklabels=[str(w) for w in wakeups], xlabel="T/n",
                 ylabel="test accuracy", title="private warm start (eps = 0.05)" if warm else "Theta(0) = 0")
        axis.legend(fontsize=7)
    for warm in (False, True):
        best = [max(_curve(runs, label="private", warm_start=warm, epsilon_bar=epsilon).values())
                for epsilon in epsilons]
        axes[2].plot(epsilons, best, marker="o", label="warm start" if warm else "Theta(0) = 0")
    axes[2].axhline(local, color="red", linestyle=":", label="local")
    axes[2].axhline(max(_curve(runs, label="non-private", warm_start=False).values()), color="black",
                    label="non-private CD")
    axes[2].set(xlabel="eps-bar", ylabel="test accuracy (best T/n)", title="accuracy against eps-bar")
    axes[2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
