"""Wall time of a full MovieLens-100K personalized run (943 agents, Laplace-private CD), by phase.

Measures, in one process: loading and preparing the data (ALS features, k-NN graph), the schedule
and its levels, calibration, and the coordinate descent itself, for the wake-ups per agent of the
tuned configs.  The issue's target: a full run under 60 s on this machine.  Each phase is
reported as wall seconds and, in brackets, this process's CPU seconds: on a shared machine the wall
time grows with the load while the CPU time stays close to what a quiet core takes.

    OMP_NUM_THREADS=1 python benchmarks/personalized.py --data-dir ../shared/data [--wakeups 100 400]
"""

from __future__ import annotations

import argparse
import time

import torch

from decentdp.config import load_config
from decentdp.personalized.runner import build_run, evaluate
from decentdp.personalized.solver import PrivateUpdates, coordinate_descent
from decentdp.rng import agent_random

CONFIG = "experiments/personalized/movielens-eps1.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--wakeups", type=int, nargs="+", default=[100, 400])
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for wakeups in args.wakeups:
        config = load_config(CONFIG, [f"personalized.wakeups={wakeups}"])
        start, start_cpu = time.perf_counter(), time.process_time()
        run = build_run(config, args.data_dir)
        built, built_cpu = time.perf_counter(), time.process_time()
        problem, privacy = run.problem, config.privacy
        rng = agent_random(config.experiment.seed, privacy.noise == "secure", config.engine.noise_streams,
                           problem.n_agents, problem.x.device)
        private = PrivateUpdates(run.noise, privacy.clip, run.ledger, rng, problem.counts > 0)
        theta = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
        coordinate_descent(problem, theta, run.plan, private=private,
                           stopped=torch.zeros(problem.n_agents, dtype=torch.bool))
        solved, solved_cpu = time.perf_counter(), time.process_time()
        epsilon = float(run.ledger.epsilon(privacy.accountant).max())
        done, done_cpu = time.perf_counter(), time.process_time()
        print(f"wakeups {wakeups}: {run.plan.total_ticks} ticks in {run.plan.n_levels} levels; build (data, "
              f"problem, schedule, calibration) {built - start:.1f} s [{built_cpu - start_cpu:.1f}], private CD "
              f"{solved - built:.1f} s [{solved_cpu - built_cpu:.1f}], accounting {done - solved:.1f} s "
              f"[{done_cpu - solved_cpu:.1f}], total {done - start:.1f} s [{done_cpu - start_cpu:.1f} CPU]; RMSE "
              f"{evaluate(run.data, theta)['rmse_mean']:.4f}, epsilon {epsilon:.4f}", flush=True)


if __name__ == "__main__":
    main()
