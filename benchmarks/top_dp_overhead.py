"""The cost of TOP-DP's per-receiver messages: a TOP-DP round against a DP-DSGD round (issue 12, item 5).

TOP-DP (Guo et al., Algorithm 1) releases, per round, one noisy copy of each agent's clipped gradient
sum for its local estimate plus one per cover group (the receivers one neighbour covers share one
message with its own residual noise), mixes those rows in place, and delivers each out-edge its
row (in one process by index: no ``(E, d)`` message tensor).  The target is a synchronous TOP-DP
round at most 1.5x a DP-DSGD round with the same model, data, graph and expected batch, and an
asynchronous round (Algorithm 2, pairing) with 30 % of agents offline within the same bound.

After the timed rounds, as many more rounds per method run with the oracle's phase timer, which
splits a round into sampling, gradients, noise and ledger (the rest is the algorithm's own work:
cover, mixing, delivery); and the *floor* is printed: a DP-DSGD round plus the extra Gaussian rows
TOP-DP must draw (its local estimates and every cover group need independent noise), at the
measured cost of one row, over a DP-DSGD round.  No implementation of Algorithm 1 that draws
its noise from the run's keyed streams can be faster than that floor.

Setting (the paper's Section VII): MNIST, i.i.d. split over N = 30 agents on an Erdos-Renyi graph with
connection rate 0.2, the MLP with one hidden layer of 100, expected batch 64, clip 4, epsilon 1
(delta = 1e-5) for 2000 planned rounds, alpha = 0.5, gamma = 0.9 every 1000 rounds; DP-DSGD with plain
SGD and Metropolis-Hastings weights.  Medians of per-round seconds, the three methods timed interleaved,
round by round, in one process (``_common.time_interleaved``).  Each round includes the ledger's
charges (the per-receiver budget checks of TOP-DP's ledger), as the simulator runs it.

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/top_dp_overhead.py --json    # 20 timed rounds per method
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/top_dp_overhead.py --quick   # 8 timed rounds, same keys (--smoke: 1)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from _common import (
    QUICK_MIN_ROUNDS,
    EngineRunner,
    ExperimentFactory,
    interleaved_stats,
    print_table,
    start_interleaved,
)
from decentdp.algorithms.components.topology_noise import CoverPlanner, cover_groups
from decentdp.rng import Stream
from decentdp.util.profiling import PhaseTimer

AGENTS, BATCH, CLIP, ROUNDS = 30, 64, 4.0, 2000
OFFLINE = 0.3
TARGET = 1.5


def config(algorithm: str, schedule: str = "synchronous", offline: float = 0.0) -> dict[str, Any]:
    """The benchmarked setting for ``algorithm`` (TOP-DP's Section VII, at a horizon of 2000 rounds)."""
    algo: dict[str, Any] = {"name": algorithm, "lr": 0.05, "batch_size": BATCH}
    if algorithm.startswith("top-dp"):
        algo.update(alpha=0.5, decay_gamma=0.9, decay_period=1000)
    else:
        algo["optimizer"] = "sgd"
    raw: dict[str, Any] = {
        "experiment": {"name": "benchmark", "rounds": ROUNDS, "seed": 0},
        "data": {"dataset": "mnist", "partition": "iid"},
        "topology": {"graph": "erdos-renyi", "agents": AGENTS, "p": 0.2},
        "model": {"name": "mlp", "options": {"hidden": 100}},
        "algorithm": algo,
        "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": CLIP},
    }
    if algorithm.startswith("top-dp"):
        raw["schedule"] = {"kind": schedule, "offline_probability": offline}
    return raw


def noise_rows(experiment: Any) -> dict[str, Any]:
    """Rows of Gaussian noise a synchronous TOP-DP round draws (N local estimates + one per cover group)
    against DP-DSGD's N, and the seconds of one row's draw (the run's keyed per-row generator)."""
    network = experiment.simulator.graphs.at(0)
    n = network.n_agents
    sigma = experiment.noise_multipliers.double().numpy()
    batch = experiment.oracle.expected_batch.double().numpy()
    cover = CoverPlanner(network).plan(0.5, sigma, batch, torch.Generator().manual_seed(0))
    groups = len(cover_groups(cover.via).via)
    rng, dim = experiment.simulator.rng, experiment.model.dim
    seconds = []
    for repeat in range(5):
        start = time.perf_counter()
        rng.normal(list(range(n)), dim, 10_000 + repeat, Stream.NOISE)
        seconds.append((time.perf_counter() - start) / n)
    return {"top_dp_rows": n + groups, "dp_dsgd_rows": n, "covered_edges": int((cover.via >= 0).sum()),
            "row_seconds": sorted(seconds)[2]}


