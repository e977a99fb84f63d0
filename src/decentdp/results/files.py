"""The results folder of a run: resolved config, provenance, metrics, privacy ledger, plots.

Files are written atomically (to a temporary name, then renamed), so an interrupted run never
leaves a truncated file behind; the checkpoint lets it resume exactly where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import tomli_w

from decentdp.errors import ConfigError

CONFIG_FILE = "config.toml"
PROVENANCE_FILE = "provenance.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PRIVACY_FILE = "privacy.json"
SETUP_FILE = "setup.json"
CHECKPOINT_FILE = "checkpoint.pt"
PROFILE_FILE = "profile.json"

_PACKAGES = ("decentdp", "torch", "numpy", "scipy", "networkx", "dp-accounting", "pydantic", "scikit-learn")


def write_durably(path: Path, write: Callable[[BinaryIO], object], temporary: Path | None = None) -> None:
    """Write ``path`` through ``write(handle)`` so that readers, and the disk after a crash or power loss, hold the
    old file or the whole new one, never a part: into ``temporary`` (by default ``.NAME.tmp`` beside it; writers
    that may race on one path give each process its own), flushed to the disk, renamed over ``path``, and the
    directory's entry flushed too."""
    tmp = temporary or path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_failure(error: BaseException) -> str:
    """Why a write failed, in a few words for a one-line message: the system's reason (``No space left on device``
    for a full disk, ``File too large`` past a size limit), else the first line of the error (torch reports a failed
    ``torch.save`` as a ``RuntimeError`` whose message carries no error number)."""
    return getattr(error, "strerror", None) or (str(error).splitlines() or [type(error).__name__])[0]


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one (:func:`write_durably`)."""
    write_durably(path, lambda handle: handle.write(text.encode() if isinstance(text, str) else text))


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(strict_json(data), indent=2, sort_keys=True, default=_jsonable) + "\n")


def write_toml(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, tomli_w.dumps(data))


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(strict_json(row), default=_jsonable) + "\n" for row in rows))


def strict_json(value: Any) -> Any:
    """``value`` with non-finite floats spelled as strings ("inf"), since JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if hasattr(value, "tolist"):
        return strict_json(value.tolist())
    return value


