"""``decentdp sweep SWEEP.toml``: a resumable hyper-parameter search over config fields, on Optuna.

Why Optuna: its samplers cover the three kinds of search the issue asks for (``GridSampler``,
``RandomSampler``, and the model-based ``TPESampler``), its ask-and-tell interface lets this module keep
the process pool and the results folders, and its SQLite storage is one file that survives a kill.
(Ray Tune's population-based training would mutate a run's hyper-parameters mid-run, which a privacy
budget calibrated for one fixed schedule of releases does not allow.)  Optuna is an optional extra,
``pip install decentdp[sweep]``; nothing else in decentdp imports it.

A sweep file::

    [sweep]
    config = "../consensus/table1-dsgt-eps10.toml"   # the base config, relative to this file
    method = "tpe"                 # grid | random | tpe
    trials = 20                    # grid: at most the grid's size (default: all of it)
    workers = 2                    # processes, one compute thread each
    seeds = [0]                    # the objective is the mean over these seeds
    objective = "accuracy_mean"    # a key of summary.json, measured on the validation split
    direction = "maximize"
    validation_fraction = 0.1      # held out of each agent's training records; never the test set
    validation_split = "exact-count"   # default: the base config's own, else this; a private selection needs
                                       # (and defaults to) "per-record"
    set = { "experiment.rounds" = 200 }   # fixed overrides of the base config
    selection = "best"             # or "private": see below

    [space]
    "algorithm.lr" = { low = 0.01, high = 1.0, log = true }
    "algorithm.batch_size" = { values = [128, 256, 512] }
    "privacy.clip" = { low = 1.0, high = 10.0, step = 1.0 }

On the command line, ``--set section.key=value`` (repeatable, as for ``decentdp run``) overrides the base
config after the file's ``set`` table, so the command line wins, and ``--trials N`` replaces ``trials``.

Keys are dotted field names; TOML's unquoted dotted keys and sub-tables (``[space.algorithm]``) are read as the
fields they spell.  A searched field that no trial would read (:func:`_check_read`) is refused.

Each trial is a results folder ``OUT/trials/trial-NNNN[/seed-S]`` that ``decentdp report`` reads, its runs'
lines in ``OUT/trials/trial-NNNN.log``. A killed sweep restarted with the same command continues: finished
trials are kept, the trials that were running resume from their checkpoints, and a changed sweep file is refused
(naming what changed).  A trial stopped by its results folder (a full disk, a folder of another run) or by an
unexpected error in its worker is queued again and the sweep stops with one error; the same command resumes it.

``selection = "private"`` (with ``method = "random"`` and no ``trials``) is Papernot and Steinke's private
selection (:mod:`decentdp.tuning.selection`)::

    private = { distribution = "negative-binomial", mean_trials = 10, eta = 1, score_noise = 1.0 }
    private = { distribution = "poisson", mean_trials = 10, score_noise = 1.0 }

The number of trials K is drawn once from the operating system's randomness and kept in the study; each
trial's score is its mean over agents of correct validation predictions plus ``N(0, score_noise^2)``;
only the best noisy score's trial is released.  ``release.json`` (with ``best.toml`` and ``best.md``) is what may
be published: the released hyper-parameters, their noisy count (no accuracy: under add-remove neighbours the
validation set's size is private, and the count divided by it would reveal it) and each agent's epsilon of the
whole selection.
Everything else in the sweep folder (``selection.json``, ``study.db``, ``trials/``, the console's lines) is the
operator's: it holds K and every trial, which the theorem's bound assumes secret, and the trial folders keep
exact validation scores.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import threading
import time
import tomllib
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decentdp.algorithms import algorithm_class
from decentdp.errors import ConfigError, DecentDPError, ResultsFolderError
from decentdp.results.files import CHECKPOINT_FILE, SUMMARY_FILE, epsilon_text, write_atomic

if TYPE_CHECKING:
    from decentdp.tuning.selection import TrialCount

STUDY_FILE = "study.db"
SELECTION_FILE = "selection.json"
RELEASE_FILE = "release.json"
#: What a private selection's operator-only record says of itself (``selection.json``).
OPERATOR_ONLY = ("the operator's record: it holds K and every trial, which the selection's epsilon assumes secret; "
                 "publish release.json (with best.toml and best.md), never this file, study.db or trials/")
TRIALS_DIR = "trials"
SPEC_ATTR = "decentdp_sweep"
TRIALS_ATTR = "decentdp_private_trials"  # K of a private selection, drawn once when the study is created
_WATCHER = "decentdp-sweep-parent"
#: Why a trial whose worker process died failed (it is queued again: it did not fail on its input).
WORKER_KILLED = "its worker process was killed from outside (the out-of-memory killer?); queued again"
#: Said beside every result of ``selection = "best"`` (best.md, best.toml): the choice is not private.
NOT_PRIVATE_SELECTION = ("selection = 'best': this choice read exact validation scores, so it is not differentially "
                         "private; each trial's epsilon bounds that trial alone, not the choice (selection = "
                         "'private' prices it)")
MAX_GRID = 100_000  # grid points a grid search may visit (every field's values, and all their combinations)
_RESERVED = {"experiment.seed": "[sweep] seeds", "data.validation_fraction": "[sweep] validation_fraction",
             "data.validation_split": "[sweep] validation_split",
             "engine.threads": "one thread per worker", "data.data_dir": "--data-dir"}


# ----------------------------------------------------------------------------- the sweep file


class Dimension(BaseModel):
    """One searched field: a list of ``values``, or a range ``low``..``high`` (``log`` scale, or ``step``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    values: list[Any] | None = Field(None, min_length=1)
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)
    integer: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> Dimension:
        ranged = self.low is not None or self.high is not None
        if self.values is not None and (ranged or self.log or self.step is not None):
            raise ValueError("give either values = [...] or low/high (with log or step), not both")
        repeated = _first_repeat(self.values or [])
        if repeated is not None:
            raise ValueError(f"values holds {repeated!r} more than once: each copy would run as another, identical "
                             "trial; list each value once")
        if self.values is None:
            if self.low is None or self.high is None:
                raise ValueError("needs values = [...], or both low and high")
            if not (math.isfinite(self.low) and math.isfinite(self.high)):
                raise ValueError(f"low and high must be finite numbers (got {self.low} and {self.high})")
            if not self.low < self.high:
                raise ValueError(f"low must be below high (got {self.low} and {self.high})")
            if self.log and self.low <= 0:
                raise ValueError("a log range needs low > 0")
            if self.log and self.step is not None:
                raise ValueError("log and step cannot be combined")
            if self.step is not None and (self.high - self.low) / self.step < 1 - 1e-9:  # (Optuna: low alone)
                raise ValueError(f"step {self.step} is larger than the range {self.low}..{self.high}, so only low "
                                 "would be searched; take a step of at most high - low")
            if self.integer and not all(float(v).is_integer() for v in (self.low, self.high, self.step or 1)):
                raise ValueError(f"integer = true needs whole low, high and step (got {self.low}, {self.high}, "
                                 f"{self.step})")
        return self

    def grid(self) -> list[Any]:
        """The values a grid search visits."""
        if self.values is not None:
            return list(self.values)
        if self.step is None:
            raise ValueError("a grid needs values = [...] or a step")
        assert self.low is not None and self.high is not None
        count = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        if count > MAX_GRID:  # (the grid is a list in memory, and Optuna lists every combination)
            raise ValueError(f"the step makes a grid of {count} values, more than {MAX_GRID}: take a larger step")
        points = [self.low + k * self.step for k in range(count)]
        return [int(round(p)) for p in points] if self.integer else [round(p, 12) for p in points]

    def edges(self) -> list[Any]:
        """The values that must each form a valid config: every choice, or both ends of the range."""
        if self.values is not None:
            return list(self.values)
        ends = [self.low, self.high]
        return [int(v) for v in ends] if self.integer else ends  # type: ignore[arg-type]


def _first_repeat(values: list[Any]) -> Any:
    """The first of ``values`` that an earlier one equals (``1`` and ``1.0`` alike, as a config reads them; lists
    and tables by their contents), or None."""
    def key(value: Any) -> Any:
        if isinstance(value, list):
            return tuple(key(item) for item in value)
        if isinstance(value, dict):
            return tuple(sorted((name, key(item)) for name, item in value.items()))
        return value

    seen: set[Any] = set()
    for value in values:
        if key(value) in seen:
            return value
        seen.add(key(value))
    return None


class PrivateSelection(BaseModel):
    """``[sweep] private = {...}``: the number of trials and the score's noise of a private selection."""

    model_config = ConfigDict(extra="forbid", strict=True)

    distribution: Literal["negative-binomial", "poisson"] = "negative-binomial"
    mean_trials: float = Field(ge=1, description="E[K], the mean number of trials")
    eta: float | None = Field(None, gt=-1, description="shape of the truncated negative binomial (default 1: "
                                                       "geometric; 0: logarithmic); not for poisson")
    score_noise: float = Field(gt=0, description="standard deviation of the Gaussian noise on each trial's count "
                                                 "of correct validation predictions")

    def count(self) -> TrialCount:
        """The distribution of the number of trials."""
        from decentdp.tuning.selection import TrialCount

        if self.distribution == "poisson":
            return TrialCount("poisson", self.mean_trials)
        return TrialCount("negative-binomial", self.mean_trials, 1.0 if self.eta is None else self.eta)


