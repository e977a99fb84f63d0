"""Write the configs of the correlated-noise comparison (DECOR's MNIST and a9a experiments, issue 32).

One table of settings (below) is the single source of truth; the TOML files in ``mnist/`` and ``a9a/`` are
generated from it (``python experiments/correlated/generate.py``) and committed, so that
``decentdp run experiments/correlated/mnist/<name>.toml --data-dir ../shared/data`` works directly (a9a: a
``--data-dir`` holding LIBSVM's files, which are not redistributed; see ``decentdp.data.libsvm``).

DECOR's MNIST setting (``reproduce_mnist.py`` of ``elfirdoussilab1/DECOR``): N = 16 agents, the MLP
784-128-10, batch 64, 1000 iterations, plain SGD with weight decay 1e-5, a near-IID Dirichlet split
(alpha = 10), Metropolis-Hastings weights.  Graphs: the ring and an Erdos-Renyi graph (p = 0.3); the
paper's accountant is replaced by ours (its example-level path does not compose iterations), so the
budgets are ours: pairwise epsilon 1, 3 and 10 at delta = 1e-5 for the decentralized methods (for
DP-DSGD and Muffliato the ledger's epsilon, which bounds every observer), the same per-record epsilon
for central DP-SGD on the pooled data.  Learning rates: the authors' tuned values where they exist
(DECOR ring 1.0; LDP 1.0; CDP 5.0 at their clip 1), scaled to our update (the clipped *sum* over the
expected batch); three seeds per cell.  Central DP-SGD draws the agents' expected batches together (16 x 64 =
1024 records a round from the pooled data): the same records per round as the network, one model.  Zip-DL's
zero-sum noise has the quick start's sigma_z = 3; its budget is the local one (the zero-sum noise cancels for all
of an agent's neighbours together), and its pairwise epsilon is reported beside it.  MAFALDA-SGD (Bellet, Cyffers et
al.) needs cyclic batches (its factorization is made for them) and keeps its C to ``MAFALDA_BANDS`` diagonals so that
its noise history fits; its budget is the local one too.

DECOR's a9a setting (``reproduce_libsvm.py``): the same network and batch with logistic regression (the
``linear`` model over a9a's 123 binary features), on the ring only; the authors tuned the learning rate and clip
per topology and user-level epsilon over T = 5000, which our example-level budgets do not match, so we keep
their clip 1 and the MNIST grid's learning rate, untuned, for every method alike.

Tuning (issue 32: "fair tuning for every method"): each MNIST method on each graph gets the same grid of
learning rates (``LR_STUDIES``) at each budget of ``TUNING_EPSILONS`` (epsilon 1, where the noise limits the MLP,
0.25, then the grid's 3 and 10), over the full 1000 rounds on a 10 % validation split of the agents' training
records (never the test set), one seed (``tuning/*.toml``, ``decentdp sweep``).  The winners go into ``TUNED`` by
hand, from the studies' ``best.md``, and ``mnist-tuned/`` holds the configs they make. Every run is one line of a
job list for ``experiments/run_jobs.py`` (``jobs.tsv``: the grids, three seeds; ``tuning/jobs.tsv``: the studies, then
the tuned configs' three seeds, except where a winner is the grid's own rate at a grid budget: the grid's runs of
that cell, ``results/<cell>-s<seed>``, are then its tuned runs), skipped once its results exist::

    python experiments/correlated/generate.py
    A9A_DIR=/path/to/libsvm_data python experiments/run_jobs.py experiments/correlated/jobs.tsv --workers 2
    python experiments/run_jobs.py experiments/correlated/tuning/jobs.tsv --workers 2 --log-dir results/jobs-tuning
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import tomli_w

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # experiments/: the job runner's line format
from run_jobs import run_line  # noqa: E402

GRAPHS: dict[str, dict[str, Any]] = {"ring": {"graph": "ring"}, "er": {"graph": "erdos-renyi", "p": 0.3}}
EPSILONS = (1.0, 3.0, 10.0)
#: MAFALDA-SGD's C keeps 32 diagonals, so each agent holds 32 past noise rows (208 MB at N = 16 for the MLP) instead of
#: all 1000 (6.5 GB); on the MNIST ring (b = 50) the models' noise is then 0.073 of independent noise's, against 0.053
#: dense (benchmarks/factorization.py, docs/reproduction.md).
MAFALDA_BANDS = 32
METHODS: dict[str, dict[str, Any]] = {
    "dp-dsgd": {"name": "dp-dsgd", "lr": 0.5},
    "muffliato": {"name": "muffliato", "lr": 0.5},
    "decor": {"name": "decor", "lr": 0.5, "correlation": 3.0},
    "zip-dl": {"name": "zip-dl", "lr": 0.5, "zero_sum_noise": 3.0},
    "mafalda-sgd": {"name": "mafalda-sgd", "lr": 0.5, "bands": MAFALDA_BANDS},
    "central-dpsgd": {"name": "central-dpsgd", "lr": 1.0, "batch_size": 1024},
}
#: Methods without a weight-decay setting (1e-5 elsewhere, the authors' value; too small to matter at 1000 rounds).
NO_WEIGHT_DECAY = {"muffliato", "mafalda-sgd"}
#: A method's own data settings: MAFALDA-SGD's factorization is made for cyclic participation (each agent's records
#: split once into b = |D_min| // 64 fixed batches, batch t mod b in round t; no Poisson amplification).
METHOD_DATA: dict[str, dict[str, Any]] = {"mafalda-sgd": {"sampling": "cyclic"}}


#: dataset -> its model and the graphs it runs on.
DATASETS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "mnist": ({"name": "mlp", "options": {"hidden": 128}}, ("ring", "er")),
    "a9a": ({"name": "linear"}, ("ring",)),
}


def config(dataset: str, method: str, graph: str, epsilon: float, name: str) -> dict[str, Any]:
    """One experiment as a TOML-ready mapping."""
    return {
        "experiment": {"name": name, "seed": 0, "rounds": 1000, "eval_every": 100},
        "data": {"dataset": dataset, "partition": "dirichlet", "dirichlet_alpha": 10.0, **METHOD_DATA.get(method, {})},
        "topology": {"agents": 16, "mixing": "metropolis-hastings", **GRAPHS[graph]},
        "model": DATASETS[dataset][0],
        "algorithm": {"batch_size": 64, **({"weight_decay": 1e-5} if method not in NO_WEIGHT_DECAY else {}),
                      **METHODS[method]},
        "privacy": {"epsilon": epsilon, "delta": 1e-5, "clip": 1.0},
    }


def cells(dataset: str) -> list[tuple[str, str, float, str]]:
    """Every (method, graph, epsilon, name) of one dataset's grid; central DP-SGD has no graph."""
    return [(method, graph, epsilon, f"{method}-{dataset}-{graph}-eps{epsilon:g}" if method != "central-dpsgd"
             else f"{method}-{dataset}-eps{epsilon:g}")
            for method in METHODS for graph in (DATASETS[dataset][1] if method != "central-dpsgd" else ("ring",))
            for epsilon in EPSILONS]


