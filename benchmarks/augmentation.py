"""The cost of augmentation multiplicity: a private round with K augmented copies per record against one without.

``[augmentation]`` (De et al. 2022; ``decentdp.data.augment``) trains each sampled record as the mean
gradient of K random translations, clipped once: the same noise and epsilon, for about K times the
gradient work.  This measures what that costs per round, as the simulator runs it, for the settings
issue 10's tuned rows use: DP-DSGD (the same per-round work as DP-DSGT's gradient, one release) with
the consensus paper's ConvNet on MNIST at 32x32, N = 10 agents on a complete graph, one digit per agent,
expected batch 256 per agent; copies K = 1 (no augmentation), 2 and 4, translations of up to 2 pixels.
Medians of per-round seconds, the three timed interleaved, round by round, in one process
(``_common.time_interleaved``), and each over K = 1.  The target: at most about K times (the copies'
gradient work is K times; sampling, noise, mixing and ledger are not repeated).

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/augmentation.py --json    # 10 timed rounds per method
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/augmentation.py --quick   # 8 timed rounds, same keys (--smoke: 1)
"""

from __future__ import annotations

import json
import os
from typing import Any

from _common import (
    DELTA,
    EPSILON,
    QUICK_MIN_ROUNDS,
    EngineRunner,
    ExperimentFactory,
    experiment_config,
    interleaved_stats,
    print_table,
    start_interleaved,
)

COPIES = (1, 2, 4)
SHIFT = 2


def main(argv: list[str] | None = None) -> None:
    args, machine = start_interleaved(__doc__.split("\n", 1)[0], argv, rounds=10, warmup=2, quick=(QUICK_MIN_ROUNDS, 1))
    print(f"DP-DSGD, ConvNet on MNIST 32x32, N = 10 complete, one digit per agent, expected batch 256, epsilon "
          f"{EPSILON}, delta {DELTA}; copies {', '.join(map(str, COPIES))} (shift {SHIFT} px); {args.rounds} timed "
          f"rounds each after {args.warmup} warm-up, interleaved; load average before: {os.getloadavg()[0]:.2f}")
    factory = ExperimentFactory(args.data_dir)
    runners = {}
    for copies in COPIES:
        raw = experiment_config("convnet", 10, 256, EPSILON)
        if copies > 1:
            raw["augmentation"] = {"kind": "shift", "copies": copies, "shift": SHIFT}
        runners[f"copies_{copies}"] = EngineRunner(factory.build(raw)).round
    stats = interleaved_stats(runners, args.warmup, args.rounds)
    print_table(stats)
    base = stats["copies_1"]["median"]
    ratios = {f"copies_{k}_over_1": stats[f"copies_{k}"]["median"] / base for k in COPIES[1:]}
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.2f}x")
    if args.json:
        result: dict[str, Any] = {"machine": machine, "synthetic_data": factory.synthetic, "round_seconds": stats,
                                  **ratios}
        print(json.dumps(result))


if __name__ == "__main__":
    main()
