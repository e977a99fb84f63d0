"""``decentdp sweep``: the command's options and its run (the search itself is :mod:`decentdp.tuning.sweep`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decentdp.errors import ConfigError, DecentDPError
from decentdp.results.files import write_atomic
from decentdp.util.arguments import positive_int

if TYPE_CHECKING:  # (the search loads torch: imported inside the command, so that ``decentdp --help`` stays fast)
    from decentdp.tuning.sweep import Sweep, SweepRunner


def add_parser(commands: Any) -> None:
    """Register ``decentdp sweep`` on the CLI's subcommands."""
    sweep = commands.add_parser(
        "sweep", help="resumable hyper-parameter search over config fields (grid, random, TPE; needs "
                      "decentdp[sweep])",
        description="Search config fields with Optuna (grid, random or TPE), several trials at once in separate "
                    "processes with one thread each, each trial evaluated on a validation split held out of the "
                    "agents' training data (never the test set). Run the same command again to resume a killed "
                    "sweep. Tuning on private data costs privacy that the trials' epsilon does not include: see "
                    "the README (selection = 'private' accounts for it).")
    sweep.add_argument("sweep_file", metavar="SWEEP.toml", help="the sweep file ([sweep] and [space])")
    sweep.add_argument("--out", type=Path, metavar="DIR",
                       help="sweep folder: study.db, trials/, best.toml (default: results/sweeps/<file name>)")
    sweep.add_argument("--data-dir", help="directory holding dataset files (overrides data.data_dir)")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a value of the base config, e.g. --set experiment.rounds=50 (repeatable; "
                            "applied after the sweep file's set = {...}, so it wins)")
    sweep.add_argument("--trials", type=positive_int, metavar="N", help="trials to run (overrides sweep.trials)")
    sweep.add_argument("--workers", type=int, metavar="N", help="processes at once (overrides sweep.workers)")
    sweep.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    sweep.add_argument("--json", action="store_true", help="print the best trials as one JSON line at the end")


def run(args: argparse.Namespace) -> int:
    """``decentdp sweep``: check the file, open or resume the study, run the trials, print the best."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise DecentDPError("decentdp sweep needs Optuna: pip install 'decentdp[sweep]'") from None
    from decentdp.tuning.sweep import STUDY_FILE, SweepRunner, check_data, load_sweep

    sweep = load_sweep(args.sweep_file, args.overrides, args.trials)
    sweep.data_dir = args.data_dir
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError("--workers", f"must be a positive integer, got {args.workers}")
        sweep.section.workers = args.workers
    out = args.out if args.out is not None else Path("results") / "sweeps" / Path(args.sweep_file).stem
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} exists and is not a directory")
    from decentdp.experiment.record import LOCK_FILE

    if out.is_dir() and {entry.name for entry in out.iterdir()} - {LOCK_FILE} and not (out / STUDY_FILE).is_file():
        raise ConfigError("--out", f"{out} already holds files that are not a sweep; choose an empty directory")
    check_data(sweep)
    runner = SweepRunner(sweep, out)
    try:
        return _run_and_report(args, sweep, runner, out)
    finally:
        runner.close()


def _run_and_report(args: argparse.Namespace, sweep: Sweep, runner: SweepRunner, out: Path) -> int:
    """Run the sweep's trials (``runner`` holds ``out``'s lock) and write and print its results."""
    from decentdp.tuning.sweep import (
        NOT_PRIVATE_SELECTION,
        RELEASE_FILE,
        SELECTION_FILE,
        TRIALS_DIR,
        best_config,
        best_table,
        public_release,
        selection_summary,
        trial_score,
    )

    try:
        best = runner.run(progress=not args.no_progress, log=lambda line: print(line, file=sys.stderr))
    except KeyboardInterrupt:
        again = shlex.join([str(args.sweep_file), "--out", str(out), *sweep.options,
                            *(["--data-dir", args.data_dir] if args.data_dir else [])])
        print(f"decentdp: interrupted; resume with: decentdp sweep {again}", file=sys.stderr)
        return 130
    if sweep.private is not None:
        selection = runner.selection()
        write_atomic(out / SELECTION_FILE, json.dumps(selection, indent=2) + "\n")
        write_atomic(out / RELEASE_FILE, json.dumps(public_release(selection), indent=2) + "\n")
        print(selection_summary(selection, out))
        if selection["released"] is None:
            if runner.failures():
                print(f"no trial finished{_failures(runner)}", file=sys.stderr)
            return 0
        best = best[:1]  # only the selected trial is released
    if not best:
        raise DecentDPError(f"no trial of {out} finished{_failures(runner)}")
    import tomli_w

    score = f"noisy count of correct validation predictions = {trial_score(sweep, best[0]):.6g}" \
        if sweep.private is not None else f"validation {sweep.section.objective} = {best[0].value:.6g}"
    caveat = "" if sweep.private is not None else f"\n# {NOT_PRIVATE_SELECTION}"
    write_atomic(out / "best.toml", "# The best trial of decentdp sweep " + str(args.sweep_file) + f" ({score}); "
                 f"evaluate it on the test set with decentdp run{caveat}\n"
                 + tomli_w.dumps(best_config(sweep, best[0])))
    table = best_table(sweep, best)
    if sweep.private is None:  # the choice itself read exact validation scores: say so beside the result
        table += f"\n{NOT_PRIVATE_SELECTION}\n"
    write_atomic(out / "best.md", table)
    print(table, end="")
    print(f"best config: {out / 'best.toml'} (validation_fraction removed: run it to measure test accuracy); "
          f"all trials: decentdp report {out / TRIALS_DIR}")
    if args.json:
        print(json.dumps({"best": [{"trial": t.number, "value": t.value, "params": t.params,
                                    "folder": str(runner.trial_folder(t))} for t in best],
                          "best_config": str(out / "best.toml")}))
    return 0


def _failures(runner: SweepRunner) -> str:
    """The failed trials' errors, one line each, for the message that no trial finished (on a resume they were
    never printed), or nothing when none failed."""
    lines = runner.failures()
    if not lines:
        return ""
    return (": failed trials are not run again (fix the cause and choose another --out); they failed with\n  "
            + "\n  ".join(lines))
