"""``decentdp report``: one table (and figures) from any set of results folders.

Every finished run's folder holds its resolved ``config.toml``, ``summary.json`` (final metrics, epsilon
spent) and ``metrics.jsonl`` (one row per evaluation); see :mod:`decentdp.experiment.record`.  The report

1. finds the runs under the given paths (a results folder, or any folder holding results folders);
2. flattens each run's config to dotted fields (``privacy.epsilon``), leaves out the fields the run did not
   read (another mode's, or a knob whose switch is off: ``ExperimentConfig.unread_fields``), and groups the runs
   by the fields that differ between them, seeds aside (so each group is one setting over its seeds);
3. gives each group the mean and sample standard deviation over seeds of the final metric, the worst
   agent, the epsilon spent (the largest over agents and seeds, as the run's accountant reports it),
   and optionally the paper's value read from a small TOML file (``--paper``);
4. writes a Markdown table, a CSV file and figures (metric against round, metric against epsilon
   spent, against any numeric config field named by ``--against``, e.g. ``topology.fiedler``, and against
   round in a grid of panels by the fields ``--panels`` names, e.g. a paper figure's sub-plots) to ``--out``,
   or prints the table (``--json``: one JSON line with one object per group);
5. with ``--paired FIELD=VALUE``, compares each group with its reference, the group that has ``FIELD = VALUE``
   and the same values of every ``--within`` field (by default, the table's other columns), seed by seed:
   the seeds of one config share their data split, graph and initial model, so the per-seed differences
   separate a method's effect from the seeds' spread (mean ± std of the differences, and in how many seeds the
   group's metric is above the reference's).

Runs that cannot share a table are refused with a message naming the folders: runs on different
datasets (their accuracies are on different test sets), unfinished runs (unless ``--skip-unfinished``,
which leaves them out and names them), runs without the metric, and runs of one setting that share a seed (a
group's statistics are over distinct seeds).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import math
import os
import statistics
import sys
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decentdp.errors import ConfigError, DecentDPError
from decentdp.results.files import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, epsilon_text, write_atomic

#: Fields that never define a group: the seed (what a group averages over), labels, where data was
#: read from and a secure run's keys kept, how often the run evaluated or checkpointed
#: (``decentdp.config.RECORDING_FIELDS``, spelled out so that a report imports no torch), where it logged
#: (``tracking.*``), and how it computed (``engine.*`` changes results only by floating-point rounding, and
#: ``engine.noise_streams`` by another draw of the same noise).
IGNORED_FIELDS = ("experiment.seed", "experiment.name", "experiment.eval_every", "experiment.checkpoint_every",
                  "data.data_dir", "privacy.key_dir")
IGNORED_SECTIONS = ("engine.", "tracking.")

#: Fields shown first when several could label the groups, in this order; the rest follow by name.
PRIORITY_FIELDS = ("algorithm.name", "privacy.epsilon", "topology.graph", "topology.fiedler", "data.overlap_t",
                   "data.partition", "data.dataset", "topology.agents", "model.name", "experiment.rounds")

#: Settings named in the "shared by all runs" line when every run has the same value.
SHARED_SUMMARY = ("data.dataset", "data.partition", "data.overlap_t", "topology.agents", "topology.graph",
                  "model.name", "algorithm.name", "experiment.rounds", "privacy.epsilon", "privacy.delta")

#: Column titles of a few well-known fields; any other field is shown by its last dotted part.
SHORT_NAMES = {"algorithm.name": "algorithm", "model.name": "model", "data.dataset": "dataset",
               "topology.graph": "graph", "topology.agents": "agents", "experiment.rounds": "rounds"}

PAPER_UNITS = {"percent": 0.01, "fraction": 1.0}
#: How many unmatched paper rows the markdown names (a typo is among few; a subset of a paper's cells leaves many).
UNMATCHED_SHOWN = 5

#: How the budgets that bound everyone together name their observer (``decentdp.privacy.report``'s AGENT_VIEW and
#: CYCLIC_AGENT_VIEW, spelled out so that a report imports no torch): a summary's ``epsilon_observer`` that starts
#: otherwise (DECOR's PAIRWISE_VIEW) names a narrower observer.
EVERYONE_TOGETHER = "everyone together"

#: Footnote marks of the narrower observers, one per observer in the order the rows name them.
OBSERVER_MARKS = ("†", "‡", "§", "¶")


@dataclass
class Run:
    """One finished run's results folder, read once."""

    path: Path
    fields: dict[str, Any]  # the resolved config, flattened to dotted names
    summary: dict[str, Any]
    curve: list[dict[str, Any]]  # metrics.jsonl rows

    @property
    def seed(self) -> int:
        return int(self.fields.get("experiment.seed", 0))


@dataclass
class Group:
    """Runs of one setting (every non-ignored field equal) over their seeds."""

    key: tuple[Any, ...]
    runs: list[Run] = field(default_factory=list)


# ----------------------------------------------------------------------------- reading


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"privacy": {"epsilon": 1.0}}`` as ``{"privacy.epsilon": 1.0}``; ``model.options`` stays one value.
    Infinite values, which results files spell "inf", become ``math.inf`` so that they compare and sort."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "model.options":
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = _number(value)
    return out