class SweepSection(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    config: str
    method: Literal["grid", "random", "tpe"] = "tpe"
    trials: int | None = Field(None, ge=1)
    workers: int = Field(1, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        """Every seed a trial trains on is valid and counted once (the first alone was checked before: a
        helper's review, where seeds = [0, -1] failed every trial)."""
        if any(not 0 <= seed < 2**63 for seed in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct whole numbers in [0, 2**63), got {seeds}")
        return seeds
    objective: str = "accuracy_mean"
    direction: Literal["maximize", "minimize"] = "maximize"
    validation_fraction: float = Field(0.1, gt=0.0, le=0.5)
    validation_split: Literal["exact-count", "per-record"] | None = Field(
        None, description="data.validation_split of every trial; default 'per-record' for a private selection "
                          "(the only one it accepts), 'exact-count' otherwise")
    sampler_seed: int = Field(0, ge=0)
    set: dict[str, Any] = Field(default_factory=dict)
    top: int = Field(5, ge=1, description="trials listed in the final table")
    selection: Literal["best", "private"] = "best"
    private: PrivateSelection | None = None


@dataclass
class Sweep:
    """A validated sweep file: the section, the space, and the base config (raw TOML, overrides applied)."""

    path: Path
    section: SweepSection
    space: dict[str, Dimension]
    base: dict[str, Any] = field(repr=False)
    data_dir: str | None = None  # where the trials read data (--data-dir); not part of the sweep's definition
    options: list[str] = field(default_factory=list)  # --set and --trials as given: what a resume repeats

    @property
    def private(self) -> PrivateSelection | None:
        """The private selection's parameters, or None for ``selection = "best"``."""
        return self.section.private if self.section.selection == "private" else None

    @property
    def trials(self) -> int:
        """The number of trials the sweep runs; for a private selection, which draws it at random when its study
        is created (:attr:`SweepRunner.total`), the mean ``mean_trials`` rounded up: what to plan for."""
        if self.private is not None:
            return math.ceil(self.private.mean_trials)
        if self.section.method == "grid":
            size = math.prod(len(dim.grid()) for dim in self.space.values())
            return min(size, self.section.trials or size)
        if self.section.trials is None:
            raise ConfigError("sweep.trials", f"is required by method = '{self.section.method}'")
        return self.section.trials

    @property
    def validation_split(self) -> str:
        """How the trials hold out their validation records (``data.validation_split``): the sweep file's
        ``validation_split``, else the base config's own ``data.validation_split`` where it sets one (a reviewer's
        finding: a base config's 'per-record' was replaced without a word), else ``per-record`` for a private
        selection and ``exact-count`` otherwise.  A private selection refuses any but ``per-record``
        (:func:`_check_private`)."""
        if self.section.validation_split is not None:
            return self.section.validation_split
        if self.base_validation_split is not None:
            return self.base_validation_split
        return "per-record" if self.section.selection == "private" else "exact-count"

    @property
    def base_validation_split(self) -> str | None:
        """The base config's own ``data.validation_split``, where it sets one."""
        data = self.base.get("data")
        chosen = data.get("validation_split") if isinstance(data, dict) else None
        return chosen if isinstance(chosen, str) else None

    def spec(self) -> dict[str, Any]:
        """What must not change when a sweep resumes: everything that defines its trials."""
        return {"method": self.section.method, "objective": self.section.objective,
                "direction": self.section.direction, "seeds": self.section.seeds,
                "validation_fraction": self.section.validation_fraction, "sampler_seed": self.section.sampler_seed,
                "space": {name: dim.model_dump(exclude_defaults=True) for name, dim in sorted(self.space.items())},
                "base_config": hashlib.sha256(json.dumps({key: value for key, value in self.base.items()
                                                          if key != "tracking"},  # where it logs, not what
                                                         sort_keys=True, default=str).encode()).hexdigest(),
                **({"private": self.private.model_dump()} if self.private is not None else {}),
                # named only when per-record, so that a sweep begun before the field existed (exact-count) resumes
                **({"validation_split": "per-record"} if self.validation_split == "per-record" else {})}

    def trial_config(self, params: dict[str, Any], seed: int) -> dict[str, Any]:
        """The raw config of one trial at one seed: the base, the trial's values, the validation split."""
        from decentdp.config import apply_overrides

        assignments = [f"{name}={_toml_value(value)}" for name, value in params.items()]
        assignments += [f"experiment.seed={seed}", f"data.validation_fraction={self.section.validation_fraction}",
                        f"data.validation_split={_toml_value(self.validation_split)}", "engine.threads=1"]
        if self.data_dir is not None:
            assignments.append(f"data.data_dir={_toml_value(self.data_dir)}")
        return apply_overrides(self.base, assignments)


def sweep_copy(sweep: Sweep, out: Path) -> str:
    """The sweep file's text as the sweep folder ``out`` keeps it (``OUT/sweep.toml``), with ``[sweep] config``
    rewritten relative to ``out`` where the file gave it relative to itself: resuming with the copy, as a changed
    sweep's refusal advises, then finds the same base config (a reviewer's finding: it was looked up beside the
    copy).  The line is rewritten in place, keeping the file's comments; a file that spells it otherwise (inside an
    inline table, with escapes) is written out anew, without them."""
    text = sweep.path.read_text(encoding="utf-8")
    written = sweep.section.config
    target = Path(os.path.relpath((sweep.path.parent / written).resolve(), out.resolve())).as_posix()
    if Path(written).is_absolute() or target == written:
        return text
    raw = tomllib.loads(text)
    wanted = {**raw, "sweep": {**raw["sweep"], "config": target}}
    line = re.compile(r"^(\s*config\s*=\s*)([\"'])" + re.escape(written) + r"\2", flags=re.MULTILINE)
    copy, count = line.subn(lambda match: match.group(1) + json.dumps(target), text)
    try:
        if count == 1 and tomllib.loads(copy) == wanted:
            return copy
    except tomllib.TOMLDecodeError:
        pass
    import tomli_w

    return f"# {sweep.path}, its config path made relative to this folder\n" + tomli_w.dumps(wanted)


def _toml_value(value: Any) -> str:
    """``value`` written as a TOML value (an override's right-hand side): inline tables and arrays too, so that
    ``set = { "model.options" = { activation = "tanh" } }`` reaches the config as a table."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(key))} = {_toml_value(item)}" for key, item in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return repr(value)


def _read_toml(file: Path, field: str) -> dict[str, Any]:
    """``file`` parsed as TOML, or one error naming ``field`` and the file."""
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(field, f"cannot read {file} as TOML: {exc}") from None


def trial_objectives(config: Any) -> tuple[str, ...]:
    """The numbers a trial of ``config`` writes in its ``summary.json``, which a sweep may optimise
    (``tests/tuning/test_sweep.py`` checks them against real runs)."""
    averaged = ("last_iterate_accuracy_mean",) if config.averaging.kind != "none" else ()
    return ("accuracy_mean", "accuracy_min", "accuracy_max", "accuracy_std", "consensus_distance", *averaged,
            "epsilon_max", "wall_seconds")


def load_sweep(path: str | Path, overrides: Sequence[str] = (), trials: int | None = None) -> Sweep:
    """Read and check a sweep file: its own keys, the base config, and every field and range it searches
    (each value at the ends of each range must make a valid config, checked by the config schema).

    ``overrides`` are the command line's ``--set section.key=value``, applied to the base config after the
    file's ``set`` table (the command line wins); ``trials`` is ``--trials``, replacing ``sweep.trials``.
    Errors they cause name ``--set`` / ``--trials``."""
    from decentdp.config import apply_overrides, overridden_algorithm_keys, parse_override, validate_config

    file = Path(path)
    if file.is_dir():
        raise ConfigError("SWEEP", f"{file} is a directory, not a sweep file")
    if not file.is_file():
        raise ConfigError("SWEEP", f"no such sweep file: {file}")
    raw = _read_toml(file, "SWEEP")
    unknown = sorted(set(raw) - {"sweep", "space"})
    if unknown:
        raise ConfigError(unknown[0], "unknown section of a sweep file; allowed: [sweep], [space]")
    for table in ("sweep", "space"):
        if not isinstance(raw.get(table, {}), dict):
            raise ConfigError(table, f"must be a table ([{table}]), got {type(raw[table]).__name__}")
    table = dict(raw.get("sweep", {}))
    if isinstance(table.get("set"), dict):  # (an unquoted experiment.rounds = 5 is a table "experiment" in TOML)
        table["set"] = _dotted_keys(table["set"], "sweep.set", lambda name, value: "." in name)
    try:
        section = SweepSection.model_validate(table)
    except ValidationError as exc:
        raise _named_error(("sweep",), exc) from None
    specs = _dotted_keys(raw.get("space", {}), "space", _ends_a_field)
    space: dict[str, Dimension] = {}
    for name, spec in specs.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"space.{name}", "must be a table: { values = [...] } or { low = ..., high = ... }")
        space[name] = _dimension(name, spec)
    if not space:
        raise ConfigError("space", "the sweep searches nothing: add fields to [space], e.g. "
                                   "\"algorithm.lr\" = { low = 0.01, high = 1.0, log = true }")
    for name in [*space, *section.set]:
        if name in _RESERVED:
            where = "space" if name in space else "sweep.set"
            raise ConfigError(f"{where}.{name}", f"is set by the sweep itself ({_RESERVED[name]}); remove it here")
    for assignment in overrides:
        name = ".".join(parse_override(assignment)[0])
        if name in _RESERVED:
            raise ConfigError("--set", f"{name} is set by the sweep itself ({_RESERVED[name]}); leave it out")
    fixed = {**{name: "sweep.set" for name in section.set},
             **{".".join(parse_override(assignment)[0]): "--set" for assignment in overrides}}
    for name in space:
        if name in fixed:  # (its searched values would replace the fixed one without a word: a reviewer's finding)
            raise ConfigError(f"space.{name}", f"is also fixed by {fixed[name]}, which its searched values would "
                                               "override; search it or fix it, not both")
    options = [part for assignment in overrides for part in ("--set", assignment)]
    if trials is not None:
        if trials < 1:
            raise ConfigError("--trials", f"must be a positive integer, got {trials}")
        if section.selection == "private":
            raise ConfigError("--trials", "private selection draws the number of trials at random (mean "
                                          "sweep.private.mean_trials); leave --trials out")
        section = section.model_copy(update={"trials": trials})
        options += ["--trials", str(trials)]
    base_file = (file.parent / section.config).resolve()
    if base_file.is_dir():
        raise ConfigError("sweep.config", f"{base_file} is a directory, not a TOML config file")
    if not base_file.is_file():
        raise ConfigError("sweep.config", f"no such config file: {base_file}")
    base_raw = _read_toml(base_file, "sweep.config")
    if "personalized" in base_raw:
        raise ConfigError("sweep.config", f"{base_file} is a [personalized] run, which does not read the "
                                          "validation split a sweep's trials train on (data.validation_fraction); "
                                          "tune it with personalized.validation = true on MovieLens "
                                          "(experiments/personalized/tune.py), or on other seeds of the synthetic "
                                          "problem")
    own = [f"{name}={_toml_value(value)}" for name, value in section.set.items()]  # the file's set table
    assignments = [*own, *overrides]
    base = apply_overrides(base_raw, assignments)
    sweep = Sweep(file, section, space, base, options=options)
    try:
        base_config = validate_config(sweep.trial_config({}, section.seeds[0]), overridden_algorithm_keys(assignments))
    except ConfigError as exc:
        # Name --set when an override is at fault: one that sets the field, or, when none does, all of them if
        # the file's config is valid without them (e.g. --set topology.graph=erdos-renyi with no topology.p).
        culprits = [a for a in overrides if _touches(".".join(parse_override(a)[0]), exc.field)]
        if not culprits and overrides:
            without = Sweep(file, section, space, apply_overrides(base_raw, own))
            try:
                validate_config(without.trial_config({}, section.seeds[0]), overridden_algorithm_keys(own))
                culprits = list(overrides)
            except ConfigError:
                pass  # the file's own config is invalid: its error stands
        if not culprits:
            own_culprits = [name for name in section.set if _touches(name, exc.field)]
            if own_culprits:  # the sweep file's own set table, not the base config, is at fault
                raise ConfigError(f"sweep.set.{own_culprits[0]}", f"makes the sweep's base config invalid: "
                                                                  f"{exc.field}: {exc.message}") from None
            raise
        raise ConfigError("--set", f"with {', '.join(map(repr, culprits))}, the sweep's base config is invalid: "
                                   f"{exc.field}: {exc.message}") from None
    edge_configs: list[tuple[str, Any]] = []  # (the space field, the config at one of its edges)
    for name, dim in space.items():
        _check_field(name, base_config)
        if not dim.integer and dim.values is None and _is_integer_field(name, base_config):
            space[name] = dim = _whole_number_dimension(name, specs[name])
        for value in dim.edges():
            try:
                edge = validate_config(apply_overrides(base, [f"{name}={_toml_value(value)}"]))
                edge_configs.append((f"space.{name}", edge))
            except ConfigError as exc:
                raise ConfigError(f"space.{name}", f"the value {value!r} makes an invalid config: "
                                                   f"{str(exc).removeprefix('invalid configuration:').strip()}") \
                    from None
    _check_read(space, base_config, edge_configs)
    objectives = trial_objectives(base_config)
    if section.objective not in objectives:  # before any trial trains, not after every one has
        raise ConfigError("sweep.objective", f"{section.objective!r} is not a number in a trial's summary.json; "
                                             f"one of: {', '.join(objectives)}")
    if section.selection == "private":  # before the grid's own checks: a private grid is refused as such
        _check_private(sweep, base_config, edge_configs)
    if section.method == "grid":
        size = 1
        for name, dim in space.items():
            try:
                size *= len(dim.grid())
            except ValueError as exc:
                raise ConfigError(f"space.{name}", f"{exc} (method = 'grid')") from None
        if size > MAX_GRID:
            raise ConfigError("space", f"the grid has {size} combinations, more than {MAX_GRID}: search fewer values "
                                       "(or use method = 'random' or 'tpe')")
    if section.selection == "best":
        if section.private is not None:
            raise ConfigError("sweep.private", "is used only with selection = 'private'")
        _ = sweep.trials  # trials is required unless the grid bounds it
    return sweep


def _dotted_keys(table: dict[str, Any], where: str, ends: Callable[[str, Any], bool]) -> dict[str, Any]:
    """``table`` (the sweep's ``set``, or ``[space]``) keyed by dotted field names, its nested tables read as the
    dotted keys they spell: TOML reads an unquoted ``experiment.rounds = 5`` (or a ``[space.algorithm]`` header)
    as a table ``experiment`` holding ``rounds``, which is what the user meant by it (a reviewer's finding: such a
    set table was reported as a --set error naming 'experiment', and such a space entry as "Extra inputs").

    ``ends(name, value)`` says whether a table at the dotted ``name`` is the key's value rather than a level of its
    name; any other value always is.  A name given twice (quoted, and unquoted or under a header) is refused,
    naming it under ``where``."""
    flat: dict[str, Any] = {}

    def read(name: str, value: Any) -> None:
        if isinstance(value, dict) and not ends(name, value):
            for key, item in value.items():
                read(f"{name}.{key}", item)
        elif name in flat:
            raise ConfigError(f"{where}.{name}", "is given twice (as a quoted dotted key, and as an unquoted one or "
                                                 "under a table header): give it once")
        else:
            flat[name] = value

    for key, value in table.items():
        read(key, value)
    return flat


def _ends_a_field(name: str, spec: Any) -> bool:
    """Whether ``spec``, a table at ``name`` in ``[space]``, is a searched field's (``{ values = ... }``,
    ``{ low = ..., high = ... }``, or anything else that is not only tables: it is checked as one) rather than a
    level of the field's name (``[space.algorithm]``, or an unquoted ``algorithm.lr = { ... }``)."""
    return not spec or bool(set(spec) & set(Dimension.model_fields)) or \
        not all(isinstance(item, dict) for item in spec.values())


def _named_error(where: tuple[str, ...], error: ValidationError) -> ConfigError:
    """A table's first validation error as one error naming the key it is about: ``where`` (the table) and the
    error's location in it, e.g. ``space.algorithm.lr.lo`` for a misspelled ``low`` (a reviewer's finding: the
    [space] entries named their field only)."""
    first = error.errors()[0]
    return ConfigError(".".join(str(part) for part in (*where, *first["loc"])),
                       first["msg"].removeprefix("Value error, "))


def _dimension(name: str, spec: dict[str, Any]) -> Dimension:
    """The searched field ``name``'s table ``spec``, checked, or one error naming the key at fault."""
    try:
        return Dimension.model_validate(spec)
    except ValidationError as exc:
        raise _named_error(("space", name), exc) from None


def _whole_number_dimension(name: str, spec: dict[str, Any]) -> Dimension:
    """The range ``spec`` of a field that takes whole numbers, checked with ``integer = true`` (implied), so that a
    fractional low, high or step is refused (a reviewer's finding: set after the checks, step 0.5 gave a traceback
    and 2.5..16.5 was truncated into repeated grid points)."""
    try:
        return _dimension(name, {**spec, "integer": True})
    except ConfigError as exc:
        raise ConfigError(exc.field, f"takes whole numbers, so {exc.message}") from None


def check_data(sweep: Sweep) -> None:
    """Load the dataset the trials read (the base trial's, with ``--data-dir``), as each trial will, so that a wrong
    data directory or missing files is one error before anything is written or run (a reviewer's finding: every
    trial failed with it, and a failed trial is not run again)."""
    from decentdp.config import validate_config
    from decentdp.data.datasets import load_dataset
    from decentdp.errors import DataError

    data = validate_config(sweep.trial_config({}, sweep.section.seeds[0])).data
    try:
        load_dataset(data.dataset, data.data_dir, image_size=data.image_size)
    except DataError as exc:
        raise ConfigError("--data-dir" if sweep.data_dir is not None else "data.data_dir", str(exc)) from None


def _touches(key: str, field: str) -> bool:
    """Whether an override of dotted ``key`` can be what a validation error on ``field`` is about: the same
    field, one inside it, or its section (``foo.bar`` on an unknown section ``foo``)."""
    return key == field or key.startswith(f"{field}.") or field.startswith(f"{key}.")


def _check_private(sweep: Sweep, base_config: Any, edge_configs: list[tuple[str, Any]]) -> None:
    """What private selection needs of the sweep file, of its base config and of the config at every edge of the
    space (a searched field could make a trial non-private, replace-one or DECOR), one error naming the field."""
    section, private = sweep.section, sweep.private
    if private is None:
        raise ConfigError("sweep.private", "is required by selection = 'private', e.g. private = { distribution = "
                                           "\"negative-binomial\", mean_trials = 10, eta = 1, score_noise = 1.0 }")
    if section.method != "random":
        raise ConfigError("sweep.method", f"must be 'random' for selection = 'private' (got '{section.method}'): "
                                          "the theorem needs independent, identically drawn trials; TPE adapts to "
                                          "earlier scores and a grid is not random")
    if section.trials is not None:
        raise ConfigError("sweep.trials", "private selection draws the number of trials at random (mean "
                                          "sweep.private.mean_trials); remove trials")
    if sweep.validation_split != "per-record":
        taken = "its default" if section.validation_split is not None else \
            f"its default; the base config's data.validation_split = '{sweep.validation_split}' is taken unless " \
            "[sweep] sets validation_split"
        raise ConfigError("sweep.validation_split", f"must be 'per-record' for selection = 'private' ({taken}): "
                                                    f"with '{sweep.validation_split}', adding one record redraws "
                                                    "which of the others are held out, which the selection's "
                                                    "epsilon does not price")
    if section.objective != "accuracy_mean" or section.direction != "maximize":
        field = "sweep.objective" if section.objective != "accuracy_mean" else "sweep.direction"
        raise ConfigError(field, "private selection scores trials by their noisy count of correct validation "
                                 "predictions: objective = 'accuracy_mean', direction = 'maximize'")
    if "sampler_seed" in section.model_fields_set:
        raise ConfigError("sweep.sampler_seed", "a private selection draws its trials' values from OS randomness (from "
                                                "a seed, the released values would say which draw they were): "
                                                "leave it out")
    if private.distribution == "poisson" and private.eta is not None:
        raise ConfigError("sweep.private.eta", "is a parameter of the negative-binomial distribution, not poisson")
    if private.distribution == "negative-binomial" and not private.mean_trials > 1:
        raise ConfigError("sweep.private.mean_trials", "must be above 1 for the truncated negative binomial "
                                                       f"(got {private.mean_trials})")
    for where, config in [(None, base_config), *edge_configs]:
        _check_private_trial(config, where)


def _check_private_trial(config: Any, where: str | None) -> None:
    """What private selection needs of one trial's config (the base's, or the one at an edge of ``where``, a
    searched field), one error naming the field."""
    if not config.privacy.private:
        raise ConfigError(where or "sweep.config", "private selection needs private trials: "
                                                   f"{'a value of it' if where else 'the base config'} leaves no "
                                                   "privacy budget")
    if config.privacy.neighbouring != "add-remove":
        raise ConfigError(where or "privacy.neighbouring", "private selection adds RDP curves, which decentdp "
                                                           "computes for add-remove neighbours only")
    if not algorithm_class(config.algorithm.name).budgets_bound_everyone:
        raise ConfigError(where or "algorithm.name", f"'{config.algorithm.name}' budgets one curious agent's view, "
                                                     "but a trial's score pools every agent's model: private "
                                                     "selection prices trials on budgets that bound every observer "
                                                     "together")


def _lookup(name: str, config: Any) -> tuple[bool, Any]:
    """Whether dotted ``name`` is a field of the resolved config, and its value."""
    data: Any = config.to_toml_dict()
    section, _, key = name.partition(".")
    model = type(config).model_fields.get(section)
    if model is None or not key:
        return False, None
    sub = getattr(config, section)
    if key.startswith("options.") and section == "model":
        return True, sub.options.get(key.removeprefix("options."))
    known = set(type(sub).model_fields) | set(getattr(sub, "__pydantic_extra__", None) or {})
    return key in known, data.get(section, {}).get(key)


def _check_field(name: str, config: Any) -> None:
    found, _ = _lookup(name, config)
    if not found:
        section = name.partition(".")[0]
        sub = getattr(config, section, None)
        allowed = sorted(set(type(sub).model_fields) | set(getattr(sub, "__pydantic_extra__", None) or {})) \
            if sub is not None else sorted(type(config).model_fields)
        where = f"[{section}] keys: {', '.join(allowed)}" if sub is not None else \
            f"sections: {', '.join(allowed)}"
        raise ConfigError(f"space.{name}", f"is not a config field of this sweep's config ({where}; "
                                           "model options as model.options.NAME)")


def _check_read(space: dict[str, Dimension], base_config: Any, edge_configs: list[tuple[str, Any]]) -> None:
    """Refuse a searched field that no trial reads, one error naming it: every trial would be the same run, and
    best.toml would report a tuned value that does nothing (a reviewer's finding: ``algorithm.lr_final`` under a
    constant schedule, ``averaging.decay`` with averaging off).  What a config reads is the schema's
    (:meth:`~decentdp.config.ExperimentConfig.unread_with_reasons`).

    The rule: a field is read if the base config (the sweep's ``set`` and ``--set`` applied) reads it, or the base
    config with one searched field at one of its edges does (each of its values, or either end of its range).
    Whether a field is read depends on one switch (the schedule, the averaging, the partition, the algorithm), and a
    switch that reads it at some value of the space does so at one of those, so a space that turns the mode on
    itself (``averaging.kind`` beside ``averaging.decay``) is accepted, without visiting its combinations."""
    unread = base_config.unread_with_reasons()
    reading = [set(config.unread_with_reasons()) for _, config in edge_configs]
    for name in space:
        if name in unread and all(name in fields for fields in reading):
            raise ConfigError(f"space.{name}", f"is not read by this run ({unread[name]}), at any value of the "
                                               "searched fields: every trial would be the same; remove it, or "
                                               "search what turns it on too")


def _is_integer_field(name: str, config: Any) -> bool:
    _, value = _lookup(name, config)
    return isinstance(value, int) and not isinstance(value, bool)


# ----------------------------------------------------------------------------- trials


def trial_folder_name(trial: Any) -> str:
    """A trial's results folder relative to the sweep folder, ``trials/trial-NNNN``: what the study stores, so that
    the sweep resumes from any working directory and ``best.md`` names folders as seen from it (a reviewer's
    finding).  An interrupted trial queued again keeps its folder's name; studies begun before stored it relative
    to the working directory they ran in, or absolute, always ending in that name."""
    stored = trial.user_attrs.get("folder")
    return f"{TRIALS_DIR}/{Path(stored).name if stored else f'trial-{trial.number:04d}'}"


def _exit_with(parent: int) -> None:
    """End this worker when the sweep process that started it dies (killed, not interrupted), so that a
    resumed sweep is the only writer of the trial's folder."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if not any(thread.name == _WATCHER for thread in threading.enumerate()):  # once per worker process
        threading.Thread(target=watch, daemon=True, name=_WATCHER).start()


def _no_process_locks() -> None:
    """Give tqdm's bars (the run's, disabled in a worker) a thread lock instead of the multiprocessing one they make
    by default: that one is a named semaphore registered with the resource tracker, and a worker killed from
    outside never unregisters it, so the sweep's error was followed by a "leaked semaphore objects" warning (a
    reviewer's finding)."""
    from tqdm.std import tqdm

    tqdm.set_lock(threading.RLock())


def run_trial(raw_configs: list[dict[str, Any]], folders: list[str], log_file: str, objective: str,
              parent: int) -> dict[str, Any]:
    """One trial in a worker process: its run at each seed (resumed where a checkpoint exists), and the mean
    of ``objective`` over them; the runs' lines go to ``log_file`` (``trials/trial-NNNN.log``, every seed's).

    Returns ``{"value": ...}`` (with ``"notes"``, lines for the sweep's console, where a damaged file was replaced
    by running again), ``{"error": message}`` for bad input (the trial failed: run again, it would fail again), or
    ``{"interrupted": message}`` when its results folder, not its input, stopped it (a full disk, a file size limit,
    a damaged file it cannot replace, a folder of another run: :class:`~decentdp.errors.ResultsFolderError`, or any
    ``OSError``): the sweep queues it again and stops, and the same command runs it once that is mended (a reviewer's
    finding: a full disk failed trials for good, spending a private selection's K)."""
    import torch

    from decentdp.config import validate_config

    _exit_with(parent)
    _no_process_locks()
    torch.set_num_threads(1)
    values, notes = [], []
    try:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        with Path(log_file).open("a", encoding="utf-8") as log:
            def say(line: str) -> None:
                print(line, file=log, flush=True)

            for raw, folder in zip(raw_configs, folders, strict=True):
                summary = _seed_summary(validate_config(raw), Path(folder), say, notes)
                value = summary.get(objective)
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    return {"error": f"the run has no finite '{objective}' in its summary"}
                values.append(float(value))
    except ResultsFolderError as error:
        return {"interrupted": str(error)}
    except OSError as error:  # (a file the run's own checks do not cover: its start's files, its log)
        return {"interrupted": f"{f'{error.filename}: ' if error.filename else ''}{error.strerror or error}"}
    except DecentDPError as error:
        return {"error": str(error)}
    return {"value": sum(values) / len(values), **({"notes": notes} if notes else {})}


def _seed_summary(config: Any, path: Path, say: Callable[[str], None], notes: list[str]) -> dict[str, Any]:
    """The ``summary.json`` of a trial's run at one seed, in ``path``: read where the run finished, else run
    (resumed from its checkpoint where there is one).  A file that cannot be read back (a damaged ``summary.json``
    or checkpoint: a reviewer's finding, a traceback on every resume) is replaced by running again, from the
    checkpoint or, where that is what is damaged, from the first round in the emptied folder; each such step is
    added to ``notes``.  (Running again from the first round is what a damaged run's own message advises: the trial
    folders are the operator's, and only the new run's results reach the sweep.)"""
    from decentdp.experiment.loop import run_experiment

    summary_file = path / SUMMARY_FILE
    if summary_file.is_file():
        _check_finished_is_this_trial(path, config)
        summary = _read_summary(summary_file)
        if isinstance(summary, dict):
            return summary
        notes.append(f"{summary_file} cannot be read ({summary}): its run "
                     + ("goes on from its checkpoint to write it again" if (path / CHECKPOINT_FILE).is_file()
                        else "has no checkpoint and starts again from its first round"))
    resume = (path / CHECKPOINT_FILE).is_file()
    if path.exists() and not resume:
        shutil.rmtree(path)  # killed before its first checkpoint: nothing to keep
    say(f"run {path} ({'resumed' if resume else 'started'})")
    try:
        return run_experiment(config, path, resume=resume, progress=False, log=say).summary
    except ResultsFolderError as error:
        if error.damaged is None:
            raise
        notes.append(f"{error.damaged} cannot be read back, so its run at {path} cannot continue from it: it starts "
                     "again from its first round")
        say(notes[-1])
    shutil.rmtree(path)
    return run_experiment(config, path, resume=False, progress=False, log=say).summary


def _read_summary(file: Path) -> dict[str, Any] | str:
    """A finished run's ``summary.json``, or why it cannot be read (a crash or a full disk mid-write, an edit)."""
    try:
        summary = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        return error.strerror or str(error)
    except ValueError:  # (JSONDecodeError, UnicodeDecodeError)
        return "it is not JSON"
    return summary if isinstance(summary, dict) else "it holds no JSON object"


def _check_finished_is_this_trial(path: Path, config: Any) -> None:
    """Refuse to take a finished folder's score for a trial it did not run (a helper's review: a folder left by
    another study would lend its score to this trial's values): its resolved config must be the trial's, up to
    where it computed, logged or recorded.  The folder is at fault, not the trial, so the error is a
    :class:`~decentdp.errors.ResultsFolderError`: the trial is queued again, and runs once the folder is moved."""
    from decentdp.config import PLACEMENT_FIELDS, RECORDING_FIELDS, config_differences, validate_config

    try:
        saved = validate_config(tomllib.loads((path / "config.toml").read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError, DecentDPError):
        raise ResultsFolderError("", f"{path} holds a finished run whose config.toml cannot be read: it is not this "
                                     "trial's; move it aside") from None
    changed = [key for key in config_differences(saved, config) if key not in PLACEMENT_FIELDS + RECORDING_FIELDS]
    if changed:
        raise ResultsFolderError("", f"{path} holds a finished run of another config (it differs in "
                                     f"{', '.join(changed)}): not this trial's; move it aside")


def _nested(raw: dict[str, Any], tracking: tuple[Any, str] | None) -> dict[str, Any]:
    """A trial's raw config, logged as a child of the sweep's MLflow run (to the same store) when there is one."""
    if tracking is None:
        return raw
    base, parent = tracking
    from decentdp.experiment.tracking import resolved_uri

    return {**raw, "tracking": {**raw.get("tracking", {}), "parent_run": parent, "uri": resolved_uri(base.tracking)}}


def _grid_sampler(optuna: Any, grid: dict[str, list[Any]], seed: int) -> Any:
    """Optuna's ``GridSampler`` over ``grid``, without its automatic stop.

    Its ``after_trial`` calls ``study.stop()`` when the last grid point is told, and under ask-and-tell,
    which this module uses, that raises ``RuntimeError`` (Optuna issues #4121 and #5141; the sampler's
    documentation notes it).  The trial is stored before the error, but the sweep would end with a
    traceback and no ``best.toml``.  The runner counts its trials itself, so the stop has nothing to do.
    """

    class AskAndTellGridSampler(optuna.samplers.GridSampler):  # type: ignore[misc]  (optuna is typed Any here)
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            """Nothing: the runner, not the sampler, decides when the sweep is done."""

    return AskAndTellGridSampler(grid, seed=seed)


class SweepRunner:
    """The study in ``out/study.db`` and the trials' results folders under ``out/trials``."""

    def __init__(self, sweep: Sweep, out: Path) -> None:
        """Open (or resume) the study in ``out``, holding ``out``'s lock until :meth:`close`: two sweeps on one
        folder would tell each other's trials and write the same trial folders (a reviewer's finding)."""
        import optuna

        from decentdp.experiment.record import FolderLock

        self.optuna = optuna
        self.sweep = sweep
        self.out = out
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        created = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. below a file
            raise ConfigError("--out", f"cannot create the sweep folder {out}: {exc.strerror or exc}") from None
        self._lock = FolderLock(out, created, writer="sweep", kind="sweep folder")
        try:
            self._open_study()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the sweep folder's lock (also released when this object is collected)."""
        self._lock.close()

    def _open_study(self) -> None:
        """Create or resume the study (refusing a changed definition), draw K of a private selection, seed the
        sampler and copy the sweep file into the folder."""
        from decentdp.tuning.selection import os_generator, os_seed

        optuna, sweep, out = self.optuna, self.sweep, self.out
        storage = f"sqlite:///{(out / STUDY_FILE).resolve()}"
        from sqlalchemy.exc import SQLAlchemyError  # optuna's storage layer

        try:
            names = optuna.study.get_all_study_names(storage)
            if names:
                self.study = optuna.load_study(study_name=names[0], storage=storage)
                _check_same(self.study.user_attrs.get(SPEC_ATTR, {}), sweep.spec(), out)
            else:
                self.study = optuna.create_study(study_name="decentdp", storage=storage,
                                                 direction=sweep.section.direction)
                self.study.set_user_attr(SPEC_ATTR, sweep.spec())
        except SQLAlchemyError as exc:  # a crash or a full disk mid-write: say so, touch nothing
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            raise ConfigError("--out", f"{out / STUDY_FILE} is damaged ({reason}); the sweep cannot resume: start it "
                                       "again with another --out (the trials' folders under trials/ keep their "
                                       "results; a private selection started again draws K and its noise afresh, "
                                       "a new selection whose epsilon composes with this one's)") from None
        self.total = sweep.trials if sweep.private is None else self._private_trials()
        self.rng = os_generator() if sweep.private is not None else None  # the scores' noise
        # A resumed sweep seeds its sampler afresh (the seed and the trials so far), so that it does not
        # propose the values of its first trials again; a grid skips the points already visited.  A private
        # selection draws its trials' values from OS randomness: from the public seed, the released values would
        # say which draw they were, hence that K reached it (a helper's review).  128 bits of it, kept nowhere
        # (a resume draws new ones): 32 bits were found by trying every seed (a reviewer's finding).
        seed = sweep.section.sampler_seed + len(self.study.get_trials(deepcopy=False)) if sweep.private is None \
            else os_seed()
        self.study.sampler = {
            "grid": lambda: _grid_sampler(optuna, {n: d.grid() for n, d in sweep.space.items()}, seed),
            "random": lambda: optuna.samplers.RandomSampler(seed=seed),
            "tpe": lambda: optuna.samplers.TPESampler(seed=seed)}[sweep.section.method]()
        repeat = f"# decentdp sweep was given {shlex.join(sweep.options)}: repeat them with this file\n" \
            if sweep.options else ""
        if sweep.path.resolve() != (out / "sweep.toml").resolve():  # (resumed with the copy: it is kept as it is)
            write_atomic(out / "sweep.toml", repeat + sweep_copy(sweep, out))

    def _private_trials(self) -> int:
        """K of a private selection: drawn with OS randomness when the study is created, kept in the study so
        that a resumed sweep runs the same number of trials (drawing again would bias K towards larger draws)."""
        from decentdp.tuning.selection import os_generator

        drawn = self.study.user_attrs.get(TRIALS_ATTR)
        if drawn is None:
            assert self.sweep.private is not None
            drawn = self.sweep.private.count().sample(os_generator())
            self.study.set_user_attr(TRIALS_ATTR, drawn)
        return int(drawn)

    def trial_folder(self, trial: Any) -> Path:
        """A trial's results folder (:func:`trial_folder_name`, under the sweep folder)."""
        return self.out / trial_folder_name(trial)

    def trial_log(self, trial: Any) -> Path:
        """Where a trial's runs write their lines, every seed's: ``trials/trial-NNNN.log``, beside its folder."""
        folder = self.trial_folder(trial)
        return folder.with_name(f"{folder.name}.log")

    def seed_folders(self, folder: Path) -> list[Path]:
        """A trial's results folder per seed."""
        seeds = self.sweep.section.seeds
        return [folder if len(seeds) == 1 else folder / f"seed-{s}" for s in seeds]

    def distributions(self) -> dict[str, Any]:
        dists = self.optuna.distributions
        out: dict[str, Any] = {}
        for name, dim in self.sweep.space.items():
            if self.sweep.section.method == "grid" or dim.values is not None:
                out[name] = dists.CategoricalDistribution(dim.grid())
            elif dim.integer:
                out[name] = dists.IntDistribution(int(dim.low or 0), int(dim.high or 0), log=dim.log,
                                                  step=int(dim.step or 1))
            else:
                out[name] = dists.FloatDistribution(dim.low or 0.0, dim.high or 0.0, log=dim.log, step=dim.step)
        return out

    def recover(self) -> int:
        """Trials a killed sweep left running: failed in the study, queued again with the same values and
        folder (they resume from their checkpoints).  Returns how many."""
        stale = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,))
        for trial in stale:
            self._queue_again(trial)
        return len(stale)

    def _queue_again(self, trial: Any) -> None:
        """Fail an interrupted trial in the study and queue its values again with its folder, so that the trial
        asked next continues it from its checkpoint (an interrupted trial does not count as finished)."""
        self.study.tell(trial.number, state=self.optuna.trial.TrialState.FAIL)
        self.study.enqueue_trial(trial.params, user_attrs={"folder": trial_folder_name(trial), "interrupted": True})

    def _stopped(self, trial: Any, reason: str) -> str:
        """Record why ``trial`` could not go on (its results folder or its worker, not its input: ``reason``) and
        queue it again, as :meth:`_queue_again` does; the line that the sweep's error gives for it."""
        trial.set_user_attr("stopped", reason)
        self._queue_again(trial)
        return f"trial {trial.number} ({trial_folder_name(trial)}): {reason}"

    def _worker_error(self, trial: Any, error: BaseException) -> str:
        """Why a trial stopped on an error its worker did not expect (one that crossed the process pool: a bug, or
        a failure no check names), with the traceback appended to the trial's log, which the reason names (a
        reviewer's finding: a JSONDecodeError's traceback ended the sweep and left the trial running)."""
        log = self.trial_log(trial)
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a", encoding="utf-8") as handle:
                handle.write("".join(traceback.format_exception(error)))
        except OSError:
            return f"{type(error).__name__}: {error} (unexpected, in its worker)"
        return f"{type(error).__name__}: {error} (unexpected, in its worker; the traceback is in {log})"

    def _worker_killed(self, trials: list[Any], log: Callable[[str], None]) -> DecentDPError:
        """The error that ends a sweep whose process pool broke (a worker killed from outside, e.g. by the
        out-of-memory killer: a reviewer's BrokenProcessPool traceback); the ``trials`` that were running are
        recorded as failed with the reason and queued again, so that the same command resumes them."""
        for trial in trials:
            trial.set_user_attr("killed", WORKER_KILLED)
            self._queue_again(trial)
            log(f"trial {trial.number} failed: {WORKER_KILLED}")
        return DecentDPError(f"a worker process of the sweep in {self.out} was killed from outside (the out-of-memory "
                             f"killer?) while {len(trials)} trial(s) ran; they are queued again: run the same command "
                             "to resume them from their checkpoints (with fewer --workers if memory ran out)")

    def failures(self) -> list[str]:
        """One line per trial that failed on bad input, with its stored error (failed trials count as finished and
        are not run again, so a resume must say why they failed)."""
        failed = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.FAIL,))
        return [f"trial {t.number}: {t.user_attrs['error']}" for t in failed if "error" in t.user_attrs]

    def finished(self) -> int:
        """Trials that count towards ``trials``: completed, and failed on bad input (not interrupted ones)."""
        state = self.optuna.trial.TrialState
        trials = self.study.get_trials(deepcopy=False, states=(state.COMPLETE, state.FAIL))
        return sum(1 for t in trials if t.state == state.COMPLETE or "error" in t.user_attrs)

    def run(self, progress: bool = True, log: Callable[[str], None] = print) -> list[Any]:
        """Run trials until ``trials`` are finished, ``workers`` at a time; the best trials, best first."""
        from tqdm.auto import tqdm

        queued = len(self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.WAITING,)))
        recovered = queued + self.recover()  # (those a stopped sweep queued again, and those a killed one left)
        done, total = self.finished(), self.total
        if done or recovered:
            log(f"resuming {self.out}: {done} of {total} trials finished, {recovered} interrupted trial(s) "
                "continue from their checkpoints")
        section = self.sweep.section
        score = "noisy_correct" if self.sweep.private is not None else section.objective  # what trials are ranked by
        bar = tqdm(total=total, initial=min(done, total), desc="trials", unit="trial", disable=not progress,
                   file=sys.stderr)
        running: dict[Future[dict[str, Any]], Any] = {}
        stopped: list[str] = []  # trials that could not go on (queued again): the sweep stops once the others end
        context = get_context("spawn")  # fresh interpreters: no inherited torch threads or locks
        tracking = self._open_tracking()
        status = "FAILED"
        try:
            with ProcessPoolExecutor(max_workers=section.workers, mp_context=context) as pool:
                while (not stopped and done + len(running) < total) or running:
                    while not stopped and done + len(running) < total and len(running) < section.workers:
                        trial = self.study.ask(self.distributions())
                        trial.set_user_attr("folder", trial_folder_name(trial))
                        folders = [str(path) for path in self.seed_folders(self.trial_folder(trial))]
                        configs = [_nested(self.sweep.trial_config(trial.params, s), tracking)
                                   for s in section.seeds]
                        running[pool.submit(run_trial, configs, folders, str(self.trial_log(trial)),
                                            section.objective, os.getpid())] = trial
                    finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                    for future in finished:
                        try:
                            result = future.result()  # (BrokenProcessPool leaves the trial in running)
                        except BrokenProcessPool:
                            raise
                        except Exception as error:  # noqa: BLE001  (any other: the trial is named, not left running)
                            result = {"interrupted": self._worker_error(running[future], error)}
                        trial = running.pop(future)
                        if "interrupted" in result:
                            stopped.append(self._stopped(trial, result["interrupted"]))
                            continue
                        for note in result.get("notes", ()):
                            log(f"trial {trial.number}: {note}")
                        if "error" in result:
                            trial.set_user_attr("error", result["error"])
                            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
                            log(f"trial {trial.number} failed: {result['error']}")
                        elif self.sweep.private is None:
                            self.study.tell(trial, result["value"])
                        else:
                            self.study.tell(trial, self._noisy_score(trial))
                        done += 1
                        bar.update(1)
                        best = self._best(1)
                        if best:
                            bar.set_postfix_str(f"best {score} {trial_score(self.sweep, best[0]):.4f} "
                                                f"(trial {best[0].number})")
            if stopped:
                raise DecentDPError(
                    f"the sweep in {self.out} stopped: {'a trial' if len(stopped) == 1 else f'{len(stopped)} trials'} "
                    "could not go on:\n  " + "\n  ".join(stopped) + "\n"
                    + ("it is" if len(stopped) == 1 else "they are") + " queued again, not failed: mend the cause "
                    "(free space, move a folder aside; an unexpected error's traceback is in the trial's log) and run "
                    "the same command to resume")
            status = "FINISHED"
        except BrokenProcessPool:
            raise self._worker_killed(list(running.values()), log) from None
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            bar.close()
            if tracking is not None:
                from decentdp.experiment.tracking import finish_sweep_run

                best = self._best(1)
                finish_sweep_run(tracking[0], tracking[1],
                                 {score: trial_score(self.sweep, best[0])} if best else {}, status)
        return self._best(section.top)

    def _open_tracking(self) -> tuple[Any, str] | None:
        """``(base config, run id)`` of the sweep's own MLflow run, its trials' parent, when the base config
        tracks to MLflow (:func:`~decentdp.experiment.tracking.open_sweep_run`); else None."""
        from decentdp.config import validate_config
        from decentdp.experiment.tracking import open_sweep_run

        base = validate_config(self.sweep.trial_config({}, self.sweep.section.seeds[0]))
        run = open_sweep_run(base, self.out.name, self.out,
                             {name: dim.model_dump(exclude_defaults=True) for name, dim in self.sweep.space.items()})
        return None if run is None else (base, run)

    def _noisy_score(self, trial: Any) -> float:
        """The score a private selection releases for a finished trial: its mean over agents (and seeds) of
        correct validation predictions plus ``N(0, score_noise^2)`` drawn with OS randomness (hardened), stored in the
        trial as ``noisy_correct`` and returned as its value.  Not divided into an accuracy: under add-remove
        neighbours the validation set's size is private, and ``noisy / size`` would give it away exactly (a
        reviewer's finding: ``release.json`` held both).

        Sensitivity 1: every agent's model is scored on the same pooled validation set
        (``data.partition.hold_out``, per-record: a record's side depends on no other record), and validation
        records are never trained on, so adding or removing one validation record changes each agent's count,
        hence their mean, by at most 1 (and the mean over seeds by at most 1), and moves no other record.
        A record in an agent's training data reaches the score only through the
        trained models, which the trial's own ledger covers (see :meth:`selection`)."""
        from decentdp.rng import hardened_normals

        assert self.sweep.private is not None and self.rng is not None
        correct = []
        for folder in self.seed_folders(self.trial_folder(trial)):
            accuracy = json.loads((folder / "summary.json").read_text())["accuracy_mean"]
            correct.append(accuracy * _validation_size(folder))
        # the hardened sampler secure noise uses (a sum of Box-Muller draws), not numpy's ziggurat: a naive
        # floating-point Gaussian's gaps can reveal the value it was added to (Mironov 2012; a helper's review)
        noise = float(hardened_normals(self.rng.random(4), 1)[0])
        noisy = sum(correct) / len(correct) + self.sweep.private.score_noise * noise
        trial.set_user_attr("noisy_correct", noisy)
        return noisy

    def _trial_rdp(self, trial: Any) -> tuple[np.ndarray, float]:
        """A trial's RDP per agent ``(agents, orders)`` from its ledgers (``privacy.json``), and its delta.

        Several seeds compose; since an agent's records differ from seed to seed, each seed contributes
        its worst agent's curve and the result is one row (a record's worst case)."""
        from decentdp.privacy.ledger import PrivacyLedger

        curves, deltas = [], []
        for folder in self.seed_folders(self.trial_folder(trial)):
            try:
                report = json.loads((folder / "privacy.json").read_text())
                ledger = PrivacyLedger.from_state_dict(report["ledger"])
            except (OSError, KeyError, ValueError) as exc:
                raise DecentDPError(f"cannot read the privacy ledger of {folder} ({exc}); private selection "
                                    "needs every finished trial's privacy.json") from None
            if ledger.relation != "add-remove":
                raise DecentDPError(f"{folder}: its ledger prices {ledger.relation!r} neighbours; private selection "
                                    "adds RDP curves, which decentdp computes for add-remove neighbours only")
            if not str(report.get("epsilon_observer", "everyone")).startswith("everyone"):
                raise DecentDPError(f"{folder}: its ledger budgets {report['epsilon_observer']!r}, not every "
                                    "observer together, which a trial's pooled score needs")
            curves.append(ledger.rdp_curves())
            deltas.append(ledger.delta)
        if len(curves) == 1:
            return curves[0], deltas[0]
        return sum(c.max(axis=0, keepdims=True) for c in curves), min(deltas)

    def selection(self) -> dict[str, Any]:
        """The private selection (Papernot and Steinke, ICLR 2022): the trial with the best noisy score, and
        each agent's epsilon of the whole selection, for ``selection.json``.

        ``Q``, one trial, releases its hyper-parameters and noisy score; its RDP per agent is the trial's
        ledger (everything the agent's training records reach, the models included) plus the score's
        Gaussian ``lambda / (2 score_noise^2)`` (a record is in training or in validation; adding both
        covers either, and several seeds).  ``Q``'s curve is the worst trial's, per order and agent, and the
        theorem's bound (:func:`~decentdp.tuning.selection.selection_rdp`) turns it into the selection's."""
        from decentdp.privacy.accounting import rdp_epsilon
        from decentdp.tuning.selection import gaussian_score_rdp, selection_rdp

        private = self.sweep.private
        assert private is not None
        count = private.count()
        state = self.optuna.trial.TrialState
        complete = self.study.get_trials(deepcopy=False, states=(state.COMPLETE,))
        report: dict[str, Any] = {
            "selection": "private (Papernot and Steinke, ICLR 2022: random search, K random trials, only the "
                         "best released)",
            "trials_drawn": self.total, "trials_completed": len(complete), **count.describe(),
            "score_noise": private.score_noise,
            "score": "noisy_correct: the mean over agents (and seeds) of correct predictions on the pooled "
                     "validation set, plus N(0, score_noise^2); sensitivity 1. No accuracy is given: the validation "
                     "set's size is private under add-remove neighbours, and dividing by it would reveal it",
            "next": "running best.toml (on the test set) is a further run on the same records: its epsilon "
                    "composes with the selection's",
            "exact_scores": "the trial folders (summary.json, metrics) hold exact validation scores on this "
                            "machine; they are not part of the release",
        }
        if not complete:
            return {**report, "released": None, "reason": "no trial finished (K = 0 or every trial failed): "
                                                          "nothing is released and there is no best.toml"}
        rdp = [self._trial_rdp(trial) for trial in complete]
        delta = min(d for _, d in rdp)
        if len({curves.shape for curves, _ in rdp}) > 1:  # trials with different numbers of agents
            rdp = [(curves.max(axis=0, keepdims=True), d) for curves, d in rdp]
        stacked = np.stack([curves for curves, _ in rdp])
        worst = stacked.max(axis=0) + gaussian_score_rdp(private.score_noise)
        # Q's curve must bound every trial the search could draw; the worst that ran does so when the searched
        # fields leave the calibrated noise alone (only NOISE_FREE_FIELDS searched, and all trials' curves equal,
        # which checks it), else it is an estimate.
        noisy_fields = sorted(set(self.sweep.space) - NOISE_FREE_FIELDS)
        same = bool(np.allclose(stacked, stacked[:1], rtol=1e-9, atol=0.0, equal_nan=True))
        epsilons = [rdp_epsilon(selection_rdp(curve, count), delta) for curve in worst]
        figures = {"epsilon_per_agent": epsilons, "epsilon_max": max(epsilons),
                   "epsilon_one_trial_max": max(rdp_epsilon(curve, delta) for curve in worst),
                   "epsilon_k_fold_composition_max": max(rdp_epsilon(self.total * curve, delta) for curve in worst)}
        warning = (_NOISY_SPACE.format(fields=", ".join(noisy_fields)) if noisy_fields
                   else _UNEQUAL_TRIALS if not same else _SIMULATED_NOISE if self._simulated_noise() else None)
        if warning is not None:  # no bound (null: infinite); the trials that ran give an estimate, labelled as one
            figures = {**{key: None for key in figures}, **{f"estimate_{key}": value for key, value in figures.items()}}
        chosen = self._best(1)[0]
        return {"operator_only": OPERATOR_ONLY, **report, "delta": delta, **figures, "trials_rdp_equal": same,
                "space_keeps_noise": not noisy_fields,
                **({} if warning is None else {"warning": warning}),
                "trials": [{"trial": t.number, "epsilon_max": max(rdp_epsilon(c, d) for c in curves)}
                           for t, (curves, d) in zip(complete, rdp, strict=True)],
                "released": {"trial": chosen.number, "params": chosen.params,
                             "noisy_correct": chosen.user_attrs["noisy_correct"],
                             "folder": trial_folder_name(chosen)}}

    def _simulated_noise(self) -> bool:
        """Whether the trials draw simulation noise (keyed by the seed they share: the same noise in every trial)."""
        from decentdp.config import validate_config

        return validate_config(self.sweep.trial_config({}, self.sweep.section.seeds[0])).privacy.noise == "simulation"

    def _best(self, count: int) -> list[Any]:
        """The ``count`` best finished trials, best first: by value, or, in a private selection, by the noisy count
        (a study begun before the count was the value holds noisy accuracies there)."""
        trials = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))
        reverse = self.sweep.section.direction == "maximize"
        return sorted(trials, key=lambda t: trial_score(self.sweep, t), reverse=reverse)[:count]


