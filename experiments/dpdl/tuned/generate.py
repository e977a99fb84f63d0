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

The protocol's second stage, the length check: the studies tune over 300 rounds and the table runs 1000, where each
release must carry more noise (DP-NET-FLEET's tuned step fell from 86.47 % to 63.09 % on the validation split, a third
of it held 86.82 %; docs/reproduction.md).  So each study's best settings also run the table's length on the
validation split (Dirichlet 0.1, epsilon 4, seed 0, the study's RDP calibration) with the step as tuned and scaled by
the ratio of the lengths (``LENGTH_FACTORS``; ``length/jobs.tsv``, results in ``length/results/``); the better final
accuracy sets the table's step (``STEP``), for every method and graph alike.  A (method, graph)'s Table I cells
are listed once its check has chosen::

    decentdp run experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir0.1-eps4.toml --data-dir ../shared/data \\
        --set experiment.seed=1 --out results/dpdl-tuned/dpdl-mnist-fc-n10-dir0.1-eps4-s1
"""

from __future__ import annotations

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
#: (method, graph) -> the factor its length check chose (module docstring; each entry's comment gives the
#: validation accuracy at round 1000 of each factor).  Only these pairs' Table I cells are in ``jobs.tsv``: a cell
#: run at a step that the check later moves would be run again.  (Seed 0 of the complete graph's cells ran at the
#: study's step before the check was added, 2026-11-28/29; their folders, DP-NET-FLEET's too, are kept in
#: ``results-study-step/``, and docs/reproduction.md reads them.)
STEP: dict[tuple[str, str], float] = {
    ("dpdl", "fc"): 0.3,  # 89.13 % as tuned, 91.18 % at 0.3 (2026-11-29)
    ("muffliato", "fc"): 0.3,  # 88.83 / 90.88 %
    ("dp-dpsgd", "fc"): 0.3,  # 85.88 / 89.84 %
    ("dp-cga", "fc"): 0.3,  # 86.65 / 90.17 %
    ("dp-net-fleet", "fc"): 0.3,  # 63.09 / 87.46 %
    ("muffliato", "bipartite"): 0.3,  # 88.64 / 90.89 %
    ("dp-dpsgd", "bipartite"): 0.3,  # 88.83 / 89.18 %
    ("dpdl", "bipartite"): 0.3,  # 84.74 / 91.83 %
}


def config(method: str, graph: str, alpha: float, epsilon: float, name: str, agents: int = 10,
           step: float | None = None) -> dict[str, Any]:
    """The untuned config of the method (``experiments/dpdl/``) with the tuned values, the cell's agents, alpha
    and epsilon, and the paper's 1000 rounds; the study's step times ``step`` (the length check's choice unless
    told)."""
    base = tomllib.loads((HERE.parent / f"{method}-mnist-{graph}-dir0.1.toml").read_text())
    base["experiment"] |= {"name": name, "rounds": 1000, "eval_every": 100}
    base["topology"]["agents"] = agents
    base["data"]["dirichlet_alpha"] = alpha
    tuned = TUNED[(method, graph)][0]
    factor = STEP.get((method, graph), 1.0) if step is None else step
    base["algorithm"] |= tuned | {"lr": round(tuned["lr"] * factor, 6)}
    base["privacy"]["epsilon"] = epsilon
    return base


def write_length_check(method: str, graph: str, factor: float) -> str:
    """Write one length-check run (module docstring) into ``length/``; its name."""
    name = f"{method}-mnist-{graph}-n10-step{factor:g}"
    raw = config(method, graph, 0.1, 4.0, name, step=factor)
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


def main() -> None:
    finals, larger, checks = [], [], []
    for method, graph in TUNED:
        names = [write(method, graph, alpha, epsilon) for alpha in ALPHAS for epsilon in EPSILONS]
        scaled = [write(method, graph, alpha, epsilon, agents) for agents, alpha, epsilon in SCALING] \
            if graph == "fc" else []
        checks += [write_length_check(method, graph, factor) for factor in LENGTH_FACTORS]
        if (method, graph) in STEP:
            finals += names
            larger += scaled
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