SEEDS = (0, 1, 2)
#: Grids that ran (2026-11-26, three seeds, docs/reproduction.md) before runs were kept in ``results/`` here: their
#: job lines come last, so that a job list resumed here runs the missing cells first.
RAN_UNKEPT = {("mnist", method) for method in ("dp-dsgd", "muffliato", "decor", "central-dpsgd")}
HEADER = "# Generated by experiments/correlated/generate.py; edit the table there, not this file.\n"
#: The budgets tuned, each with its own studies: epsilon 1, the grid's lowest, and 0.25, a budget below the grid's
#: where the gap between local and central DP (3.3 points at epsilon 1) leaves room for the issue's 3-point goal;
#: then the grid's other budgets, 3 and 10, so that the tuned figure spans the grid's range.
TUNING_EPSILONS = (1.0, 0.25, 3.0, 10.0)
#: Each study's base is the method's grid config at this budget; other budgets set ``privacy.epsilon`` in the study.
STUDY_BASE_EPSILON = 1.0
#: Each method's studies at each budget, by the suffix of their names, and the learning rates each tries.  At
#: epsilon 1: first the grid's 0.5 (central DP-SGD: 1.0) with a factor of 2 either side and 4; then, where the best
#: lay at the bottom of that range (every decentralized method's did: 0.25), two lower values in a study of their own
#: (a sweep refuses a changed space, and the first study's trials stay as they are).  At epsilon 0.25, four times the
#: noise: the same four-point grid shifted one factor of 2 down, around epsilon 1's winners; again the best lay at
#: the bottom (DP-DSGD's and Muffliato's: 0.0625; central DP-SGD's: 0.25), and two lower values followed for every
#: method.  The winners' validation curves are steep (DP-DSGD, ER: 81.2 / 83.9 / 80.0 % at 0.031 / 0.0625 / 0.125), so a
#: factor-2 grid can miss a baseline's best by a point, and the goal's 3 points are a difference between methods:
#: a third pass puts the points halfway (a factor sqrt 2) between 0.03125 and 0.25 for the baselines the goal compares
#: against (DP-DSGD, Muffliato) and for DECOR, the best correlated method in both passes, and beside central DP-SGD's
#: best (the goal's other yardstick).  Zip-DL (2-3 points below DECOR in both, at 4 minutes a trial) keeps the
#: factor-2 grid, which can only understate it.  MAFALDA-SGD (added 2026-11-28, with its banded C) gets the first two
#: passes at both budgets, as Zip-DL; at epsilon 1 its best lay at the bottom again (0.0625: its cyclic batches are
#: not amplified, so its noise is larger), and two lower values followed.  At epsilon 3 and 10, a third and a tenth of
#: epsilon 1's noise: a factor-2 grid around the grid's 0.5 (epsilon 1's winners, 0.25-0.5, at its bottom, since less
#: noise allows longer steps), MAFALDA-SGD's shifted down as at epsilon 1 (its winner there: 0.0625); a winner at an
#: end of its grid gets the next value in a study of its own, as before.
#: Studies above a factor-2 grid whose best lay at its top, by (method, budget): DECOR's at epsilon 3 (1.0, on both
#: graphs; less of its noise reaches the average, so it takes longer steps, as at epsilon 0.25 and 1), and central
#: DP-SGD's at epsilon 3 (2.0); DP-DSGD's, Muffliato's, DECOR's and Zip-DL's at epsilon 10 (1.0, on both graphs;
#: DP-DSGD's, Muffliato's and Zip-DL's studies above found 1.0 again, DECOR's 2.0), MAFALDA-SGD's (0.5; above it, 1.0
#: won on ER only) and central DP-SGD's (2.0; above it, 4.0 won).
HIGHER: dict[tuple[str, float], dict[str, tuple[float, ...]]] = {("decor", 3.0): {"-high": (2.0, 4.0)},
                                                                  ("central-dpsgd", 3.0): {"-high": (4.0, 8.0)},
                                                                  **{(method, 10.0): {"-high": (2.0, 4.0)}
                                                                     for method in ("dp-dsgd", "muffliato", "decor",
                                                                                    "zip-dl")},
                                                                  ("mafalda-sgd", 10.0): {"-high": (1.0, 2.0)},
                                                                  ("central-dpsgd", 10.0): {"-high": (4.0, 8.0)}}