def trial_score(sweep: Sweep, trial: Any) -> float:
    """What a finished trial is ranked and shown by: its value, or, in a private selection, its noisy count of
    correct validation predictions (what the selection priced)."""
    return float(trial.user_attrs["noisy_correct"] if sweep.private is not None else trial.value)


_SIMULATED_NOISE = ("privacy.noise = 'simulation': every trial draws the same noise (keyed by the seed they share), "
                    "while the theorem needs independent trials, and anyone holding the config can recompute it, so "
                    "no epsilon is claimed (null); estimate_* are what secure noise (privacy.noise = 'secure') "
                    "would give, not a bound for this sweep")
_UNEQUAL_TRIALS = ("the trials' RDP curves differ (the searched fields change the calibrated noise): the theorem "
                   "needs Q's curve over every hyper-parameter the search could draw, not only those that ran, so "
                   "no epsilon is claimed (null); estimate_* use the worst trial that ran and are not a bound")
#: Fields a private selection may search and still claim an epsilon: the step, its schedule and the optimizer's
#: other settings change what a trial releases, never how it is noised or how often (the noise multiplier depends
#: on the budget, delta, sampling rate, rounds and releases a round), and the clip norm scales the noise with the
#: sensitivity (every event is in units of it), so every draw's RDP curve is the trials'.
#: Any other searched field may change the curve of draws that did not run (a batch size drawn only once, or
#: never), which equal curves among the trials that ran cannot rule out: then no epsilon is claimed.
NOISE_FREE_FIELDS = frozenset({"algorithm.lr", "algorithm.lr_final", "algorithm.lr_schedule", "algorithm.momentum",
                               "algorithm.nesterov", "algorithm.weight_decay", "privacy.clip"})