def check_creatable(path: Path) -> None:
    """Refuse, before anything runs, a results folder that cannot be created: one below a file, or below
    a directory this process may not write (such as /proc)."""
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError("--out", f"cannot create {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK) or read_only_mount(ancestor):
        why = "a read-only file system" if read_only_mount(ancestor) else "permission denied"
        cause = f"not writable ({why})"
        if ancestor == path.absolute():  # (it exists: nothing to create, but it cannot be written)
            raise ConfigError("--out", f"cannot write in {path}: it is {cause}")
        raise ConfigError("--out", f"cannot create {path}: {ancestor} is {cause}")


def read_only_mount(directory: Path) -> bool:
    """Whether ``directory`` is on a read-only or pseudo file system (os.access says yes to root there)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY) or str(directory.resolve()).startswith(
            ("/proc", "/sys"))
    except OSError:
        return True


def epsilon_json(value: Any) -> Any:
    """Epsilons as results files store them: a number, or ``null`` where it is infinite (a non-private
    release); lists and arrays element by element.  One encoding everywhere, documented in the README."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [epsilon_json(item) for item in value]
    return None if value is None or not math.isfinite(float(value)) else float(value)


def epsilon_text(value: float | None, decimals: int | None = 3, significant: int | None = None) -> str:
    """An epsilon for people to read, rounded *up* (a figure below the bound it shows would promise more
    privacy than the run has): to ``decimals`` places, or to ``significant`` figures; "inf" where infinite or
    ``None`` (no guarantee).  See :func:`rounded_text`."""
    return rounded_text(value, decimals, significant, ROUND_CEILING)


def lower_bound_text(value: float | None, decimals: int | None = 3, significant: int | None = None) -> str:
    """An empirical lower bound (an audit's epsilon) for people to read, rounded *down*: a figure above the bound
    it shows would claim a violation the audit did not find.  See :func:`rounded_text`."""
    return rounded_text(value, decimals, significant, ROUND_FLOOR)


#: Above this, a figure is printed in scientific notation (a 1e300 epsilon is not worth 300 digits).
SCIENTIFIC_ABOVE = 1e6


def rounded_text(value: float | None, decimals: int | None, significant: int | None, rounding: str) -> str:
    """``value`` as text rounded in one direction (``decimal.ROUND_CEILING`` for an upper bound, such as an
    epsilon or a calibrated noise multiplier, ``ROUND_FLOOR`` for a lower bound), so that the text is never on the
    wrong side of it: to ``decimals`` places, or to ``significant`` figures; above :data:`SCIENTIFIC_ABOVE` to
    ``significant`` (else 6) figures in scientific notation.  "inf" where infinite or ``None``."""
    if value is None or not math.isfinite(value):
        return "inf" if value is None or value > 0 else "-inf"
    if abs(value) > SCIENTIFIC_ABOVE:
        figures = significant or 6
        shown = _rounded(value, figures - 1 - Decimal(repr(float(value))).adjusted(), rounding)
        return f"{shown:.{figures - 1}e}"
    if significant is not None:
        if value == 0:
            return "0"
        decimals = max(0, significant - 1 - Decimal(repr(float(value))).adjusted())
        shown = _rounded(value, decimals, rounding)
        return f"{shown:.{significant}g}" if shown < 10**significant else f"{shown:.0f}"
    return f"{_rounded(value, decimals or 0, rounding):.{decimals or 0}f}"


def _rounded(value: float, decimals: int, rounding: str) -> float:
    """``value`` rounded to ``decimals`` places (negative: to tens, hundreds, ...) in the direction ``rounding``, in
    decimal from its shortest round-trip text (``repr``), so that the text read back is never a float on the wrong
    side of ``value`` (``math.ceil(value * 10**d)`` rounds the product first: 83.94200000000001 * 1000 is 83942.0,
    and it read 83.942), while 4.2 stays 4.200 (its exact binary value, 4.2000000000000002, would show as 4.201).
    The float returned prints back as those digits."""
    with localcontext(prec=400):  # room for any float64's digits (up to 1.8e308) and the places
        return float(Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-decimals), rounding=rounding))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def git_commit() -> str | None:
    """The commit of the decentdp checkout in use, if it is one (``None`` for an installed wheel).

    A folder inside some git repository is not enough: decentdp installed in a project's ``.venv`` lies inside that
    project's repository, whose commit (and "+dirty" from its changes) says nothing of decentdp's code.  It counts
    as decentdp's checkout only where git tracks this very file, or where the repository's top is the folder holding
    decentdp's own ``pyproject.toml`` (a new module not yet added, in a developer's checkout)."""
    here = Path(__file__).resolve()

    def git(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *arguments], cwd=here.parent, capture_output=True, text=True, timeout=5)

    try:
        if git("ls-files", "--error-unmatch", here.name).returncode != 0:
            top = git("rev-parse", "--show-toplevel")
            if top.returncode != 0 or not _is_decentdp_project(Path(top.stdout.strip()), here):
                return None
        out = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _is_decentdp_project(top: Path, module: Path) -> bool:
    """Whether ``top`` is the source tree ``module`` (a file of the package, ``src/decentdp/...``) comes from: its
    ``pyproject.toml`` names the project decentdp, and the package lies in its ``src``."""
    try:
        with open(top / "pyproject.toml", "rb") as handle:
            name = tomllib.load(handle).get("project", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return name == "decentdp" and module.is_relative_to((top / "src" / "decentdp").resolve())


def provenance(seed: int) -> dict[str, Any]:
    """What is needed to reproduce a run: seed, package versions, git commit, machine."""
    versions = {}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "seed": seed,
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "packages": versions,
        "platform": platform.platform(),
        "processor": platform.machine(),
        "command": sys.argv,
    }


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (figures are written, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_log_ticks(axis: Any) -> None:
    """Label the ticks of a log-scaled ``axis`` as plain numbers (``2``, ``0.5``, ``100``) instead of
    matplotlib's ``2×10⁰``.  The same ticks carry labels as by default (every decade; the others only when
    the axis spans too little for a decade to show, which is when ``2×10⁰`` appeared): a
    :class:`~matplotlib.ticker.LogFormatter` still chooses them, and only their text changes."""
    from matplotlib.ticker import Formatter, LogFormatter

    class PlainLogFormatter(Formatter):
        def __init__(self) -> None:
            self.chooser = LogFormatter(labelOnlyBase=False)

        def set_axis(self, axis: Any) -> None:
            super().set_axis(axis)
            self.chooser.set_axis(axis)

        def set_locs(self, locs: Any) -> None:
            super().set_locs(locs)
            self.chooser.set_locs(locs)

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if self.chooser(x, pos) else ""

    axis.set_major_formatter(PlainLogFormatter())
    axis.set_minor_formatter(PlainLogFormatter())


#: The y label of ``consensus.png``, in mathtext: the root mean square distance of the models to their mean.
CONSENSUS_LABEL = r"consensus distance  $\sqrt{\mathrm{mean}_i\ \|\theta_i - \bar\theta\|^2}$"


def accuracy_figure(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Test accuracy against round: the mean over agents, with the min-max band."""
    fig, ax = pyplot().subplots(figsize=(6, 4))
    rounds = [row["round"] for row in rows]
    ax.plot(rounds, [row["accuracy_mean"] for row in rows], label="mean over agents")
    ax.fill_between(rounds, [row["accuracy_min"] for row in rows], [row["accuracy_max"] for row in rows],
                    alpha=0.25, label="min-max over agents")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def consensus_figure(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Consensus distance against round on a log axis, from the first evaluation where it is positive: the
    models start equal, and a 0 (drawn at some floor) would stretch the axis over decades nothing reaches.
    A run whose models always agree (one pooled model) gets a flat line at 0 on a linear axis and a note."""
    fig, ax = pyplot().subplots(figsize=(6, 4))
    positive = [(row["round"], row["consensus_distance"]) for row in rows
                if isinstance(row.get("consensus_distance"), (int, float)) and row["consensus_distance"] > 0]
    if positive:
        ax.plot([r for r, _ in positive], [d for _, d in positive])
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    else:  # a linear axis, at 0 over the rounds evaluated
        ax.plot([row["round"] for row in rows], [0.0] * len(rows))
        ax.text(0.5, 0.5, "0 at every evaluation: the models are equal", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel(CONSENSUS_LABEL)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_metrics(rows: Sequence[dict[str, Any]], out_dir: Path, title: str = "") -> list[Path]:
    """``accuracy.png`` and ``consensus.png`` (:func:`accuracy_figure`, :func:`consensus_figure`), titled with
    ``title`` (the run's name, algorithm and epsilon)."""
    plt = pyplot()
    written = []
    for name, make in (("accuracy.png", accuracy_figure), ("consensus.png", consensus_figure)):
        fig = make(rows, title)
        written.append(_save(fig, out_dir / name))
        plt.close(fig)
    return written


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path