LR_STUDIES: dict[float, dict[str, dict[str, tuple[float, ...]]]] = {
    1.0: {"central-dpsgd": {"": (0.5, 1.0, 2.0, 4.0)},
          **{method: {"": (0.25, 0.5, 1.0, 2.0), "-low": (0.0625, 0.125),
                      **({"-lower": (0.015625, 0.03125)} if method == "mafalda-sgd" else {})}
             for method in ("dp-dsgd", "muffliato", "decor", "zip-dl", "mafalda-sgd")}},
    0.25: {"central-dpsgd": {"": (0.25, 0.5, 1.0, 2.0), "-low": (0.0625, 0.125), "-fine": (0.177, 0.354)},
           **{method: {"": (0.0625, 0.125, 0.25, 0.5), "-low": (0.015625, 0.03125),
                       **({"-fine": (0.0442, 0.0884, 0.177)} if method not in ("zip-dl", "mafalda-sgd") else {})}
              for method in ("dp-dsgd", "muffliato", "decor", "zip-dl", "mafalda-sgd")}},
    **{budget: {"central-dpsgd": {"": (0.5, 1.0, 2.0), **HIGHER.get(("central-dpsgd", budget), {})},
                "mafalda-sgd": {"": (0.0625, 0.125, 0.25, 0.5), **HIGHER.get(("mafalda-sgd", budget), {})},
                **{method: {"": (0.25, 0.5, 1.0), **HIGHER.get((method, budget), {})}
                   for method in ("dp-dsgd", "muffliato", "decor", "zip-dl")}}
       for budget in (3.0, 10.0)},
}
#: (method, graph, epsilon) -> the learning rate its studies chose (best validation accuracy), filled in as they
#: finish.
TUNED: dict[tuple[str, str, float], float] = {
    ("dp-dsgd", "ring", 1.0): 0.25, ("dp-dsgd", "er", 1.0): 0.25,
    ("muffliato", "ring", 1.0): 0.25, ("muffliato", "er", 1.0): 0.25,
    ("decor", "ring", 1.0): 0.25, ("decor", "er", 1.0): 0.5,
    ("zip-dl", "ring", 1.0): 0.25, ("zip-dl", "er", 1.0): 0.25,
    ("central-dpsgd", "ring", 1.0): 1.0,
    ("dp-dsgd", "ring", 0.25): 0.0625, ("dp-dsgd", "er", 0.25): 0.0625,
    ("muffliato", "ring", 0.25): 0.0625, ("muffliato", "er", 0.25): 0.0625,
    ("decor", "ring", 0.25): 0.0884, ("decor", "er", 0.25): 0.125,
    ("zip-dl", "ring", 0.25): 0.0625, ("zip-dl", "er", 0.25): 0.0625,
    ("central-dpsgd", "ring", 0.25): 0.25,
    ("mafalda-sgd", "ring", 1.0): 0.0625, ("mafalda-sgd", "er", 1.0): 0.0625,
    ("mafalda-sgd", "ring", 0.25): 0.03125, ("mafalda-sgd", "er", 0.25): 0.03125,
    ("dp-dsgd", "ring", 3.0): 0.5, ("dp-dsgd", "er", 3.0): 0.5,
    ("muffliato", "ring", 3.0): 0.5, ("muffliato", "er", 3.0): 0.5,
    ("decor", "ring", 3.0): 1.0, ("decor", "er", 3.0): 2.0,
    ("zip-dl", "ring", 3.0): 0.5, ("zip-dl", "er", 3.0): 0.5,
    ("mafalda-sgd", "ring", 3.0): 0.25, ("mafalda-sgd", "er", 3.0): 0.25,
    ("central-dpsgd", "ring", 3.0): 4.0,
    ("dp-dsgd", "ring", 10.0): 1.0, ("dp-dsgd", "er", 10.0): 1.0,
    ("muffliato", "ring", 10.0): 1.0, ("muffliato", "er", 10.0): 1.0,
    ("decor", "ring", 10.0): 2.0, ("decor", "er", 10.0): 2.0,
    ("zip-dl", "ring", 10.0): 1.0, ("zip-dl", "er", 10.0): 1.0,
    ("mafalda-sgd", "ring", 10.0): 0.5, ("mafalda-sgd", "er", 10.0): 1.0,
    ("central-dpsgd", "ring", 10.0): 4.0,
}
#: Tuned configs run again with one setting changed, to measure what a piece is worth, by (method, budget): the name's
#: suffix and the algorithm settings.  MAFALDA-SGD with C diagonal (independent noise at the same cyclic batches and
#: learning rate): what the optimised correlation adds at MNIST scale.
VARIANTS: dict[tuple[str, float], tuple[str, dict[str, Any]]] = {
    ("mafalda-sgd", 1.0): ("-independent", {"factorization": "independent"}),
}