_NOISY_SPACE = ("the space searches {fields}, which may change the calibrated noise of draws that did not run (the "
                "theorem needs Q's curve over every draw; equal curves among the trials that ran do not show it), "
                "so no epsilon is claimed (null); estimate_* use the worst trial that ran and are not a bound. "
                "Searching only " + ", ".join(sorted(NOISE_FREE_FIELDS)) + " keeps the claim")


def _validation_size(folder: Path) -> int:
    """The number of validation records of a trial's run, from its ``setup.json``: what turns its accuracy into a
    count of correct predictions.  Private under add-remove neighbours, so never released, nor anything divided
    by it."""
    setup = json.loads((folder / "setup.json").read_text())
    match = re.match(r"validation: (\d+) records", str(setup.get("evaluation_set", "")))
    if match is None:
        raise DecentDPError(f"{folder / 'setup.json'} names no validation set; a private selection scores trials "
                            "on one")
    return int(match.group(1))


def _with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """A sweep's definition (:meth:`Sweep.spec`) with the private selection's default ``eta`` (1, for the negative
    binomial) written out, so that a file that writes the default and one that leaves it out define the same sweep
    (a reviewer's finding: eta = 1.0 written out made a resume fail as a different definition)."""
    private = spec.get("private")
    if isinstance(private, dict) and private.get("distribution") == "negative-binomial" and private.get("eta") is None:
        return {**spec, "private": {**private, "eta": 1.0}}
    return spec


