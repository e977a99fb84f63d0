"""What noise calibration costs a run, and what the tight accountant buys.

For a few (epsilon, q, releases) settings, in one process, caches cleared before each: the seconds
to calibrate sigma with RDP (what runs used before) and with the default ``tight`` accountant
(bracketed by RDP, then regula falsi on PLD), how many accountant calls that took, a repeated call
(the in-process cache), and sigma under each: how much less noise the tight accountant adds for the
same epsilon.  Also the cost of a secure-mode noise draw against a simulation-mode one, and of a long
ledger: one agent charged 100,000 releases, each with its own noise scale (alternately Gaussian and
Laplace), then its epsilon; the seconds per release over the first and the last tenth show whether a
charge's cost grows with the history (it must not: the ledger keeps running RDP totals).  And, A/B in the
same process, the sampled-Gaussian RDP curve from dp_accounting's per-order loops against the vectorised
series ``rdp_curve`` uses (``privacy/sampled_gaussian_rdp.py``), per curve, inside a tight calibration, and in
building DECOR's quick start (digits, 16 agents: one calibration per distinct rate, then its observers' curves).

    python benchmarks/calibration.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from dp_accounting.rdp import rdp_privacy_accountant

from decentdp.config import load_config
from decentdp.experiment.build import build_experiment
from decentdp.privacy import accounting
from decentdp.privacy.accounting import calibrate_noise_multiplier, epsilon_spent, rdp_curve
from decentdp.privacy.events import gaussian_event, laplace_event
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.rng import AgentKeys, AgentRandom, SecureRandom, Stream

SETTINGS = [(1.0, 0.0417, 2000), (0.5, 0.0256, 2000), (10.0, 0.0256, 2000), (0.16, 0.0025, 6400)]


def _timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = call(*args, **kwargs)
    return value, time.perf_counter() - start


def _clear_caches() -> None:
    for cached in (calibrate_noise_multiplier, accounting._epsilon_of_merged, rdp_curve):
        cached.cache_clear()


def calibration_rows() -> list[dict[str, float]]:
    rows = []
    for epsilon, q, count in SETTINGS:
        _clear_caches()
        rdp, rdp_s = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q, count, accountant="rdp")
        _clear_caches()
        tight, tight_s = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q, count)
        evaluations = accounting._epsilon_of_merged.cache_info().misses  # (epsilon_of_history's cache)
        _, cached_s = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q, count)
        rows.append({"epsilon": epsilon, "q": q, "releases": count, "sigma_rdp": rdp, "sigma_tight": tight,
                     "seconds_rdp": rdp_s, "seconds_tight": tight_s, "seconds_cached": cached_s,
                     "accountant_calls_tight": evaluations,
                     "epsilon_reached_tight": epsilon_spent(tight, 1e-5, q, count)})
    return rows


def dp_accountings_series(sample_rate: float, noise_multiplier: float, orders: np.ndarray) -> np.ndarray:
    """The same curve from dp_accounting's per-order loops (what ``rdp_curve`` used before)."""
    return rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(sample_rate, noise_multiplier, orders)


def series_rows() -> list[dict[str, float]]:
    """Per setting: one curve at its tight sigma, and the whole tight calibration, with each series (A/B)."""
    rows = []
    vectorised = accounting.sampled_gaussian_rdp
    for epsilon, q, count in SETTINGS:
        row: dict[str, float] = {"epsilon": epsilon, "q": q, "releases": count}
        for label, series in (("dp_accounting", dp_accountings_series), ("vectorised", vectorised)):
            accounting.sampled_gaussian_rdp = series
            try:
                _clear_caches()
                sigma, row[f"seconds_calibration_{label}"] = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q,
                                                                    count)
                _clear_caches()
                _, row[f"seconds_curve_{label}"] = _timed(rdp_curve, gaussian_event(sigma, q))
                row[f"sigma_{label}"] = sigma
            finally:
                accounting.sampled_gaussian_rdp = vectorised
        rows.append(row)
    return rows


