"""The algorithms the tracing harness does not trace (DPDL, DP-CGA, central DP-SGD), checked under Poisson
sampling against an exact loss computed without a privacy accountant.

``tests/privacy/tracing.py``'s ``NOT_TRACED`` says why they are not traced: DPDL's cosine-similarity weights and
DP-CGA's quadratic program make their messages nonlinear in the noise, and central DP-SGD sends no message.  What
each of them releases is still a set of noisy clipped sums, one joint release per owner and batch
(:meth:`~decentdp.privacy.oracle.DataOracle.release`): DPDL's and DP-CGA's ``k = deg + 1`` self- and
cross-gradients on one batch (``test_dpdl.py`` measures that each carries its own noise of std ``sigma C``), central
DP-SGD's one pooled sum.  Every other agent together can read those sums back from what they receive (a
neighbour's cross-gradient directly, the owner's own sum from its next model, whose other terms they hold), so the
exact loss of the released sums is the loss of the view the ledger names.

**Why the comparison is exact.**  A record is in each of its owner's batches independently with the owner's rate
``q`` (checked to be the sampler's) and moves each of the ``k`` sums of that batch by at most ``C``: aligned, the
whitened view of one batch is a Poisson-sampled Gaussian of mean shift ``mu = sqrt(k) C / s`` (``s``: the noise
std per coordinate), batches are independent, and :func:`tests.privacy.sampled_exact.exact_sampled_epsilon`
computes the exact epsilon of two of them directly (Gaussian tails, quadrature, root finding).  So the runs are
:data:`ROUNDS` rounds long.  Every epsilon the run reports for the ledger's observer (``summary.json``'s per-agent
and maximum, ``privacy.json``'s RDP) must be at least it, and the tightest within :data:`FACTOR` of it.

Two planted bugs are caught: a ledger charging each joint release as one sum (the ``sqrt(k)`` dropped) for the
cross-gradient algorithms, and one pricing at half the sampling rate for central DP-SGD.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.privacy.sampled_exact import exact_sampled_epsilon

from decentdp.config import validate_config
from decentdp.experiment.loop import run_experiment
from decentdp.privacy.oracle import DataOracle

ROUNDS = 2
BATCH = 24
CLIP = 1.0
DELTA = 1e-5
FACTOR = 1.1  # the tight accountant (the smaller of a pessimistic PLD and RDP) within 10% of the exact loss
ALGORITHMS = ("dpdl", "dp-cga", "central-dpsgd")


@dataclass
class Released:
    """What a run released and reported: per owner, the number of sums of each joint release (one per round),
    the sampler's rates and each owner's noise std per coordinate; the run's summary.json and privacy.json."""

    sums: list[list[int]]
    rates: np.ndarray
    scales: np.ndarray
    summary: dict[str, Any]
    privacy: dict[str, Any]

    def exact(self, owner: int) -> float:
        """The exact epsilon at :data:`DELTA` of the owner's releases: one Poisson-sampled Gaussian of mean shift
        ``sqrt(k) C / s`` per batch, independent across batches."""
        mus = tuple(math.sqrt(k) * CLIP / float(self.scales[owner]) for k in self.sums[owner])
        return exact_sampled_epsilon(mus, float(self.rates[owner]), DELTA)


def config(name: str) -> dict[str, Any]:
    """A path 0 - 1 - 2 - 3 (two leaves, two inner agents) over an unequal partition of digits: each agent samples
    at its own rate ``BATCH / |D_i|``, below one."""
    return {
        "experiment": {"name": name, "seed": 0, "rounds": ROUNDS, "eval_every": ROUNDS},
        "data": {"dataset": "digits", "partition": "unequal", "size_skew": 1.0},
        "topology": {"graph": "path", "agents": 4},
        "model": {"name": "linear"},
        "algorithm": {"name": name, "lr": 0.1, "batch_size": BATCH},
        "privacy": {"epsilon": 2.0, "delta": DELTA, "clip": CLIP},
        "engine": {"threads": 1},
    }


