"""Run a list of long jobs on many cores (or one GPU) until they are done or a deadline comes, resumable.

The reproductions are hundreds of independent ``decentdp run``/``sweep``/``audit`` commands.  On a machine with
more cores than this project's 2-core VM (a cluster node, the lent GPU machine) they go faster side by side than
one by one; this runs them from a list, in the list's order, ``--workers`` at a time, each with one thread
(``OMP_NUM_THREADS=1``, as the docs' commands), and stops cleanly at ``--deadline``: the jobs still running get
SIGTERM, then SIGKILL, and are simply started again by the next call (every decentdp command resumes: runs from
their checkpoint, sweeps from their study, audits from their chunks).  A job that finished is recorded as
``<log-dir>/<name>.done`` and skipped the next time, unless its command tests for its own result (below).

The job list has one job a line, ``NAME<TAB>COMMAND`` (``#`` starts a comment)::

    table1-dsgd-eps1-fiedler0.7-s0\tdecentdp run experiments/consensus/table1-dsgd-eps1-fiedler0.7.toml ...

    python experiments/run_jobs.py jobs.tsv --workers 12 --deadline 3600 --log-dir results/jobs

``--status`` runs nothing and says how far a list has come, by group (what ``--group``, a regular expression,
matches at the start of the name: by default the name up to its first ``-``) and seed (a trailing ``-sN``).
A job counts as finished, for ``--status`` and for the runner alike, when the file its command tests for
(``[ -f FILE ] || ...``, the generators' lines) exists, whatever ``.done`` records say; for a command without that
test, when the ``--out`` folder of its command holds ``summary.json`` (so the count holds on any machine that has
the results folders) or its ``.done`` record is in ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_SECONDS = 15.0


@dataclass
class Job:
    """One line of the job list."""

    name: str
    command: str


def read_jobs(path: Path) -> list[Job]:
    """The jobs of a list file, in order; a malformed line stops the program with its line number."""
    jobs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, tab, command = line.partition("\t")
        if not tab or not name.strip() or not command.strip():
            sys.exit(f"{path}:{number}: expected NAME<TAB>COMMAND")
        jobs.append(Job(name.strip(), command.strip()))
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        sys.exit(f"{path}: job names repeat: " + ", ".join(sorted({n for n in names if names.count(n) > 1})))
    return jobs


def run_line(name: str, config: str, seed: int, data_dir: str, out: str, sets: tuple[str, ...] = ()) -> str:
    """The job-list line of one seeded ``decentdp run`` (what the experiments' generators write): named
    ``NAME-sSEED``, one compute thread, skipped once ``OUT/summary.json`` exists, wherever the list runs, and
    continued with ``--resume`` where a stopped run left its checkpoint (``decentdp run`` refuses a folder that
    holds files otherwise).  A folder with neither (a run stopped before its first checkpoint, or a copy of the
    results that kept the metrics but not the checkpoint) has nothing to continue from: the run starts afresh.
    ``sets`` are extra ``--set`` overrides (``experiment.eval_every=200``: a grid that needs only final figures)."""
    overrides = "".join(f" --set {item}" for item in (f"experiment.seed={seed}", *sets))
    return (f"{name}-s{seed}\t[ -f {out}/summary.json ] || {{ [ -f {out}/checkpoint.pt ] || rm -rf {out}; "
            f"decentdp run {config}{overrides} --data-dir {data_dir} --out {out} --threads 1 "
            f"--no-progress $([ -f {out}/checkpoint.pt ] && echo --resume); }}")


def finished(job: Job, log_dir: Path) -> bool:
    """Whether a job has finished.  A command that starts with its own completion test, ``[ -f FILE ] || ...`` (the
    generators' run and attack lines), has finished exactly when FILE exists: a ``.done`` record left from an
    earlier run of the same name (whose results were moved away, or that ran another config) does not count.
    Otherwise the job's ``--out`` folder holds ``summary.json``, or (a sweep) its ``.done`` record is in
    ``log_dir``."""
    own_test = re.match(r"\[ -f (\S+) \] \|\|", job.command)
    if own_test:
        return Path(own_test.group(1)).exists()
    out = re.search(r"--out\s+(\S+)", job.command)
    if out and (Path(out.group(1)) / "summary.json").exists():
        return True
    return (log_dir / f"{job.name}.done").exists()


def status(jobs: list[Job], log_dir: Path, group: str = r"[^-]+") -> str:
    """A table of finished / listed jobs per group (what ``group`` matches at the start of the name, or the whole
    name without its seed) and seed (a trailing ``-sN``)."""
    counts: dict[str, dict[str, list[int]]] = {}
    for job in jobs:
        seed = re.search(r"-s(\d+)$", job.name)
        label = re.match(group, job.name)
        name = label.group(0) if label else job.name.removesuffix(seed.group(0) if seed else "")
        cell = counts.setdefault(name, {}).setdefault(f"s{seed.group(1)}" if seed else "-", [0, 0])
        cell[0] += finished(job, log_dir)
        cell[1] += 1
    seeds = sorted({seed for group in counts.values() for seed in group})
    lines = ["| group | " + " | ".join(seeds) + " | all |", "|---|" + "---:|" * (len(seeds) + 1)]
    for group, row in counts.items():
        cells = [f"{row[s][0]} / {row[s][1]}" if s in row else "" for s in seeds]
        total = [sum(values) for values in zip(*row.values(), strict=True)]
        lines.append(f"| {group} | " + " | ".join(cells) + f" | {total[0]} / {total[1]} |")
    done = sum(cell[0] for row in counts.values() for cell in row.values())
    return "\n".join(lines) + f"\n\n{done} of {len(jobs)} jobs finished, {len(jobs) - done} left"


def start(job: Job, log_dir: Path) -> subprocess.Popen[bytes]:
    """Start one job in its own process group (so that a stop reaches its children), output to its log."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(log_dir / f"{job.name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(["bash", "-c", job.command], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def finish(job: Job, process: subprocess.Popen[bytes], started: float, log_dir: Path) -> None:
    """Record how a job ended: ``.done`` for exit 0, ``.failed`` otherwise (it is tried again next call)."""
    seconds = round(time.monotonic() - started, 1)
    record = {"returncode": process.returncode, "seconds": seconds}
    suffix = "done" if process.returncode == 0 else "failed"
    (log_dir / f"{job.name}.{suffix}").write_text(json.dumps(record) + "\n")
    print(f"{suffix:6s} {job.name} ({seconds} s)", flush=True)


def stop(running: dict[str, tuple[Job, subprocess.Popen[bytes], float]]) -> None:
    """SIGTERM every running job's process group, then SIGKILL what is left after the grace period."""
    for _, process, _ in running.values():
        with _quiet():
            os.killpg(process.pid, signal.SIGTERM)
    end = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < end and any(process.poll() is None for _, process, _ in running.values()):
        time.sleep(0.5)
    for job, process, _ in running.values():
        if process.poll() is None:
            with _quiet():
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        print(f"stopped {job.name} at the deadline", flush=True)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM to the runner: leave the loop as Ctrl-C does."""
    raise KeyboardInterrupt


class _quiet:
    """Ignore a process group that has already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is ProcessLookupError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", type=Path, help="the job list: NAME<TAB>COMMAND a line")
    parser.add_argument("--workers", type=int, default=2, help="jobs at once (default 2)")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="seconds from now to stop at")
    parser.add_argument("--log-dir", type=Path, default=Path("results/jobs"), help="logs and .done records")
    parser.add_argument("--status", action="store_true", help="run nothing: finished / listed jobs per group and seed")
    parser.add_argument("--group", default=r"[^-]+", metavar="REGEX",
                        help="with --status: a group is what this matches at the start of a name (default: up to '-')")
    args = parser.parse_args(argv)
    if args.status:
        if hasattr(signal, "SIGPIPE"):  # POSIX: ``--status | head`` ends quietly when the reader does
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        print(status(read_jobs(args.jobs), args.log_dir, args.group))
        return
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + args.deadline
    waiting = [job for job in read_jobs(args.jobs) if not finished(job, args.log_dir)]
    running: dict[str, tuple[Job, subprocess.Popen[bytes], float]] = {}
    print(f"{len(waiting)} jobs to run, {args.workers} at a time", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped runner stops its jobs (each has a session of its own)
    try:
        while (waiting or running) and time.monotonic() < end:
            while waiting and len(running) < args.workers:
                job = waiting.pop(0)
                running[job.name] = (job, start(job, args.log_dir), time.monotonic())
            for name, (job, process, started) in list(running.items()):
                if process.poll() is not None:
                    finish(job, process, started, args.log_dir)
                    del running[name]
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("interrupted: stopping the running jobs", flush=True)
    stop(running)
    print(f"{len(waiting)} jobs not started", flush=True)


if __name__ == "__main__":
    main()
