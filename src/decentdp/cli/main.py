"""The ``decentdp`` command line: run experiments, answer privacy questions, list what a config can name.

Errors caused by input (configs, data, graphs, privacy requests, options) are printed as one readable
message naming the field or option, with exit status 2 and no traceback.

Heavy modules (torch, the registry, dp_accounting) are imported inside the commands that need them,
so building the parser (and ``--help``) stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import math
import os
import shlex
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from decimal import ROUND_CEILING
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

from decentdp import __version__
from decentdp.cli import audit as audit_command
from decentdp.cli import report as report_command
from decentdp.cli import sweep as sweep_command
from decentdp.errors import ConfigError, DecentDPError
from decentdp.results.files import CHECKPOINT_FILE, epsilon_text, rounded_text
from decentdp.util.arguments import add_threads_option, with_threads

if TYPE_CHECKING:
    from decentdp.config import ExperimentConfig

EXIT_USER_ERROR = 2


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


# ----------------------------------------------------------------------------- parser

_RUN_DESCRIPTION = """\
Run the experiment a TOML config describes and write its results folder.

Allowed values of every choice a config makes (algorithms and their own settings, datasets,
partitions, graphs and the parameter each needs, mixings, models, schedules, accountants,
optimizers): `decentdp list` (or `decentdp list graphs`, ...). Start a config with
`decentdp init OUT.toml`; check one, with its overrides, with --dry-run."""

_INIT_DESCRIPTION = """\
Write a starting config: the quick-start demo (10 agents, bundled digits, DP-DSGT at epsilon = 4),
or the demo with another registered algorithm (`--template dp-dsgd`; names: `decentdp list algorithms`).
Every setting is written at its resolved value; experiment.name is taken from OUT's file name."""

