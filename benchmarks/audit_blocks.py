"""How fast many trainings run as blocks of one simulation, against one simulation per training.

The membership-inference audit (``decentdp audit mia``, Bayrooti et al. App. D) trains 5,000 models on
each of two datasets.  This script times, in one process and interleaved, (a) ``--models`` trainings
as blocks of one simulation (:func:`decentdp.audit.blocks.block_simulation`) and (b) ``--separate``
trainings each in its own simulation of one block (what one process per model would cost, without the
process start-up), both for ``--rounds`` rounds of the config; then extrapolates the full audit
(``audit.models`` per world, ``experiment.rounds`` rounds) from the block mode's seconds per model-round.
With ``--ungrouped``, (c) the same block trainings with the stacked engine's agent groups switched off
(one call for all agents, padded to the round's largest batch: the engine before the groups) are
timed in the same interleaved loop, for a before/after ratio under the same load.

    python benchmarks/audit_blocks.py experiments/audits/mia-dp-dsgd.toml --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from _machine import cpu_model
from decentdp.audit.blocks import audit_experiment, block_simulation
from decentdp.audit.mia import membership_data
from decentdp.audit.settings import load_audit_config
from decentdp.gradients import stacked_model


def _train(experiment, x, y, parts, blocks: int, seed: int, rounds: int) -> tuple[float, float]:  # noqa: ANN001
    """Wall and CPU seconds of ``blocks`` trainings of ``rounds`` rounds (CPU time: this process, all threads;
    on a machine shared with other work it is the figure that does not depend on their load)."""
    member = np.arange(blocks) % 2 == 0
    start, cpu = time.perf_counter(), time.process_time()
    run = block_simulation(experiment, x, y, parts, 0, len(x) - 1, member, seed)
    run.train(rounds)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--data-dir")
    parser.add_argument("--models", type=int, default=200, help="trainings in the block simulation")
    parser.add_argument("--separate", type=int, default=4, help="trainings timed one simulation each")
    parser.add_argument("--rounds", type=int, default=10, help="rounds timed per training")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ungrouped", action="store_true",
                        help="also time the blocks with the engine's agent groups off (before/after)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    config, audit = load_audit_config(args.config)
    experiment = audit_experiment(config, data_dir=args.data_dir)
    x, y, parts = membership_data(experiment, audit.digits, audit.per_digit)
    _train(experiment, x, y, parts, 2, 0, 1)  # warm-up, and the calibration (cached for the audit)
    block_times, separate_times, ungrouped_times = [], [], []
    for repeat in range(args.repeats):  # interleaved: the machine's drift hits every mode alike
        block_times.append(np.array(_train(experiment, x, y, parts, args.models, 1000 + repeat, args.rounds))
                           / (args.models * args.rounds))
        if args.ungrouped:
            grouped_budget = stacked_model.GROUP_ACTIVATION_BYTES
            stacked_model.GROUP_ACTIVATION_BYTES = 2**62  # one group of every agent at full width
            try:
                ungrouped_times.append(np.array(_train(experiment, x, y, parts, args.models, 1000 + repeat,
                                                       args.rounds)) / (args.models * args.rounds))
            finally:
                stacked_model.GROUP_ACTIVATION_BYTES = grouped_budget
        separate = [np.array(_train(experiment, x, y, parts, 1, 2000 + repeat * args.separate + k, args.rounds))
                    for k in range(args.separate)]
        separate_times.append(sum(separate) / (args.separate * args.rounds))
    per_model_round, cpu_per_model_round = (float(v) for v in np.median(block_times, axis=0))
    per_model_round_separate, cpu_separate = (float(v) for v in np.median(separate_times, axis=0))
    full_models = 2 * audit.models
    result = {
        "algorithm": config.algorithm.name, "model": config.model.name, "agents_per_training":
            experiment.topology.n_agents, "batch_size": config.algorithm.batch_size,
        "block_models": args.models, "rounds_timed": args.rounds,
        "seconds_per_model_round_blocks": per_model_round,
        "seconds_per_model_round_separate": per_model_round_separate,
        "cpu_seconds_per_model_round_blocks": cpu_per_model_round,
        "cpu_seconds_per_model_round_separate": cpu_separate,
        "speedup_blocks_over_separate": per_model_round_separate / per_model_round,
        "cpu_speedup_blocks_over_separate": cpu_separate / cpu_per_model_round,
        "full_audit_models": full_models, "full_audit_rounds": config.experiment.rounds,
        "full_audit_minutes_extrapolated": per_model_round * full_models * config.experiment.rounds / 60,
        "full_audit_cpu_minutes_extrapolated": cpu_per_model_round * full_models * config.experiment.rounds / 60,
        "platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
    }
    if ungrouped_times:
        ungrouped, cpu_ungrouped = (float(v) for v in np.median(ungrouped_times, axis=0))
        result.update({
            "seconds_per_model_round_ungrouped": ungrouped, "cpu_seconds_per_model_round_ungrouped": cpu_ungrouped,
            "cpu_speedup_grouped_over_ungrouped": cpu_ungrouped / cpu_per_model_round,
            "full_audit_cpu_minutes_ungrouped": cpu_ungrouped * full_models * config.experiment.rounds / 60})
    for key, value in result.items():
        print(f"{key:>36}: {value:.4g}" if isinstance(value, float) else f"{key:>36}: {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
