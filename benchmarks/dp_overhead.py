"""The price of privacy per round, and decentdp's speed-up over the reference per-agent Opacus loop.

Every figure is a median of per-round seconds of DP-DSGD (epsilon = 1, delta = 1e-5, clip C = 10,
noise calibrated for 1000 rounds) on MNIST, with the methods of one setting timed interleaved,
round by round, in the same process, so that background load hits them alike.

Target 1, DP overhead (``dp / nonprivate``): one private round against one non-private round
(epsilon = inf: same sampling and mixing, ordinary backward, no clipping or noise) through the
same engine, N = 10 agents on a complete graph with one class per agent (overlap t = 1), expected
batch 256, for the consensus paper's ConvNet (MNIST at 32x32), LeNet-5 and the MLP (one hidden
layer of 100).

Target 2, versus the reference approach (``opacus_loop / dp``): the reference loop of
``_common.OpacusLoopRunner`` (one ``GradSampleModule`` per agent, same model, batch, data, rates
and sigma) against decentdp's private round, for the ConvNet at N = 10 (setting above), the MLP
at N = 100 (ring, IID split, the paper's expected batch 256) and multinomial logistic regression (model
``linear``, 7,850 parameters) at N = 1000 (ring, IID split: 60 records per agent, expected
batch 16).

Run from the repository root::

    .venv/bin/python benchmarks/dp_overhead.py --json     # full measurement
    .venv/bin/python benchmarks/dp_overhead.py --quick    # the same keys: medians of 3 processes of 8 rounds each
    .venv/bin/python benchmarks/dp_overhead.py --smoke    # 1 round, 4 agents, RDP: the interface only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _common import (
    CLIP,
    DEFAULT_DATA_DIR,
    DELTA,
    EPSILON,
    QUICK_MIN_ROUNDS,
    SMOKE_HELP,
    EngineRunner,
    ExperimentFactory,
    OpacusLoopRunner,
    experiment_config,
    machine_info,
    paired_ratio,
    print_machine,
    print_table,
    summarize,
    time_interleaved,
)
from decentdp.util.allocator import retain_freed_memory

#: Fresh processes a ``--quick`` measurement takes the median over.
QUICK_PROCESSES = 3
#: Agents of every setting under ``--smoke``: the reference loop's first round at N = 100 and 1000 alone took 60 s of
#: the test suite's time, and a smoke run's figures are never read.
SMOKE_AGENTS = 4
#: The summary's figures (the keys later checks read), and where they were measured.
RATIO_PREFIXES = ("dp_over_nonprivate", "speedup_vs_opacus_loop")
MACHINE_KEYS = ("platform", "python", "cpu_model", "cpu_cores", "torch_version", "torch_threads", "opacus_version")


@dataclass(frozen=True)
class Setting:
    """One benchmarked configuration and which comparisons it takes part in."""

    key: str
    model: str
    agents: int
    batch: int
    graph: str
    partition: str
    image_size: int | None
    nonprivate: bool  # target 1: time a non-private round too
    opacus: bool      # target 2: time the reference loop too


SETTINGS = (
    Setting("convnet_n10", "convnet", 10, 256, "complete", "overlap", 32, nonprivate=True, opacus=True),
    Setting("lenet5_n10", "lenet5", 10, 256, "complete", "overlap", None, nonprivate=True, opacus=False),
    Setting("mlp_n10", "mlp", 10, 256, "complete", "overlap", None, nonprivate=True, opacus=False),
    Setting("mlp_n100", "mlp", 100, 256, "ring", "iid", None, nonprivate=False, opacus=True),
    Setting("logistic_n1000", "linear", 1000, 16, "ring", "iid", None, nonprivate=False, opacus=True),
)


def measure(setting: Setting, factory: ExperimentFactory, warmup: int, rounds: int,
            accountant: str = "tight") -> dict[str, Any]:
    """Median round seconds of each method of ``setting`` and the ratios between them (``accountant`` calibrates
    the noise: the ledger's default, or RDP alone under ``--smoke``, where only the interface counts)."""
    def build(epsilon: float) -> Any:
        raw = experiment_config(setting.model, setting.agents, setting.batch, epsilon, setting.graph,
                                setting.partition, setting.image_size)
        raw["privacy"]["accountant"] = accountant
        return factory.build(raw)

    private = build(EPSILON)
    runners = {"dp": EngineRunner(private).round}
    if setting.nonprivate:
        runners["nonprivate"] = EngineRunner(build(float("inf"))).round
    if setting.opacus:
        runners["opacus_loop"] = OpacusLoopRunner(private).round
    times = time_interleaved(runners, warmup, rounds)
    stats = {name: summarize(seconds) for name, seconds in times.items()}
    result: dict[str, Any] = {
        "setting": setting.__dict__, "parameters": private.model.dim, "gradient_engine": private.model.backend,
        "sigma_range": [float(private.noise_multipliers.min()), float(private.noise_multipliers.max())],
        "round_seconds": stats,
    }
    if setting.nonprivate:
        result["dp_over_nonprivate_spread"] = paired_ratio(times["dp"], times["nonprivate"])
        result["dp_over_nonprivate"] = result["dp_over_nonprivate_spread"]["ratio"]
    if setting.opacus:
        result["speedup_vs_opacus_loop_spread"] = paired_ratio(times["opacus_loop"], times["dp"])
        result["speedup_vs_opacus_loop"] = result["speedup_vs_opacus_loop_spread"]["ratio"]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="folder holding mnist.npz (default: ../shared/data from the repo root); "
                             "synthetic data of MNIST's size is used if it is missing")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per method (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per method first (default 3)")
    parser.add_argument("--only", choices=[s.key for s in SETTINGS], action="append",
                        help="measure only this setting (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help=f"1 warm-up and {QUICK_MIN_ROUNDS} timed rounds per method, in {QUICK_PROCESSES} "
                             "processes")
    parser.add_argument("--processes", type=int, default=1,
                        help="repeat the measurement in this many fresh processes, one after another, and report "
                             "each figure's median over them (default 1)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--json", action="store_true", help="end with one line of JSON holding every figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.processes = QUICK_MIN_ROUNDS, 1, QUICK_PROCESSES
    if args.smoke:
        args.rounds, args.warmup, args.processes = 1, 0, 1
    if args.rounds < 1 or args.warmup < 0 or args.processes < 1:
        parser.error("--rounds and --processes must be positive and --warmup non-negative")
    return args


def across_processes(args: argparse.Namespace) -> None:
    """The measurement in ``args.processes`` fresh processes, one after another: each figure's median over them.

    Two processes measuring the same ratio differ by up to 20 % on this machine while the rounds inside one
    process agree within a few percent (BENCHMARKS.md, "Threads and waiting chosen from the work"): where a
    process's memory lands is drawn once per process, so only more processes average it out."""
    command = [sys.executable, __file__, "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--json",
               "--data-dir", str(args.data_dir), *[f"--only={key}" for key in args.only or []]]
    figures: list[dict[str, Any]] = []
    for index in range(args.processes):
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        lines = done.stdout.strip().splitlines()
        if index == 0:
            print(lines[0])  # the machine, as the child printed it
        figures.append(json.loads(lines[-1]))
        ratios = sorted(key for key in figures[-1] if key.startswith(RATIO_PREFIXES))
        print(f"process {index + 1} of {args.processes}: "
              + ", ".join(f"{key} {figures[-1][key]:.2f}" for key in ratios), flush=True)
    keys = sorted(key for key in figures[0] if key.startswith(RATIO_PREFIXES))
    medians = {key: statistics.median(figure[key] for figure in figures) for key in keys}
    for key in keys:
        values = ", ".join(f"{figure[key]:.2f}" for figure in figures)
        print(f"  {key}: median {medians[key]:.2f} over {args.processes} processes ({values})")
    if args.json:
        print(json.dumps({**medians, "processes": [{key: figure[key] for key in keys} for figure in figures],
                          "timed_rounds": args.rounds, "warmup_rounds": args.warmup, "smoke": False,
                          **{key: figures[0][key] for key in MACHINE_KEYS if key in figures[0]}}, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.processes > 1:
        across_processes(args)
        return
    retain_freed_memory()  # as `decentdp run` does; the reference loop runs in this process too
    machine = machine_info()
    print_machine(machine)
    print(f"DP-DSGD on MNIST, epsilon {EPSILON}, delta {DELTA}, C = {CLIP}; {args.rounds} timed rounds per method "
          f"after {args.warmup} warm-up, interleaved; load average before: {os.getloadavg()[0]:.2f}")
    factory = ExperimentFactory(args.data_dir)
    results: dict[str, Any] = {}
    for setting in SETTINGS:
        if args.smoke:
            setting = replace(setting, agents=min(setting.agents, SMOKE_AGENTS))
        if args.only and setting.key not in args.only:
            continue
        result = measure(setting, factory, args.warmup, args.rounds, "rdp" if args.smoke else "tight")
        results[setting.key] = result
        print(f"{setting.key}: {setting.model} ({result['parameters']} parameters, {result['gradient_engine']} "
              f"engine), N = {setting.agents} {setting.graph}, {setting.partition} split, expected batch "
              f"{setting.batch}, sigma {result['sigma_range'][0]:.3f}..{result['sigma_range'][1]:.3f}")
        print_table(result["round_seconds"])
        for key, label in (("dp_over_nonprivate", "dp / nonprivate: "),
                           ("speedup_vs_opacus_loop", "opacus_loop / dp:")):
            if key in result:
                spread = result[f"{key}_spread"]
                print(f"  {label} {spread['ratio']:.2f}x (per-round ratios: IQR {spread['q1']:.2f}-{spread['q3']:.2f} "
                      f"over {spread['rounds']} rounds)")
        sys.stdout.flush()
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}; data: {'synthetic' if factory.synthetic else 'MNIST'}")
    if args.json:
        summary: dict[str, Any] = {}
        if "convnet_n10" in results:
            summary["dp_over_nonprivate"] = results["convnet_n10"]["dp_over_nonprivate"]
        for key in ("lenet5_n10", "mlp_n10"):
            if key in results:
                summary[f"dp_over_nonprivate_{key.removesuffix('_n10')}"] = results[key]["dp_over_nonprivate"]
        for key in ("convnet_n10", "mlp_n100", "logistic_n1000"):
            if key in results:
                summary[f"speedup_vs_opacus_loop_{key}"] = results[key]["speedup_vs_opacus_loop"]
        print(json.dumps({**summary, "settings": results, "timed_rounds": args.rounds, "warmup_rounds": args.warmup,
                          "smoke": args.smoke,
                          "synthetic_data": factory.synthetic, "load_average_after": load_after, **machine},
                         sort_keys=True))


if __name__ == "__main__":
    main()