def released(name: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Released:
    """Run ``name`` and record each joint release's sums per owner as the oracle makes it."""
    sums: dict[int, list[int]] = {}
    seen: dict[str, np.ndarray] = {}
    release = DataOracle.release

    def recording(self: DataOracle, *clipped: Any, **kwargs: Any) -> tuple[Any, ...]:
        rows = np.bincount(np.concatenate([item.owners.numpy() for item in clipped]), minlength=self.n_agents)
        for owner in np.flatnonzero(rows):
            sums.setdefault(int(owner), []).append(int(rows[owner]))
        seen["rates"] = self.sampler.sample_rates.numpy().copy()
        seen["scales"] = self.mechanism.scales.double().numpy().copy()
        return release(self, *clipped, **kwargs)

    monkeypatch.setattr(DataOracle, "release", recording)
    run_experiment(validate_config(config(name)), folder, progress=False, log=lambda line: None)
    owners = len(seen["rates"])
    return Released([sums.get(owner, []) for owner in range(owners)], seen["rates"], seen["scales"],
                    json.loads((folder / "summary.json").read_text()),
                    json.loads((folder / "privacy.json").read_text()))


def understated(run: Released) -> list[tuple[str, int, float, float]]:
    """Each reported epsilon below its owner's exact loss: (field, owner, reported, exact)."""
    found = []
    for owner in range(len(run.rates)):
        exact = run.exact(owner)
        for field, values in (("epsilon_per_agent", run.summary["epsilon_per_agent"]),
                              ("epsilon_rdp", run.privacy["epsilon_rdp"])):
            if values[owner] < exact * (1 - 1e-9):
                found.append((field, owner, values[owner], exact))
    exacts = [run.exact(owner) for owner in range(len(run.rates))]
    if run.summary["epsilon_max"] < max(exacts) * (1 - 1e-9):
        found.append(("epsilon_max", int(np.argmax(exacts)), run.summary["epsilon_max"], max(exacts)))
    return found


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_reported_epsilon_is_at_least_the_exact_loss_of_the_released_sums(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = released(name, tmp_path / "run", monkeypatch)
    owners = len(run.rates)
    # the setting the exact computation needs: rates below one (different ones when agents differ), two releases
    # per owner, one per round; DPDL and DP-CGA release deg + 1 sums on a batch, central DP-SGD one pooled sum
    assert (run.rates < 1).all() and len(set(run.rates.tolist())) == owners
    assert all(len(per_round) == ROUNDS for per_round in run.sums)
    if name == "central-dpsgd":
        assert owners == 1 and run.sums == [[1] * ROUNDS]
    else:
        assert [per_round[0] for per_round in run.sums] == [2, 3, 3, 2]  # the path's degrees, plus one
    assert run.summary["refused_releases"] == 0
    assert not understated(run)
    tightness = [run.summary["epsilon_per_agent"][owner] / run.exact(owner) for owner in range(owners)]
    assert min(tightness) <= FACTOR, f"not a sharp check: reported / exact = {tightness}"


@pytest.mark.parametrize("name", ["dpdl", "dp-cga"])
def test_a_ledger_charging_each_joint_release_as_one_sum_is_caught(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    event_ids = DataOracle._event_ids
    monkeypatch.setattr(DataOracle, "_event_ids",
                        lambda self, mechanism, rows: event_ids(self, mechanism, np.minimum(rows, 1)))
    assert understated(released(name, tmp_path / "run", monkeypatch))


def test_central_dpsgd_priced_at_half_its_rate_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    event_ids = DataOracle._event_ids

    def halved(self: DataOracle, mechanism: Any, rows: np.ndarray) -> np.ndarray:
        true_rates, self._rates = self._rates, self._rates / 2
        try:
            return event_ids(self, mechanism, rows)
        finally:
            self._rates = true_rates

    monkeypatch.setattr(DataOracle, "_event_ids", halved)
    assert understated(released("central-dpsgd", tmp_path / "run", monkeypatch))