def _number(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in {"inf", "infinity"}:
        return math.inf
    if isinstance(value, list):
        return tuple(_number(item) for item in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return value


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DecentDPError(f"cannot read {path}: {exc}") from None


class UnfinishedRunError(DecentDPError):
    """A results folder whose run has not finished (still running, killed, or stopped early)."""


def read_run(folder: Path) -> Run:
    """The run in ``folder``; a clear error when it is not a finished results folder."""
    summary_file, config_file = folder / SUMMARY_FILE, folder / CONFIG_FILE
    if not config_file.is_file():
        raise DecentDPError(f"{folder} is not a results folder (no {CONFIG_FILE})")
    if not summary_file.is_file():
        raise UnfinishedRunError(f"{folder}: the run has not finished (no {SUMMARY_FILE}); finish it with "
                                 f"`decentdp run CONFIG --resume --out {folder}`, leave it out of the report, "
                                 "or pass --skip-unfinished")
    summary = _read_json(summary_file)
    if not isinstance(summary, dict) or "finished" not in summary:
        raise DecentDPError(f"{summary_file} is not a decentdp run summary")
    _check_summary(summary, summary_file)
    if summary.get("finished") is False:
        raise UnfinishedRunError(f"{folder}: the run stopped after round {summary.get('rounds')} of "
                                 f"{summary.get('config', {}).get('experiment', {}).get('rounds', '?')}; "
                                 "resume it, leave it out of the report, or pass --skip-unfinished")
    try:
        config = summary["config"] if isinstance(summary.get("config"), dict) else \
            tomllib.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise DecentDPError(f"cannot read {config_file}: {exc}") from None
    curve: list[dict[str, Any]] = []
    metrics_file = folder / METRICS_FILE
    if metrics_file.is_file():
        curve = _read_jsonl(metrics_file)
        _check_rows(curve, metrics_file)
    fields = {**schema_defaults(), **flatten(config)}  # a field the run's library did not have yet: its default
    for name in unread_fields(config):
        fields.pop(name, None)
    seed = fields.get("experiment.seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):  # (groups are keyed and paired by it)
        where = f"{summary_file}: config.experiment.seed" if isinstance(summary.get("config"), dict) else \
            f"{config_file}: experiment.seed"
        raise DecentDPError(f"{where} must be an integer, got {seed!r}")
    personalized = config.get("personalized")
    if isinstance(personalized, dict):  # its [data], [topology], [model], [algorithm] are unused defaults
        fields = {key: value for key, value in fields.items()
                  if key.startswith(("experiment.seed", "experiment.name", "privacy.", "personalized."))}
        fields["data.dataset"] = personalized.get("dataset")
        fields["algorithm.name"] = f"personalized {personalized.get('method', 'cd')}"
    return Run(folder, fields, summary, curve)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a damaged line is named by its line number in the file (each line parsed
    alone, the parser's own message said "line 1" for every one)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DecentDPError(f"cannot read {path}: {exc}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DecentDPError(f"cannot read {path}: line {number}: {exc.msg} (column {exc.colno})") from None
    return rows


def _check_summary(summary: dict[str, Any], path: Path) -> None:
    """Refuse a hand-edited or corrupt ``summary.json`` field that the report reads, naming it, before anything is
    written (the table takes the epsilons' and wall time's floats and the observer's text; a wrong kind crashed
    it with a traceback)."""
    for key in ("epsilon_max", "epsilon_target", "epsilon_local_max"):
        value = summary.get(key)
        if not (value is None or value == "inf" or _is_real(value)):
            raise DecentDPError(f"{path}: {key} must be a number, \"inf\" or null, got {value!r}")
    wall = summary.get("wall_seconds")
    if not (wall is None or _is_real(wall) and math.isfinite(wall)):
        raise DecentDPError(f"{path}: wall_seconds must be a number or null, got {wall!r}")
    observer = summary.get("epsilon_observer")
    if not (observer is None or isinstance(observer, str)):
        raise DecentDPError(f"{path}: epsilon_observer must be a text naming who the epsilons bound, got {observer!r}")


def _stored_number(value: Any) -> float | None:
    """A number as a summary stores it: a JSON number, or the text "nan", "inf" or "-inf" that the library writes
    for a non-finite float (read as a missing metric before, so a diverged run was named as lacking the metric);
    None for anything else."""
    if _is_real(value):
        return float(value)
    return float(value) if value in ("nan", "inf", "-inf") else None


def _finite(value: Any) -> bool:
    number = _stored_number(value)
    return number is not None and math.isfinite(number)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def results_folders_under(root: Path) -> list[Path]:
    """Every folder below ``root`` that holds a ``config.toml``, in path order, hidden folders skipped.

    Symbolic links to folders are followed (a folder of links is a common way to gather chosen runs),
    each real folder at most once, so a link back up the tree cannot loop."""
    found: list[Path] = []
    seen: set[str] = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        if CONFIG_FILE in files:
            found.append(Path(folder))
    return sorted(found)


def find_runs(paths: Sequence[str | Path], *, skip_unfinished: bool = False) -> tuple[list[Run], list[Path]]:
    """Every results folder at or below ``paths`` (a folder holding a ``config.toml`` is one run; any
    other folder is searched), each once, in path order, and the folders left out.

    An unfinished run is an error unless ``skip_unfinished``; then it is left out and returned among
    the folders left out, so that the caller can say what the table does not hold.  So is, then, a folder given
    by name that holds no run yet (a run that has just made its folder, before its config)."""
    folders: dict[Path, None] = {}
    skipped: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise DecentDPError(f"no such results folder: {path}")
        if not path.is_dir():
            raise DecentDPError(f"{path} is a file; give results folders (or folders that hold them)")
        found = [path] if (path / CONFIG_FILE).is_file() else results_folders_under(path)
        if not found and skip_unfinished:
            skipped.append(path.resolve())
        elif not found:
            raise DecentDPError(f"no results folder under {path} (a results folder holds {CONFIG_FILE} and "
                                f"{SUMMARY_FILE})")
        folders.update((folder.resolve(), None) for folder in found)
    runs: list[Run] = []
    for folder in folders:
        try:
            runs.append(read_run(folder))
        except UnfinishedRunError:
            if not skip_unfinished:
                raise
            skipped.append(folder)
    if not runs:
        raise DecentDPError(f"none of the {len(folders)} results folder(s) holds a finished run")
    return runs, skipped


def check_compatible(runs: Sequence[Run], metric: str) -> None:
    """Refuse runs that cannot share a table: different datasets or evaluation sets (the test set, or a
    validation split held out for tuning), or runs without the metric."""
    datasets: dict[Any, list[Path]] = {}
    for run in runs:
        key = (run.fields.get("data.dataset"), run.fields.get("data.image_size"),
               float(run.fields.get("data.validation_fraction") or 0.0))
        datasets.setdefault(key, []).append(run.path)
    if len(datasets) > 1:
        listing = "; ".join(f"{name}{'' if size is None else f' at {size}px'}"
                            f"{f', validation split {held:g}' if held else ', test set'}: {_paths(paths)}"
                            for (name, size, held), paths in datasets.items())
        raise DecentDPError(f"these runs were evaluated on different data, so their {metric} values do not "
                            f"belong in one table ({listing}); report each group separately")
    missing = [run.path for run in runs if _stored_number(run.summary.get(metric)) is None]
    if missing:
        raise DecentDPError(f"{_paths(missing)}: no numeric '{metric}' in {SUMMARY_FILE} (choose another --metric, "
                            "or leave these runs out)")
    shown = [metric, "accuracy_min"] if metric == "accuracy_mean" else [metric]   # with the worst-agent column
    broken = [run.path for run in runs if any(key in run.summary and not _finite(run.summary[key]) for key in shown)]
    if broken:  # a NaN would make its row's mean and std NaN without a word
        raise DecentDPError(f"{_paths(broken)}: '{metric}' in {SUMMARY_FILE} is not a finite number (NaN or "
                            "infinite); rerun these runs, or leave them out")


def _paths(paths: Sequence[Path]) -> str:
    shown = ", ".join(str(path) for path in paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


# ----------------------------------------------------------------------------- grouping


def varying_fields(runs: Sequence[Run], ignore: Iterable[str] = ()) -> list[str]:
    """The config fields whose values differ between runs (seeds, labels and ``engine.*`` aside), in
    :data:`PRIORITY_FIELDS` order, then by name."""
    ignored = set(IGNORED_FIELDS) | set(ignore)
    names = sorted({name for run in runs for name in run.fields})
    differing = [name for name in names if name not in ignored and not name.startswith(IGNORED_SECTIONS)
                 and len({_hashable(run.fields.get(name)) for run in runs}) > 1]
    return sorted(differing, key=lambda name: (PRIORITY_FIELDS.index(name) if name in PRIORITY_FIELDS
                                               else len(PRIORITY_FIELDS), name))


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value


def group_runs(runs: Sequence[Run], fields: Sequence[str]) -> list[Group]:
    """Runs with equal values of ``fields``, ordered by those values (numbers numerically)."""
    groups: dict[tuple[Any, ...], Group] = {}
    for run in runs:
        key = tuple(_hashable(run.fields.get(name)) for name in fields)
        groups.setdefault(key, Group(key)).runs.append(run)
    for group in groups.values():
        group.runs.sort(key=lambda run: run.seed)
    return sorted(groups.values(), key=lambda group: tuple(_sort_key(value) for value in group.key))


def _sort_key(value: Any) -> tuple[int, Any]:
    if value is None:
        return (0, 0)
    if isinstance(value, bool):
        return (1, int(value))
    if isinstance(value, (int, float)):
        return (1, value)
    return (2, str(value))


def label_fields(groups: Sequence[Group], fields: Sequence[str]) -> list[str]:
    """The fewest of ``fields`` (taken in order) that still tell every group apart: the others are implied,
    e.g. a learning rate chosen per (algorithm, epsilon)."""
    def distinct(names: Sequence[str]) -> int:
        return len({tuple(group.key[fields.index(name)] for name in names) for group in groups})

    chosen: list[str] = []
    for name in fields:
        if distinct(chosen) == len(groups):
            break
        if distinct([*chosen, name]) > distinct(chosen):
            chosen.append(name)
    return chosen


# ----------------------------------------------------------------------------- statistics


def _one_or_all(values: Iterable[Any]) -> Any:
    """The value every run of a group shares, or (where an ``--ignore`` field let runs that differ in it share a
    group) a tuple of their distinct values, in order, so that no row shows one run's value as the group's."""
    distinct = list(dict.fromkeys(_hashable(value) for value in values))
    return distinct[0] if len(distinct) == 1 else tuple(sorted(distinct, key=_sort_key))


def varying_ignored(group: Group, ignore: Sequence[str]) -> dict[str, list[Any]]:
    """Each ``--ignore`` field whose value differs between the group's runs, with its value in each run (in the
    group's run order): the group averages over them, which the report says."""
    varying = {}
    for name in ignore:
        values = [run.fields.get(name) for run in group.runs]
        if len({_hashable(value) for value in values}) > 1:
            varying[name] = values
    return varying


def _mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean, and the sample standard deviation (None for a single seed)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _epsilon(value: Any) -> float:
    """An epsilon as summaries store it (a number; null or "inf" when not private)."""
    if value is None:
        return math.inf
    return float(value)


def group_row(group: Group, fields: Sequence[str], metric: str) -> dict[str, Any]:
    """One group's statistics over its seeds, with its config fields (dotted names) as keys."""
    values = [float(run.summary[metric]) for run in group.runs]
    mean, std = _mean_std(values)
    spent = [_epsilon(run.summary.get("epsilon_max")) for run in group.runs]
    first = group.runs[0]
    row: dict[str, Any] = {name: first.fields.get(name) for name in fields}
    row.update({
        "n": len(group.runs),
        "seeds": [run.seed for run in group.runs],
        "metric": metric,
        "mean": mean,
        "std": std,
        "min": min(values),
        "max": max(values),
        "epsilon_spent": max(spent),
        "epsilon_spent_mean": statistics.fmean(spent),
        "epsilon_accountant": _one_or_all(run.summary.get("epsilon_accountant") for run in group.runs),
        "epsilon_target": _one_or_all(_epsilon(run.summary.get("epsilon_target", run.fields.get("privacy.epsilon")))
                                      for run in group.runs),
        "delta": _one_or_all(run.fields.get("privacy.delta") for run in group.runs),
        "rounds": _one_or_all(run.summary.get("rounds") for run in group.runs),
        "wall_seconds": _mean_of_known(run.summary.get("wall_seconds") for run in group.runs),
        "runs": [str(run.path) for run in group.runs],
    })
    observers = sorted({observer for run in group.runs if (observer := narrower_observer(run.summary))})
    if observers:  # budgets towards a narrower observer than everyone together (DECOR)
        row["epsilon_observer"] = "; ".join(observers)
        row["epsilon_local"] = max(_epsilon(run.summary.get("epsilon_local_max")) for run in group.runs)
    if metric == "accuracy_mean" and all(isinstance(run.summary.get("accuracy_min"), (int, float))
                                         for run in group.runs):
        row["worst_agent"] = statistics.fmean(float(run.summary["accuracy_min"]) for run in group.runs)
    return row


def _mean_of_known(values: Iterable[float | None]) -> float | None:
    """The mean of the values a run recorded (a null wall time is unknown, not zero seconds); None if none did."""
    known = [float(value) for value in values if value is not None]
    return statistics.fmean(known) if known else None


def narrower_observer(summary: Mapping[str, Any]) -> str | None:
    """The observer a run's epsilon names when narrower than everyone together (DECOR's pairwise view), else None:
    a cyclic run names everyone together too (its ledger's own accounting), which needs no mark."""
    observer = summary.get("epsilon_observer")
    return None if observer is None or observer.startswith(EVERYONE_TOGETHER) else observer


def observer_marks(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each narrower observer the rows name, by its short name (before the colon), and its footnote mark."""
    names = dict.fromkeys(_observer_name(row["epsilon_observer"]) for row in rows if row.get("epsilon_observer"))
    return {name: OBSERVER_MARKS[index] if index < len(OBSERVER_MARKS) else f"†{index + 1}"
            for index, name in enumerate(names)}


def _observer_name(observer: str) -> str:
    return observer.split(":")[0]


# ----------------------------------------------------------------------------- paper values


@dataclass(frozen=True)
class PaperRow:
    match: dict[str, Any]
    value: float
    std: float | None
    number: int = 0  # its place in the file (1 for the first row), which messages name


def read_paper(path: Path, metric: str = "accuracy_mean") -> tuple[str, list[PaperRow]]:
    """A paper-values file: ``source``, ``unit`` ("percent" or "fraction") and ``[[row]]`` entries, each
    ``match = {dotted field = value, ...}``, ``value`` and optionally ``std``.  Values come back as
    fractions when the unit is percent.  ``unit`` defaults to percent for an accuracy only: another metric's
    values (an RMSE of 0.95) were divided by 100 without a word."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("--paper", f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--paper", f"cannot read {path} as TOML: {exc}") from None
    if "unit" not in data and not metric.startswith("accuracy"):
        raise ConfigError("--paper", f"{path}: give unit = \"fraction\" (or \"percent\"): the metric {metric} is not "
                                     "an accuracy, so percent cannot be assumed")
    unit = data.get("unit", "percent")
    if unit not in PAPER_UNITS:
        raise ConfigError("--paper", f"{path}: unit must be one of {', '.join(PAPER_UNITS)}, got {unit!r}")
    unknown = sorted(set(data) - {"source", "unit", "row"})
    if unknown:
        raise ConfigError("--paper", f"{path}: unknown key(s) {', '.join(unknown)}; allowed: source, unit, row")
    rows = []
    if not isinstance(data.get("row", []), list):
        raise ConfigError("--paper", f"{path}: row must be a list of tables ([[row]] sections)")
    for index, entry in enumerate(data.get("row", [])):
        where = f"{path}: row {index + 1}"
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), dict) or not entry["match"]:
            raise ConfigError("--paper", f"{where} needs match = {{field = value, ...}}")
        value, std = entry.get("value"), entry.get("std")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError("--paper", f"{where} needs a finite numeric value, got {value!r}")
        if std is not None and (isinstance(std, bool) or not isinstance(std, (int, float))
                                or not math.isfinite(std) or std < 0):
            raise ConfigError("--paper", f"{where}: std must be a non-negative finite number, got {std!r}")
        extra = sorted(set(entry) - {"match", "value", "std"})
        if extra:
            raise ConfigError("--paper", f"{where}: unknown key(s) {', '.join(extra)}; allowed: match, value, std")
        scale = PAPER_UNITS[unit]
        rows.append(PaperRow({name: _number(value) for name, value in entry["match"].items()},
                             entry["value"] * scale, None if std is None else std * scale, index + 1))
    return str(data.get("source", path.name)), rows


def paper_value(paper: Sequence[PaperRow], fields: dict[str, Any], file: Path) -> PaperRow | None:
    """The most specific paper row whose every ``match`` field equals the run's; None if no row matches."""
    matching = [row for row in paper if all(fields.get(name) == value for name, value in row.match.items())]
    if not matching:
        return None
    best = max(len(row.match) for row in matching)
    top = [row for row in matching if len(row.match) == best]
    if len({(row.value, row.std) for row in top}) > 1:
        raise ConfigError("--paper", f"{file}: rows {', '.join(str(row.match) for row in top)} all match one "
                                     "group; make one of them more specific")
    return top[0]


def unread_fields(config: dict[str, Any]) -> list[str]:
    """The fields a run's resolved ``config`` holds but its run did not read
    (:meth:`~decentdp.config.ExperimentConfig.unread_fields`): a knob left behind under a switch that is off must
    not split one setting into two rows, nor another mode's default match a paper row.  A config this library no
    longer accepts (a run of an algorithm since renamed) keeps every field: it is still reported, as before."""
    from decentdp.config import validate_config

    if isinstance(config.get("personalized"), dict):  # read_run keeps only the fields such a run reads
        return []
    try:
        return validate_config(config).unread_fields()
    except ConfigError:
        return []


@functools.cache
def _schema_specs() -> dict[str, Any]:
    """Every ``section.key`` the config schema defines, with its pydantic field (an optional section's too)."""
    from pydantic import BaseModel

    from decentdp.config import ExperimentConfig

    specs = {}
    for section, info in ExperimentConfig.model_fields.items():
        for model in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(model, type) and issubclass(model, BaseModel):
                specs |= {f"{section}.{key}": spec for key, spec in model.model_fields.items()}
    return specs


def schema_fields() -> set[str]:
    """Every ``section.key`` the config schema defines, set or not (an optional field left unset, such as
    ``topology.fiedler`` on a complete graph, is absent from a run's resolved config but is still a field)."""
    return set(_schema_specs())


@functools.cache
def schema_defaults() -> dict[str, Any]:
    """Each schema field's default as a resolved ``config.toml`` writes it (fields without a default, or with
    None, which such a file leaves out, are not listed).  A run written before a field existed ran as its
    default (a new field keeps the old behaviour as its default), so a run whose config lacks the field is
    read with it: otherwise the field would split old and new runs of one setting into two rows."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from decentdp.config.schema import toml_ready

    defaults = {}
    for name, spec in _schema_specs().items():
        default = spec.get_default(call_default_factory=True)
        if not (default is PydanticUndefined or default is None or isinstance(default, BaseModel)):
            defaults[name] = toml_ready(default)
    return defaults


def check_paper_fields(paper: Sequence[PaperRow], runs: Sequence[Run], file: Path) -> None:
    """Refuse a ``match`` field that is no config field (a typo would silently match nothing), and a match value of a
    kind that no run's value of the field has (a string "4" where the runs hold the number 4.0 equals none)."""
    known = {name for run in runs for name in run.fields} | schema_fields()
    for row in paper:
        unknown = sorted(set(row.match) - known)
        if unknown:
            raise ConfigError("--paper", f"{file}: match field(s) {', '.join(unknown)} are not config fields of "
                                         "these runs (write dotted names such as privacy.epsilon)")
        for name, value in row.match.items():
            kinds = {_kind(run.fields[name]) for run in runs if run.fields.get(name) is not None}
            if kinds and _kind(value) not in kinds:
                raise ConfigError("--paper", f"{file}: row {row.number}: match {name} = {value!r} is a "
                                             f"{_kind(value)}, but {name} is a {' or a '.join(sorted(kinds))} in these "
                                             "runs, so it can match none of them")


def _kind(value: Any) -> str:
    """What kind of value a config field holds, as far as equality goes (an integer equals its float)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, tuple):
        return "list"
    return "string" if isinstance(value, str) else type(value).__name__


#: What :func:`group_paper_value` answers for a group whose runs match different paper rows.
AMBIGUOUS = object()


def group_paper_value(paper: Sequence[PaperRow], group: Group, file: Path) -> PaperRow | None | object:
    """The paper row of a group's runs, None where none matches, or :data:`AMBIGUOUS` where its runs (merged by
    ``--ignore``) match different rows: the first run's row was shown for them all (a review: Fiedler 0.39's value
    beside runs of 0.39 and 0.7)."""
    found = {id(row): row for run in group.runs for row in [paper_value(paper, run.fields, file)]}
    if len(found) > 1:
        return AMBIGUOUS
    return next(iter(found.values()))


def unmatched_paper_rows(paper: Sequence[PaperRow], groups: Sequence[Group]) -> list[PaperRow]:
    """The paper rows that match no run (a typo in a match value, a setting these runs lack): the report names
    them rather than leave the paper's value out without a word."""
    return [row for row in paper if not any(all(run.fields.get(name) == value for name, value in row.match.items())
                                            for group in groups for run in group.runs)]


# ----------------------------------------------------------------------------- the report


@dataclass
class Report:
    """The groups' rows, the fields that label them and the context a table states once."""

    metric: str
    fields: list[str]  # every field that differs between groups
    labels: list[str]  # the fewest of them that tell the groups apart (the table's columns)
    shared: dict[str, Any]
    rows: list[dict[str, Any]]
    groups: list[Group]
    paper_source: str | None = None
    paired: str | None = None  # "FIELD=VALUE" of the reference groups (``--paired``)
    skipped: list[str] = field(default_factory=list)  # unfinished folders left out (``--skip-unfinished``)
    paper_unmatched: list[dict[str, Any]] = field(default_factory=list)  # paper rows matching no group


def build_report(runs: Sequence[Run], metric: str = "accuracy_mean", ignore: Iterable[str] = (),
                 paper_file: Path | None = None, paired: str | None = None, within: Sequence[str] = (),
                 skipped: Sequence[Path] = ()) -> Report:
    """Group ``runs`` and compute every group's row (see the module docstring); ``skipped`` are the unfinished
    folders :func:`find_runs` left out, which the report names."""
    check_compatible(runs, metric)
    ignore = list(ignore)
    known = {name for run in runs for name in run.fields}
    for name in ignore:
        if name not in known:
            raise ConfigError("--ignore", f"{name} is not a config field of these runs (dotted, e.g. "
                                          "experiment.rounds)")
    fields = varying_fields(runs, ignore)
    groups = group_runs(runs, fields)
    check_distinct_seeds(groups)
    labels = label_fields(groups, fields)
    shared = {name: runs[0].fields.get(name) for name in SHARED_SUMMARY
              if name in known and name not in fields and name not in ignore}
    if shared.get("data.partition") != "overlap":
        shared.pop("data.overlap_t", None)  # A(t) applies to the overlap partition only
    rows = [group_row(group, fields, metric) for group in groups]
    for row, group in zip(rows, groups, strict=True):
        varying = varying_ignored(group, ignore)
        if varying:
            row["ignored_varying"] = varying
    source, unmatched = None, []
    if paper_file is not None:
        source, paper = read_paper(paper_file, metric)
        check_paper_fields(paper, runs, paper_file)
        for row, group in zip(rows, groups, strict=True):
            found = group_paper_value(paper, group, paper_file)
            if found is AMBIGUOUS:
                row["paper_mixed"] = True
            found = found if isinstance(found, PaperRow) else None
            row["paper"] = None if found is None else found.value
            row["paper_std"] = None if found is None else found.std
            row["difference"] = None if found is None else row["mean"] - found.value
        unmatched = [{"row": row.number, "match": row.match} for row in unmatched_paper_rows(paper, groups)]
    if paired is not None:
        add_paired_differences(rows, groups, fields, metric, paired, within or
                               [label for label in labels if label != paired.partition("=")[0]], known)
    elif within:
        raise ConfigError("--within", "names the fields a --paired comparison keeps equal: give --paired as well")
    return Report(metric, fields, labels, shared, rows, groups, source, paired, [str(path) for path in skipped],
                  unmatched)


def add_paired_differences(rows: Sequence[dict[str, Any]], groups: Sequence[Group], fields: Sequence[str],
                           metric: str, paired: str, within: Sequence[str], known: Iterable[str]) -> None:
    """Each row's per-seed difference from its reference group (``paired`` = "FIELD=VALUE", matched on the
    ``within`` fields, which :func:`build_report` defaults to the table's other columns; a ``within`` field every
    run shares matches trivially): ``paired_difference`` (mean), ``paired_std``, ``paired_above`` (seeds in which
    the group's metric is above its reference's), ``paired_seeds``; None where a group is a reference itself, or
    has no reference or no seed in common with it.  No comparison at all is refused: it was a table of dashes."""
    name, separator, text = paired.partition("=")
    if not separator or name not in fields:
        raise ConfigError("--paired", f"must be FIELD=VALUE with FIELD one of the fields that differ between these "
                                      f"runs ({', '.join(fields)}), got {paired!r}")
    try:
        value = _number(tomllib.loads(f"value = {text}")["value"])
    except tomllib.TOMLDecodeError:
        value = text
    known = set(known)
    unknown = [other for other in within if other not in known or other == name]
    if unknown:
        raise ConfigError("--within", f"{unknown[0]} is not another config field of these runs (dotted, e.g. "
                                      f"privacy.epsilon; those that differ: "
                                      f"{', '.join(other for other in fields if other != name)})")
    matched = [other for other in within if other in fields]
    position = fields.index(name)
    references: dict[tuple[Any, ...], Group] = {}
    for group in groups:
        if group.key[position] != _hashable(value):
            continue
        cell = tuple(group.key[fields.index(other)] for other in matched)
        if cell in references:  # two references for one cell: the comparison would be ambiguous
            apart = [other for index, other in enumerate(fields) if group.key[index] != references[cell].key[index]]
            raise ConfigError("--within", f"two {name} = {text} settings share the --within values "
                                          f"{_value_text(cell)} (they differ in {', '.join(apart)}): add "
                                          f"{apart[0]} to --within, or leave --within out")
        references[cell] = group
    if not references:
        present = sorted({_value_text(group.runs[0].fields.get(name)) for group in groups})
        raise ConfigError("--paired", f"no run has {name} = {text}; its values here: {', '.join(present)}")
    for row, group in zip(rows, groups, strict=True):
        reference = references.get(tuple(group.key[fields.index(other)] for other in matched))
        by_seed = {run.seed: float(run.summary[metric]) for run in reference.runs} if reference is not None else {}
        differences = [float(run.summary[metric]) - by_seed[run.seed] for run in group.runs if run.seed in by_seed]
        if reference is group or not differences:
            row.update(paired_difference=None, paired_std=None, paired_above=None, paired_seeds=0)
            continue
        mean, std = _mean_std(differences)
        row.update(paired_difference=mean, paired_std=std, paired_above=sum(d > 0 for d in differences),
                   paired_seeds=len(differences))
    if all(row["paired_seeds"] == 0 for row, group in zip(rows, groups, strict=True)
           if group.key[position] != _hashable(value)):
        raise ConfigError("--paired", f"no setting has a {name} = {text} run with the same {', '.join(matched)} "
                                      "and a seed in common: name the fields to keep equal with --within")


def repeated_seeds(groups: Sequence[Group]) -> list[list[Run]]:
    """The runs of one group that share a seed (copies of a run, runs differing only in ignored fields such as
    ``experiment.eval_every`` or ``engine.*``, a sweep's repeated draws)."""
    repeats = []
    for group in groups:
        by_seed: dict[int, list[Run]] = {}
        for run in group.runs:
            by_seed.setdefault(run.seed, []).append(run)
        repeats += [runs for runs in by_seed.values() if len(runs) > 1]
    return repeats


def check_distinct_seeds(groups: Sequence[Group]) -> None:
    """Refuse a group with two runs of one seed: its mean ± std would weight that seed twice and read as more
    seeds than it has (a review found a copy, and a run differing only in eval_every, counted as seeds).  The
    message names the folders and the fields they differ in, so that the user can leave one out."""
    repeats = repeated_seeds(groups)
    if not repeats:
        return
    listing = []
    for runs in repeats[:3]:
        names = sorted({name for run in runs for name in run.fields} - {"experiment.seed"})
        apart = [name for name in names if len({_hashable(run.fields.get(name)) for run in runs}) > 1]
        listing.append(f"seed {runs[0].seed}: {', '.join(str(run.path) for run in runs)} ("
                       f"{'differing only in ' + ', '.join(apart) if apart else 'the same config'})")
    more = f"; and {len(repeats) - 3} more" if len(repeats) > 3 else ""
    raise DecentDPError(f"runs of one setting share a seed, so its mean ± std would count that seed more than once: "
                        f"{'; '.join(listing)}{more}. Leave all but one of each out of the report (or report them "
                        "apart)")


def _scale(metric: str) -> float:
    """Accuracies are shown in percent."""
    return 100.0 if metric.startswith("accuracy") else 1.0


def _number_text(value: float, scale: float, signed: bool = False) -> str:
    """A statistic in the table: percent to two places; any other metric (an RMSE of 0.9502, a consensus
    distance of 3e-5) to four significant figures, which two places would flatten to 0.95 or 0.00."""
    sign = "+" if signed else ""
    return f"{scale * value:{sign}.2f}" if scale == 100 else f"{value:{sign}.4g}"


def _value_text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_value_text(item) for item in value) + "]"
    return str(value)


