"""What DECOR's correlated noise costs per round: a DECOR round against a DP-DSGD round.

The same run twice (MNIST, LeNet-5, N = 16 agents on a ring and on an Erdos-Renyi graph of p = 0.3,
expected batch 64, pairwise epsilon 1 for DECOR and epsilon 1 for DP-DSGD, both calibrated for 1000
rounds), timed interleaved, round by round, in one process, so that background load hits both alike.
DECOR draws one extra Gaussian vector per edge (keyed by the edge) and adds it to both ends' releases;
the ratio ``decor / dp-dsgd`` of median round times is the issue's figure (goal: at most 1.3).

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/correlated_round.py [--quick] [--json]
"""

from __future__ import annotations

import json

import torch

from _common import (
    DEFAULT_DATA_DIR,
    EngineRunner,
    ExperimentFactory,
    interleaved_stats,
    print_table,
    start_interleaved,
)

GRAPHS = {"ring": {"graph": "ring"}, "erdos-renyi": {"graph": "erdos-renyi", "p": 0.3}}


def config(algorithm: str, topology: dict[str, object]) -> dict[str, object]:
    """The benchmarked run for ``algorithm`` on ``topology``."""
    return {"experiment": {"name": "benchmark", "rounds": 1000, "seed": 0},
            "data": {"dataset": "mnist", "partition": "iid"},
            "topology": {"agents": 16, **topology},
            "model": {"name": "lenet5"},
            "algorithm": {"name": algorithm, "lr": 0.05, "batch_size": 64},
            "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": 1.0}}


def main(argv: list[str] | None = None) -> None:
    args, machine = start_interleaved(__doc__.split("\n", 1)[0], argv, rounds=20, warmup=3, quick=(6, 1),
                                      retain_memory=False)
    factory = ExperimentFactory(args.data_dir or DEFAULT_DATA_DIR)
    results: dict[str, object] = {"machine": machine, "threads": torch.get_num_threads()}
    for name, topology in GRAPHS.items():
        runners = {algorithm: EngineRunner(factory.build(config(algorithm, topology)))
                   for algorithm in ("dp-dsgd", "decor")}
        stats = interleaved_stats({key: runner.round for key, runner in runners.items()}, args.warmup, args.rounds)
        ratio = stats["decor"]["median"] / stats["dp-dsgd"]["median"]
        print(f"{name}: decor / dp-dsgd = {ratio:.3f}")
        print_table(stats)
        results[name] = {"stats": stats, "ratio": ratio}
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