def decor_build_row(config: str = "experiments/correlated/decor-digits.toml") -> dict[str, float]:
    """Seconds to build DECOR's quick start (data, graph, calibration) with each series, caches cleared, after
    one untimed build (so that neither side pays the process's first build)."""
    row: dict[str, float] = {}
    vectorised = accounting.sampled_gaussian_rdp
    build_experiment(load_config(config))
    for label, series in (("dp_accounting", dp_accountings_series), ("vectorised", vectorised)):
        accounting.sampled_gaussian_rdp = series
        try:
            _clear_caches()
            _, row[f"seconds_{label}"] = _timed(build_experiment, load_config(config))
        finally:
            accounting.sampled_gaussian_rdp = vectorised
    return row


def noise_rows(rows: int = 10, dim: int = 100_000) -> dict[str, float]:
    agents = list(range(rows))
    simulation = AgentRandom(0)
    secure = SecureRandom(0, AgentKeys.generate(agents))
    _, sim_s = _timed(simulation.normal, agents, dim, 1, Stream.NOISE)
    _, sec_s = _timed(secure.normal, agents, dim, 1, Stream.NOISE)
    return {"values": rows * dim, "seconds_simulation": sim_s, "seconds_secure": sec_s}


def long_ledger_row(releases: int = 100_000) -> dict[str, float]:
    """One agent, ``releases`` distinct events charged one by one, then its RDP epsilon (delta 1e-5)."""
    ledger = PrivacyLedger(1, 1000.0, 1e-5)
    tenth = releases // 10
    marks = []  # the clock at the start of each tenth, and at the end
    for k, scale in enumerate((50.0 + 1e-3 * np.arange(releases)).tolist()):
        if k % tenth == 0:
            marks.append(time.perf_counter())
        event = gaussian_event(scale) if k % 2 == 0 else laplace_event(scale)
        ledger.charge(k, np.array([ledger.intern(event)]))
    marks.append(time.perf_counter())
    charged = marks[-1] - marks[0]
    epsilon, epsilon_s = _timed(ledger.epsilon, "rdp")
    first, last = marks[1] - marks[0], marks[-1] - marks[-2]
    return {"releases": releases, "seconds_charging": charged, "seconds_epsilon": epsilon_s,
            "microseconds_per_release_first_tenth": 1e6 * first / tenth,
            "microseconds_per_release_last_tenth": 1e6 * last / tenth,
            "last_over_first": last / first, "epsilon": float(epsilon[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, series, decor = calibration_rows(), series_rows(), decor_build_row()
    noise, ledger = noise_rows(), long_ledger_row()
    print("| epsilon | q | releases | sigma RDP | sigma tight | s RDP | s tight (accountant calls) | s cached |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['epsilon']:g} | {row['q']:g} | {row['releases']} | {row['sigma_rdp']:.4f} | "
              f"{row['sigma_tight']:.4f} | {row['seconds_rdp']:.3f} | {row['seconds_tight']:.2f} "
              f"({row['accountant_calls_tight']}) | {row['seconds_cached']:.6f} |")
    print("\n| epsilon | q | releases | curve s, dp_accounting | curve s, vectorised | calibration s, dp_accounting | "
          "calibration s, vectorised | same sigma |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in series:
        print(f"| {row['epsilon']:g} | {row['q']:g} | {row['releases']} | {row['seconds_curve_dp_accounting']:.4f} | "
              f"{row['seconds_curve_vectorised']:.4f} | {row['seconds_calibration_dp_accounting']:.2f} | "
              f"{row['seconds_calibration_vectorised']:.2f} | "
              f"{row['sigma_dp_accounting'] == row['sigma_vectorised']} |")
    print(f"DECOR quick start built in {decor['seconds_dp_accounting']:.2f} s with dp_accounting's series, "
          f"{decor['seconds_vectorised']:.2f} s vectorised")
    print(f"noise: {noise['values']} values, simulation {noise['seconds_simulation']:.3f} s, "
          f"secure {noise['seconds_secure']:.3f} s")
    print(f"long ledger: {ledger['releases']} distinct releases charged in {ledger['seconds_charging']:.1f} s "
          f"({ledger['microseconds_per_release_first_tenth']:.0f} us each over the first tenth, "
          f"{ledger['microseconds_per_release_last_tenth']:.0f} over the last: x{ledger['last_over_first']:.2f}), "
          f"epsilon in {ledger['seconds_epsilon']:.2f} s")
    if args.json:
        print(json.dumps({"calibration": rows, "series": series, "decor_build": decor, "noise": noise,
                          "long_ledger": ledger}))


if __name__ == "__main__":
    main()