def _column_names(fields: Sequence[str]) -> dict[str, str]:
    short = {name: SHORT_NAMES.get(name, name.rsplit(".", 1)[-1]) for name in fields}
    counts = {title: list(short.values()).count(title) for title in short.values()}
    return {name: title if counts[title] == 1 else name for name, title in short.items()}


def _epsilon_text(value: float | tuple[float, ...]) -> str:
    """An epsilon to three decimals; a group's differing values (see :func:`_one_or_all`) each, joined by " / "."""
    if isinstance(value, tuple):
        return " / ".join(_epsilon_text(item) for item in value)
    return epsilon_text(value)


def markdown(report: Report) -> str:
    """The report as Markdown: a heading line, the shared settings, the table, and what it means."""
    scale = _scale(report.metric)
    unit = " %" if scale == 100 else ""
    titles = _column_names([*report.labels, *report.shared])
    paper = report.paper_source is not None
    has_worst = all("worst_agent" in row for row in report.rows)
    marks = observer_marks(report.rows)
    accountants = sorted({str(name) for row in report.rows for name in _values(row["epsilon_accountant"])})
    header = [titles[name] for name in report.labels] + ["seeds", f"{report.metric}{unit} (mean ± std)"]
    header += ["worst agent" + unit] if has_worst else []
    header += ["ε spent", "ε target"]
    header += [f"paper{unit}", "ours − paper"] if paper else []
    header += [f"− the {report.paired} run, paired by seed (seeds above it)"] if report.paired else []
    lines = [f"{len(report.rows)} settings from {sum(row['n'] for row in report.rows)} runs; "
             f"{report.metric} of the last evaluation, mean ± sample std over seeds.", ""]
    if report.shared:
        lines += ["Shared by all runs: " + ", ".join(f"{titles.get(name, name)} = {_value_text(value)}"
                                                     for name, value in report.shared.items()) + ".", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(report.labels) + "---:|" * (len(header)
                                                                                                  - len(report.labels))]
    for row in report.rows:
        std = "" if row["std"] is None else f" ± {_number_text(row['std'], scale)}"
        cells = [_value_text(row[name]) for name in report.labels]
        cells += [str(row["n"]), f"{_number_text(row['mean'], scale)}{std}"]
        cells += [_number_text(row["worst_agent"], scale)] if has_worst else []
        narrower = f" {marks[_observer_name(row['epsilon_observer'])]}" if row.get("epsilon_observer") else ""
        by = f" ({'/'.join(map(str, _values(row['epsilon_accountant']))).upper()})" if len(accountants) > 1 else ""
        cells += [_epsilon_text(row["epsilon_spent"]) + by + narrower, _epsilon_text(row["epsilon_target"])]
        if paper:
            if row["paper"] is None:
                cells += ["—", "—"]
            else:
                paper_std = "" if row["paper_std"] is None else f" ± {_number_text(row['paper_std'], scale)}"
                cells += [f"{_number_text(row['paper'], scale)}{paper_std}",
                          _number_text(row["difference"], scale, signed=True)]
        if report.paired:
            cells.append(_paired_text(row, scale))
        lines.append("| " + " | ".join(cells) + " |")
    implied = [name for name in report.fields if name not in report.labels]
    lines.append("")
    deltas = sorted({_value_text(delta) for row in report.rows for delta in _values(row["delta"])})
    which = f"{accountants[0].upper()} accountant" if len(accountants) == 1 else "each row's accountant beside it"
    lines.append(f"ε spent: the largest over agents and seeds ({which}); δ = {', '.join(deltas)}.")
    for name, mark in marks.items():  # the metric pools every agent's model: everyone together is who reads it
        narrower = [row for row in report.rows if row.get("epsilon_observer")
                    and _observer_name(row["epsilon_observer"]) == name]
        together = max(_epsilon(row["epsilon_local"]) for row in narrower)
        lines.append(f"{mark} ε spent towards a narrower observer than everyone together: {name}. Everyone "
                     f"together, who sees every model the metric is computed from, is bounded by epsilon_local: up "
                     f"to {_epsilon_text(together)} in these rows.")
    lines += _ignored_notes(report)
    lines += curve_notes(report)
    if implied:
        lines.append(f"Also differing, set by the columns above: {', '.join(implied)} (all values in the CSV).")
    if paper:
        lines.append(f"Paper values: {report.paper_source}.")
    mixed = [row for row in report.rows if row.get("paper_mixed")]
    if mixed:
        listing = "; ".join(", ".join(f"{titles[name]} = {_value_text(row[name])}" for name in report.labels) or "all"
                            for row in mixed)
        lines.append(f"No paper value in the row(s) whose runs, merged by --ignore, match different paper rows: "
                     f"{listing}.")
    if report.paper_unmatched:  # a typo shows here; a report over a subset of the paper's cells lists the rest briefly
        shown = report.paper_unmatched[:UNMATCHED_SHOWN]
        listing = "; ".join(f"row {entry['row']} ({_match_text(entry['match'])})" for entry in shown)
        more = len(report.paper_unmatched) - len(shown)
        if more:
            listing += f"; and {more} more (all in report.json, paper_unmatched)"
        lines.append(f"Paper rows that match no setting here: {listing}.")
    if report.skipped:
        lines.append(f"Left out {len(report.skipped)} unfinished run(s) (--skip-unfinished): "
                     f"{', '.join(report.skipped)}.")
    return "\n".join(lines) + "\n"