def _check_same(saved: dict[str, Any], current: dict[str, Any], out: Path) -> None:
    """Refuse to resume a study whose trials were defined differently, defaults written out or not (nothing is
    changed on disk)."""
    saved, current = _with_defaults(saved), _with_defaults(current)
    changed = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    if not saved:
        raise ConfigError("--out", f"{out / STUDY_FILE} was not written by decentdp sweep; choose another --out")
    if changed:
        detail = "; ".join(_describe_change(key, saved.get(key), current.get(key)) for key in changed)
        raise ConfigError("--out", f"the sweep in {out} was started with a different definition ({detail}); its "
                                   "finished trials would not be comparable with new ones. Resume it with the "
                                   "original sweep file (a copy is in sweep.toml there), or choose another --out")


def _describe_change(key: str, old: Any, new: Any) -> str:
    if key == "space" and isinstance(old, dict) and isinstance(new, dict):
        fields = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
        return f"search space changed in {', '.join(fields)}"
    if key == "base_config":
        return "the base config (or its set = {...} or --set overrides) changed"
    return f"{key}: {old!r} -> {new!r}"


def best_table(sweep: Sweep, best: list[Any]) -> str:
    """Markdown table of the best trials: value, the searched fields, the trial and its results folder (not for
    a private selection, whose table is published: a trial's number says that K reached it)."""
    names = list(sweep.space)
    section = sweep.section
    private = sweep.private is not None
    score = "noisy count of correct predictions (private selection" if private else \
        f"{section.objective} (validation"
    lines = [("| rank |" if private else "| rank | trial |") + f" {score}, mean of {len(section.seeds)} seed(s)) | "
             + " | ".join(names) + ("" if private else " | folder") + " |",
             ("|---:|---:|" if private else "|---:|---:|---:|") + "---:|" * len(names) + ("" if private else "---|")]
    for rank, trial in enumerate(best, 1):
        cells = [f"{trial.params[name]:.4g}" if isinstance(trial.params[name], float) else str(trial.params[name])
                 for name in names]
        lines.append(f"| {rank} |" + ("" if private else f" {trial.number} |") + f" {trial_score(sweep, trial):.4f} | "
                     + " | ".join(cells) + ("" if private else f" | {trial_folder_name(trial)}") + " |")
    return "\n".join(lines) + "\n"