def phase_split(experiments: dict[str, Any], runners: dict[str, Any], rounds: int) -> dict[str, dict[str, float]]:
    """``rounds`` more interleaved rounds per method, split into the oracle's phases (mean seconds per round;
    ``other``: the algorithm's own work outside the oracle)."""
    timers = {}
    for name, experiment in experiments.items():
        timers[name] = experiment.oracle.timer = PhaseTimer()
    total = dict.fromkeys(experiments, 0.0)
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            total[name] += time.perf_counter() - start
    split = {}
    for name, timer in timers.items():
        phases = {phase: seconds / rounds for phase, seconds in timer.seconds.items()}
        split[name] = {**phases, "other": total[name] / rounds - sum(phases.values()), "round": total[name] / rounds}
    return split


class SetupRunner(EngineRunner):
    """An :class:`EngineRunner` that first runs the algorithm's setup phase (TOP-DP's lines 4-6)."""

    def __init__(self, experiment: Any) -> None:
        super().__init__(experiment)
        self.state = experiment.simulator.setup(self.state)


def main(argv: list[str] | None = None) -> None:
    args, machine = start_interleaved(__doc__.split("\n", 1)[0], argv, rounds=20, warmup=3, quick=(QUICK_MIN_ROUNDS, 1))
    print(f"TOP-DP vs DP-DSGD, MNIST iid, N = {AGENTS} Erdos-Renyi(0.2), MLP(100), expected batch {BATCH}; "
          f"{args.rounds} timed rounds after {args.warmup} warm-up, interleaved; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    factory = ExperimentFactory(args.data_dir)
    experiments = {
        "dp_dsgd": factory.build(config("dp-dsgd")),
        "top_dp": factory.build(config("top-dp")),
        "top_dp_async_offline": factory.build(config("top-dp-async", "pairing", OFFLINE)),
    }
    runners = {name: SetupRunner(experiment).round for name, experiment in experiments.items()}
    stats = interleaved_stats(runners, args.warmup, args.rounds)
    base = stats["dp_dsgd"]["median"]
    ratios = {"top_dp_over_dsgd": stats["top_dp"]["median"] / base,
              "top_dp_async_offline_over_dsgd": stats["top_dp_async_offline"]["median"] / base}
    top = experiments["top_dp"]
    print(f"mlp ({top.model.dim} parameters, {top.model.backend} engine), {len(top.topology.edges())} edges")
    print_table(stats)
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.2f}x (target <= {TARGET}x)")
    rows = noise_rows(top)
    extra = (rows["top_dp_rows"] - rows["dp_dsgd_rows"]) * rows["row_seconds"]
    floor = (base + extra) / base
    print(f"  noise rows per round: TOP-DP {rows['top_dp_rows']} ({rows['covered_edges']} covered edges in "
          f"{rows['top_dp_rows'] - AGENTS} groups), DP-DSGD {rows['dp_dsgd_rows']}; one row "
          f"{rows['row_seconds'] * 1e3:.2f} ms, so the extra draws alone cost {extra:.3f} s "
          f"({extra / base:.2f}x a DP-DSGD round): floor {floor:.2f}x")
    split = phase_split({name: experiments[name] for name in ("dp_dsgd", "top_dp")},
                        {name: runners[name] for name in ("dp_dsgd", "top_dp")}, args.rounds)
    for name, phases in split.items():
        print(f"  {name} per round (ms): " + ", ".join(f"{phase} {seconds * 1e3:.1f}" for phase, seconds in
                                                      phases.items()))
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}; data: {'synthetic' if factory.synthetic else 'MNIST'}")
    if args.json:
        print(json.dumps({**ratios, "round_seconds": stats, "noise": rows, "floor_over_dsgd": floor,
                          "phase_seconds": split, "parameters": top.model.dim,
                          "edges": len(top.topology.edges()), "offline_probability": OFFLINE,
                          "timed_rounds": args.rounds, "warmup_rounds": args.warmup,
                          "synthetic_data": factory.synthetic, "load_average_after": load_after, **machine},
                         sort_keys=True))


if __name__ == "__main__":
    main()