def _match_text(match: Mapping[str, Any]) -> str:
    return ", ".join(f"{name} = {_value_text(value)}" for name, value in match.items())


def _values(value: Any) -> tuple[Any, ...]:
    """A row's value as a tuple of its values (one, or a group's differing ones)."""
    return value if isinstance(value, tuple) else (value,)


def _ignored_notes(report: Report) -> list[str]:
    """One line per row whose runs differ in an ``--ignore`` field: the field and each run's value (its folder's
    name), since the row averages over them and its ε target and rounds are then each run's, not one."""
    lines = []
    for row, group in zip(report.rows, report.groups, strict=True):
        for name, values in row.get("ignored_varying", {}).items():
            each = ", ".join(f"{_value_text(value)} ({run.path.name})"
                             for value, run in zip(values, group.runs, strict=True))
            lines.append(f"Row {_label(row, report.labels, group)} averages runs that differ in the ignored field "
                         f"{name}: {each}.")
    return lines


def _paired_text(row: dict[str, Any], scale: float) -> str:
    if row["paired_difference"] is None:
        return "—"
    std = "" if row["paired_std"] is None else f" ± {_number_text(row['paired_std'], scale)}"
    return f"{_number_text(row['paired_difference'], scale, signed=True)}{std}, {row['paired_above']} of " \
        f"{row['paired_seeds']}"


