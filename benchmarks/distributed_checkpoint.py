"""Cost of one Ray checkpoint: the workers writing their shards against the driver gathering every row.

Before issue 16's last step the driver fetched every agent's state rows and the shards' ledgers and
wrote one ``checkpoint.pt``; now each worker writes its own shard file and the driver writes a small
manifest (``RaySimulator.write_shards``).  This times both on the same run, interleaved: the MLP
(79,510 parameters) with N = 1000 agents on a ring (as ``benchmarks/distributed.py``), after one
round on ``--workers`` workers.

* ``workers write``: ``write_shards`` into a fresh folder (every worker writes its rows at once) and
  the manifest saved, as the runner does;
* ``driver gathers``: the state fetched through the driver (``dict`` of the sharded state), the
  merged ledger and scheduler state, and one ``torch.save`` of them, as the runner did (the merged
  ledger is cached after the first repeat; after one round it is small beside the rows).

Run from the repository root::

    .venv/bin/python benchmarks/distributed_checkpoint.py --repeats 3
"""

from __future__ import annotations

import decentdp  # noqa: F401  (before torch: idle OpenMP threads sleep, as in every decentdp process)

# isort: split
import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import DEFAULT_DATA_DIR, machine_info, print_machine
from decentdp.runtime.distributed.ray_backend import ShardedState, connect
from decentdp.util.threads import apply_threads
from distributed import build, ray_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timings of each way, interleaved")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    args = parser.parse_args()
    apply_threads(None)
    machine = machine_info()
    print_machine(machine)
    ray, owned = connect("", args.workers)
    scratch = Path(tempfile.mkdtemp(prefix="decentdp-checkpoint-bench-"))
    times: dict[str, list[float]] = {"workers_write": [], "driver_gathers": []}
    sizes: dict[str, int] = {}
    try:
        experiment = build("mlp", args.agents, "ring", args.data_dir)
        engine = ray_engine(experiment, ray, args.workers)

        def measure(done: int, state) -> bool:
            for repeat in range(args.repeats):
                folder = scratch / f"workers-{repeat}"
                start = time.perf_counter()
                manifest = engine.write_shards(folder, done + repeat + 1)  # a new round: the workers write
                torch.save({"round": done, "shards": manifest}, folder / "checkpoint.pt")
                times["workers_write"].append(time.perf_counter() - start)
                sizes["workers_write"] = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
                start = time.perf_counter()
                fresh = ShardedState(engine, list(state), engine._per_agent)  # rows fetched again, not cached
                payload = {"round": done, "state": dict(fresh),
                           "ledger": experiment.ledger.state_dict(), "scheduler": engine.scheduler.state_dict()}
                torch.save(payload, scratch / f"driver-{repeat}.pt")
                times["driver_gathers"].append(time.perf_counter() - start)
                sizes["driver_gathers"] = (scratch / f"driver-{repeat}.pt").stat().st_size
                shutil.rmtree(folder, ignore_errors=True)
                (scratch / f"driver-{repeat}.pt").unlink()
            return False

        engine.run(engine.setup(experiment.initial_state()), 0, 1, measure)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if owned:
            ray.shutdown()
    result = {"agents": args.agents, "workers": args.workers, "repeats": args.repeats,
              **{f"{way}_median_s": statistics.median(values) for way, values in times.items()},
              "seconds": times, "bytes": sizes}
    print(f"N = {args.agents}, {args.workers} workers: workers write {result['workers_write_median_s']:.2f} s, "
          f"driver gathers {result['driver_gathers_median_s']:.2f} s (median of {args.repeats})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
