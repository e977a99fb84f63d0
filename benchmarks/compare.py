"""A/B comparison of a benchmark script between two source trees, interleaved in one run.

Why: this project's machine is a VM whose speed drifts by 10-30 % over minutes, so figures taken
in two separate runs (before a change, then after it) cannot support a claim such as "within 10 %
of the previous revision".  This harness runs the same benchmark script of both trees in turn,
``--repeats`` times, alternating the order (before, after; then after, before; ...) so that a
drift hits both sides alike, and reports per figure the median of each side and their ratio.

How each run is made: ``<tree>/benchmarks/<script>`` runs as a subprocess with ``cwd=<tree>``,
the same interpreter and the same environment, except that ``<tree>/src`` is prepended to
``PYTHONPATH``.  That is enough to make ``import decentdp`` resolve to that tree even though the
virtualenv has an editable install of one of them: the install is a plain path entry
(``__editable__.decentdp-*.pth`` holding ``.../src``), which ``site`` appends to ``sys.path``
*after* the ``PYTHONPATH`` entries, and ``decentdp`` is a regular package, so the first tree on
the path wins for every submodule too.  The environment variable (rather than a wrapper that
edits ``sys.path``) also reaches the subprocesses a script starts itself (``scaling.py`` runs each
point in a fresh ``sys.executable``).  Before timing anything the harness checks, with the same
command line and environment, where ``decentdp`` resolves for each tree, and stops if it is not
that tree's ``src`` (an editable install of the import-hook kind would fail this check).

Each script, given ``--json``, prints one JSON object on its last line of stdout.  Nested
objects and lists are flattened into dotted keys (``settings.mlp_n10.round_seconds.dp.median``,
``points.3.peak_bytes``); numeric leaves are kept (booleans and strings are dropped).  The
harness adds ``harness.wall_seconds``, each subprocess's wall-clock time.  Keys found on one side
only (a refactor may rename some) are listed separately.

Run from the repository root::

    .venv/bin/python benchmarks/compare.py --before ../before --after . --script dp_overhead.py \\
        --script scaling.py --args="--quick --json" --repeats 3 --out results/compare.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIDES = ("before", "after")
WALL_KEY = "harness.wall_seconds"
TAIL_LINES = 40
# Asks the interpreter where ``decentdp`` would be imported from, without importing it (no torch start-up).
PROBE = "import importlib.util as u; s = u.find_spec('decentdp'); print(s.origin if s else '')"


class HarnessError(Exception):
    """A failure to report to the user as one clear message, without a traceback."""


@dataclass
class Side:
    """One tree under comparison and the figures its runs produced, per flattened key."""

    name: str
    tree: Path
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # script -> key -> one value per run


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a parsed JSON value, keyed by their dotted path (list items by index).

    Booleans are not figures (``True`` would otherwise read as 1.0), so they are dropped with strings and nulls.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return {}
    if isinstance(value, int | float):
        return {prefix: float(value)}
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
    elif isinstance(value, list):
        items = [(str(index), item) for index, item in enumerate(value)]
    else:
        return {}
    flat: dict[str, float] = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else key))
    return flat


def child_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``<tree>/src`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    src = str(tree / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    return env


def tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def check_tree(python: str, side: Side, scripts: list[str]) -> None:
    """Fail early unless every script exists in the tree and ``decentdp`` resolves to the tree's ``src``."""
    for script in scripts:
        path = side.tree / "benchmarks" / script
        if not path.is_file():
            raise HarnessError(f"{side.name} tree {side.tree}: no benchmark script {path}")
    if not (side.tree / "src" / "decentdp").is_dir():
        raise HarnessError(f"{side.name} tree {side.tree}: no package src/decentdp there")
    probe = subprocess.run([python, "-c", PROBE], cwd=side.tree, env=child_env(side.tree),
                           capture_output=True, text=True)
    origin = probe.stdout.strip()
    if probe.returncode != 0 or not origin:
        raise HarnessError(f"{side.name} tree {side.tree}: cannot locate decentdp with {python}\n"
                           f"{tail(probe.stderr)}")
    if not Path(origin).resolve().is_relative_to((side.tree / "src").resolve()):
        raise HarnessError(f"{side.name} tree {side.tree}: decentdp resolves to {origin}, not to {side.tree / 'src'}; "
                           "PYTHONPATH did not take precedence over the installed package")


