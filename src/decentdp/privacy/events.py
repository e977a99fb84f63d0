"""Privacy events: immutable descriptions of *what was released*, as Google's ``dp_accounting`` defines them.

Every noisy release in decentdp is described by one ``dp_accounting.DpEvent`` built here: a
(Poisson-sampled) Gaussian release of a clipped sum, a Laplace release, or a *joint* Gaussian release
of ``k`` clipped sums computed on one batch.  Accountants (:mod:`decentdp.privacy.accounting`) only
consume these events, so the epsilon we report always reflects the mechanism that ran.

Events are hashable values.  A run makes millions of releases but only a handful of distinct events,
so the ledger stores small integer ids into an :class:`EventTable` that interns each distinct event
once; the table serialises to JSON (for checkpoints and ``privacy.json``) and back.
"""

from __future__ import annotations

import math
from typing import Any

import attr
import dp_accounting


def gaussian_event(noise_multiplier: float, sample_rate: float = 1.0) -> dp_accounting.DpEvent:
    """One Gaussian release of a sum with sensitivity ``C`` and noise ``N(0, (sigma C)^2)``, on a
    Poisson batch of rate ``sample_rate`` (no sampling event when it is 1).  ``sigma = 0`` is not private, and
    neither is a NaN multiplier (no noise to speak of: the release is priced as unbounded, never as free)."""
    if not noise_multiplier > 0:
        return dp_accounting.NonPrivateDpEvent()
    gaussian = dp_accounting.GaussianDpEvent(float(noise_multiplier))
    return gaussian if sample_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(float(sample_rate), gaussian)


def joint_gaussian_event(noise_multiplier: float, sample_rate: float, releases: int) -> dp_accounting.DpEvent:
    """``releases`` Gaussian releases computed on *one* batch, each with noise ``sigma C``: one record
    changes all of them, so together they are one Gaussian mechanism of sensitivity ``sqrt(k) C``,
    i.e. noise multiplier ``sigma / sqrt(k)`` (specs A.4).  Composing them as ``k`` independently
    sampled releases would under-count the loss."""
    if releases < 1:
        raise ValueError(f"a joint release needs at least one released sum, got {releases}")
    return gaussian_event(noise_multiplier / math.sqrt(releases), sample_rate)


def laplace_event(noise_multiplier: float, sample_rate: float = 1.0) -> dp_accounting.DpEvent:
    """One Laplace release with scale ``b = noise_multiplier * l1_sensitivity`` (pure ``1/noise_multiplier``-DP;
    as for the Gaussian, zero or NaN is not private)."""
    if not noise_multiplier > 0:
        return dp_accounting.NonPrivateDpEvent()
    laplace = dp_accounting.LaplaceDpEvent(float(noise_multiplier))
    return laplace if sample_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(float(sample_rate), laplace)


def event_to_json(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """A JSON-ready description of an event: its class name and fields (nested events recursively)."""
    fields: dict[str, Any] = {"type": type(event).__name__}
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        if isinstance(value, dp_accounting.DpEvent):
            value = event_to_json(value)
        elif isinstance(value, list | tuple) and value and isinstance(value[0], dp_accounting.DpEvent):
            value = [event_to_json(item) for item in value]
        fields[field.name] = value
    return fields


def event_from_json(data: dict[str, Any]) -> dp_accounting.DpEvent:
    """The event :func:`event_to_json` described."""
    cls = getattr(dp_accounting, data["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
        raise ValueError(f"unknown privacy event type {data['type']!r}")
    kwargs = {}
    for key, value in data.items():
        if key == "type":
            continue
        if isinstance(value, dict) and "type" in value:
            value = event_from_json(value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            value = [event_from_json(item) for item in value]
        kwargs[key] = value
    return cls(**kwargs)


class EventTable:
    """Interns distinct events as small integer ids (id ``i`` is the ``i``-th distinct event seen)."""

    def __init__(self, events: list[dp_accounting.DpEvent] | None = None) -> None:
        self._events: list[dp_accounting.DpEvent] = []
        self._ids: dict[dp_accounting.DpEvent, int] = {}
        for event in events or []:
            self.intern(event)

    def __len__(self) -> int:
        return len(self._events)

    def intern(self, event: dp_accounting.DpEvent) -> int:
        """The id of ``event``, adding it to the table the first time it is seen."""
        found = self._ids.get(event)
        if found is None:
            found = self._ids[event] = len(self._events)
            self._events.append(event)
        return found

    def __getitem__(self, event_id: int) -> dp_accounting.DpEvent:
        return self._events[event_id]

    def to_json(self) -> list[dict[str, Any]]:
        return [event_to_json(event) for event in self._events]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> EventTable:
        return cls([event_from_json(item) for item in data])