def csv_text(report: Report) -> str:
    """Every group with every differing field and unrounded statistics."""
    columns = [*report.fields, "n", "seeds", "metric", "mean", "std", "min", "max", "worst_agent", "epsilon_spent",
               "epsilon_spent_mean", "epsilon_accountant", "epsilon_observer", "epsilon_local",
               "epsilon_target", "delta", "rounds", "wall_seconds",
               "paper", "paper_std", "difference", "paired_difference", "paired_std", "paired_above", "paired_seeds",
               "ignored_varying", "runs"]
    columns = [name for name in columns if any(name in row for row in report.rows)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in report.rows:
        row = {**row, "ignored_varying": "; ".join(  # the --ignore fields that differ inside the row, run by run
            f"{name}={' / '.join(map(_value_text, values))}" for name, values in row.get("ignored_varying", {}).items())
            or None}
        writer.writerow([_csv_cell(row.get(name)) for name in columns])
    return buffer.getvalue()


def _csv_cell(value: Any) -> Any:
    """A CSV cell: empty where there is no value (a std over one seed, no paper value), a list (seeds, run folders)
    joined by ";" so that a folder with a space in its name stays one item, a tuple of values as the table shows it."""
    if value is None:
        return ""
    if isinstance(value, list):
        return ";".join(map(str, value))
    return _value_text(value) if isinstance(value, tuple) else value


def json_rows(report: Report) -> dict[str, Any]:
    """The report as one JSON-ready object: ``rows`` (one per group), infinities (and any NaN) as null, so that a
    strict JSON parser reads it (``allow_nan=False`` where it is written)."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, (tuple, list)):
            return [clean(item) for item in value]
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        return value

    rows = [{key: clean(value) for key, value in row.items()} for row in report.rows]
    return {"metric": report.metric, "fields": report.fields, "labels": report.labels,
            "shared": {key: clean(value) for key, value in report.shared.items()}, "rows": rows,
            "paper_source": report.paper_source, "paper_unmatched": clean(report.paper_unmatched),
            "paired": report.paired, "skipped": report.skipped}


# ----------------------------------------------------------------------------- figures


def _label(row: dict[str, Any], names: Sequence[str], group: Group, aliases: Mapping[str, str] | None = None) -> str:
    """A series' legend entry: its values of ``names`` (a value's text replaced by its entry in ``aliases``); when
    no field tells the series apart (one setting), the group's algorithm, which says what ran."""
    titles = _column_names(names)
    aliases = aliases or {}
    return ", ".join(f"{titles[name]}={aliases.get(text, text)}" for name in names
                     for text in [_value_text(row[name])]) or \
        str(group.runs[0].fields.get("algorithm.name", "all runs"))


