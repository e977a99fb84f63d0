"""Time and bytes per round of the Ray backend (1, 2, 4 workers) against the simulator, in one run.

Settings (issue 16, item 6), DP-DSGD on MNIST, IID split, expected batch 32, epsilon = 1:

* the paper's MNIST ConvNet (model ``convnet``), N = 10 agents on a ring;
* the MLP of one hidden layer of 100 (79,510 parameters), N = 1000 agents on a ring and on an
  Erdos-Renyi graph with p = 2 ln N / N (as ``benchmarks/scaling.py``).

For each setting the experiment is built once; the simulator and then each worker count run
``--rounds`` timed rounds after one warm-up round from the same state.  Time per round is the
median of the timed rounds, measured at the driver (what a user waits for: every worker's round,
halo exchange included); worker start-up (processes, unpickling the run) is reported apart.  Bytes
per round are what the workers sent each other (payload tensors; Ray's framing is not counted),
divided by the rounds run.  Ray runs locally, bound to 127.0.0.1 (``runtime/distributed/ray_backend.py``).

Run from the repository root::

    .venv/bin/python benchmarks/distributed.py --json            # all settings, 1/2/4 workers
    .venv/bin/python benchmarks/distributed.py --quick           # ConvNet N = 10 and MLP ring only, 1/2 workers
"""

from __future__ import annotations

import decentdp  # noqa: F401  (before torch: idle OpenMP threads sleep, as in every decentdp process)

# isort: split
import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from _common import DEFAULT_DATA_DIR, EPSILON, experiment_config, machine_info, print_machine
from decentdp.config import validate_config
from decentdp.experiment.build import build_experiment
from decentdp.runtime.distributed.ray_backend import RaySimulator, connect
from decentdp.runtime.distributed.sharded import shard_bounds
from decentdp.util.threads import apply_threads

BATCH = 32
SETTINGS = {
    "convnet-ring-10": ("convnet", 10, "ring"),
    "mlp-ring-1000": ("mlp", 1000, "ring"),
    "mlp-er-1000": ("mlp", 1000, "erdos-renyi"),
}


def build(model: str, agents: int, graph: str, data_dir: str) -> Any:
    raw = experiment_config(model, agents, BATCH, EPSILON, graph, "iid", None)
    if model == "mlp":
        raw["model"]["options"] = {"hidden": 100}
    if graph == "erdos-renyi":
        raw["topology"]["p"] = min(1.0, 2 * math.log(agents) / agents)
    raw["privacy"]["accountant"] = "rdp"
    return build_experiment(validate_config(raw), data_dir)


def ray_engine(experiment: Any, ray: Any, workers: int) -> RaySimulator:
    """``experiment``'s run on ``workers`` workers of the Ray instance ``ray`` (which the engine leaves running)."""
    engine = experiment.config.engine.model_copy(update={"workers": workers})
    return RaySimulator(experiment.simulator, engine, experiment.config.experiment.checkpoint_interval, ray, False)


def time_rounds(engine: Any, state: dict[str, torch.Tensor], rounds: int,
                at_end: Callable[[], int] | None = None) -> tuple[float, Any, int | None]:
    """Median seconds of ``rounds`` rounds after one warm-up round, the final state, and ``at_end()``
    read after the last round (before a Ray engine stops its workers)."""
    stamps, read = [time.perf_counter()], []

    def after_round(done: int, current: Any) -> bool:
        stamps.append(time.perf_counter())
        if done == rounds + 1 and at_end is not None:
            read.append(at_end())
        return True

    final = engine.run({key: value.clone() for key, value in state.items()}, 0, rounds + 1, after_round)
    seconds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return statistics.median(seconds[1:]), final, read[0] if read else None


def measure(name: str, workers_list: list[int], rounds: int, data_dir: str, ray: Any) -> dict[str, Any]:
    model, agents, graph = SETTINGS[name]
    experiment = build(model, agents, graph, data_dir)
    initial = experiment.initial_state()
    simulator, expected, _ = time_rounds(experiment.simulator, initial, rounds)
    row: dict[str, Any] = {"setting": name, "model": model, "agents": agents, "graph": graph,
                           "parameters": experiment.model.dim, "edges": experiment.topology.report.n_edges,
                           "simulator_s_per_round": simulator, "full_matrix_bytes": agents * experiment.model.dim * 4,
                           "ray": []}
    del experiment  # one run's data in memory at a time (each worker holds its agents' records)
    for workers in workers_list:
        start = time.perf_counter()
        engine = ray_engine(build(model, agents, graph, data_dir), ray, workers)
        startup = time.perf_counter() - start
        seconds, final, sent = time_rounds(engine, initial, rounds, engine.bytes_sent)
        bounds = shard_bounds(agents, workers)
        row["ray"].append({
            "workers": workers, "shard_sizes": [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)],
            "s_per_round": seconds, "over_simulator": seconds / simulator, "bytes_per_round": sent / (rounds + 1),
            "startup_s": startup, "max_abs_difference": float((final["params"] - expected["params"]).abs().max()),
        })
        print(json.dumps({"setting": name, **row["ray"][-1]}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="ConvNet N = 10 and MLP ring N = 1000, 1 and 2 workers")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object at the end")
    args = parser.parse_args()
    threads = apply_threads(None)
    machine = machine_info()
    print_machine(machine)
    settings = ["convnet-ring-10", "mlp-ring-1000"] if args.quick else list(SETTINGS)
    workers = [1, 2] if args.quick else [1, 2, 4]
    ray, owned = connect("", max(workers))
    try:
        rows = [measure(name, workers, args.rounds, args.data_dir, ray) for name in settings]
    finally:
        if owned:
            ray.shutdown()
    for row in rows:
        print(f"{row['setting']}: simulator {row['simulator_s_per_round']:.3f} s/round; " + "; ".join(
            f"{r['workers']} worker(s) {r['s_per_round']:.3f} s ({r['over_simulator']:.2f}x), "
            f"{r['bytes_per_round'] / 2**20:.2f} MiB/round" for r in row["ray"]))
    if args.json:
        print(json.dumps({"machine": machine, "threads": threads.threads, "rounds": args.rounds,
                          "results": rows}))


if __name__ == "__main__":
    main()
