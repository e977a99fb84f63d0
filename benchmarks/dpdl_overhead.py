"""The cost of DPDL's private cross-gradients: one DPDL round against one DP-DSGD round.

DPDL (issue 13, target 6) evaluates on each agent's batch its own model and each neighbour's: on a
ring of N = 10 that is 3 models per batch, so its gradient work is 3x DP-DSGD's.  The target is a
round at most 3.5x a DP-DSGD round with the same model, data and expected batch: everything besides
the gradients (cosine calibration, the return of cross-gradients, two mixings) must be nearly free.

Setting: MNIST, Dirichlet(0.5) split over N = 10 agents on a ring (Metropolis-Hastings weights),
expected batch 64, clip C = 10, epsilon = 1 (delta = 1e-5) for 1000 planned rounds, LeNet-5 and the
MLP, DP-DSGD with plain SGD.  Medians of per-round seconds, the two methods timed interleaved,
round by round, in one process (``_common.time_interleaved``).

The same on the complete graph (``dpdl_over_dsgd_complete``): there every owner is sent N - 1 models that
Metropolis-Hastings mixing keeps bitwise equal to its own after the first round, which the oracle computes once
(``util.rows.repeated_rows``), so DPDL's gradient work is 2x DP-DSGD's (own model, one cross-gradient sum)
instead of N = 10x.

Run from the repository root::

    .venv/bin/python benchmarks/dpdl_overhead.py --json     # 10 timed rounds per method
    .venv/bin/python benchmarks/dpdl_overhead.py --quick    # 8 timed rounds, same keys (--smoke: 1)
"""

from __future__ import annotations

import json
import os
from typing import Any

from _common import (
    EPSILON,
    QUICK_MIN_ROUNDS,
    EngineRunner,
    ExperimentFactory,
    experiment_config,
    interleaved_stats,
    print_table,
    start_interleaved,
)

AGENTS, BATCH = 10, 64
MODELS = ("lenet5", "mlp")
GRAPHS = ("ring", "complete")


def config(model: str, algorithm: str, graph: str) -> dict[str, Any]:
    raw = experiment_config(model, AGENTS, BATCH, EPSILON, graph=graph, partition="dirichlet", image_size=None)
    raw["data"]["dirichlet_alpha"] = 0.5
    raw["algorithm"] = {"name": algorithm, "lr": 0.01, "batch_size": BATCH}
    return raw


def measure(model: str, graph: str, factory: ExperimentFactory, warmup: int, rounds: int) -> dict[str, Any]:
    dsgd = factory.build(config(model, "dp-dsgd", graph))
    dpdl = factory.build(config(model, "dpdl", graph))
    runners = {"dp_dsgd": EngineRunner(dsgd).round, "dpdl": EngineRunner(dpdl).round}
    stats = interleaved_stats(runners, warmup, rounds)
    return {"parameters": dpdl.model.dim, "gradient_engine": dpdl.model.backend, "round_seconds": stats,
            "sigma_dpdl": [float(dpdl.noise_multipliers.min()), float(dpdl.noise_multipliers.max())],
            "sigma_dp_dsgd": [float(dsgd.noise_multipliers.min()), float(dsgd.noise_multipliers.max())],
            "dpdl_over_dsgd": stats["dpdl"]["median"] / stats["dp_dsgd"]["median"]}


def main(argv: list[str] | None = None) -> None:
    args, machine = start_interleaved(__doc__.split("\n", 1)[0], argv, rounds=10, warmup=2, quick=(QUICK_MIN_ROUNDS, 1))
    print(f"DPDL vs DP-DSGD, MNIST Dirichlet(0.5), N = {AGENTS}, expected batch {BATCH}; {args.rounds} timed "
          f"rounds after {args.warmup} warm-up, interleaved; load average before: {os.getloadavg()[0]:.2f}")
    factory = ExperimentFactory(args.data_dir)
    results, figures = {}, {}
    for graph in GRAPHS:
        for model in MODELS:
            key = model if graph == "ring" else f"{model}_{graph}"
            results[key] = result = measure(model, graph, factory, args.warmup, args.rounds)
            figures["dpdl_over_dsgd" + ("" if graph == "ring" else f"_{graph}") + ("" if model == "lenet5"
                                                                                 else f"_{model}")] = \
                result["dpdl_over_dsgd"]
            print(f"{model} on the {graph} graph ({result['parameters']} parameters, {result['gradient_engine']} "
                  "engine)")
            print_table(result["round_seconds"])
            print(f"  dpdl / dp_dsgd: {result['dpdl_over_dsgd']:.2f}x"
                  + (" (target <= 3.5x)" if graph == "ring" else ""))
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}; data: {'synthetic' if factory.synthetic else 'MNIST'}")
    if args.json:
        print(json.dumps({**figures, "settings": results,
                          "timed_rounds": args.rounds, "warmup_rounds": args.warmup,
                          "synthetic_data": factory.synthetic, "load_average_after": load_after, **machine},
                         sort_keys=True))


if __name__ == "__main__":
    main()
