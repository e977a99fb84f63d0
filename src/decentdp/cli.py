"""The ``decentdp`` command line: run experiments, answer privacy questions.

Errors caused by input (configs, data, graphs, privacy requests) are printed as one readable
message naming the field, with exit status 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from decentdp import __version__
from decentdp.errors import DecentDPError

EXIT_USER_ERROR = 2


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decentdp", description="Differentially private decentralized learning.")
    parser.add_argument("--version", action="version", version=f"decentdp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run an experiment described by a TOML config")
    run.add_argument("config", help="path of the experiment's TOML file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set privacy.epsilon=1 (repeatable)")
    run.add_argument("--data-dir", help="directory holding dataset files (overrides data.data_dir)")
    run.add_argument("--out", help="results folder (default: results/<name>-<timestamp>)")
    run.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --out")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--profile", action="store_true",
                     help="report where a round's time goes (per phase, and torch's busiest operators); "
                          "saved as profile.json in the results folder")

    privacy = commands.add_parser("privacy", help="noise calibration and epsilon accounting")
    which = privacy.add_subparsers(dest="question", required=True)
    sigma = which.add_parser("sigma", help="noise multiplier reaching a target (epsilon, delta)")
    sigma.add_argument("--epsilon", type=_float, required=True)
    epsilon = which.add_parser("epsilon", help="epsilon spent with a given noise multiplier")
    epsilon.add_argument("--sigma", type=_float, required=True)
    for sub, default in ((sigma, "rdp"), (epsilon, "pld")):
        sub.add_argument("--delta", type=_float, required=True)
        sub.add_argument("--sample-rate", type=_float, required=True, help="Poisson sampling rate q")
        sub.add_argument("--steps", type=int, required=True, help="number of steps (rounds)")
        sub.add_argument("--releases-per-step", type=int, default=1,
                         help="noisy releases per step (e.g. DP-DiNNO's primal steps T)")
        sub.add_argument("--accountant", choices=("rdp", "pld"), default=default)
        sub.add_argument("--json", action="store_true")
    return parser


def _eps(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.3f}"


def _run(args: argparse.Namespace) -> int:
    from decentdp.config import load_config
    from decentdp.run.loop import run_experiment, summary_line

    config = load_config(args.config, args.overrides)
    if args.out:
        out = Path(args.out)
    else:
        out = Path("results") / f"{config.experiment.name}-{datetime.now():%Y%m%d-%H%M%S}"
    result = run_experiment(config, out, data_dir=args.data_dir, resume=args.resume,
                            progress=not args.no_progress, log=lambda line: print(line, file=sys.stderr),
                            profile=args.profile)
    summary = result.summary
    per_agent = ", ".join(_eps(e) for e in summary["epsilon_per_agent"])
    print(f"final test accuracy over {summary['n_agents']} agents: mean {summary['accuracy_mean']:.4f}, "
          f"min {summary['accuracy_min']:.4f}, max {summary['accuracy_max']:.4f}")
    print(f"epsilon spent per agent ({summary['epsilon_accountant'].upper()}, delta={summary['delta']:g}): "
          f"max {_eps(summary['epsilon_max'])}"
          f"  [{per_agent}]")
    print(f"wall time {summary['wall_seconds']:.1f} s; results in {out}")
    if args.json:
        print(summary_line(summary))
    return 0


def _privacy(args: argparse.Namespace) -> int:
    from decentdp.privacy.accounting import calibrate_noise_multiplier, check_epsilon_delta, epsilon_spent

    if args.question == "sigma":
        check_epsilon_delta(args.epsilon, args.delta, epsilon_field="--epsilon", delta_field="--delta")
        sigma = calibrate_noise_multiplier(args.epsilon, args.delta, args.sample_rate, args.steps,
                                           args.releases_per_step, accountant=args.accountant)
        epsilon = args.epsilon
    else:
        check_epsilon_delta(math.inf, args.delta, delta_field="--delta")
        sigma = args.sigma
        epsilon = epsilon_spent(sigma, args.delta, args.sample_rate, args.steps, args.releases_per_step,
                                accountant=args.accountant)
    releases = args.steps * args.releases_per_step
    name = {"rdp": "RDP (dp_accounting RdpAccountant)", "pld": "PLD (dp_accounting PLDAccountant)"}[args.accountant]
    if args.question == "sigma":
        print(f"noise multiplier sigma = {sigma:.6g} reaches epsilon = {epsilon:g} at delta = {args.delta:g}")
    else:
        print(f"sigma = {sigma:g} spends epsilon = {epsilon:.6g} at delta = {args.delta:g}")
    print(f"  {releases} sampled Gaussian releases at sample rate {args.sample_rate:g}; accountant: {name}")
    if args.json:
        print(json.dumps({"sigma": sigma, "epsilon": epsilon if math.isfinite(epsilon) else "inf",
                          "delta": args.delta, "accountant": args.accountant, "sample_rate": args.sample_rate,
                          "steps": args.steps, "releases_per_step": args.releases_per_step}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``decentdp`` command."""
    args = _build_parser().parse_args(argv)
    try:
        return _run(args) if args.command == "run" else _privacy(args)
    except DecentDPError as error:
        print(f"decentdp: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("decentdp: interrupted; resume with --resume and the same --out", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
