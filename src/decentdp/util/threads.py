"""How many compute threads a run uses: the cores this process may actually use, unless told otherwise.

torch starts with one intra-op thread per core of the machine (as MKL or OpenMP counts them),
whatever share of it the process may use: a CPU affinity mask (``taskset``, a cpuset) or a
cgroup CPU quota (a container's ``--cpus``) leaves torch's threads fighting over fewer cores,
and every OpenMP barrier then waits for a thread that is not running.
:func:`choose_threads` decides the count, in this order:

1. ``engine.threads`` from the config, when given;
2. ``MKL_NUM_THREADS`` or ``OMP_NUM_THREADS`` when the user set them (torch follows them already,
   MKL's first as torch does; ``OMP_NUM_THREADS=1`` is the documented way to run several
   experiments side by side);
3. the CPUs in the process's affinity mask, lowered to a cgroup CPU quota (rounded down) if one
   is set; never below 1.

:func:`apply_threads` applies it with ``torch.set_num_threads`` and returns what it did.  Only the
intra-op count is set: torch's inter-op pool serves ``torch.jit.fork`` and the like, which
decentdp does not use, its threads block instead of spinning, and
``torch.set_num_interop_threads`` may be called once per process only (a second run in the
same process would fail).

Threads that wait spin-free are the other half of the fix: ``decentdp/__init__.py`` sets
``OMP_WAIT_POLICY=PASSIVE`` before torch loads its OpenMP runtime (BENCHMARKS.md, "Next to a busy
process", has the measured effect of both).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")

#: The variables torch reads its default thread count from, the first one set winning (as in torch).
THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class ThreadChoice:
    """The compute threads of a run and where the number came from."""

    threads: int
    source: str  #: "config", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "cpu affinity" or "cgroup quota"
    affinity: int  #: CPUs in the process's affinity mask (os.cpu_count() where there is no mask)
    quota: float | None  #: CPUs a cgroup quota allows, None when unlimited or unknown
    previous: int | None = None  #: torch's count before :func:`apply_threads` (None: not applied)

    def describe(self) -> str:
        """One line for the run's announcement."""
        limit = f"{self.affinity} CPU(s) in the affinity mask" + (
            f", cgroup quota {self.quota:g} CPU(s)" if self.quota is not None else "")
        why = {"config": "engine.threads", "cpu affinity": "the cores this process may use",
               "cgroup quota": "the cores this process may use"}.get(self.source, self.source)
        return f"threads: {self.threads} ({why}; {limit})"


def parse_thread_count(value: str | None) -> int | None:
    """A positive count from ``OMP_NUM_THREADS``-style text (its first level: "4" or "4,2"), else None."""
    if value is None:
        return None
    try:
        count = int(value.split(",")[0].strip())
    except ValueError:
        return None
    return count if count >= 1 else None


def choose_threads(requested: int | None, *, affinity: int, quota: float | None = None,
                   environ: Mapping[str, str] | None = None) -> ThreadChoice:
    """The thread count of a run (see the module's docstring for the order); pure, at least 1.

    ``requested`` is ``engine.threads``; ``affinity`` the CPUs the process may run on; ``quota``
    the CPUs a cgroup quota allows (fractional, None: no quota); ``environ`` the environment
    whose thread variables count as the user's explicit setting.
    """
    affinity = max(1, affinity)
    if requested is not None:
        return ThreadChoice(max(1, requested), "config", affinity, quota)
    for name in THREAD_VARIABLES:
        count = parse_thread_count((environ or {}).get(name))
        if count is not None:
            return ThreadChoice(count, name, affinity, quota)
    if quota is not None and math.floor(quota) < affinity:
        return ThreadChoice(max(1, math.floor(quota)), "cgroup quota", affinity, quota)
    return ThreadChoice(affinity, "cpu affinity", affinity, quota)


def affinity_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one, else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """CPUs a cgroup v2 ``cpu.max`` allows ("150000 100000" -> 1.5; "max 100000" -> None)."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _ancestors(root: Path, relative: str) -> Iterator[Path]:
    """``root/relative`` and its parents up to ``root`` itself."""
    parts = [part for part in relative.split("/") if part]
    for depth in range(len(parts), -1, -1):
        yield root.joinpath(*parts[:depth])


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota, in CPUs, on this process's cgroup or its ancestors, or None.

    Reads cgroup v2's ``cpu.max`` and cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    along the path ``/proc/self/cgroup`` names, the root (a container's own cgroup) included.
    """
    v2_path, v1_path = "/", "/"
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    limits = []
    for directory in _ancestors(root, v2_path):
        text = _read(directory / "cpu.max")
        if text is not None and (limit := parse_cpu_max(text)) is not None:
            limits.append(limit)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for directory in _ancestors(root / mount, v1_path):
            quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
            if quota is not None and period is not None and (limit := parse_cpu_max(f"{quota} {period}")):
                limits.append(limit)
    return min(limits) if limits else None


def apply_threads(requested: int | None, environ: Mapping[str, str] | None = None) -> ThreadChoice:
    """Choose the run's thread count (``requested`` is ``engine.threads``) and give it to torch.

    Process-wide, like every torch thread setting: it stays after the run.
    """
    choice = choose_threads(requested, affinity=affinity_cpus(), quota=cgroup_cpu_limit(),
                            environ=os.environ if environ is None else environ)
    previous = torch.get_num_threads()
    if previous != choice.threads:
        torch.set_num_threads(choice.threads)
    return replace(choice, previous=previous)
