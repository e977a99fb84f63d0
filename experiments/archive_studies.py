"""Keep tuning studies in the repository: results/ is not committed, and a session's machine does not last.

For every finished or running study under a results folder (``decentdp sweep`` output folders; DPDL's Table I
studies by default), copy its Optuna study (``study.db``, from which ``decentdp sweep`` resumes),
``best.md``/``best.toml`` where the sweep has written them, and a table of every trial (``trials.md``) to
``<archive>/<study>/``; trial folders (checkpoints, metrics) stay behind.  ``--restore`` copies the studies back,
so that the sweep commands in docs/reproduction.md resume where the last session stopped::

    python experiments/archive_studies.py             # after trials finish: then commit the archive folder
    python experiments/archive_studies.py --restore   # on a fresh checkout, before resuming the sweeps
    python experiments/archive_studies.py --results results/correlated-tuning \
        --archive experiments/correlated/tuning/studies   # the correlated-noise learning-rate studies
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "dpdl-tuning"
ARCHIVE = ROOT / "experiments" / "dpdl" / "tuning" / "studies"
KEPT = ("study.db", "best.md", "best.toml")


def trials_table(study_file: Path) -> str:
    """Every trial of the study, best first: number, state, validation accuracy and parameters."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="decentdp", storage=f"sqlite:///{study_file.resolve()}")
    trials = sorted(study.trials, key=lambda t: (t.value is None, -(t.value or 0.0), t.number))
    names = sorted({name for trial in trials for name in trial.params})
    lines = ["| trial | state | validation accuracy | " + " | ".join(names) + " |",
             "|---:|---|---:|" + "---:|" * len(names)]
    for trial in trials:
        value = f"{trial.value:.4f}" if trial.value is not None else ""
        params = " | ".join(f"{trial.params[name]:.4g}" if isinstance(trial.params.get(name), float)
                            else str(trial.params.get(name, "")) for name in names)
        lines.append(f"| {trial.number} | {trial.state.name.lower()} | {value} | {params} |")
    return "\n".join(lines) + "\n"


def archive(results: Path, kept: Path) -> None:
    for folder in sorted(path for path in results.iterdir() if (path / "study.db").is_file()):
        target = kept / folder.name
        target.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
        (target / "trials.md").write_text(trials_table(folder / "study.db"))
        print(f"{folder} -> {target}")


def restore(results: Path, kept: Path) -> None:
    for folder in sorted(path for path in kept.iterdir() if (path / "study.db").is_file()):
        target = results / folder.name
        if (target / "study.db").exists():
            print(f"{target / 'study.db'} exists: left alone")
            continue
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / "study.db", target / "study.db")
        print(f"{folder / 'study.db'} -> {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--restore", action="store_true", help="copy the kept studies back into the results folder")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the sweeps' output folders (default {RESULTS})")
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help=f"where they are kept (default {ARCHIVE})")
    args = parser.parse_args()
    (restore if args.restore else archive)(args.results, args.archive)


if __name__ == "__main__":
    main()
