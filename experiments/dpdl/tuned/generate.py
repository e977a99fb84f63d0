"""Write the tuned configs of DPDL's Table I (issue 33): one per method, graph, Dirichlet alpha and epsilon.

The tuned values come from the sweeps in ``experiments/dpdl/tuning/`` (TPE, 16 trials of 300 rounds on a 10 %
validation split, alpha = 0.1, epsilon = 4; the same budget for every method) and are copied into
``TUNED`` by hand from each sweep's ``best.md``, with the validation accuracy they reached, so that this
table is the single source of truth.  A method appears here once its sweep has finished.  Every cell runs
the paper's setting: MNIST, LeNet-5, N = 10, 1000 rounds, expected batch 64, C = 1, delta = 1e-5, with
the block labels we chose (docs/reproduction.md: alpha in {0.1, 1.0}, epsilon in {2, 4, 8}); three
seeds with ``--set experiment.seed=S`` (``jobs.tsv`` lists them for the pairs in ``STEP``).  Then issue 33's
item 3: N = 20 and 30 on the complete graph in the cell where the paper's gaps are largest (alpha = 0.1,
epsilon = 2: DPDL 95.3 and 91.9 % against at most 82.1 and 76.4 % for the baselines), with each method's N = 10
tuning (one study per method and graph; the agents' count is not tuned), listed after every N = 10 run.

The protocol's second stage, the length check, per cell: the studies tune over 300 rounds and the table runs 1000,
where each release must carry more noise (DP-NET-FLEET's tuned step fell from 86.47 % to 63.09 % on the validation
split, a third of it held 86.82 %; docs/reproduction.md), and how much step the noise allows depends on the cell's
epsilon and alpha (checked at alpha = 0.1, epsilon = 4 alone, a third of the step cost DPDL and Muffliato 2.0-3.5 points
in the cells with less noise).  So each study's best settings also run every cell of the table at its length on the
validation split (seed 0, the study's RDP calibration), with the step as tuned and scaled by the ratio of the lengths
(``LENGTH_FACTORS``; ``length/jobs.tsv``, results in ``length/results/``); the better final accuracy sets that cell's
step (``STEP``, copied by hand from ``generate.py --checks``, which prints every check's figures), for every method
and graph alike.  A cell is listed once its check has chosen, and ``--checks`` also names any test run in the
wrong folder (``results/`` holds the chosen steps' runs, ``ASIDE`` the others) with the ``git mv`` that moves it::

    decentdp run experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir0.1-eps4.toml --data-dir ../shared/data \\
        --set experiment.seed=1 --out results/dpdl-tuned/dpdl-mnist-fc-n10-dir0.1-eps4-s1
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from run_jobs import run_line  # noqa: E402

SEEDS = (0, 1, 2)
ALPHAS = (0.1, 1.0)
EPSILONS = (2.0, 4.0, 8.0)
GRAPHS = {"fc": "complete", "bipartite": "complete-bipartite", "ring": "ring"}
#: (agents, alpha, epsilon) of the larger networks, on the complete graph (the paper's largest gaps).
SCALING = ((20, 0.1, 2.0), (30, 0.1, 2.0))

#: (method, graph) -> the tuned [algorithm] values and the sweep's best validation accuracy (300 rounds).
TUNED: dict[tuple[str, str], tuple[dict[str, Any], float]] = {
    ("dpdl", "fc"): ({"lr": 0.0321, "calibration_scale": 0.5904}, 0.9108),  # 16 trials, done (2026-11-28)
    ("muffliato", "fc"): ({"lr": 1.21}, 0.9056),  # the wide study (lr to 4.0, 16 trials)
    # Synchronous A(DP)2SGD with plain SGD is DP-DSGD to the bit (tests/algorithms/test_dp_dpsgd.py): DP-DSGD's wide
    # study (lr to 4.0, 16 trials) is its study, and DP-DSGD, which Table I does not report, is not run again.
    ("dp-dpsgd", "fc"): ({"lr": 1.177}, 0.8683),
    ("dp-cga", "fc"): ({"lr": 1.745, "momentum": 0.0}, 0.8970),  # 16 trials, done (2026-11-28)
    # DP-NET-FLEET: its second study (lr and correction decay; 16 trials, done 2026-11-28); lr alone: 55.35 %.
    ("dp-net-fleet", "fc"): ({"lr": 0.8907, "correction_decay": 0.6623}, 0.8647),
    # The complete bipartite graph's studies (16 trials each, done 2026-11-29).
    ("muffliato", "bipartite"): ({"lr": 1.21}, 0.9032),
    ("dp-dpsgd", "bipartite"): ({"lr": 0.8332}, 0.8629),  # DP-DSGD's study, as on the complete graph
    ("dpdl", "bipartite"): ({"lr": 0.072, "calibration_scale": 0.883}, 0.9044),
}
#: The length check's factors on the study's step: as tuned, and times the ratio of the lengths (300 / 1000).
LENGTH_FACTORS = (1.0, 0.3)
#: (method, graph) -> {(alpha, epsilon): the factor its cell's length check chose} (module docstring; the comments
#: give each factor's validation accuracy at round 1000, in LENGTH_FACTORS' order).  Only these cells are in
#: ``jobs.tsv``: a cell run at a step that its check later moves would be run again.  Test runs at a factor not
#: chosen are kept for the record: the study's step in ``results-study-step/`` (seed 0 of the complete graph's
#: cells ran there before the check existed, 2026-11-28/29), a third of it in ``results-short-step/`` (the first
#: check, at alpha 0.1 and epsilon 4 alone, chose it for every cell of its method and graph).
STEP: dict[tuple[str, str], dict[tuple[float, float], float]] = {
    ("dpdl", "fc"): {(0.1, 2.0): 0.3,  # 70.66 / 89.51 % (2026-11-29)
                     (0.1, 4.0): 0.3,  # 89.13 / 91.18 %
                     (0.1, 8.0): 1.0,  # 93.91 / 91.19 %
                     (1.0, 2.0): 1.0,  # 93.30 / 91.86 %
                     (1.0, 4.0): 1.0,  # 94.55 / 91.98 %
                     (1.0, 8.0): 1.0},  # 95.05 / 91.93 %
    ("muffliato", "fc"): {(0.1, 2.0): 0.3,  # 72.00 / 89.71 %
                          (0.1, 4.0): 0.3,  # 88.83 / 90.88 %
                          (0.1, 8.0): 1.0,  # 93.20 / 91.14 %
                          (1.0, 2.0): 1.0,  # 93.03 / 92.29 %
                          (1.0, 4.0): 1.0,  # 94.83 / 92.18 %
                          (1.0, 8.0): 1.0},  # 95.30 / 92.14 %
    ("dp-dpsgd", "fc"): {(0.1, 2.0): 0.3,  # 66.87 / 87.62 %
                         (0.1, 4.0): 0.3,  # 85.88 / 89.84 %
                         (0.1, 8.0): 1.0,  # 91.02 / 90.38 %
                         (1.0, 2.0): 0.3,  # 92.22 / 92.25 %: a tie, the rule takes the better
                         (1.0, 4.0): 1.0,  # 94.36 / 92.31 %
                         (1.0, 8.0): 1.0},  # 95.27 / 92.32 %
    ("dp-cga", "fc"): {(0.1, 2.0): 0.3,  # 74.17 / 86.32 % (2026-12-07)
                       (0.1, 4.0): 0.3,  # 86.65 / 90.17 %
                       (0.1, 8.0): 1.0},  # 90.94 / 90.14 % (2026-12-07)
    ("dp-net-fleet", "fc"): {(0.1, 2.0): 0.3,  # 29.74 / 70.30 %
                             (0.1, 4.0): 0.3,  # 63.09 / 87.46 %
                             (0.1, 8.0): 0.3,  # 84.31 / 89.61 %
                             (1.0, 2.0): 0.3,  # 83.46 / 90.83 %
                             (1.0, 4.0): 0.3,  # 91.06 / 91.23 %
                             (1.0, 8.0): 1.0},  # 93.31 / 91.39 %
    ("muffliato", "bipartite"): {(0.1, 2.0): 0.3,  # 73.85 / 89.69 % (2026-12-07)
                                 (0.1, 4.0): 0.3,  # 88.64 / 90.89 %
                                 (0.1, 8.0): 1.0,  # 92.90 / 91.07 %
                                 (1.0, 2.0): 1.0,  # 93.01 / 92.26 %
                                 (1.0, 4.0): 1.0,  # 94.63 / 92.20 %
                                 (1.0, 8.0): 1.0},  # 95.23 / 92.15 %
    ("dp-dpsgd", "bipartite"): {(0.1, 2.0): 0.3,  # 76.81 / 88.20 % (2026-12-07)
                                (0.1, 4.0): 0.3,  # 88.83 / 89.18 %
                                (0.1, 8.0): 1.0,  # 91.78 / 89.27 %
                                (1.0, 2.0): 1.0,  # 92.79 / 91.30 %
                                (1.0, 4.0): 1.0,  # 93.93 / 91.28 %
                                (1.0, 8.0): 1.0},  # 94.34 / 91.16 %
    ("dpdl", "bipartite"): {(0.1, 2.0): 0.3,  # 60.63 / 88.62 %
                            (0.1, 4.0): 0.3,  # 84.74 / 91.83 %
                            (0.1, 8.0): 1.0,  # 92.37 / 92.05 %
                            (1.0, 2.0): 0.3,  # 90.84 / 92.40 %
                            (1.0, 4.0): 1.0,  # 93.65 / 92.53 %
                            (1.0, 8.0): 1.0},  # 94.94 / 92.74 % (2026-11-30)
}


#: Where test runs at a step their cell did not choose are kept (the study's step, a third of it).
ASIDE = ("results-study-step", "results-short-step")


def chosen(method: str, graph: str, alpha: float, epsilon: float) -> float | None:
    """The factor the cell's length check chose, or None before it has."""
    return STEP.get((method, graph), {}).get((alpha, epsilon))


