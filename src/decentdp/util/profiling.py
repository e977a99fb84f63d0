"""Where a run's time goes: wall-clock time per phase of a round, and the busiest torch operators.

``decentdp run --profile`` attaches a :class:`PhaseTimer` to the gradient oracle (ledger,
sampling, gradients and clipping, noise), the network (communication), the simulator (the rest of
the algorithm's update) and the runner (evaluation, checkpoints), and records torch's operator
profile (``torch.profiler``) over a few rounds.  The report is printed at the end of the run and
saved as ``profile.json`` in the results folder.  Without ``--profile`` the hooks are a shared
no-op timer, whose cost is one method call per phase.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from decentdp.util.device import synchronize

#: Phases in report order; "algorithm update" is a round's time outside the other in-round phases.
ROUND_PHASES = ("ledger", "sampling", "augmentation", "gradients", "noise", "communication", "algorithm update")
OUTER_PHASES = ("evaluation", "checkpoint")


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase (phases must not nest, except in ``round``).

    On a CUDA ``device`` every phase starts and ends with a synchronisation, so that a phase is
    charged its own kernels rather than the ones queued before it (profiling runs only: it removes
    the overlap of host and device that ordinary runs have)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.rounds = 0
        self.device = device if device is not None else torch.device("cpu")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def count_round(self) -> None:
        """Record that one more round has run."""
        self.rounds += 1

    def report(self) -> dict[str, Any]:
        """Seconds, share of the total and seconds per round of every phase."""
        inside = sum(self.seconds[name] for name in ROUND_PHASES[:-1])
        seconds = {name: self.seconds[name] for name in ROUND_PHASES[:-1]}
        seconds["algorithm update"] = max(0.0, self.seconds["round"] - inside)
        seconds.update({name: self.seconds[name] for name in OUTER_PHASES})
        total = sum(seconds.values())
        rounds = max(1, self.rounds)
        return {"rounds": self.rounds, "total_seconds": total, "phases": {
            name: {"seconds": value, "share": value / total if total else 0.0, "per_round": value / rounds}
            for name, value in seconds.items()}}


class _NoTimer(PhaseTimer):
    """The timer used when nobody profiles: phases cost nothing but the call."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def count_round(self) -> None:
        pass


NO_TIMER: PhaseTimer = _NoTimer()


class TimedNetwork:
    """A :class:`Network` whose every method call is timed as communication, but :meth:`public_graph`
    (the wrapped network's own cached host object: no message)."""

    def __init__(self, network: Any, timer: PhaseTimer) -> None:
        self._network = network
        self._timer = timer

    def public_graph(self) -> Any:
        return self._network.public_graph()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._network, name)
        if not callable(attribute):
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._timer.phase("communication"):
                return attribute(*args, **kwargs)

        return timed


def operator_table(profile: torch.profiler.profile, rows: int = 12) -> list[dict[str, Any]]:
    """The operators with the most self CPU time in a torch profile."""
    events = sorted((event for event in profile.key_averages() if not event.key.startswith("ProfilerStep")),
                    key=lambda event: event.self_cpu_time_total, reverse=True)
    total = sum(event.self_cpu_time_total for event in events) or 1.0
    return [{"operator": event.key, "calls": event.count, "self_cpu_ms": event.self_cpu_time_total / 1000,
             "share": event.self_cpu_time_total / total} for event in events[:rows]]


def format_report(report: dict[str, Any], operators: list[dict[str, Any]], gradient_engine: str) -> list[str]:
    """Human-readable lines of a profile."""
    lines = [f"profile over {report['rounds']} round(s), {report['total_seconds']:.2f} s "
             f"(gradient engine: {gradient_engine}):"]
    for name, phase in report["phases"].items():
        lines.append(f"  {name:<18}{phase['seconds']:>9.3f} s {100 * phase['share']:>6.1f} %"
                     f"{1000 * phase['per_round']:>10.2f} ms/round")
    if operators:
        lines.append("  busiest torch operators (self CPU time over the profiled rounds):")
        for op in operators:
            lines.append(f"    {op['operator']:<40}{op['calls']:>7} calls{op['self_cpu_ms']:>10.1f} ms"
                         f"{100 * op['share']:>7.1f} %")
    return lines