#: The shared settings a figure's title names, in this order.
TITLE_FIELDS = ("data.dataset", "model.name", "topology.graph", "topology.agents", "algorithm.name")


def _figure_title(report: Report, what: str) -> str:
    """``what``, and on a second line the settings every run shares (dataset, model, graph, ...)."""
    context = ", ".join(f"{SHORT_NAMES.get(name, name)} {_value_text(report.shared[name])}"
                        for name in TITLE_FIELDS if report.shared.get(name) is not None)
    return f"{what}\n{context}" if context else what


def _draw_curves(ax: Any, series: Sequence[tuple[str, int, Group]], metric: str) -> None:
    """One line per ``(label, style index, group)``: the metric against round, mean over seeds with a ± std band.
    The style index picks the colour (and, past ten, the line style), so one series keeps its look across panels."""
    scale = _scale(metric)
    for label, index, group in series:
        rounds, means, stds = _curve(group.runs, metric)
        if not rounds:
            continue
        line, = ax.plot(rounds, [scale * m for m in means], label=label, color=f"C{index % 10}",
                        linestyle=SERIES_STYLES[index // 10 % len(SERIES_STYLES)][0])
        if len(group.runs) > 1:
            ax.fill_between(rounds, [scale * (m - s) for m, s in zip(means, stds, strict=True)],
                            [scale * (m + s) for m, s in zip(means, stds, strict=True)], alpha=0.2,
                            color=line.get_color())
    ax.grid(alpha=0.3)


def round_figure(report: Report) -> Any | None:
    """The metric against round (mean over seeds, band ± std), one line per group; None when no run has
    rounds (personalized runs count ticks)."""
    from decentdp.results.files import pyplot

    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    _draw_curves(ax, [(_label(row, report.labels, group), index, group)
                      for index, (row, group) in enumerate(zip(report.rows, report.groups, strict=True))],
                 report.metric)
    if not ax.lines:
        pyplot().close(fig)
        return None
    ax.set_xlabel("round")
    ax.set_ylabel(_ylabel(report.metric))
    ax.set_title(_figure_title(report, f"{report.metric} against round"), fontsize=9)
    _legend(ax, len(report.rows))
    fig.tight_layout()
    return fig


def check_panels(report: Report, panels: Sequence[str]) -> None:
    """``--panels``: one or two different config fields, each differing between these groups."""
    if len(panels) > 2 or len(set(panels)) != len(panels):
        raise ConfigError("--panels", "give one or two different fields (rows of panels, then columns)")
    for name in panels:
        if name not in report.fields:
            raise ConfigError("--panels", f"{name} is not a config field that differs between these runs' groups "
                                          f"(they differ in: {', '.join(report.fields) or 'nothing'})")


def panel_figure(report: Report, panels: Sequence[str], aliases: Mapping[str, str] | None = None) -> Any | None:
    """The metric against round in a grid of panels, one per value of ``panels`` (one field: a row of panels;
    two: rows by the first field's values, columns by the second's), e.g. a paper figure's sub-plots.  Inside a
    panel, one line per group, labelled by the fewest other fields that tell the series apart; a series has the
    same label and colour in every panel and the figure one legend.  ``aliases`` relabels field values, so that
    one method registered under two names (one per protocol, which the panels already tell apart) is one series.
    None when no run has rounds."""
    from decentdp.results.files import pyplot

    axes_values = [sorted({_hashable(row[name]) for row in report.rows}, key=_sort_key) for name in panels]
    rows_of, columns_of = (axes_values[0], axes_values[1]) if len(panels) > 1 else ([None], axes_values[0])
    others = [name for name in report.fields if name not in panels]
    cells: dict[tuple[Any, Any], list[tuple[dict[str, Any], Group]]] = {}
    for row, group in zip(report.rows, report.groups, strict=True):
        key = (_hashable(row[panels[0]]), _hashable(row[panels[1]])) if len(panels) > 1 else \
            (None, _hashable(row[panels[0]]))
        cells.setdefault(key, []).append((row, group))
    # The fewest other fields that tell the curves of each panel apart: the panel fields first, so that a field
    # they imply (an asynchronous schedule's offline probability) names no series; the same names in every panel.
    ordered = [*panels, *others]
    names = [name for name in label_fields([Group(tuple(_hashable(row[name]) for name in ordered))
                                            for row in report.rows], ordered) if name not in panels]
    labelled = {id(group): _label(row, names, group, aliases)
                for row, group in zip(report.rows, report.groups, strict=True)}
    styles = {label: index for index, label in enumerate(dict.fromkeys(labelled.values()))}
    legend_inches = 0.7 + 0.06 * max(map(len, styles))  # room for the longest label at font size 7
    width = 3.6 * len(columns_of) + legend_inches
    fig, grid = pyplot().subplots(len(rows_of), len(columns_of), sharex=True, sharey=True, squeeze=False,
                                  figsize=(width, 2.8 * len(rows_of) + 0.9))
    titles = _column_names(panels)
    for r, row_value in enumerate(rows_of):
        for c, column_value in enumerate(columns_of):
            ax = grid[r][c]
            items = cells.get((row_value, column_value), [])
            _draw_curves(ax, [(labelled[id(group)], styles[labelled[id(group)]], group) for _, group in items],
                         report.metric)
            values = (row_value, column_value) if len(panels) > 1 else (column_value,)  # one field: columns only
            heading = [f"{titles[name]}={_value_text(value)}" for name, value in zip(panels, values, strict=True)]
            ax.set_title(", ".join(heading) + ("" if items else " (no runs)"), fontsize=8)
            if r == len(rows_of) - 1:
                ax.set_xlabel("round")
            if c == 0:
                ax.set_ylabel(_ylabel(report.metric), fontsize=8)
    if not any(ax.lines for axes_row in grid for ax in axes_row):
        pyplot().close(fig)
        return None
    handles = {}  # label -> line, each series once, in the order the panels drew them
    for axes_row in grid:
        for ax in axes_row:
            lines, labels = ax.get_legend_handles_labels()
            handles.update(zip(labels, lines, strict=True))
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="center right")
    fig.suptitle(_figure_title(report, f"{report.metric} against round, by {', '.join(panels)}"), fontsize=9)
    fig.tight_layout(rect=(0.0, 0.0, 1.0 - legend_inches / width, 1.0))
    return fig


#: Past the colour cycle's ten colours, a line style and a marker tell the series apart (colours repeat).
SERIES_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def _legend(ax: Any, series: int) -> None:
    """The legend, inside the axes for a few series, beside them for more (where it would hide the data); none
    past 20 series (the table names them)."""
    if series > 20:
        return
    if series <= 6:
        ax.legend(fontsize=7)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax.figure.set_size_inches(11, 4.5)


#: The config field an ε figure's axis shows (so no series is keyed by it).
EPSILON_AXIS = "privacy.epsilon"


def epsilon_series_fields(report: Report) -> list[str]:
    """The fields an ε figure's series are keyed by: the label fields but the ε target, and every other
    ``privacy.*`` field that differs (clip, accountant, neighbouring relation, δ change what an ε means or buys, so
    runs that differ in them are never one line, even where the table's columns leave them implied)."""
    return [*(name for name in report.labels if name != EPSILON_AXIS),
            *(name for name in report.fields if name.startswith("privacy.") and name != EPSILON_AXIS
              and name not in report.labels)]


def epsilon_figure(report: Report) -> Any | None:
    """The metric against the ε spent (log axis, plain tick labels), one series per setting of
    :func:`epsilon_series_fields` (named by its algorithm when there is one setting), non-private groups as dashed
    lines; a series whose ε names a narrower observer than everyone together (DECOR's) has open markers and the
    table's footnote mark, and the title says towards whom.  None when no run is private."""
    from decentdp.results.files import plain_log_ticks, pyplot

    if not any(math.isfinite(row["epsilon_spent"]) for row in report.rows):
        return None
    scale = _scale(report.metric)
    others = epsilon_series_fields(report)
    marks = observer_marks(report.rows)
    series: dict[str, list[dict[str, Any]]] = {}
    for row, group in zip(report.rows, report.groups, strict=True):
        observer = row.get("epsilon_observer")
        name = _label(row, others, group) + (f" {marks[_observer_name(observer)]}" if observer else "")
        series.setdefault(name, []).append(row)
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for index, (name, rows) in enumerate(series.items()):
        private = sorted((row for row in rows if math.isfinite(row["epsilon_spent"])),
                         key=lambda row: row["epsilon_spent_mean"])
        linestyle, marker = SERIES_STYLES[index // 10 % len(SERIES_STYLES)]
        narrower = any(row.get("epsilon_observer") for row in rows)
        line = ax.errorbar([row["epsilon_spent_mean"] for row in private],
                           [scale * row["mean"] for row in private],
                           yerr=[scale * (row["std"] or 0.0) for row in private], marker=marker,
                           linestyle=linestyle, capsize=3, label=name,
                           **({"markerfacecolor": "none"} if narrower else {}))
        for row in rows:
            if not math.isfinite(row["epsilon_spent"]):
                ax.axhline(scale * row["mean"], linestyle="--", color=line[0].get_color(), alpha=0.7)
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    ax.set_xlabel("ε spent (largest over agents)")
    ax.set_ylabel(_ylabel(report.metric))
    dashed = "; dashed: non-private" if any(not math.isfinite(row["epsilon_spent"]) for row in report.rows) else ""
    towards = "".join(f"\nopen markers {mark}: ε towards {name}, not everyone together" for name, mark in marks.items())
    ax.set_title(_figure_title(report, f"{report.metric} against ε spent{dashed}{towards}"), fontsize=9)
    ax.grid(alpha=0.3)
    _legend(ax, len(series))
    fig.tight_layout()
    return fig


def check_against(report: Report, axis_field: str) -> None:
    """``--against FIELD`` needs a config field that differs between these groups and is a number in some of them."""
    if axis_field not in report.fields:
        raise ConfigError("--against", f"{axis_field} is not a config field that differs between these runs' groups "
                                       f"(they differ in: {', '.join(report.fields) or 'nothing'})")
    if not any(_is_number(row[axis_field]) for row in report.rows):
        raise ConfigError("--against", f"{axis_field} is not a number in any group of these runs")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def field_figure(report: Report, axis_field: str) -> Any:
    """The metric against a numeric config field (``topology.fiedler``: Bayrooti et al.'s Fig. 1), mean ± std over
    seeds, one series per setting of the other label fields; groups where the field is unset (a complete graph has
    no Fiedler target) are left out and counted in the title.  With a paper file, the paper's values of the same
    groups stand beside ours as open markers of the series' colour, with their std where the paper gives one."""
    from decentdp.results.files import pyplot

    scale = _scale(report.metric)
    drawn = [(row, group) for row, group in zip(report.rows, report.groups, strict=True) if _is_number(row[axis_field])]
    others = [name for name in report.labels  # the label fields that tell the drawn groups apart
              if name != axis_field and len({_hashable(row[name]) for row, _ in drawn}) > 1]
    series: dict[str, list[dict[str, Any]]] = {}
    for row, group in drawn:
        series.setdefault(_label(row, others, group), []).append(row)
    left_out = len(report.rows) - len(drawn)
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for index, (name, rows) in enumerate(series.items()):
        rows = sorted(rows, key=lambda row: row[axis_field])
        linestyle, marker = SERIES_STYLES[index // 10 % len(SERIES_STYLES)]
        line = ax.errorbar([row[axis_field] for row in rows], [scale * row["mean"] for row in rows],
                           yerr=[scale * (row["std"] or 0.0) for row in rows], marker=marker, linestyle=linestyle,
                           capsize=3, label=name)
        paper = [row for row in rows if row.get("paper") is not None]
        if paper:
            ax.errorbar([row[axis_field] for row in paper], [scale * row["paper"] for row in paper],
                        yerr=[scale * (row["paper_std"] or 0.0) for row in paper], marker=marker, linestyle="none",
                        markerfacecolor="none", color=line[0].get_color(), capsize=2, alpha=0.8)
    ax.set_xlabel(_column_names([axis_field])[axis_field] + f" ({axis_field})")
    ax.set_ylabel(_ylabel(report.metric))
    notes = ([f"open markers: {report.paper_source}"] if any(row.get("paper") is not None for row in report.rows)
             else []) + ([f"{left_out} group(s) without {axis_field} left out"] if left_out else [])
    ax.set_title(_figure_title(report, f"{report.metric} against {axis_field}" + "".join(f"; {n}" for n in notes)),
                 fontsize=9)
    ax.grid(alpha=0.3)
    _legend(ax, len(series))
    fig.tight_layout()
    return fig


def _ylabel(metric: str) -> str:
    return metric + (" (%)" if _scale(metric) == 100 else "")


def plot_report(report: Report, out: Path, against: Sequence[str] = (), panels: Sequence[str] = ()) -> list[Path]:
    """``{metric}_vs_round.png`` (:func:`round_figure`), when some run is private ``{metric}_vs_epsilon.png``
    (:func:`epsilon_figure`), ``{metric}_vs_{field}.png`` for each field of ``against`` (:func:`field_figure`), and
    with ``panels`` ``{metric}_vs_round_by_{fields}.png`` (:func:`panel_figure`)."""
    from decentdp.results.files import pyplot

    figures = [("round", round_figure), ("epsilon", epsilon_figure)]
    figures += [(name, lambda report, name=name: field_figure(report, name)) for name in against]
    if panels:
        figures.append(("round_by_" + "_".join(panels), lambda report: panel_figure(report, panels)))
    written = []
    for suffix, make in figures:
        fig = make(report)
        if fig is not None:
            written.append(_save(fig, out / f"{report.metric}_vs_{suffix}.png"))
            pyplot().close(fig)
    return written


def _check_rows(rows: list[Any], path: Path) -> None:
    """Refuse a ``metrics.jsonl`` whose rows the figures could not read (a hand edit, another tool's file), naming
    the line, before anything is written: each row an object, its ``round`` (if any) an integer."""
    for line, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DecentDPError(f"cannot read {path}, line {line}: a row must be a JSON object, got {row!r:.60}")
        value = row.get("round", 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DecentDPError(f"cannot read {path}, line {line}: round must be an integer, got {value!r:.60}")


def _run_curve(run: Run, metric: str) -> dict[int, float]:
    """A run's metric by round from its ``metrics.jsonl`` (empty when the file is missing or lacks the metric)."""
    return {int(row["round"]): float(row[metric]) for row in run.curve   # (personalized rows count ticks)
            if "round" in row and isinstance(row.get(metric), (int, float))}


def _curve(runs: Sequence[Run], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and std over the seeds that have a curve, at the rounds every one of them evaluated: always the same
    seeds at every round (:func:`curve_notes` says where they are fewer than the table's, or stop early)."""
    per_run = [values for run in runs if (values := _run_curve(run, metric))]
    rounds = sorted(set.intersection(*(set(values) for values in per_run))) if per_run else []
    means, stds = [], []
    for k in rounds:
        mean, std = _mean_std([values[k] for values in per_run])
        means.append(mean)
        stds.append(std or 0.0)
    return rounds, means, stds


def curve_notes(report: Report) -> list[str]:
    """What the round figures draw differently from the table, one line per folder: a seed without the metric in
    its ``metrics.jsonl`` (the file missing or empty) is left out of its setting's curve, or the setting is not
    drawn at all; a seed whose ``metrics.jsonl`` stops before its summary's last round ends its setting's curve
    there, while the table holds the last round.  None when no run has a curve (personalized runs count ticks)."""
    if not any(_run_curve(run, report.metric) for group in report.groups for run in group.runs):
        return []
    lines = []
    for row, group in zip(report.rows, report.groups, strict=True):
        label = _label(row, report.labels, group)
        curves = {run.path: _run_curve(run, report.metric) for run in group.runs}
        missing = [path for path, values in curves.items() if not values]
        drawn = len(group.runs) - len(missing)
        for path in missing:
            lines.append(f"{path}: no {report.metric} in its {METRICS_FILE} (missing or empty); the round figures "
                         + (f"draw {label} from the other {drawn} seed(s)" if drawn else f"do not draw {label}") + ".")
        for run in group.runs:
            last, rounds = max(curves[run.path], default=None), run.summary.get("rounds")
            if last is not None and isinstance(rounds, int) and last < rounds:
                lines.append(f"{run.path}: its {METRICS_FILE} stops at round {last}, the run at round {rounds}; the "
                             f"round figures draw {label} only up to round {last}, the table at the last round.")
    return lines


def _save(fig: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    write_atomic(path, buffer.getvalue())
    return path


# ----------------------------------------------------------------------------- command


def add_parser(commands: Any) -> None:
    """Register ``decentdp report`` on the CLI's subcommands."""
    report = commands.add_parser(
        "report", help="one table and figures from any set of results folders",
        description="Collect results folders into a table grouped by the config fields that differ (mean ± "
                    "std over seeds, epsilon spent), with figures of the metric against round and against "
                    "epsilon, and optionally a column of a paper's values.",
        epilog="Paper file (TOML): source = '...', unit = 'percent', then [[row]] entries with "
               "match = { 'algorithm.name' = 'dp-dsgt', 'privacy.epsilon' = 1.0 }, value = 89.24, std = 0.27. "
               "A group takes the most specific row whose fields all match its config.")
    report.add_argument("results", nargs="+", metavar="RESULTS_DIR",
                        help="results folders, or folders holding them (searched recursively)")
    report.add_argument("--metric", default="accuracy_mean",
                        help="summary.json key to tabulate (default: %(default)s)")
    report.add_argument("--paper", type=Path, metavar="FILE", help="TOML file of the paper's values")
    report.add_argument("--ignore", action="append", default=[], metavar="FIELD",
                        help="config field (dotted) that does not define a group, e.g. experiment.rounds "
                             "(repeatable)")
    report.add_argument("--out", type=Path, metavar="DIR",
                        help="write report.md, report.csv, report.json and the figures here")
    report.add_argument("--json", action="store_true", help="print one JSON line with a 'rows' list instead of "
                                                            "the table")
    report.add_argument("--against", action="append", default=[], metavar="FIELD",
                        help="with --out, also a figure of the metric against this numeric config field, e.g. "
                             "topology.fiedler (repeatable)")
    report.add_argument("--panels", action="append", default=[], metavar="FIELD",
                        help="with --out, also the metric against round in a grid of panels, one per value of "
                             "this config field (a row of panels; given twice: rows, then columns), e.g. "
                             "schedule.kind and algorithm.alpha for a paper figure's sub-plots")
    report.add_argument("--paired", metavar="FIELD=VALUE",
                        help="compare each setting with the one that has FIELD = VALUE and otherwise the same "
                             "--within fields (by default the table's other columns), seed by seed (mean ± std of the "
                             "differences, and in how many seeds its metric is above), e.g. algorithm.name=dpdl")
    report.add_argument("--within", action="append", default=[], metavar="FIELD",
                        help="with --paired, a field the compared settings share (repeatable; default: every other "
                             "field that differs), e.g. privacy.epsilon")
    report.add_argument("--skip-unfinished", action="store_true",
                        help="leave out runs that have not finished (still running, killed) and name them on "
                             "stderr and in report.md and report.json, instead of refusing the report")


#: What ``decentdp report --out`` writes: a folder holding only these may be written again (the report redrawn).
REPORT_FILES = ("report.md", "report.csv", "report.json")


def _check_report_folder(out: Path) -> None:
    """Refuse an ``--out`` that holds anything but an earlier report (``REPORT_FILES`` and ``*_vs_*.png``
    figures): its files would be overwritten, and a results folder would get a report mixed into it."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} exists and is not a directory")
    if out.is_dir():
        foreign = sorted(entry.name for entry in out.iterdir()
                         if not (entry.name in REPORT_FILES or (entry.suffix == ".png" and "_vs_" in entry.name)))
        if foreign:
            raise ConfigError("--out", f"{out} holds files that are not an earlier report's ({', '.join(foreign[:3])}"
                                       f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder")


def remove_stale_figures(out: Path, drawn: Sequence[Path]) -> None:
    """Remove an earlier report's ``*_vs_*.png`` that this one did not draw (another ``--metric``, ``--against`` or
    ``--panels``, or an epsilon figure where no run is now private): left there, it read as part of the new report.
    :func:`_check_report_folder` has made sure the folder holds nothing but a report's files."""
    keep = {path.name for path in drawn}
    for figure in out.glob("*_vs_*.png"):
        if figure.name not in keep:
            figure.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    """``decentdp report``: read, check, group; print the table or JSON; write files with ``--out``."""
    runs, skipped = find_runs(args.results, skip_unfinished=args.skip_unfinished)
    report = build_report(runs, args.metric, args.ignore, args.paper, args.paired, args.within, skipped)
    for name in args.against:
        if args.out is None:
            raise ConfigError("--against", "draws a figure: give --out DIR as well")
        check_against(report, name)
    if args.panels:
        if args.out is None:
            raise ConfigError("--panels", "draws a figure: give --out DIR as well")
        check_panels(report, args.panels)
    if skipped:
        print(f"left out {len(skipped)} unfinished run(s): {_paths(skipped)}", file=sys.stderr)
    table = markdown(report)
    if args.out is not None:
        _check_report_folder(args.out)
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--out", f"cannot create {args.out}: {exc.strerror or exc}") from None
        write_atomic(args.out / "report.md", table)
        write_atomic(args.out / "report.csv", csv_text(report))
        write_atomic(args.out / "report.json", json.dumps(json_rows(report), indent=2, allow_nan=False) + "\n")
        drawn = plot_report(report, args.out, args.against, args.panels)
        remove_stale_figures(args.out, drawn)
    if args.json:
        print(json.dumps(json_rows(report), allow_nan=False))
    else:
        print(table, end="")
        if args.out is not None:
            print(f"\nwritten to {args.out}: report.md, report.csv, report.json and figures")
    return 0