def config(method: str, graph: str, alpha: float, epsilon: float, name: str, agents: int = 10,
           step: float | None = None) -> dict[str, Any]:
    """The untuned config of the method (``experiments/dpdl/``) with the tuned values, the cell's agents, alpha
    and epsilon, and the paper's 1000 rounds; the study's step times ``step`` (the cell's length check's choice
    unless told; the study's step before it has chosen)."""
    base = tomllib.loads((HERE.parent / f"{method}-mnist-{graph}-dir0.1.toml").read_text())
    base["experiment"] |= {"name": name, "rounds": 1000, "eval_every": 100}
    base["topology"]["agents"] = agents
    base["data"]["dirichlet_alpha"] = alpha
    tuned = TUNED[(method, graph)][0]
    factor = (chosen(method, graph, alpha, epsilon) or 1.0) if step is None else step
    base["algorithm"] |= tuned | {"lr": round(tuned["lr"] * factor, 6)}
    base["privacy"]["epsilon"] = epsilon
    return base


def check_name(method: str, graph: str, alpha: float, epsilon: float, factor: float) -> str:
    """The name (config, job and results folder) of one cell's length-check run at ``factor`` of the study's step."""
    return f"{method}-mnist-{graph}-n10-dir{alpha:g}-eps{epsilon:g}-step{factor:g}"


