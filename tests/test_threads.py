"""Compute threads (issue 11): the count a run chooses, that runs apply it, and the passive OpenMP wait policy."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decentdp.config import validate_config
from decentdp.experiment.loop import run_experiment
from decentdp.util.threads import (
    apply_threads,
    cgroup_cpu_limit,
    choose_threads,
    parse_cpu_max,
    parse_thread_count,
)

from conftest import tiny_config

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_LIBRARY")


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Give torch its thread count back after the test (the setting is process-wide)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- the count ----------------------------------------------------------------------------------


def test_default_is_the_affinity_mask() -> None:
    choice = choose_threads(None, affinity=6, environ={})
    assert (choice.threads, choice.source) == (6, "cpu affinity")


@pytest.mark.parametrize(("quota", "threads", "source"), [
    (2.0, 2, "cgroup quota"),
    (2.5, 2, "cgroup quota"),  # rounded down: a throttled thread stalls every barrier
    (0.5, 1, "cgroup quota"),  # never below 1
    (8.0, 4, "cpu affinity"),  # a quota above the mask changes nothing
    (None, 4, "cpu affinity"),
])
def test_a_cgroup_quota_lowers_the_count(quota: float | None, threads: int, source: str) -> None:
    choice = choose_threads(None, affinity=4, quota=quota, environ={})
    assert (choice.threads, choice.source) == (threads, source)


def test_engine_threads_wins_over_everything() -> None:
    choice = choose_threads(3, affinity=2, quota=1.0, environ={"OMP_NUM_THREADS": "1"})
    assert (choice.threads, choice.source) == (3, "config")


def test_the_users_thread_variables_are_followed_as_torch_does() -> None:
    assert choose_threads(None, affinity=8, environ={"OMP_NUM_THREADS": "1"}).threads == 1
    both = choose_threads(None, affinity=8, environ={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "3"})
    assert (both.threads, both.source) == (3, "MKL_NUM_THREADS")
    nested = choose_threads(None, affinity=8, environ={"OMP_NUM_THREADS": "4,2"})
    assert nested.threads == 4
    for bad in ("", "zero", "0", "-2"):  # ignored, as the runtime ignores them
        assert choose_threads(None, affinity=8, environ={"OMP_NUM_THREADS": bad}).source == "cpu affinity"


def test_never_below_one() -> None:
    assert choose_threads(None, affinity=0, environ={}).threads == 1
    assert choose_threads(None, affinity=1, quota=0.01, environ={}).threads == 1
    assert parse_thread_count("0") is None


def test_describe_names_the_source() -> None:
    assert choose_threads(2, affinity=4, environ={}).describe().startswith("threads: 2 (engine.threads")
    line = choose_threads(None, affinity=4, quota=1.5, environ={}).describe()
    assert "threads: 1" in line and "cgroup quota 1.5" in line


# -- cgroup quotas ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "cpus"), [
    ("max 100000\n", None), ("150000 100000\n", 1.5), ("200000\n", 2.0), ("", None), ("x y", None),
    ("-1 100000", None),
])
def test_parse_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


def test_cgroup_v2_takes_the_tightest_quota_up_the_path(tmp_path: Path) -> None:
    (tmp_path / "proc").write_text("0::/jobs/me\n")
    mine = tmp_path / "cg" / "jobs" / "me"
    mine.mkdir(parents=True)
    (mine / "cpu.max").write_text("max 100000\n")
    (mine.parent / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "cg" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == 1.5


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "proc").write_text("4:memory:/x\n1:cpu,cpuacct:/job\n0::/\n")
    job = tmp_path / "cg" / "cpu,cpuacct" / "job"
    job.mkdir(parents=True)
    (job / "cpu.cfs_quota_us").write_text("50000\n")
    (job / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == 0.5
    (job / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-proc") is None


# -- applying it --------------------------------------------------------------------------------


def test_apply_threads_sets_torch_and_reports_what_it_did(torch_threads: None) -> None:
    torch.set_num_threads(2)
    choice = apply_threads(1, environ={})
    assert (choice.threads, choice.previous, choice.source) == (1, 2, "config")
    assert torch.get_num_threads() == 1
    default = apply_threads(None, environ={})
    assert default.previous == 1 and default.source in ("cpu affinity", "cgroup quota")
    assert torch.get_num_threads() == default.threads >= 1


@pytest.mark.parametrize("threads", [1, 3])
def test_run_experiment_applies_engine_threads(tmp_path: Path, torch_threads: None, threads: int) -> None:
    torch.set_num_threads(threads + 1)
    raw = tiny_config(experiment={"rounds": 2, "eval_every": 2}, engine={"threads": threads})
    run_experiment(validate_config(raw), tmp_path / "run", progress=False, log=lambda _: None)
    assert torch.get_num_threads() == threads


def test_run_experiment_defaults_to_the_usable_cores(tmp_path: Path, torch_threads: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(7)
    raw = tiny_config(experiment={"rounds": 2, "eval_every": 2})
    run_experiment(validate_config(raw), None, progress=False, log=lambda _: None)
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_limit()
    if quota is not None:
        expected = max(1, min(expected, int(quota)))
    assert torch.get_num_threads() == expected


# -- the wait policy, set on import before torch loads OpenMP -------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES and k != "OMP_DISPLAY_ENV"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


_SHOW = f"import decentdp, os; print([os.environ.get(n) for n in {WAIT_VARIABLES!r}])"


def test_import_sets_a_passive_wait_policy() -> None:
    assert _python(_SHOW).stdout.strip() == str(["PASSIVE", None, "0", None])


@pytest.mark.parametrize(("name", "value"), [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000"),
                                             ("KMP_BLOCKTIME", "200"), ("KMP_LIBRARY", "turnaround")])
def test_import_leaves_a_users_wait_setting_alone(name: str, value: str) -> None:
    shown = _python(_SHOW, **{name: value}).stdout.strip()
    assert shown == str([value if n == name else None for n in WAIT_VARIABLES])


def test_openmp_runtime_sees_the_policy() -> None:
    """libgomp reports its spin count at start-up: 0 (sleep at once) after importing decentdp first."""
    code = "import decentdp, torch; torch.ones(1)"
    ours = _python(code, OMP_DISPLAY_ENV="VERBOSE").stderr
    if "GOMP_SPINCOUNT" not in ours:
        pytest.skip("torch does not run on GNU OpenMP here (no libgomp environment display)")
    assert "GOMP_SPINCOUNT = '0'" in ours
    users = _python(code, OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="ACTIVE").stderr
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in users and "GOMP_SPINCOUNT = '0'" not in users
