"""What noise calibration costs a run, and what the tight accountant buys.

For a few (epsilon, q, releases) settings, in one process, caches cleared before each: the seconds
to calibrate sigma with RDP (what runs used before) and with the default ``tight`` accountant
(bracketed by RDP, then regula falsi on PLD), how many accountant calls that took, a repeated call
(the in-process cache), and sigma under each: how much less noise the tight accountant adds for the
same epsilon.  Also the cost of a secure-mode noise draw against a simulation-mode one.

    python benchmarks/calibration.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from decentdp.privacy.accounting import calibrate_noise_multiplier, epsilon_of_history, epsilon_spent, rdp_curve
from decentdp.rng import AgentKeys, AgentRandom, SecureRandom, Stream

SETTINGS = [(1.0, 0.0417, 2000), (0.5, 0.0256, 2000), (10.0, 0.0256, 2000), (0.16, 0.0025, 6400)]


def _timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = call(*args, **kwargs)
    return value, time.perf_counter() - start


def _clear_caches() -> None:
    for cached in (calibrate_noise_multiplier, epsilon_of_history, rdp_curve):
        cached.cache_clear()


def calibration_rows() -> list[dict[str, float]]:
    rows = []
    for epsilon, q, count in SETTINGS:
        _clear_caches()
        rdp, rdp_s = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q, count, accountant="rdp")
        _clear_caches()
        tight, tight_s = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q, count)
        evaluations = epsilon_of_history.cache_info().misses
        _, cached_s = _timed(calibrate_noise_multiplier, epsilon, 1e-5, q, count)
        rows.append({"epsilon": epsilon, "q": q, "releases": count, "sigma_rdp": rdp, "sigma_tight": tight,
                     "seconds_rdp": rdp_s, "seconds_tight": tight_s, "seconds_cached": cached_s,
                     "accountant_calls_tight": evaluations,
                     "epsilon_reached_tight": epsilon_spent(tight, 1e-5, q, count)})
    return rows


def noise_rows(rows: int = 10, dim: int = 100_000) -> dict[str, float]:
    agents = list(range(rows))
    simulation = AgentRandom(0)
    secure = SecureRandom(0, AgentKeys.generate(agents))
    _, sim_s = _timed(simulation.normal, agents, dim, 1, Stream.NOISE)
    _, sec_s = _timed(secure.normal, agents, dim, 1, Stream.NOISE)
    return {"values": rows * dim, "seconds_simulation": sim_s, "seconds_secure": sec_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, noise = calibration_rows(), noise_rows()
    print("| epsilon | q | releases | sigma RDP | sigma tight | s RDP | s tight (accountant calls) | s cached |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['epsilon']:g} | {row['q']:g} | {row['releases']} | {row['sigma_rdp']:.4f} | "
              f"{row['sigma_tight']:.4f} | {row['seconds_rdp']:.3f} | {row['seconds_tight']:.2f} "
              f"({row['accountant_calls_tight']}) | {row['seconds_cached']:.6f} |")
    print(f"noise: {noise['values']} values, simulation {noise['seconds_simulation']:.3f} s, "
          f"secure {noise['seconds_secure']:.3f} s")
    if args.json:
        print(json.dumps({"calibration": rows, "noise": noise}))


if __name__ == "__main__":
    main()