def run_script(python: str, side: Side, script: str, args: list[str], timeout: float | None) -> dict[str, float]:
    """Run ``script`` of ``side``'s tree once and return its flattened figures plus its wall time."""
    command = [python, str(side.tree / "benchmarks" / script), *args]
    where = f"{script} of the {side.name} tree ({side.tree})"
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=side.tree, env=child_env(side.tree), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(f"{where} ran past --timeout {timeout:g} s") from exc
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise HarnessError(f"{where} failed with exit status {done.returncode}: {shlex.join(command)}\n"
                           f"--- last lines of its stderr ---\n{tail(done.stderr) or '(empty)'}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        parsed = json.loads(lines[-1])
        if not isinstance(parsed, dict):
            raise ValueError("not a JSON object")
    except (IndexError, ValueError) as exc:
        raise HarnessError(f"{where}: its last line of stdout is not a JSON object ({exc}); does it take --json?\n"
                           f"--- last lines of its stdout ---\n{tail(done.stdout) or '(empty)'}") from exc
    return {**flatten(parsed), WALL_KEY: wall}


def run_all(python: str, sides: tuple[Side, Side], scripts: list[str], args: list[str], repeats: int,
            timeout: float | None) -> None:
    """Run every script of both trees ``repeats`` times, the order of the two sides flipping each repeat."""
    for repeat in range(repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        for script in scripts:
            for side in order:
                print(f"[{repeat + 1}/{repeats}] {script:<20} {side.name:<6} ({side.tree}) ...", end="",
                      file=sys.stderr, flush=True)
                figures = run_script(python, side, script, args, timeout)
                print(f" {figures[WALL_KEY]:.1f} s", file=sys.stderr, flush=True)
                per_key = side.values.setdefault(script, {})
                for key, value in figures.items():
                    per_key.setdefault(key, []).append(value)


def median(values: list[float]) -> float | None:
    """The median of ``values``, ``None`` when there are none."""
    return statistics.median(values) if values else None


def ratio(after: float | None, before: float | None) -> float | None:
    """``after / before``, ``None`` where it is undefined (a side missing, or a zero before)."""
    if after is None or before is None or before == 0:
        return None
    return after / before


def compare(before: Side, after: Side, scripts: list[str], pattern: re.Pattern[str]) -> dict[str, dict[str, Any]]:
    """Per script and key matching ``pattern``: each side's values, their medians and the ratio after/before.

    A key seen on one side only has an empty list, a null median and a null ratio for the other.
    """
    result: dict[str, dict[str, Any]] = {}
    for script in scripts:
        old, new = before.values.get(script, {}), after.values.get(script, {})
        entries: dict[str, Any] = {}
        for key in sorted(old.keys() | new.keys()):
            if not pattern.search(key):
                continue
            b, a = old.get(key, []), new.get(key, [])
            entries[key] = {"before": b, "after": a, "before_median": median(b), "after_median": median(a),
                            "ratio": ratio(median(a), median(b))}
        result[script] = entries
    return result


def fmt(value: float | None) -> str:
    """A figure in at most 6 significant digits, ``-`` when absent."""
    return "-" if value is None else f"{value:.6g}"


def is_constant(entry: dict[str, Any]) -> bool:
    """True if every run of both sides gave the same value: a setting or machine fact, not a measurement."""
    values = entry["before"] + entry["after"]
    return bool(entry["before"]) and bool(entry["after"]) and len(set(values)) == 1


def print_report(comparison: dict[str, dict[str, Any]], before: Side, after: Side, repeats: int, tolerance: float,
                 show_constant: bool) -> None:
    """The human-readable tables, one per script, on stdout."""
    print(f"before: {before.tree}\nafter:  {after.tree}\n{repeats} repeat(s) per side, interleaved; "
          f"medians over repeats; ratio = after / before; '!' marks |ratio - 1| > {tolerance:g}")
    for script, entries in comparison.items():
        both = {k: e for k, e in entries.items() if e["before"] and e["after"]}
        shown = {k: e for k, e in both.items() if show_constant or not is_constant(e)}
        width = max([len(k) for k in shown] + [len("key")])
        print(f"\n{script}")
        print(f"  {'key':<{width}}  {'before':>12}  {'after':>12}  {'ratio':>7}")
        for key, e in shown.items():
            r = e["ratio"]
            flag = " !" if r is not None and (not math.isfinite(r) or abs(r - 1) > tolerance) else ""
            print(f"  {key:<{width}}  {fmt(e['before_median']):>12}  {fmt(e['after_median']):>12}  "
                  f"{'-' if r is None else f'{r:.3f}':>7}{flag}")
        hidden = len(both) - len(shown)
        if hidden:
            print(f"  ({hidden} key(s) with one identical value in every run of both sides, settings and machine "
                  "facts, not shown; --show-constant lists them)")
        for present, missing in (("before", "after"), ("after", "before")):
            only = [k for k, e in entries.items() if e[present] and not e[missing]]
            if only:
                print(f"  only in {present} ({len(only)}): " + ", ".join(only))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                     epilog="Progress goes to stderr; the table (and the JSON line) to stdout.")
    parser.add_argument("--before", type=Path, required=True,
                        help="root of the baseline source tree (holds src/decentdp and benchmarks/)")
    parser.add_argument("--after", type=Path, required=True, help="root of the source tree to compare with it")
    parser.add_argument("--script", action="append", required=True, metavar="NAME",
                        help="benchmark script in <tree>/benchmarks/ to run, e.g. dp_overhead.py (repeatable)")
    parser.add_argument("--args", default="--json",
                        help="arguments passed to every script, one shell-quoted string, e.g. --args='--quick --json' "
                             "(default --json; --json is added if missing, the harness reads the JSON line)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each script per side; the order of the sides flips every repeat (default 3)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for both sides (default: the one running this harness)")
    parser.add_argument("--timeout", type=float, help="seconds one script run may take before the harness gives up")
    parser.add_argument("--keys", default="", metavar="REGEX",
                        help="report only keys matching this regular expression (re.search; default: all)")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="mark ratios further than this from 1 with '!' in the table (default 0.10)")
    parser.add_argument("--show-constant", action="store_true",
                        help="also list keys whose value never changes (settings, machine facts) in the table")
    parser.add_argument("--json", action="store_true",
                        help='end stdout with one JSON line {"<script>": {"<key>": {"before": [...], "after": [...], '
                             '"before_median": .., "after_median": .., "ratio": ..}}}')
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write that JSON to FILE")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        args.keys = re.compile(args.keys)
    except re.error as exc:
        parser.error(f"--keys: {exc}")
    args.args = shlex.split(args.args)
    if "--json" not in args.args:
        args.args.append("--json")
    return args


def main(argv: list[str] | None = None) -> int:
    """Check both trees, run the scripts interleaved, report; the exit status is 1 on any failure."""
    args = parse_args(argv)
    before = Side("before", args.before.resolve())
    after = Side("after", args.after.resolve())
    if before.tree == after.tree:
        print(f"note: both sides are {before.tree}; the ratios measure only the noise", file=sys.stderr)
    try:
        for side in (before, after):
            check_tree(args.python, side, args.script)
        start = time.perf_counter()
        run_all(args.python, (before, after), args.script, args.args, args.repeats, args.timeout)
    except HarnessError as exc:
        print(f"\ncompare.py: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncompare.py: interrupted", file=sys.stderr)
        return 130
    print(f"total wall time {time.perf_counter() - start:.1f} s", file=sys.stderr)
    comparison = compare(before, after, args.script, args.keys)
    print_report(comparison, before, after, args.repeats, args.tolerance, args.show_constant)
    # allow_nan: a script's figures may be inf or nan; Python's json reads them back.
    line = json.dumps(comparison, sort_keys=True)
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(line + "\n")
        except OSError as exc:
            print(f"compare.py: cannot write --out {args.out}: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
