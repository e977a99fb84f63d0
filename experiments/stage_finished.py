"""Stage the finished results folders of the experiments' grids for a commit, and never a running one.

The grids write their runs into ``experiments/**/results*/<run>/`` while they run, so ``git add`` of a whole
``results`` folder would stage the metrics of a run that is still going (and whose folder a later resume
rewrites).  A run has finished when its folder holds the file it writes last: ``summary.json`` for a
``decentdp run``, ``inversion.json`` for a ``decentdp attack inversion``.  This stages exactly those folders and
names the unfinished ones it left out::

    python experiments/stage_finished.py            # then: git commit
    python experiments/stage_finished.py --dry-run  # only say what it would stage
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent
LAST_WRITTEN = ("summary.json", "inversion.json")  # what a run or an attack writes when it has finished


def run_folders(root: Path = EXPERIMENTS) -> list[Path]:
    """Every run folder under a ``results*`` folder of the experiments."""
    return sorted(run for results in root.rglob("results*") if results.is_dir()
                  for run in results.iterdir() if run.is_dir())


def is_finished(run: Path) -> bool:
    return any((run / name).exists() for name in LAST_WRITTEN)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would be staged, stage nothing")
    args = parser.parse_args(argv)
    folders = run_folders()
    finished = [run for run in folders if is_finished(run)]
    for run in folders:
        if not is_finished(run):
            print(f"left out (not finished): {run.relative_to(EXPERIMENTS.parent)}")
    if args.dry_run:
        print(f"would stage {len(finished)} finished folders")
        return
    for start in range(0, len(finished), 200):  # git add's ignore rules keep checkpoints and figures out
        subprocess.run(["git", "add", "--", *map(str, finished[start:start + 200])], check=True,
                       cwd=EXPERIMENTS.parent)
    print(f"staged {len(finished)} finished folders (unchanged ones add nothing)")


if __name__ == "__main__":
    main()