def write_grids() -> list[str]:
    """The MNIST and a9a configs; returns their job lines (seed 0 of every cell first)."""
    data_dirs = {"mnist": "${DATA_DIR:-../shared/data}", "a9a": "${A9A_DIR:?set A9A_DIR to the folder holding a9a}"}
    lines = []
    for dataset in DATASETS:
        (HERE / dataset).mkdir(exist_ok=True)
        for method, graph, epsilon, name in cells(dataset):
            (HERE / dataset / f"{name}.toml").write_text(
                HEADER + tomli_w.dumps(config(dataset, method, graph, epsilon, name)))
    for rerun in (False, True):
        for seed in SEEDS:
            for dataset in DATASETS:
                lines += [run_line(name, f"experiments/correlated/{dataset}/{name}.toml", seed, data_dirs[dataset],
                                   f"experiments/correlated/results/{name}-s{seed}")
                          for method, *_, name in cells(dataset) if ((dataset, method) in RAN_UNKEPT) == rerun]
    return lines


#: Seeds beyond ``SEEDS`` for the tuned runs of one budget and graph (and central DP-SGD's at that budget), every
#: method alike.  At epsilon 0.25 on Erdos-Renyi, DECOR's lead over Muffliato was 2.90 +- 0.23 points over three seeds
#: against the goal's 3: two more seeds decide whether the miss is in the noise; their result is reported whichever way
#: it falls.
EXTRA_SEEDS: dict[float, tuple[str, tuple[int, ...]]] = {0.25: ("er", (3, 4))}


