"""``decentdp audit mia|messages|one-run CONFIG`` and ``decentdp attack inversion CONFIG``.

Each command prints a readable summary and, with ``--json``, ends with one JSON line (strict JSON: no NaN or
Infinity, null instead); with ``--out`` it writes a results folder (``audit.json`` or ``inversion.json``,
``scores.csv``, and for the attack ``reconstructions.png``), refusing a non-empty one, or one that cannot be
created, before anything runs.  The JSON line is printed before the folder is written, so a folder that fails
at the end loses no result.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decentdp.errors import ConfigError
from decentdp.results.files import check_creatable, epsilon_text, lower_bound_text
from decentdp.util.arguments import add_threads_option, with_threads

_AUDIT_DESCRIPTION = """\
Lower-bound a config's epsilon by attack.  The config is an experiment config (as for `decentdp run`)
with an [audit] table.  `mia`: the membership-inference audit of Bayrooti et al. (App. D), many
trainings on D and D' = D + {blank image} as blocks of one simulation.  `messages`: a neighbour
records an agent's releases and tests for a Dirac gradient canary (tight for the Gaussian mechanism).
`one-run`: the same adversary against many canaries, each held with probability 1/2, in ONE training
(Steinke, Nasr & Jagielski 2023): cheap, sound, but a weaker bound than the many-run audits.
A bound above the nominal epsilon means the noise or its accounting is wrong."""

_ATTACK_DESCRIPTION = """\
Gradient inversion (DLG, iDLG, Geiping et al.) against an agent's released gradient, cross-gradient or
difference of consecutive momenta (audit.release), without DP and at each epsilon of [audit] epsilons;
scores are MSE, PSNR and SSIM (scikit-image, the `audit` extra: pip install 'decentdp[audit]')."""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="experiment TOML with an [audit] table "
                                                         "(examples: experiments/audits/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set privacy.epsilon=4 or --set audit.chunk=500")
    add_threads_option(parser)
    parser.add_argument("--data-dir", help="directory holding dataset files (overrides data.data_dir)")
    parser.add_argument("--out", help="results folder to write (must be new or empty)")
    parser.add_argument("--json", action="store_true", help="end with the summary as one JSON line")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``audit`` (``mia``, ``messages``, ``one-run``) and ``attack`` (``inversion``) to the CLI's commands."""
    audit = commands.add_parser("audit", help="empirical epsilon lower bounds (membership inference, messages)",
                                description=_AUDIT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = audit.add_subparsers(dest="audit_kind", required=True, metavar="KIND",
                                 help="mia, messages or one-run (each has its own --help)")
    for name, text in (("mia", "membership inference on the loss of a blank image (Bayrooti et al., App. D)"),
                       ("messages", "a neighbour's test for a Dirac gradient canary in an agent's releases")):
        sub = kinds.add_parser(name, help=text, description=text)
        _common(sub)
        sub.add_argument("--models", type=int, metavar="M", help="trainings per world (overrides audit.models)")
        sub.add_argument("--chunk-dir", metavar="DIR",
                         help="keep each chunk's scores in DIR as it finishes: a killed audit resumes there, and "
                              "processes given --chunks share one audit; the bound covers the chunks DIR holds")
        sub.add_argument("--chunks", metavar="A:B",
                         help="train only chunks A to B-1 (of audit.models / audit.chunk), reading the others from "
                              "--chunk-dir where present (A:A trains none)")
    text = ("one training with audit.canaries Dirac canaries, each held with probability 1/2 (Steinke, Nasr & "
            "Jagielski 2023, Theorem 5.2)")
    _common(kinds.add_parser("one-run", help=text, description=text))
    attack = commands.add_parser("attack", help="privacy attacks on released messages (gradient inversion)",
                                 description=_ATTACK_DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    attacks = attack.add_subparsers(dest="attack_kind", required=True, metavar="KIND",
                                   help="inversion (its own --help lists its options)")
    _common(attacks.add_parser("inversion", help="reconstruct an agent's records from one of its messages",
                               description=_ATTACK_DESCRIPTION))


def _out_folder(out: str | None) -> Path | None:
    """``--out``, checked and created before anything runs (an audit may take hours): a new or empty directory."""
    if out is None:
        return None
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError("--out", f"{path} exists and is not an empty directory; choose a new folder")
    check_creatable(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--out", f"cannot create {path}: {exc.strerror or exc}") from None
    return path


def _publish(temporary: str, path: Path) -> None:
    """Give a finished temporary file the permissions a plain ``open`` would (umask) and move it into place."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)
    os.replace(temporary, path)


def _write(path: Path, text: str) -> None:
    """Write ``text`` atomically (a temporary file renamed into place)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as file:
        file.write(text)
    _publish(file.name, path)


def _csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as CSV atomically."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _publish(file.name, path)


def _jsonable(value: Any) -> Any:
    """``value`` (a summary) with every non-finite float as null, nested values included: infinite is one encoding
    of "no finite epsilon", as in run summaries, and NaN (an undefined number) has none in JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


def _json(summary: dict[str, Any], indent: int | None = None) -> str:
    """``summary`` as strict JSON (what every JSON parser reads: no NaN or Infinity)."""
    return json.dumps(_jsonable(summary), indent=indent, allow_nan=False)


#: What a command leaves to write into ``--out`` once its summary is printed.
Writer = Callable[[Path], None]


def run(args: argparse.Namespace) -> int:
    """Handler of ``decentdp audit`` and ``decentdp attack``."""
    from decentdp.audit.settings import load_audit_config
    from decentdp.util.threads import apply_threads

    overrides = list(args.overrides)
    if getattr(args, "models", None) is not None:
        overrides.append(f"audit.models={args.models}")
    config, audit = load_audit_config(args.config, with_threads(overrides, args.threads))
    out = _out_folder(args.out)  # once the config is valid (a typo leaves no folder), before anything trains
    print(apply_threads(config.engine.threads).describe(), file=sys.stderr)  # as decentdp run does
    if args.command == "attack":
        summary, write = _attack(config, audit, args.data_dir)
    elif args.audit_kind == "one-run":
        summary, write = _one_run(config, audit, args.data_dir)
    else:
        summary, write = _audit(args.audit_kind, config, audit, args.data_dir,
                                _chunk_store(args.chunk_dir, args.chunks))
    if args.json:
        print(_json(summary), flush=True)  # first: a results folder that cannot be written loses nothing
    if out is not None:
        try:
            write(out)
        except OSError as exc:
            kept = ("the JSON line above holds the summary" if args.json
                    else f"the summary, written nowhere else: {_json(summary)}")
            raise ConfigError("--out", f"cannot write the results into {out} ({exc.strerror or exc}); {kept}"
                              ) from None
    return 0


def _chunk_store(folder: str | None, chunks: str | None) -> Any:
    """``--chunk-dir`` and ``--chunks`` as a :class:`~decentdp.audit.blocks.ChunkStore` (None without a folder)."""
    from decentdp.audit.blocks import ChunkStore

    if folder is None:
        if chunks is not None:
            raise ConfigError("--chunks", "a process that trains some chunks needs --chunk-dir, where the chunks "
                                          "of the audit meet")
        return None
    only = None
    if chunks is not None:
        first, _, last = chunks.partition(":")
        try:
            only = range(int(first), int(last))
        except ValueError:
            raise ConfigError("--chunks", f"{chunks!r} is not A:B (two chunk indices, e.g. 0:10)") from None
        if not 0 <= only.start <= only.stop:
            raise ConfigError("--chunks", f"{chunks!r}: need 0 <= A <= B (A = B trains none: the bound of the chunks "
                                          "--chunk-dir holds)")
    return ChunkStore(Path(folder), only)


def _audit(kind: str, config: Any, audit: Any, data_dir: str | None, store: Any = None
           ) -> tuple[dict[str, Any], Writer]:
    from decentdp.audit.blocks import audit_experiment
    from decentdp.audit.messages import run_message_audit
    from decentdp.audit.mia import run_membership_audit

    experiment = audit_experiment(config, data_dir=data_dir)
    print(f"audit {kind}: {config.algorithm.name}, {audit.models} trainings per world in blocks of "
          f"{experiment.topology.n_agents} agent(s), {2 * audit.chunk} blocks ({audit.chunk} per world) at a time")
    outcome = (run_membership_audit(experiment, audit, store) if kind == "mia"
               else run_message_audit(experiment, audit, store=store))
    summary = outcome.summary
    wall = summary["wall_seconds"]
    print(f"epsilon lower bound {lower_bound_text(summary['epsilon_lower_bound'])} (eq. 25 alone: "
          f"{lower_bound_text(summary['epsilon_eq25'])}) "
          f"at {100 * summary['confidence']:g}% confidence; nominal epsilon {summary['epsilon_nominal']:g}, the "
          f"ledger's {epsilon_text(summary['epsilon_ledger'], significant=4)}; "
          + (f"{wall:.1f} s of training" if wall is not None
             else "training time unknown (chunks written before chunks recorded their time)"))
    summary["bound_exceeds"] = _verdict(summary)
    if not summary["complete"]:
        print(f"interim bound over {summary['chunks']} chunks: its confidence holds for one evaluation, so report "
              "the bound of the finished audit, not the largest of several interim ones")

    def write(out: Path) -> None:
        selection = summary["selection_runs"]
        member_seen = non_member_seen = 0
        rows = []
        for score, member in zip(outcome.scores.tolist(), outcome.member.tolist(), strict=True):
            seen = member_seen if member else non_member_seen
            rows.append({"score": score, "member": int(member), "part": "select" if seen < selection else "evaluate"})
            member_seen, non_member_seen = member_seen + member, non_member_seen + (not member)
        _save(out, summary, rows)

    return summary, write


def _one_run(config: Any, audit: Any, data_dir: str | None) -> tuple[dict[str, Any], Writer]:
    from decentdp.audit.blocks import audit_experiment
    from decentdp.audit.one_run import run_one_run_audit

    experiment = audit_experiment(config, data_dir=data_dir)
    print(f"audit one-run: {config.algorithm.name}, one training; agent {audit.target} holds each of "
          f"{audit.canaries} canaries with probability 1/2")
    outcome = run_one_run_audit(experiment, audit)
    summary = outcome.summary
    print(f"epsilon lower bound {lower_bound_text(summary['epsilon_lower_bound'])} at {100 * summary['confidence']:g}% "
          f"confidence: {summary['correct']} of {summary['guesses']} guesses right ({summary['guesses_per_side']} "
          f"in, as many out; the best of {len(summary['guess_grid'])} numbers of guesses); nominal epsilon "
          f"{summary['epsilon_nominal']:g}, the ledger's {epsilon_text(summary['epsilon_ledger'], significant=4)}; "
          f"{summary['wall_seconds']:.1f} s")
    summary["bound_exceeds"] = _verdict(summary)

    def write(out: Path) -> None:
        columns = zip(outcome.coordinates, outcome.included, outcome.scores, outcome.guesses, strict=True)
        _save(out, summary, [{"canary": k, "coordinate": int(j), "included": int(member), "score": float(score),
                              "guess": int(guess)} for k, (j, member, score, guess) in enumerate(columns)])

    return summary, write


#: The epsilons an audit's bound is checked against: the target's budget, and what its ledger says was spent (for
#: some algorithms far less than the budget); a lower bound above either refutes it.
_CLAIMS = {"epsilon_nominal": "the nominal epsilon (the target's budget)",
           "epsilon_ledger": "the ledger's epsilon (what the accountant reports as spent)"}


def _verdict(summary: dict[str, Any]) -> list[str]:
    """What an audit's bound says about the epsilons claimed for the target (:data:`_CLAIMS`): nothing to refute,
    or a warning naming each one the bound exceeds; returns their keys (the summary's ``bound_exceeds``)."""
    nominal = summary["epsilon_nominal"]
    if math.isinf(nominal):
        print("the config is non-private: there is no guarantee to refute (the bound is unbounded above); "
              "the bound measures the attack's power")
        return []
    bound = summary["epsilon_lower_bound"]
    exceeded = [key for key in _CLAIMS if summary.get(key) is not None and bound > summary[key]]
    if exceeded:
        failure = 100 * (1 - summary["confidence"])
        claims = " and ".join(f"{_CLAIMS[key]}, {epsilon_text(summary[key], significant=4)}" for key in exceeded)
        print(f"WARNING: the bound {lower_bound_text(bound)} exceeds {claims}: the noise or its accounting is "
              f"probably wrong (a correct mechanism whose epsilon is exactly tight crosses it in at most {failure:g}% "
              "of audits)")
    return exceeded


def _save(out: Path, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """An audit's results folder: ``audit.json`` (the summary) and ``scores.csv`` (``rows``)."""
    _write(out / "audit.json", _json(summary, indent=2) + "\n")
    _csv(out / "scores.csv", rows)
    print(f"wrote {out}/audit.json and scores.csv", file=sys.stderr)


def _attack(config: Any, audit: Any, data_dir: str | None) -> tuple[dict[str, Any], Writer]:
    from decentdp.audit.inversion import run_inversion, save_figure

    outcome = run_inversion(config, audit, data_dir)
    summary = outcome.summary
    print(f"{audit.attack} on a {audit.release} of {config.model.name} ({config.data.dataset}): SSIM "
          f"{summary['ssim_nonprivate']:.3f} without DP, {summary['ssim_private']:.3f} at epsilon "
          f"{audit.epsilons[0]:g}; PSNR {summary['psnr_nonprivate']:.1f} / {summary['psnr_private']:.1f} dB")

    def write(out: Path) -> None:
        _write(out / "inversion.json", _json(summary, indent=2) + "\n")
        _csv(out / "scores.csv", outcome.rows)
        save_figure(outcome.figure, out / "reconstructions.png",
                    f"{audit.attack} on {audit.release}s of {config.model.name}, {config.data.dataset}")
        print(f"wrote {out}/inversion.json, scores.csv and reconstructions.png", file=sys.stderr)

    return summary, write