def write_length_check(method: str, graph: str, alpha: float, epsilon: float, factor: float) -> str:
    """Write one length-check run (module docstring) into ``length/``; its name."""
    name = check_name(method, graph, alpha, epsilon, factor)
    raw = config(method, graph, alpha, epsilon, name, step=factor)
    raw["data"]["validation_fraction"] = 0.1
    raw["privacy"]["accountant"] = "rdp"
    (HERE / "length").mkdir(exist_ok=True)
    (HERE / "length" / f"{name}.toml").write_text(
        "# Generated by experiments/dpdl/tuned/generate.py; edit the table there, not this file.\n"
        + tomli_w.dumps(raw))
    return name


def write(method: str, graph: str, alpha: float, epsilon: float, agents: int = 10) -> str:
    """Write one cell's config; its name."""
    name = f"{method}-mnist-{graph}-n{agents}-dir{alpha:g}-eps{epsilon:g}"
    (HERE / f"{name}.toml").write_text(
        "# Generated by experiments/dpdl/tuned/generate.py; edit the table there, not this file.\n"
        + tomli_w.dumps(config(method, graph, alpha, epsilon, name, agents)))
    return name


def final_accuracy(run: Path) -> float | None:
    """A finished run's mean accuracy at its last evaluation, or None while it has not finished."""
    summary = run / "summary.json"
    return json.loads(summary.read_text())["accuracy_mean"] if summary.exists() else None