def write_tuning() -> list[str]:
    """The learning-rate studies and the tuned configs; returns their job lines (each budget's studies, then its
    tuned runs seed by seed, every cell's seed 0 first, the budgets in ``TUNING_EPSILONS``' order)."""
    folder, tuned_folder = HERE / "tuning", HERE / "mnist-tuned"
    folder.mkdir(exist_ok=True)
    lines = []
    for budget in TUNING_EPSILONS:
        studies: list[str] = []
        runs: list[tuple[int, str]] = []
        for method, graph, epsilon, base in cells("mnist"):
            if epsilon != STUDY_BASE_EPSILON:
                continue
            name = base.replace(f"eps{epsilon:g}", f"eps{budget:g}")
            fixed = {} if budget == epsilon else {"set": {"privacy.epsilon": budget, "experiment.name": name}}
            for suffix, rates in LR_STUDIES[budget][method].items():
                study = {"sweep": {"config": f"../mnist/{base}.toml", "method": "grid", "workers": 1, "seeds": [0],
                                   "objective": "accuracy_mean", "direction": "maximize", "validation_fraction": 0.1,
                                   **fixed},
                         "space": {"algorithm.lr": {"values": list(rates)}}}
                (folder / f"{name}{suffix}.toml").write_text(HEADER + tomli_w.dumps(study))
                studies.append(f"tune-{name}{suffix}\tdecentdp sweep experiments/correlated/tuning/{name}{suffix}.toml "
                               "--data-dir ${DATA_DIR:-../shared/data} "
                               f"--out results/correlated-tuning/{name}{suffix} --no-progress")
            if (method, graph, budget) in TUNED:
                tuned = config("mnist", method, graph, budget, f"{name}-tuned")
                tuned["algorithm"]["lr"] = TUNED[method, graph, budget]
                tuned_folder.mkdir(exist_ok=True)
                (tuned_folder / f"{name}.toml").write_text(HEADER + tomli_w.dumps(tuned))
                extra_graph, extra = EXTRA_SEEDS.get(budget, ("", ()))
                seeds = SEEDS + (extra if extra_graph == graph or method == "central-dpsgd" else ())
                if budget in EPSILONS and TUNED[method, graph, budget] == METHODS[method]["lr"]:
                    seeds = ()  # the grid's config but for its name: the grid's runs are this cell's tuned runs
                runs += [(seed, run_line(f"{name}-tuned", f"experiments/correlated/mnist-tuned/{name}.toml", seed,
                                         "${DATA_DIR:-../shared/data}",
                                         f"experiments/correlated/results/{name}-tuned-s{seed}"))
                         for seed in seeds]
                if (method, budget) in VARIANTS:
                    suffix, settings = VARIANTS[method, budget]
                    variant = f"{name}{suffix}"
                    tuned["experiment"]["name"] = f"{variant}-tuned"
                    tuned["algorithm"].update(settings)
                    (tuned_folder / f"{variant}.toml").write_text(HEADER + tomli_w.dumps(tuned))
                    runs += [(seed, run_line(f"{variant}-tuned", f"experiments/correlated/mnist-tuned/{variant}.toml",
                                             seed, "${DATA_DIR:-../shared/data}",
                                             f"experiments/correlated/results/{variant}-tuned-s{seed}"))
                             for seed in SEEDS]
        lines += studies + [line for _, line in sorted(runs, key=lambda run: run[0])]
    return lines


def main() -> None:
    usage = "# Generated by experiments/correlated/generate.py: python experiments/run_jobs.py {} --workers 2\n"
    (HERE / "jobs.tsv").write_text(usage.format("experiments/correlated/jobs.tsv (a9a needs A9A_DIR)")
                                   + "\n".join(write_grids()) + "\n")
    (HERE / "tuning" / "jobs.tsv").write_text(usage.format("experiments/correlated/tuning/jobs.tsv")
                                              + "\n".join(write_tuning()) + "\n")


if __name__ == "__main__":
    main()