_PRIVACY_SAMPLING = """\
Sampling is described either by --sample-rate and --steps, or Opacus-style by --batch-size,
--dataset-size and --epochs (then q = B/N and steps = ceil(E * N / B)); exactly one of the two."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decentdp", description="Differentially private decentralized learning.",
        epilog="Allowed config values: `decentdp list`. A starting config: `decentdp init OUT.toml`.")
    parser.add_argument("--version", action="version", version=f"decentdp {__version__}",
                        help="print decentdp's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="run, privacy, list, init, report, sweep, audit or attack (each has "
                                          "its own --help)")

    run = commands.add_parser("run", help="run an experiment described by a TOML config",
                              description=_RUN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("config", metavar="CONFIG",
                     help="path of the experiment's TOML file (start one with `decentdp init`)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set privacy.epsilon=1 (repeatable; allowed values: "
                          "`decentdp list`)")
    add_threads_option(run)
    run.add_argument("--data-dir", help="directory holding dataset files (overrides data.data_dir)")
    run.add_argument("--out", help="results folder (default: results/<name>-<timestamp>)")
    run.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --out")
    run.add_argument("--dry-run", action="store_true",
                     help="validate the config and overrides, draw the run's first graph (a random graph's "
                          "search can fail), print the resolved config as TOML (and to stderr the warnings a run "
                          "would give about the config) and exit; loads no data, trains nothing, writes nothing")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--diagnostics", action="store_true",
                     help="also write operator statistics computed from the raw private data (class histograms "
                          "in diagnostics.json, clipped fractions in metrics.jsonl), labelled as not private; "
                          "off by default so that results folders can be shared")
    run.add_argument("--profile", action="store_true",
                     help="report where a round's time goes (per phase, and torch's busiest operators); "
                          "saved as profile.json in the results folder")

    privacy = commands.add_parser("privacy", help="noise calibration and epsilon accounting",
                                  description="Noise calibration and epsilon accounting of the sampled Gaussian "
                                              "mechanism (Poisson sampling).")
    which = privacy.add_subparsers(dest="question", required=True, metavar="QUESTION",
                                   help="sigma or epsilon (each has its own --help)")
    sigma = which.add_parser("sigma", help="noise multiplier reaching a target (epsilon, delta)",
                             description="The smallest noise multiplier sigma whose releases stay within a target "
                                         "(epsilon, delta).\n\n" + _PRIVACY_SAMPLING,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    sigma.add_argument("--epsilon", type=_float, required=True, help="target epsilon ('inf': no noise needed)")
    epsilon = which.add_parser("epsilon", help="epsilon spent with a given noise multiplier",
                               description="The epsilon spent by releases with a given noise multiplier sigma.\n\n"
                                           + _PRIVACY_SAMPLING,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    epsilon.add_argument("--sigma", type=_float, required=True,
                         help="noise multiplier: noise std / clipping norm (0: no noise)")
    for sub in (sigma, epsilon):
        sub.add_argument("--delta", type=_float, required=True, help="delta of (epsilon, delta)-DP, in (0, 1)")
        direct = sub.add_argument_group("sampling as a rate and a step count")
        direct.add_argument("--sample-rate", type=_float, metavar="Q", help="Poisson sampling rate q, in (0, 1]")
        direct.add_argument("--steps", type=int, help="number of steps (rounds)")
        opacus = sub.add_argument_group("or Opacus-style sampling (q = B/N, steps = ceil(E * N / B))")
        opacus.add_argument("--batch-size", type=int, metavar="B", help="expected (Poisson) batch size B")
        opacus.add_argument("--dataset-size", type=int, metavar="N", help="number of records N in the dataset")
        opacus.add_argument("--epochs", type=_float, metavar="E", help="epochs E: expected passes over the data")
        sub.add_argument("--releases-per-step", type=int, default=1,
                         help="noisy releases per step (e.g. DP-DiNNO's primal steps T) (default: %(default)s)")
        sub.add_argument("--accountant", choices=("tight", "pld", "rdp"), default="tight",
                         help="tight: the smaller of PLD and RDP, both sound (what runs calibrate, enforce and "
                              "report with); pld: privacy loss distributions; rdp: Renyi DP, as Opacus "
                              "(default: %(default)s)")
        sub.add_argument("--neighbouring", choices=("add-remove", "replace-one"), default="add-remove",
                         help="neighbouring relation: add or remove one record, or replace one (about 2x the "
                              "epsilon) (default: %(default)s)")
        sub.add_argument("--json", action="store_true", help="also print the answer as one JSON object")

    listing = commands.add_parser("list", help="what a config can name: algorithms (with their settings), "
                                               "datasets, graphs, models, ...",
                                  description="List the values a config can name, as the installed code "
                                              "defines them.")
    listing.add_argument("what", nargs="?", metavar="WHAT",
                         help=f"one category: {', '.join(_CATEGORIES)} (default: all of them)")
    listing.add_argument("--json", action="store_true", help="print one JSON object {category: [entries]}")

    init = commands.add_parser("init", help="write a starting config (the demo, or the demo with an algorithm)",
                               description=_INIT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    init.add_argument("out", metavar="OUT.toml", help="file to write; it must not exist yet")
    init.add_argument("--template", default="demo", metavar="NAME",
                      help="demo, or an algorithm name from `decentdp list algorithms` (the demo with that "
                           "algorithm) (default: %(default)s)")
    report_command.add_parser(commands)
    sweep_command.add_parser(commands)
    audit_command.add_parser(commands)
    return parser


# ----------------------------------------------------------------------------- run


def _eps(value: float | str | None) -> str:
    """An epsilon of a summary: a number, or "inf" / null (results files' spellings of no guarantee)."""
    if value is None or isinstance(value, str):
        return "inf" if value is None else value
    return epsilon_text(value)


#: The exit status of a run stopped by SIGTERM (a batch scheduler's stop, ``run_jobs.py``'s deadline): the shell's
#: 128 + 15, as if the signal had ended the process, after the run has stopped as Ctrl-C stops it.
EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM during a run, raised where it arrives as Ctrl-C's KeyboardInterrupt is, so that the run stops the
    same way (its tracked run marked KILLED, Ray's workers stopped, its folder's lock released) and the command
    says how to resume it, where by default the signal ended the process at once, silently."""


def _raise_terminated(number: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Within it, SIGTERM raises :class:`_Terminated`; the handler before it is put back after.  Only the main
    thread may set handlers: in another (a program running the CLI on a worker thread) nothing changes.  A Ray
    engine started inside puts this handler back after ``ray.init`` replaces it
    (:func:`decentdp.runtime.distributed.ray_backend._exit_on_sigterm`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _run(args: argparse.Namespace) -> int:
    from decentdp.config import load_config

    config = load_config(args.config, with_threads(args.overrides, args.threads))
    if args.resume and not args.out:
        raise ConfigError("--resume", "needs --out: the results folder of the run to continue")
    if args.out and not args.resume:
        from decentdp.experiment.record import refuse_config_inside

        refuse_config_inside(args.config, Path(args.out))
    if args.dry_run:
        import tomli_w

        _draw_first_graph(config)
        _check_start(config, Path(args.out) if args.out else None, args.resume)
        for notice in config.notices:  # what a run would say of the config at its start (stdout stays TOML)
            print(f"warning: {notice}", file=sys.stderr)
        sys.stdout.write(tomli_w.dumps(config.to_toml_dict()))
        return 0

    from decentdp.experiment.loop import run_experiment, summary_line

    out = Path(args.out) if args.out else Path("results") / f"{config.experiment.name}-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        with _sigterm_interrupts():
            result = run_experiment(config, out, data_dir=args.data_dir, resume=args.resume,
                                    progress=not args.no_progress, log=lambda line: print(line, file=sys.stderr),
                                    profile=args.profile, diagnostics=args.diagnostics)
    except KeyboardInterrupt as stop:
        stopped = "terminated (SIGTERM)" if isinstance(stop, _Terminated) else "interrupted"
        if (out / CHECKPOINT_FILE).is_file():
            print(f"decentdp: {stopped}; continue with: {_resume_command(args, out)} (with no --threads it "
                  "computes on as many threads as before)", file=sys.stderr)
        else:
            print(f"decentdp: {stopped} before the first checkpoint was written; nothing to resume, start the "
                  "run again", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(stop, _Terminated) else 130
    summary = result.summary
    per_agent = _per_agent(summary["epsilon_per_agent"])
    if "rmse_mean" in summary:  # personalized regression (MovieLens): per-agent test RMSE
        print(f"final per-agent test RMSE over {summary['n_agents']} agents: mean {summary['rmse_mean']:.4f}, "
              f"min {summary['rmse_min']:.4f}, max {summary['rmse_max']:.4f}")
    else:
        print(f"final test accuracy over {summary['n_agents']} agents: mean {summary['accuracy_mean']:.4f}, "
              f"min {summary['accuracy_min']:.4f}, max {summary['accuracy_max']:.4f}")
    towards = f", towards {summary['epsilon_observer'].split(':')[0]}" if "epsilon_observer" in summary else ""
    print(f"epsilon spent per agent{towards} ({summary['epsilon_accountant'].upper()}, delta={summary['delta']:g}): "
          f"max {_eps(summary['epsilon_max'])}"
          f"  [{per_agent}]")
    print(f"wall time {summary['wall_seconds']:.1f} s; results in {out}")
    if args.json:
        print(summary_line(summary))
    return 0


def _resume_command(args: argparse.Namespace, out: Path) -> str:
    """The command that continues the run ``args`` started in ``out``, quoted for a POSIX shell so that it can be
    pasted back as it is: the same config, ``--set`` options, ``--threads`` and ``--data-dir`` as given."""
    words = ["decentdp", "run", args.config]
    for override in args.overrides:
        words += ["--set", override]
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    words += ["--resume", "--out", str(out)]
    if args.data_dir:
        words += ["--data-dir", args.data_dir]
    return shlex.join(words)


def _check_start(config: ExperimentConfig, out: Path | None, resume: bool) -> None:
    """The cheap checks a run makes at its start, for ``--dry-run`` (nothing written or locked): the device
    ``engine.device`` names, Ray's worker count against the agents, and, with ``--out``, the results folder as
    :meth:`~decentdp.experiment.record.ResultsFolder.check` sees it (a finished run's folder, a missing
    checkpoint to resume)."""
    from decentdp.experiment.record import ResultsFolder
    from decentdp.util.device import resolve_device

    resolve_device(config.engine.device)
    if config.engine.backend == "ray":
        from decentdp.runtime.distributed.ray_backend import check_worker_count

        check_worker_count(config.engine.workers, 1 if config.pools_data else config.topology.agents)
    if out is not None and config.personalized is None:  # (a personalized run checks its own folder)
        ResultsFolder(out).check(config, resume)


def _draw_first_graph(config: ExperimentConfig) -> None:
    """Build the graph the run starts on, as ``build_experiment`` will, so that a random search finding no connected
    draw (or none on the Fiedler target) fails the dry-run, with a GraphError naming the field to change, as it
    would fail the run's start.  Validation checks the rest of the graph's parameters without drawing: a search takes
    milliseconds for most graphs but seconds for a Fiedler target on many agents (or one it cannot meet), which only
    a dry-run, not every config load, should spend.  A run that pools the data (one agent) or a ``[personalized]``
    run (its own similarity graph) draws none; the later graphs of ``topology.redraw_every`` are drawn as the run
    goes."""
    if config.personalized is not None or config.pools_data:
        return
    from decentdp.experiment.build import config_topology

    config_topology(config, config.experiment.seed)


def _per_agent(epsilons: list[float | None]) -> str:
    """Each agent's epsilon, or for more than 20 agents their range and median (the values are in
    ``summary.json``)."""
    if len(epsilons) <= 20:
        return ", ".join(_eps(e) for e in epsilons)
    finite = sorted(math.inf if e is None else e for e in epsilons)
    return (f"{len(epsilons)} agents: min {_eps(finite[0])}, median {_eps(finite[len(finite) // 2])}, "
            f"max {_eps(finite[-1])}; each in summary.json")


# ----------------------------------------------------------------------------- privacy

_DIRECT = ("--sample-rate", "--steps")
_OPACUS = ("--batch-size", "--dataset-size", "--epochs")
_EITHER = "give either --sample-rate and --steps, or --batch-size, --dataset-size and --epochs (Opacus style)"


def _sampling(args: argparse.Namespace) -> tuple[float, int, dict[str, Any]]:
    """The sample rate and step count, from exactly one of the two forms; extra JSON keys of the Opacus form."""
    values = {"--sample-rate": args.sample_rate, "--steps": args.steps, "--batch-size": args.batch_size,
              "--dataset-size": args.dataset_size, "--epochs": args.epochs}
    direct = [name for name in _DIRECT if values[name] is not None]
    opacus = [name for name in _OPACUS if values[name] is not None]
    if direct and opacus:
        raise ConfigError("", f"{' and '.join(direct)} cannot be combined with {' and '.join(opacus)}: "
                              f"{_EITHER}, not both")
    if not direct and not opacus:
        raise ConfigError("", f"no sampling given: {_EITHER}")
    form = _DIRECT if direct else _OPACUS
    missing = [name for name in form if values[name] is None]
    if missing:
        given = " and ".join(direct or opacus)
        raise ConfigError(missing[0], f"missing: {given} also needs {' and '.join(missing)}; {_EITHER}")
    if direct:
        return args.sample_rate, args.steps, {}

    batch, size, epochs = args.batch_size, args.dataset_size, args.epochs
    if size < 1:
        raise ConfigError("--dataset-size", f"must be a positive integer, got {size}")
    if not 1 <= batch <= size:
        raise ConfigError("--batch-size", f"must lie in [1, --dataset-size = {size}], got {batch}")
    if not (math.isfinite(epochs) and epochs > 0):
        raise ConfigError("--epochs", f"must be a positive number, got {epochs!r}")
    steps = math.ceil(Fraction(repr(epochs)) * size / batch)  # exact: 1.1 epochs of 100 records at B=1 is 110
    return batch / size, steps, {"batch_size": batch, "dataset_size": size, "epochs": epochs}


#: The accountant's parameter names -> the ``decentdp privacy`` options that give them.
_PRIVACY_OPTIONS = {"sample_rate": "--sample-rate", "steps": "--steps", "releases_per_step": "--releases-per-step",
                    "noise_multiplier": "--sigma"}


def _privacy(args: argparse.Namespace) -> int:
    try:
        return _answer_privacy(args)
    except ConfigError as error:  # the accountant names its parameters; the user gave options
        if error.field in _PRIVACY_OPTIONS:
            raise ConfigError(_PRIVACY_OPTIONS[error.field], error.message) from None
        raise


def _answer_privacy(args: argparse.Namespace) -> int:
    """``decentdp privacy sigma|epsilon``: the answer, printed (and as JSON with ``--json``)."""
    from decentdp.privacy.accounting import calibrate_noise_multiplier, check_epsilon_delta, epsilon_spent

    if args.question == "sigma":
        check_epsilon_delta(args.epsilon, args.delta, epsilon_field="--epsilon", delta_field="--delta")
    else:
        check_epsilon_delta(math.inf, args.delta, delta_field="--delta")
    sample_rate, steps, opacus = _sampling(args)
    if args.question == "sigma":
        sigma = calibrate_noise_multiplier(args.epsilon, args.delta, sample_rate, steps,
                                           args.releases_per_step, accountant=args.accountant,
                                           relation=args.neighbouring)
        epsilon = args.epsilon
        # Printed rounded up (more noise spends less), so that the figure a user copies into a config stays within
        # the budget; the epsilon reached is the printed sigma's, not the unrounded one's.
        sigma_shown = rounded_text(sigma, None, 6, ROUND_CEILING)
        reached = epsilon_spent(float(sigma_shown), args.delta, sample_rate, steps, args.releases_per_step,
                                accountant=args.accountant, relation=args.neighbouring)
    else:
        sigma = args.sigma
        epsilon = epsilon_spent(sigma, args.delta, sample_rate, steps, args.releases_per_step,
                                accountant=args.accountant, relation=args.neighbouring)
    releases = steps * args.releases_per_step
    name = {"rdp": "RDP (dp_accounting RdpAccountant)", "pld": "PLD (dp_accounting PLDAccountant)",
            "tight": "the smaller of PLD and RDP (dp_accounting)"}[args.accountant]
    if args.accountant == "tight" and args.neighbouring == "replace-one" and sample_rate < 1:
        name = "PLD (dp_accounting PLDAccountant; RDP has no replace-one bound for sampled releases)"
    if args.question == "sigma":
        print(f"noise multiplier sigma = {sigma_shown} reaches epsilon = {epsilon:g} at delta = {args.delta:g}")
        print(f"  epsilon reached with this sigma: {epsilon_text(reached, significant=6)}")
    else:
        print(f"sigma = {sigma:g} spends epsilon = {epsilon_text(epsilon, significant=6)} at delta = {args.delta:g}")
    if opacus:
        print(f"  sample rate q = B/N = {opacus['batch_size']}/{opacus['dataset_size']}; "
              f"steps = ceil(E * N / B) = ceil({opacus['epochs']:g} * {opacus['dataset_size']} / "
              f"{opacus['batch_size']}) = {steps}")
    print(f"  {releases} sampled Gaussian releases at sample rate {sample_rate:g}; accountant: {name}; "
          f"neighbouring: {args.neighbouring}")
    if args.json:
        answer: dict[str, Any] = {"sigma": sigma, "epsilon": _finite_or_inf(epsilon)}
        if args.question == "sigma":  # (the printed sigma's: the JSON sigma is exact, the printed one rounded up)
            answer["sigma_printed"] = float(sigma_shown)
            answer["epsilon_reached"] = _finite_or_inf(reached)
        answer.update({"delta": args.delta, "accountant": args.accountant, "neighbouring": args.neighbouring,
                       "sample_rate": sample_rate,
                       "steps": steps, "releases_per_step": args.releases_per_step, **opacus})
        print(json.dumps(answer))
    return 0


def _finite_or_inf(value: float) -> float | str:
    return value if math.isfinite(value) else "inf"


# ----------------------------------------------------------------------------- list
#
# Every list is read from the code: the config schema's Literal types, the algorithm registry and
# its Settings models, the model registry, and the schema's own cross-field checks.

Entry = dict[str, Any]


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` annotation (also inside ``Literal[...] | None``); () otherwise."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(value for arg in get_args(annotation) for value in _literal_values(arg))


def _schema_choices(section: str, field: str) -> tuple[Any, ...]:
    from decentdp.config import ExperimentConfig

    model = ExperimentConfig.model_fields[section].annotation
    values = _literal_values(model.model_fields[field].annotation)  # type: ignore[union-attr]
    assert values, f"{section}.{field} is not a Literal field"
    return values


def _schema_description(section: str, field: str) -> str:
    from decentdp.config import ExperimentConfig

    model = ExperimentConfig.model_fields[section].annotation
    return model.model_fields[field].description or ""  # type: ignore[union-attr]


def _type_name(annotation: Any) -> str:
    """An annotation as people write it: a ``Literal``'s values, ``X | None`` for ``Optional[X]``, and the type
    inside ``Annotated[X, ...]`` (its validators are functions, printed with their memory address)."""
    choices = _literal_values(annotation)
    if choices:
        return " | ".join(str(choice) for choice in choices)
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type_name(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is not None and get_args(annotation):
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in get_args(annotation))}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _setting_entry(name: str, field: Any) -> Entry:
    """One setting of an algorithm: name, type, default, constraints and description."""
    required = field.is_required()
    return {
        "name": name,
        "type": _type_name(field.annotation),
        "default": None if required else field.get_default(call_default_factory=True),
        "required": required,
        "constraints": [f"{symbol} {getattr(meta, attr)}" for meta in field.metadata
                        for attr, symbol in _BOUNDS if getattr(meta, attr, None) is not None],
        "description": field.description or "",
    }


def _first_line(text: str | None) -> str:
    """A docstring's first paragraph, its lines joined into one (its first physical line may end mid-sentence)."""
    paragraph = inspect.cleandoc(text or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def _algorithm_summary(cls: type) -> str:
    """The first line of the algorithm's module docstring when the module registers only it, else of its own."""
    from decentdp.algorithms import algorithm_class, algorithm_names

    module = sys.modules.get(cls.__module__)
    alone = [algorithm_class(name).__module__ for name in algorithm_names()].count(cls.__module__) == 1
    return (_first_line(getattr(module, "__doc__", None)) if alone else "") or _first_line(cls.__doc__)


def _list_algorithms() -> list[Entry]:
    from decentdp.algorithms import algorithm_class, algorithm_names

    entries = []
    for name in algorithm_names():
        cls = algorithm_class(name)
        entries.append({
            "name": name,
            "description": _algorithm_summary(cls),
            "schedules": list(cls.schedules),
            "pools_data": bool(cls.pools_data),
            "settings": [_setting_entry(key, field) for key, field in cls.Settings.model_fields.items()],
        })
    return entries


def _names(values: Sequence[Any]) -> list[Entry]:
    return [{"name": value} for value in values]


def _graph_needs() -> dict[str, list[str]]:
    """The topology parameter each graph requires."""
    from decentdp.config import GRAPH_REQUIRES

    return {graph: [GRAPH_REQUIRES[graph]] if graph in GRAPH_REQUIRES else []
            for graph in _schema_choices("topology", "graph")}


def _list_graphs() -> list[Entry]:
    return [{"name": graph, "needs": needs} for graph, needs in _graph_needs().items()]


def _list_models() -> list[Entry]:
    from decentdp.models import MODELS

    entries = []
    for name in _schema_choices("model", "name"):
        builder = MODELS.get(name)
        options = {} if builder is None else {
            parameter.name: None if parameter.default is inspect.Parameter.empty else parameter.default
            for parameter in inspect.signature(builder).parameters.values()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
        entries.append({"name": name, "options": options})
    return entries


def _list_schedules() -> list[Entry]:
    from decentdp.algorithms import algorithm_class, algorithm_names

    entries = []
    for kind in _schema_choices("schedule", "kind"):
        if kind == "auto":
            about = _schema_description("schedule", "kind").removeprefix(f"{kind}: ")
            entries.append({"name": kind, "description": about, "algorithms": list(algorithm_names())})
        else:
            entries.append({"name": kind, "algorithms": [name for name in algorithm_names()
                                                         if kind in algorithm_class(name).schedules]})
    return entries


def _list_optimizers() -> list[Entry]:
    from decentdp.algorithms import algorithm_class, algorithm_names

    users: dict[Any, list[str]] = {}
    for name in algorithm_names():
        field = algorithm_class(name).Settings.model_fields.get("optimizer")
        if field is not None:
            for optimizer in _literal_values(field.annotation):
                users.setdefault(optimizer, []).append(name)
    return [{"name": optimizer, "algorithms": names} for optimizer, names in users.items()]


def _section_model(annotation: Any) -> Any:
    """The section model of an ``ExperimentConfig`` field (an optional section's, ``X | None``, included)."""
    from pydantic import BaseModel

    return next(kind for kind in (annotation, *get_args(annotation))
                if isinstance(kind, type) and issubclass(kind, BaseModel))


def _list_fields() -> list[Entry]:
    """Every field of every config section, optional ones (``[personalized]``) included, as ``section.key`` with its
    type, default, constraints and description (``[algorithm]``'s own settings: ``decentdp list algorithms``)."""
    from decentdp.config import ExperimentConfig

    entries = []
    for section, field in ExperimentConfig.model_fields.items():
        for key, setting in _section_model(field.annotation).model_fields.items():
            entries.append({**_setting_entry(key, setting), "name": f"{section}.{key}"})
    return entries


# category -> (config key it fills, how to list it)
_CATEGORIES: dict[str, tuple[str, Callable[[], list[Entry]]]] = {
    "algorithms": ("algorithm.name", _list_algorithms),
    "datasets": ("data.dataset", lambda: _names(_schema_choices("data", "dataset"))),
    "partitions": ("data.partition", lambda: _names(_schema_choices("data", "partition"))),
    "graphs": ("topology.graph", _list_graphs),
    "mixings": ("topology.mixing", lambda: _names(_schema_choices("topology", "mixing"))),
    "models": ("model.name", _list_models),
    "schedules": ("schedule.kind", _list_schedules),
    "lr-schedules": ("algorithm.lr_schedule", lambda: _names(_schema_choices("algorithm", "lr_schedule"))),
    "accountants": ("privacy.accountant", lambda: _names(_schema_choices("privacy", "accountant"))),
    "optimizers": ("algorithm.optimizer", _list_optimizers),
    "fields": ("section.key", _list_fields),
}


def _category(what: str) -> str:
    text = what.strip().lower().replace("_", "-")
    for candidate in (text, f"{text}s"):  # "graph" is "graphs"
        if candidate in _CATEGORIES:
            return candidate
    raise ConfigError("WHAT", f"unknown category {what!r}; choose one of: {', '.join(_CATEGORIES)}")


def _toml_value(value: Any) -> str:
    return json.dumps(value, default=str) if value is not None else "(none)"


def _print_category(name: str, key: str, entries: list[Entry]) -> None:
    print(f"{name} ({key})")
    width = max((len(str(entry["name"])) for entry in entries), default=0) + 2
    for entry in entries:
        label = f"  {str(entry['name']):<{width}}"
        if name == "algorithms":
            extra = "; pools all agents' data (no graph)" if entry["pools_data"] else ""
            print(f"{label}{entry['description']}")
            print(f"  {'':<{width}}schedules: {', '.join(entry['schedules'])}{extra}")
            settings = entry["settings"]
            key_width = max((len(s["name"]) for s in settings), default=0) + 2
            for setting in settings:
                kind = setting["type"] + (f" ({', '.join(setting['constraints'])})" if setting["constraints"] else "")
                default = "required" if setting["required"] else f"default {_toml_value(setting['default'])}"
                about = f"  {setting['description']}" if setting["description"] else ""
                print(f"  {'':<{width}}  {setting['name']:<{key_width}}{kind}; {default}{about}")
        elif name == "fields":
            kind = entry["type"] + (f" ({', '.join(entry['constraints'])})" if entry["constraints"] else "")
            default = "required" if entry["required"] else f"default {_toml_value(entry['default'])}"
            about = f"  {entry['description']}" if entry["description"] else ""
            print(f"{label}{kind}; {default}{about}")
        elif name == "graphs":
            print(f"{label}needs topology.{', topology.'.join(entry['needs'])}" if entry["needs"] else label.rstrip())
        elif name == "models":
            options = ", ".join(f"{key} = {_toml_value(value)}" for key, value in entry["options"].items())
            print(f"{label}options: {options}" if options else label.rstrip())
        elif name in ("schedules", "optimizers"):
            about = entry.get("description") or f"algorithms: {', '.join(entry['algorithms']) or 'none yet'}"
            print(f"{label}{about}")
        else:
            print(label.rstrip())


def _list(args: argparse.Namespace) -> int:
    chosen = [_category(args.what)] if args.what is not None else list(_CATEGORIES)
    listed = {name: _CATEGORIES[name][1]() for name in chosen}
    if args.json:
        from decentdp.results.files import strict_json

        print(json.dumps(strict_json(listed), default=str))
        return 0
    for index, (name, entries) in enumerate(listed.items()):
        if index:
            print()
        _print_category(name, _CATEGORIES[name][0], entries)
    return 0


# ----------------------------------------------------------------------------- init

# The settings of experiments/demo.toml (tests/cli/test_cli.py checks that the two agree).
_DEMO_SUMMARY = ("The quick start: 10 agents learn handwritten digits (scikit-learn's bundled 8x8 digits, no\n"
                 "download) over a random connected graph with DP-DSGT, each agent's data (epsilon, delta)-DP.")
_DEMO: dict[str, Any] = {
    "experiment": {"name": "demo", "seed": 0, "rounds": 300, "eval_every": 25},
    "data": {"dataset": "digits", "partition": "iid"},
    "topology": {"graph": "erdos-renyi", "agents": 10, "p": 0.4, "mixing": "metropolis-hastings"},
    "model": {"name": "mlp", "options": {"hidden": 64}},
    "algorithm": {"name": "dp-dsgt", "lr": 0.4, "lr_schedule": "cosine", "lr_final": 0.01, "batch_size": 32},
    "privacy": {"epsilon": 4.0, "delta": 1e-5, "clip": 1.0},
}


def _template(name: str, out: Path) -> tuple[str, dict[str, Any]]:
    """The comment header and resolved, validated config of template ``name``, named after ``out``."""
    from decentdp.algorithms import algorithm_class, algorithm_names
    from decentdp.config import validate_config

    templates = ("demo", *algorithm_names())
    if name not in templates:
        raise ConfigError("--template", f"unknown template {name!r}; choose one of: {', '.join(templates)}")
    raw = copy.deepcopy(_DEMO)
    about = _DEMO_SUMMARY
    if name != "demo":
        raw["algorithm"]["name"] = name
        raw["experiment"]["name"] = f"demo-{name}"
        about = f"The quick-start demo with algorithm '{name}': {_algorithm_summary(algorithm_class(name))}"
        if not algorithm_class(name).communicates:  # (no graph: the demo's would be reported as changing nothing)
            raw["topology"] = {"agents": raw["topology"]["agents"]}
        elif not algorithm_class(name).reads_mixing:
            del raw["topology"]["mixing"]
        if not algorithm_class(name).adds_noise:  # a run of it must say it is not private
            raw["privacy"]["epsilon"] = "inf"
            about += "\nIt adds no noise, so its run is deliberately non-private: privacy.epsilon = 'inf'."
    config = validate_config(raw)
    try:  # experiment.name names the results folder: take OUT's file name when it is a valid name
        config = validate_config({**raw, "experiment": {**raw["experiment"], "name": out.stem}})
    except ConfigError:
        pass
    header = "\n".join(f"# {line}" for line in [
        f"Written by `decentdp init --template {name}` (decentdp {__version__}).",
        *about.splitlines(),
        "Every setting is spelled out at its resolved value; allowed values: `decentdp list`.",
        f"Check edits with `decentdp run {out.name} --dry-run`.",
    ])
    return header + "\n\n", config.to_toml_dict()


def _init(args: argparse.Namespace) -> int:
    import tomli_w

    out = Path(args.out)
    header, data = _template(args.template, out)
    text = header + tomli_w.dumps(data)
    if out.exists():
        raise ConfigError("OUT", f"{out} already exists; refusing to overwrite it (choose another name or remove it)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # (not OUT: it is a file of the folder's name that exists)
        raise ConfigError("OUT", f"cannot write {out}: {out.parent} is a file, not a folder") from None
    except OSError as exc:
        raise ConfigError("OUT", f"cannot write {out}: {exc.strerror or exc}") from None
    try:
        with out.open("x", encoding="utf-8") as file:  # "x": never replaces a file created meanwhile
            file.write(text)
    except FileExistsError:
        raise ConfigError("OUT", f"{out} already exists; refusing to overwrite it") from None
    except OSError as exc:
        raise ConfigError("OUT", f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {out} (template {args.template}); check it with: decentdp run {out} --dry-run")
    return 0


# ----------------------------------------------------------------------------- entry point

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"run": _run, "privacy": _privacy, "list": _list,
                                                             "init": _init, "report": report_command.run,
                                                             "sweep": sweep_command.run, "audit": audit_command.run,
                                                             "attack": audit_command.run}


def _is_out_of_memory(error: RuntimeError) -> bool:
    """Whether a RuntimeError is an allocator's (torch's CPU allocator, CUDA's out-of-memory), not a bug."""
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``decentdp`` command."""
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except DecentDPError as error:
        print(f"decentdp: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("decentdp: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as error:  # numpy's and torch's allocators; CUDA's OutOfMemoryError
        if isinstance(error, RuntimeError) and not _is_out_of_memory(error):
            raise
        print(f"decentdp: error: out of memory ({str(error).splitlines()[0][:160]}): the command asks for more "
              "memory than this machine has; lower the sizes it sets (model.options, topology.agents, "
              "algorithm.batch_size, personalized.dim or wakeups, audit.models)", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # the reader went away (``decentdp report --json | head``): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python would report the flush at exit)
        return 0