def checks_report() -> str:
    """Every cell's length check as a table (validation accuracy at round 1000 per factor, the better one, and what
    ``STEP`` holds), then each test run that lies in the wrong folder: ``results/`` holds the runs at their cell's
    chosen step, ``ASIDE`` the others, by step."""
    lines = ["| method | graph | alpha | epsilon | " + " | ".join(f"x{f:g}" for f in LENGTH_FACTORS)
             + " | better | in STEP |", "|---|---|---:|---:|" + "---:|" * (len(LENGTH_FACTORS) + 2)]
    moves = []
    for method, graph in TUNED:
        for alpha in ALPHAS:
            for epsilon in EPSILONS:
                accuracy = {f: final_accuracy(HERE / "length" / "results" /
                                              f"{check_name(method, graph, alpha, epsilon, f)}-s0")
                            for f in LENGTH_FACTORS}
                done = {f: a for f, a in accuracy.items() if a is not None}
                better = f"x{max(done, key=lambda f: done[f]):g}" if len(done) == len(LENGTH_FACTORS) else ""
                step = chosen(method, graph, alpha, epsilon)
                cells = " | ".join("" if a is None else f"{100 * a:.2f}" for a in accuracy.values())
                lines.append(f"| {method} | {graph} | {alpha:g} | {epsilon:g} | {cells} | {better} | "
                             f"{'' if step is None else f'x{step:g}'} |")
                name = f"{method}-mnist-{graph}-n10-dir{alpha:g}-eps{epsilon:g}"
                lr = config(method, graph, alpha, epsilon, name)["algorithm"]["lr"]
                for folder in ("results", *ASIDE):
                    for run in sorted((HERE / folder).glob(f"{name}-s*/summary.json")):
                        ran = json.loads(run.read_text())["lr"]
                        kind = "results-study-step" if ran == TUNED[(method, graph)][0]["lr"] else "results-short-step"
                        belongs = "results" if step is not None and ran == lr else kind
                        if belongs != folder:
                            why = ("its cell's check has not chosen" if step is None else
                                   f"the cell's step is {lr:g}" if belongs != "results" else "the cell's chosen step")
                            moves.append(f"git mv {run.parent.relative_to(HERE.parents[2])} "
                                         f"experiments/dpdl/tuned/{belongs}/  # ran at lr {ran:g}: {why}")
    return "\n".join(lines + ["", "Test runs in the wrong folder (results/ holds the chosen steps' runs):" if moves else
                                "Every test run is in its folder: results/ holds the chosen steps' runs, the others "
                                "are aside.", *moves])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", action="store_true", help="write nothing: print every cell's length check and "
                                                              "the test runs at another step than their cell's")
    if parser.parse_args(argv).checks:
        print(checks_report())
        return
    finals, larger, checks = [], [], []
    for method, graph in TUNED:
        cells = [(alpha, epsilon) for alpha in ALPHAS for epsilon in EPSILONS]
        names = {cell: write(method, graph, *cell) for cell in cells}
        checks += [write_length_check(method, graph, *cell, factor) for cell in cells for factor in LENGTH_FACTORS]
        finals += [names[cell] for cell in cells if chosen(method, graph, *cell) is not None]
        if graph == "fc":
            larger += [name for agents, alpha, epsilon in SCALING
                       for name in [write(method, graph, alpha, epsilon, agents)]
                       if chosen(method, graph, alpha, epsilon) is not None]
    (HERE / "length" / "jobs.tsv").write_text(
        "# Generated by experiments/dpdl/tuned/generate.py: python experiments/run_jobs.py "
        "experiments/dpdl/tuned/length/jobs.tsv --workers 2 (DATA_DIR defaults to ../shared/data)\n"
        + "".join(run_line(name, f"experiments/dpdl/tuned/length/{name}.toml", 0, "${DATA_DIR:-../shared/data}",
                           f"experiments/dpdl/tuned/length/results/{name}-s0") + "\n" for name in checks))
    # Three seeds of every final cell, on the test set, into results/ here; seed 0 of every cell first, and the
    # larger networks after every N = 10 run.
    lines = ["# Generated by experiments/dpdl/tuned/generate.py: python experiments/run_jobs.py "
             "experiments/dpdl/tuned/jobs.tsv --workers 2 (DATA_DIR defaults to ../shared/data)"]
    lines += [run_line(name, f"experiments/dpdl/tuned/{name}.toml", seed, "${DATA_DIR:-../shared/data}",
                       f"experiments/dpdl/tuned/results/{name}-s{seed}")
              for cells in (finals, larger) for seed in SEEDS for name in cells]
    (HERE / "jobs.tsv").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
