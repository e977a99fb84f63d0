"""The observer-view accountant's cost: Muffliato's pairwise epsilons over a run's whole view.

For each size (agents N, rounds T, gossip steps K on a random regular graph of degree 4, full batch),
times building the explicit view (``Muffliato.linear_view``) and pricing every sender towards every
single observer (``observer_mu``, one SVD per observer), next to the work ``dense_cost`` estimates
before anything is built (what a run checks against its budget).  Sizes past the budget are only
estimated: the paper-scale N = 100, T = 2000 among them.  No data is read.

Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/observer_view.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from _machine import cpu_model
from decentdp.algorithms.base import RunFacts
from decentdp.algorithms.muffliato import Muffliato, MuffliatoSettings
from decentdp.privacy.observer_view import VIEW_BUDGET_BYTES, VIEW_BUDGET_FLOPS, dense_cost, observer_mu
from decentdp.runtime.network import SimulatedNetwork
from decentdp.topology import build_topology

SIZES = [(8, 10, 3), (16, 20, 4), (16, 50, 4), (32, 20, 4), (16, 100, 4), (10, 200, 4), (100, 2000, 10)]


def facts(n: int, rounds: int) -> tuple[RunFacts, Muffliato]:
    network = SimulatedNetwork(build_topology("k-regular", n, k=4, seed=0))
    run = RunFacts(rounds, lambda k: network, lambda k: 0.1, np.full(n, 2.0), np.full(n, 64.0), 1e-5,
                   "add-remove", np.full(n, 4.0))
    return run, network


def measure(n: int, rounds: int, steps: int) -> dict[str, float | int | bool]:
    run, _ = facts(n, rounds)
    muffliato = Muffliato(MuffliatoSettings(gossip_steps=steps))
    received, noise, data = muffliato.view_size(run)
    cost, memory = dense_cost(received, noise, data), 8.0 * sum(received) * (noise + data)
    row: dict[str, float | int | bool] = {"agents": n, "rounds": rounds, "gossip_steps": steps,
                                          "estimated_flops": cost, "view_bytes": memory,
                                          "within_budget": cost <= VIEW_BUDGET_FLOPS and memory <= VIEW_BUDGET_BYTES}
    if row["within_budget"]:
        start = time.perf_counter()
        view = muffliato.linear_view(run)
        built = time.perf_counter()
        observer_mu(view, [[v] for v in range(n)])
        done = time.perf_counter()
        row |= {"build_seconds": built - start, "price_seconds": done - built}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = [measure(*size) for size in SIZES]
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "budget_flops": VIEW_BUDGET_FLOPS, "rows": rows}))
        return
    print(f"cpu: {cpu_model()}; budget {VIEW_BUDGET_FLOPS:.2g} flops, {VIEW_BUDGET_BYTES / 2**30:.3g} GiB")
    print("| N | T | K | estimated flops | view | build s | price s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        timing = (f"{row['build_seconds']:.2f} | {row['price_seconds']:.2f}" if row["within_budget"]
                  else "beyond budget | (local epsilon reported)")
        print(f"| {row['agents']} | {row['rounds']} | {row['gossip_steps']} | {row['estimated_flops']:.2g} | "
              f"{row['view_bytes'] / 2**20:.3g} MiB | {timing} |")


if __name__ == "__main__":
    main()
