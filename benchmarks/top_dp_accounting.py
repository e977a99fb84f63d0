"""What TOP-DP's sound accounting costs in a whole run: the replayed calibration and the ledger's epsilons.

Under the joint view each round of TOP-DP is one Gaussian release whose multiplier depends on how many
noisy copies that round's covers made (``topology_noise.py``), so an agent's ledger holds hundreds of short
runs of a handful of distinct events, and a run prices it at every evaluation.  This benchmark builds
Section VII's synchronous setting (``experiments/top-dp/fig3-top-dp-sync-a0.25.toml``: N = 30 on
Erdos-Renyi(0.2), the MLP, alpha = 0.25, epsilon 1) for ``--rounds`` rounds (decay period half of them),
runs them as the simulator does, and times:

* the build of the experiment, next to the build of Optimal from the same config (same data, graph and
  model; its calibration is one closed-form search): the difference is TOP-DP's calibration, the replay
  of the covers included;
* the rounds themselves;
* pricing every agent's ledger (``tight``: the smaller of PLD and RDP), caches cleared, two ways:
  *per run*, one PLD per run of the ledger, as dp_accounting composes the runs in order (what the ledger
  did before its histories were merged), and *merged*, one PLD per distinct event
  (``accounting.merged_history``, what it does now).  Both are PLD upper bounds of the same composition;
  they differ only in how often the distributions are discretised and truncated (printed).

Run from the repository root (MNIST from ``../shared/data``, synthetic data of its size if missing)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/top_dp_accounting.py --json       # 300 rounds
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/top_dp_accounting.py --rounds 60
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from _common import ExperimentFactory, machine_info, print_machine
from decentdp.privacy import accounting

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "experiments" / "top-dp" / "fig3-top-dp-sync-a0.25.toml"


def raw_config(algorithm: str, rounds: int) -> dict[str, Any]:
    """Section VII's synchronous config for ``algorithm`` (``top-dp`` or ``optimal``) over ``rounds`` rounds."""
    with CONFIG.open("rb") as handle:
        raw = tomllib.load(handle)
    raw["experiment"] |= {"rounds": rounds, "eval_every": rounds}
    if algorithm == "top-dp":
        raw["algorithm"]["decay_period"] = max(rounds // 2, 1)
    else:
        raw["algorithm"] = {key: value for key, value in raw["algorithm"].items()
                            if key not in ("decay_gamma", "decay_period")} | {"name": algorithm}
    return raw


def timed(action: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = action()
    return value, time.perf_counter() - start


def price_per_run(ledger: Any) -> np.ndarray:
    """Each agent's tight epsilon with one distribution per run of its history (the unmerged path)."""
    return np.array([accounting._epsilon_of_merged(tuple(run for run in ledger.history(agent) if run[1] > 0),
                                                   ledger.delta, "tight", ledger.relation)
                     for agent in range(ledger.n_agents)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=300, help="rounds of the run (default 300)")
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    machine = machine_info()
    print_machine(machine)
    factory = ExperimentFactory(args.data_dir)
    _, optimal_build = timed(lambda: factory.build(raw_config("optimal", args.rounds)))
    experiment, top_dp_build = timed(lambda: factory.build(raw_config("top-dp", args.rounds)))
    state = experiment.simulator.setup(experiment.initial_state())  # the setup release, as a run makes it
    _, rounds_seconds = timed(lambda: experiment.simulator.run(state, 0, args.rounds, lambda *_: True))
    ledger = experiment.ledger
    runs = [len(ledger.history(agent)) for agent in range(ledger.n_agents)]
    distinct = [len(accounting.merged_history(ledger.history(agent))) for agent in range(ledger.n_agents)]
    accounting._epsilon_of_merged.cache_clear()
    per_run, per_run_seconds = timed(lambda: price_per_run(ledger))
    accounting._epsilon_of_merged.cache_clear()
    merged, merged_seconds = timed(lambda: ledger.epsilon("tight"))
    difference = (merged - per_run) / per_run  # both are PLD upper bounds; they differ by discretisation only
    figures = {
        "rounds": args.rounds, "synthetic_data": factory.synthetic,
        "build_seconds": {"top-dp": top_dp_build, "optimal": optimal_build},
        "calibration_seconds": top_dp_build - optimal_build,
        "rounds_seconds": rounds_seconds,
        "ledger_runs_per_agent": {"median": float(np.median(runs)), "max": int(max(runs))},
        "ledger_events_per_agent": {"median": float(np.median(distinct)), "max": int(max(distinct))},
        "pricing_seconds": {"per_run": per_run_seconds, "merged": merged_seconds},
        "per_run_over_merged": per_run_seconds / merged_seconds,
        "epsilon_max": float(merged.max()),
        "merged_minus_per_run_relative": {"min": float(difference.min()), "max": float(difference.max())},
        "machine": machine,
    }
    print(f"TOP-DP, {args.rounds} rounds (N = 30, alpha = 0.25, epsilon 1): build {top_dp_build:.1f} s (Optimal's "
          f"{optimal_build:.1f} s, so calibration about {top_dp_build - optimal_build:.1f} s), rounds "
          f"{rounds_seconds:.1f} s")
    print(f"ledger: {figures['ledger_runs_per_agent']['median']:.0f} runs of "
          f"{figures['ledger_events_per_agent']['median']:.0f} distinct events per agent (median); pricing every "
          f"agent: per run {per_run_seconds:.1f} s, merged {merged_seconds:.1f} s "
          f"({figures['per_run_over_merged']:.1f}x); epsilon max {merged.max():.6f} merged, "
          f"{per_run.max():.6f} per run "
          f"(merged / per run - 1 from {difference.min():.1e} to {difference.max():.1e})")
    if args.json:
        print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
