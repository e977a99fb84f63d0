"""Find the finished runs whose noise the current code would calibrate differently, so only they are re-run.

A fix to a calibration (TOP-DP's worst case on 2026-12-07) changes the noise of some runs of a grid and leaves
the others as they were.  For each results folder this rebuilds the run from its own ``config.toml`` with the
code as it is now (data, graph, calibration; no training) and compares the noise multipliers with the ones its
``setup.json`` recorded.  A run is stale when any agent's multiplier moved by more than ``--rtol``::

    python experiments/stale_calibration.py experiments/top-dp/results/*top-dp* experiments/top-dp/results/*top-only*
    python experiments/stale_calibration.py --move-to /tmp/stale experiments/top-dp/results/fig9-*

``--move-to`` moves the stale folders out of the way, so that the grid's job list (which skips a run whose
``summary.json`` exists) re-runs exactly those; ``git checkout`` brings back any that were not re-run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from decentdp.config.schema import load_config
from decentdp.errors import DecentDPError
from decentdp.experiment.build import build_experiment


def recorded_and_current(run: Path, data_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """The noise multipliers ``run`` recorded, and the ones its config calibrates to now."""
    recorded = np.asarray(json.loads((run / "setup.json").read_text())["noise_multipliers"], dtype=float)
    current = build_experiment(load_config(run / "config.toml"), data_dir).setup["noise_multipliers"]
    return recorded, np.asarray(current, dtype=float)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="results folders (each with config.toml, setup.json)")
    parser.add_argument("--data-dir", default="../shared/data", help="dataset files (default ../shared/data)")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative change that makes a run stale")
    parser.add_argument("--move-to", type=Path, help="move the stale folders here")
    args = parser.parse_args(argv)
    stale = []
    print("| run | mean σ² recorded | mean σ² now | largest σ recorded | largest σ now | stale |")
    print("|---|---:|---:|---:|---:|---|")
    for run in args.runs:
        if not (run / "setup.json").exists():
            print(f"| {run.name} | no setup.json: skipped | | | | |")
            continue
        try:
            recorded, current = recorded_and_current(run, args.data_dir)
        except DecentDPError as error:
            sys.exit(f"{run}: {error}")
        moved = recorded.shape != current.shape or not np.allclose(current, recorded, rtol=args.rtol, atol=0.0)
        print(f"| {run.name} | {np.mean(recorded ** 2):.2f} | {np.mean(current ** 2):.2f} | {recorded.max():.2f} | "
              f"{current.max():.2f} | {'yes' if moved else ''} |", flush=True)
        if moved:
            stale.append(run)
    print(f"\n{len(stale)} of {len(args.runs)} runs are stale")
    if args.move_to is not None:
        args.move_to.mkdir(parents=True, exist_ok=True)
        for run in stale:
            shutil.move(str(run), str(args.move_to / run.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
