"""Does ``noise_left`` rank TOP-DP's sound sigma vectors the way training does?  Runs that were re-run with another
sigma vector give the test: for each, the accuracy before and after, and the noise each vector leaves in the models
(:func:`~decentdp.algorithms.components.topology_noise.noise_left`, on the run's own covers), beside their mean
sigma^2, the ranking the calibration used before.  Both vectors, accuracies and the config are read from git: at the
commit that re-ran the run and at its parent.  Run from the repository root::

    python experiments/top-dp/selection_check.py e80801e:fig9-top-dp-sync-ring-s0 34f2ee8:fig9-top-dp-sync-tree-s1

Each argument is ``COMMIT:RUN``: the commit that replaced the run's results, and its folder under
``experiments/top-dp/results/``.  It also says which vector the calibration keeps now.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from decentdp.algorithms.base import Calibrated, NoisePlan
from decentdp.algorithms.components.topology_noise import noise_left
from decentdp.algorithms.top_dp import TopDPBase
from decentdp.config.schema import load_config
from decentdp.experiment.build import build_experiment

RESULTS = Path("experiments/top-dp/results")


@contextmanager
def captured_plans() -> Iterator[list[tuple[TopDPBase, NoisePlan]]]:
    """Record the noise plan each TOP-DP calibration (either protocol) is given while the block runs."""
    plans: list[tuple[TopDPBase, NoisePlan]] = []
    original = TopDPBase.calibrate

    def calibrate(self: TopDPBase, plan: NoisePlan) -> Calibrated:
        plans.append((self, plan))
        return original(self, plan)

    TopDPBase.calibrate = calibrate  # type: ignore[method-assign]
    try:
        yield plans
    finally:
        TopDPBase.calibrate = original  # type: ignore[method-assign]


def at_commit(revision: str, path: Path) -> str:
    """A file as it was at ``revision`` (``COMMIT`` after the re-run, ``COMMIT^`` before it)."""
    return subprocess.check_output(["git", "show", f"{revision}:{path.as_posix()}"], text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="COMMIT:RUN (the commit that re-ran RUN)")
    parser.add_argument("--data-dir", default="../shared/data")
    args = parser.parse_args(argv)
    print("| run | accuracy before → after | mean σ² before → after | noise_left before → after | kept now |")
    print("|---|---|---|---|---|")
    for spec in args.runs:
        commit, name = spec.split(":", 1)
        folder = RESULTS / name
        (before, accuracy_before), (after, accuracy_after) = (
            (np.asarray(json.loads(at_commit(revision, folder / "setup.json"))["noise_multipliers"], dtype=float),
             json.loads(at_commit(revision, folder / "summary.json"))["accuracy_mean"])
            for revision in (f"{commit}^", commit))
        with tempfile.TemporaryDirectory() as scratch, captured_plans() as plans:
            config = Path(scratch) / "config.toml"
            config.write_text(at_commit(commit, folder / "config.toml"))
            experiment = build_experiment(load_config(config), args.data_dir)
        algorithm, plan = plans[0]
        kept = np.asarray(experiment.setup["noise_multipliers"], dtype=float)
        if not algorithm.messages_per_cover:
            print(f"| {name} | {100 * accuracy_before:.2f} → {100 * accuracy_after:.2f} | {np.mean(before**2):.1f} → "
                  f"{np.mean(after**2):.1f} | — (Algorithm 2: no fixed covers) | least mean σ² |", flush=True)
            continue
        left = noise_left(plan, algorithm.alpha, [before, after], algorithm.gamma, algorithm.period)
        which = next((label for label, vector in (("before", before), ("after", after))
                      if np.allclose(kept, vector, rtol=1e-6, atol=0)), "another")
        print(f"| {name} | {100 * accuracy_before:.2f} → {100 * accuracy_after:.2f} | {np.mean(before**2):.1f} → "
              f"{np.mean(after**2):.1f} | {left[0]:.3g} → {left[1]:.3g} | {which} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