def best_config(sweep: Sweep, trial: Any) -> dict[str, Any]:
    """The base config with the best trial's values: what a final run (on the test set) uses, so with no
    validation split (a base config's own ``data.validation_fraction`` included: a helper's review)."""
    from decentdp.config import apply_overrides, validate_config

    raw = apply_overrides(sweep.base, [f"{name}={_toml_value(value)}" for name, value in trial.params.items()]
                          + ["data.validation_fraction=0.0"])
    return validate_config(raw).to_toml_dict()


# ----------------------------------------------------------------------------- command


def public_release(selection: dict[str, Any]) -> dict[str, Any]:
    """What a private selection may publish (``release.json``): its settings, the released hyper-parameters
    and noisy count (what the selection priced; no accuracy, whose division by the validation set's exact size
    would reveal it), and the epsilon figures that do not depend on which trials ran.

    Not K, the trials, their numbers or folders, nor anything taken over the trials that ran, which changes with
    how many did: the K-fold composition, whether the trials' curves agreed and, when no bound is claimed (the
    searched fields may change the noise), the estimates and the smallest delta (all in ``selection.json``, the
    operator's).  A claimed bound is the same whatever trials ran: every trial's curve is then one curve."""
    operator_only = {"trials_drawn", "trials_completed", "trials", "epsilon_k_fold_composition_max", "exact_scores",
                     "operator_only", "trials_rdp_equal", *(key for key in selection if key.startswith("estimate_"))}
    if selection.get("epsilon_max") is None:
        operator_only.add("delta")
    public = {key: value for key, value in selection.items() if key not in operator_only}
    if selection.get("released") is not None:
        public["released"] = {key: selection["released"][key] for key in ("params", "noisy_correct")}
    return public


