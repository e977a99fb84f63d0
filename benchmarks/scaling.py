"""How a private round scales with the number of agents, in time and in memory.

Setting (issue 3, target 3): DP-DSGD with the MLP of one hidden layer of 100 (79,510 parameters)
on MNIST, IID split, expected Poisson batch B = 32 per agent, epsilon = 1, delta = 1e-5, C = 10,
on a ring and on an Erdos-Renyi graph (p = min(1, 2 ln N / N), twice the connectivity threshold,
so the graph stays connected and sparse), sparse mixing, N from 10 to 1000 agents.

Each (graph, N) runs in a fresh process, so that its peak memory is its own.  The child builds the
experiment, hands its freed memory back to the system (``malloc_trim``), records its resident set
as the baseline, resets the kernel's peak counter (``/proc/self/clear_refs``), then allocates the
algorithm state and times rounds.  Reported per point:

* seconds per round (median);
* measured peak: the resident-set high-water mark minus the baseline;
* the *need*: parameters and optimizer state (the algorithm's state), the clipped-gradient sums
  (one ``(N, d)`` matrix) and one batch of activations (every agent's padded batch of inputs
  plus what the engine keeps per sample, measured with autograd's saved-tensor hooks);
* the engine's own estimate of its peak (:mod:`decentdp.gradients.memory`).

Summary figures: ``time_exponent``, the slope of log(seconds per round) against log(N * B)
fitted over all N (the largest over the graphs); ``peak_memory_ratio``, the largest
measured-peak / need over all points.

Run from the repository root::

    .venv/bin/python benchmarks/scaling.py --json     # N = 10, 32, 100, 316, 1000 on both graphs
    .venv/bin/python benchmarks/scaling.py --quick    # N = 10 and 1000 only, 5 timed rounds (about a minute)
    .venv/bin/python benchmarks/scaling.py --smoke    # the same with 1 round: the interface only
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _common import (
    DEFAULT_DATA_DIR,
    EPSILON,
    QUICK_MIN_ROUNDS,
    SMOKE_HELP,
    EngineRunner,
    ExperimentFactory,
    experiment_config,
    machine_info,
    print_machine,
)
from decentdp.gradients.memory import state_bytes
from decentdp.util.allocator import retain_freed_memory

BATCH = 32
FULL_AGENTS = (10, 32, 100, 316, 1000)
QUICK_AGENTS = (10, 1000)
GRAPHS = ("ring", "erdos-renyi")
ER_DEGREE_FACTOR = 2.0  # p = 2 ln N / N: twice the connectivity threshold, mean degree about 14 at N = 1000


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(graph: str, agents: int, warmup: int, rounds: int, data_dir: Path, smoke: bool = False) -> dict[str, Any]:
    """Measure one (graph, N) point in this process (``smoke``: the noise calibrated by RDP alone, which is quicker;
    a smoke run's figures are never read)."""
    raw = experiment_config("mlp", agents, BATCH, EPSILON, graph, "iid", None)
    if smoke:
        raw["privacy"]["accountant"] = "rdp"
    if graph == "erdos-renyi":
        raw["topology"]["p"] = min(1.0, ER_DEGREE_FACTOR * math.log(agents) / agents)
    factory = ExperimentFactory(data_dir)
    experiment = factory.build(raw)
    sample = experiment.data.x[0]
    per_sample = experiment.model.activation_bytes_per_sample(sample, experiment.data.y[0])
    input_bytes = sample.numel() * sample.element_size()
    # One round on a throwaway state first: code pages and one-off buffers of the kernels it uses
    # then belong to the baseline, not to the run's peak.
    throwaway = EngineRunner(experiment)
    throwaway.round()
    experiment.oracle.drop_spare()  # the block kept for the next round's sums belongs to the measured run
    gc.collect()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc_trim(0)
    baseline = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    retain_freed_memory()  # as `decentdp run` does, after the baseline so no freed build memory is reused

    runner = EngineRunner(experiment, first_round=throwaway.round_index)
    state = state_bytes(runner.state)
    widths, seconds = [], []
    for index in range(warmup + rounds):
        start = time.perf_counter()
        runner.round()
        if index >= warmup:
            seconds.append(time.perf_counter() - start)
        widths.append(experiment.oracle.last_batch_sizes.max().item())
    peak = _status_kib("VmHWM") * 1024 - baseline
    dim = experiment.model.dim
    width = max(widths)
    need = state + agents * dim * 4 + agents * width * (per_sample + input_bytes)
    return {
        "graph": graph, "agents": agents, "edges": experiment.topology.report.n_edges,
        "round_seconds": statistics.median(seconds), "round_seconds_all": seconds,
        "peak_bytes": peak, "need_bytes": need, "peak_over_need": peak / need,
        "need_parts": {"state": state, "clipped_sums": agents * dim * 4,
                       "activations": agents * width * (per_sample + input_bytes)},
        "max_batch_width": width, "estimated_peak_bytes": experiment.setup["memory_plan"]["peak_bytes"],
        "agents_per_pass": experiment.setup["memory_plan"]["agents_per_pass"], "parameters": dim,
        "synthetic_data": factory.synthetic,
    }


def fitted_exponent(points: list[dict[str, Any]]) -> float:
    """Least-squares slope of log(seconds per round) on log(N * B)."""
    x = np.log([p["agents"] * BATCH for p in points])
    y = np.log([p["round_seconds"] for p in points])
    return float(np.polyfit(x, y, 1)[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="folder holding mnist.npz (default: ../shared/data); synthetic data if missing")
    parser.add_argument("--agents", type=int, nargs="+", help=f"values of N (default {FULL_AGENTS})")
    parser.add_argument("--graphs", nargs="+", choices=GRAPHS, default=list(GRAPHS))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per point (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help=f"N in {QUICK_AGENTS}, 1 warm-up and {QUICK_MIN_ROUNDS} timed rounds")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--json", action="store_true", help="end with one line of JSON holding every figure")
    parser.add_argument("--child", nargs=2, metavar=("GRAPH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick or args.smoke:
        args.rounds, args.warmup = (1, 0) if args.smoke else (QUICK_MIN_ROUNDS, 1)
        args.agents = args.agents or list(QUICK_AGENTS)
    args.agents = args.agents or list(FULL_AGENTS)
    if min(args.agents) < 2 or args.rounds < 1 or args.warmup < 0:
        parser.error("--agents must be at least 2, --rounds positive and --warmup non-negative")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.warmup, args.rounds, args.data_dir,
                               args.smoke)))
        return
    machine = machine_info()
    print_machine(machine)
    print(f"DP-DSGD, MLP (hidden 100) on MNIST, IID, expected batch {BATCH} per agent, epsilon {EPSILON}; "
          f"{args.rounds} timed rounds after {args.warmup} warm-up per point, each point in a fresh process; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'graph':<12}{'N':>6}{'edges':>7}{'s/round':>10}{'peak MiB':>10}{'need MiB':>10}{'peak/need':>10}"
          f"{'estimate MiB':>14}")
    points: list[dict[str, Any]] = []
    for graph in args.graphs:
        for agents in args.agents:
            command = [sys.executable, __file__, "--child", graph, str(agents), "--rounds", str(args.rounds),
                       "--warmup", str(args.warmup), "--data-dir", str(args.data_dir), *(["--smoke"] * args.smoke)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            point = json.loads(output.strip().splitlines()[-1])
            points.append(point)
            mib = 2**20
            print(f"{graph:<12}{agents:>6}{point['edges']:>7}{point['round_seconds']:>10.4f}"
                  f"{point['peak_bytes'] / mib:>10.1f}{point['need_bytes'] / mib:>10.1f}"
                  f"{point['peak_over_need']:>10.2f}{point['estimated_peak_bytes'] / mib:>14.1f}", flush=True)
    exponents = {graph: fitted_exponent([p for p in points if p["graph"] == graph]) for graph in args.graphs}
    ratio = max(p["peak_over_need"] for p in points)
    for graph, exponent in exponents.items():
        print(f"time exponent ({graph}): {exponent:.3f} (seconds per round ~ (N B)^exponent)")
    print(f"peak memory / need: at most {ratio:.2f}; load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"time_exponent": max(exponents.values()), "time_exponents": exponents,
                          "peak_memory_ratio": ratio, "points": points, "batch": BATCH,
                          "timed_rounds": args.rounds, "warmup_rounds": args.warmup, "smoke": args.smoke,
                          **machine}, sort_keys=True))


if __name__ == "__main__":
    main()
