"""What replace-one and PLD-only accounting cost: the ledger's exact headroom search and the PLD grid.

Every replace-one ledger and the ``pld`` accountant find an agent's exact count of further releases with no RDP
count to start from (RDP cannot price Poisson-sampled replace-one, and ``pld`` does not trust it); under
replace-one with sampling the PLD grid is sized without RDP's epsilon too.  In one process, caches cleared
before each figure:

* a first charge (one agent, budget 8, ``gaussian_event(2.0, 0.02)``): compositions and seconds, tight under
  replace-one and pld under add-remove; the demo's headroom from RDP's count (tight, add-remove) beside them;
* a replace-one ledger whose two events alternate round by round (each round a new headroom search): the
  cumulative seconds after rounds 0, 1, 2;
* replace-one PLD epsilons of sampled Gaussian histories: the grid width chosen, seconds, and the epsilon
  against the finest grid's (1e-4), which must stay within the 0.25 % discretisation target;
* ``decentdp privacy sigma --epsilon 60 --delta 1e-5 --sample-rate 0.5 --steps 10 --neighbouring replace-one``'s
  calibration, seconds.

Only functions both sides of a change have are used, so the same script measures two source trees
(``PYTHONPATH=<tree>/src python benchmarks/replace_one_accounting.py``).

    python benchmarks/replace_one_accounting.py [--json] [--skip-calibration]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import numpy as np

import decentdp.privacy.ledger as ledger_module
from _machine import cpu_model
from decentdp.privacy import accounting
from decentdp.privacy.accounting import calibrate_noise_multiplier, epsilon_of_history
from decentdp.privacy.events import gaussian_event

#: (sigma, q, releases) of the replace-one PLD rows: the review's two, and a long history at a small epsilon.
HISTORIES = [(1.0, 0.02, 1000), (0.8, 0.05, 2000), (2.0, 0.02, 6908)]


class _Counted:
    """``epsilon_of_history`` as the ledger calls it, counting the compositions (one per call: its cache is
    cleared before each figure)."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = ledger_module.epsilon_of_history

    def __call__(self, history: Any, delta: float, accountant: str = "tight",
                 relation: str = "add-remove") -> float:
        self.calls += 1
        return self.original(history, delta, accountant, relation)


def _clear_caches() -> None:
    for cached in (accounting._epsilon_of_merged, ledger_module._max_count, calibrate_noise_multiplier):
        cached.cache_clear()


def first_charge(counted: _Counted, accountant: str, relation: str) -> dict[str, Any]:
    _clear_caches()
    counted.calls = 0
    ledger = ledger_module.PrivacyLedger(1, 8.0, 1e-5, accountant, relation)
    event = ledger.intern(gaussian_event(2.0, 0.02))
    start = time.perf_counter()
    ledger.charge(0, np.array([event]))
    seconds = time.perf_counter() - start
    return {"accountant": accountant, "relation": relation, "compositions": counted.calls, "seconds": seconds,
            "count": int(ledger.releases()[0] + ledger._room[0])}


def demo_headroom(counted: _Counted) -> dict[str, Any]:
    sigma = calibrate_noise_multiplier(4.0, 1e-5, 0.03, 300)
    _clear_caches()
    counted.calls = 0
    ledger = ledger_module.PrivacyLedger(1, 4.0, 1e-5)
    event = ledger.intern(gaussian_event(sigma, 0.03))
    start = time.perf_counter()
    room, _ = ledger._headroom(0, event)
    return {"compositions": counted.calls, "seconds": time.perf_counter() - start, "count": int(room)}


def alternating(counted: _Counted, rounds: int = 3) -> dict[str, Any]:
    _clear_caches()
    counted.calls = 0
    ledger = ledger_module.PrivacyLedger(1, 8.0, 1e-5, "tight", "replace-one")
    events = [ledger.intern(gaussian_event(2.0, 0.02)), ledger.intern(gaussian_event(2.2, 0.02))]
    start, marks = time.perf_counter(), []
    for round_index in range(rounds):
        ledger.charge(round_index, np.array([events[round_index % 2]]))
        marks.append(time.perf_counter() - start)
    return {"cumulative_seconds": marks, "compositions": counted.calls}


def pld_rows() -> list[dict[str, Any]]:
    rows = []
    for sigma, q, count in HISTORIES:
        history = ((gaussian_event(sigma, q), count),)
        _clear_caches()
        start = time.perf_counter()
        epsilon = epsilon_of_history(history, 1e-5, "pld", "replace-one")
        seconds = time.perf_counter() - start
        priced = tuple((accounting.priced_event(event, "pld", "replace-one"), n) for event, n in history)
        finest = accounting._replace_one_pld_epsilon(priced, 1e-5, accounting.PLD_DISCRETIZATION)
        rows.append({"sigma": sigma, "q": q, "releases": count, "epsilon": epsilon, "seconds": seconds,
                     "interval": accounting._pld_interval(history, 1e-5, "replace-one"), "epsilon_finest": finest,
                     "relative_to_finest": epsilon / finest - 1})
    return rows


def calibration_seconds() -> dict[str, Any]:
    _clear_caches()
    start = time.perf_counter()
    sigma = calibrate_noise_multiplier(60.0, 1e-5, 0.5, 10, relation="replace-one")
    return {"sigma": sigma, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-calibration", action="store_true",
                        help="skip the CLI case's calibration (minutes at the finest grid)")
    args = parser.parse_args()
    print(f"{platform.platform()}, {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"decentdp from {os.path.dirname(accounting.__file__)}")
    counted = _Counted()
    ledger_module.epsilon_of_history = counted
    try:
        charges = [first_charge(counted, "tight", "replace-one"), first_charge(counted, "pld", "add-remove")]
        demo, alternate = demo_headroom(counted), alternating(counted)
    finally:
        ledger_module.epsilon_of_history = counted.original
    for row in charges:
        print(f"first charge, {row['accountant']} / {row['relation']}: {row['compositions']} compositions, "
              f"{row['seconds']:.2f} s, count {row['count']}")
    print(f"demo headroom from RDP's count (tight / add-remove): {demo['compositions']} compositions, "
          f"{demo['seconds']:.2f} s, count {demo['count']}")
    print("alternating replace-one ledger, cumulative s after rounds 0/1/2: "
          + " / ".join(f"{mark:.1f}" for mark in alternate["cumulative_seconds"])
          + f" ({alternate['compositions']} compositions)")
    rows = pld_rows()
    print("| sigma | q | releases | grid | s | epsilon | epsilon at 1e-4 | difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['sigma']:g} | {row['q']:g} | {row['releases']} | {row['interval']:.2g} | {row['seconds']:.2f} | "
              f"{row['epsilon']:.5f} | {row['epsilon_finest']:.5f} | {100 * row['relative_to_finest']:+.3f} % |")
    calibration = None if args.skip_calibration else calibration_seconds()
    if calibration is not None:
        print(f"calibration, epsilon 60, q 0.5, 10 releases, replace-one: sigma {calibration['sigma']:.6g} in "
              f"{calibration['seconds']:.1f} s")
    if args.json:
        print(json.dumps({"first_charges": charges, "demo_headroom": demo, "alternating": alternate, "pld": rows,
                          "calibration": calibration}))


if __name__ == "__main__":
    main()