def selection_summary(selection: dict[str, Any], out: Path) -> str:
    """A few lines on a private selection: K, the released trial and noisy score, each agent's epsilon."""
    lines = [f"private selection: K = {selection['trials_drawn']} trial(s) drawn from {selection['distribution']} "
             f"(mean {selection.get('mean_trials', selection.get('mu'))}), {selection['trials_completed']} finished"]
    released = selection["released"]
    if released is None:
        lines.append(selection["reason"])
    else:
        lines.append(f"released: trial {released['trial']}, noisy count of correct validation predictions "
                     f"{released['noisy_correct']:.2f} (score_noise {selection['score_noise']:g})")
        if "estimate_epsilon_max" not in selection:
            lines.append(f"epsilon of the selection at delta {selection['delta']:g}: "
                         f"{epsilon_text(selection['epsilon_max'])} (worst agent; one trial with its score: "
                         f"{epsilon_text(selection['epsilon_one_trial_max'])}; {selection['trials_drawn']} trials "
                         f"composed: {epsilon_text(selection['epsilon_k_fold_composition_max'])})")
        else:
            lines.append(f"epsilon of the selection: no bound (see the warning); the trials that ran estimate "
                         f"{epsilon_text(selection['estimate_epsilon_max'])} at delta {selection['delta']:g}")
        lines.append("running best.toml on the test set is a further run: its epsilon composes with the selection's")
        if "warning" in selection:
            lines.append(f"warning: {selection['warning']}")
    lines.append(f"to publish: {out / RELEASE_FILE}, best.toml and best.md; {out / SELECTION_FILE}, study.db, "
                 "trials/ and these lines hold K and every trial (the operator's only)")
    return "\n".join(lines)

