"""The observer-view accountant's cost: Muffliato's pairwise epsilons over a run's whole view.

For each size (agents N, rounds T, gossip steps K on a random regular graph of degree 4, full batch),
times both accountants pricing every sender towards every single observer:

* the dense one: building the explicit view and ``observer_mu`` (one SVD per observer), next to the
  work ``dense_cost`` estimates before anything is built; sizes past its budget are only estimated;
* the recursive one (``privacy/observer_filter.py``): unrolling the run round by round and
  ``recursive_mu`` (a Kalman filter per observer), at every size including the paper-scale
  N = 100, T = 2000;

and, where both ran, how far the recursive sound bound sits above the dense one (median and largest
ratio of mu over sender-observer pairs; both are upper bounds of the truth).  No data is read.

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
from decentdp.algorithms.zip_dl import ZipDL, ZipDLSettings
from decentdp.privacy.observer_filter import recursive_mu
from decentdp.privacy.observer_pricing import VIEW_BUDGET_BYTES, VIEW_BUDGET_FLOPS
from decentdp.privacy.observer_view import dense_cost, observer_mu
from decentdp.runtime.network import SimulatedNetwork
from decentdp.topology import build_topology

SIZES = [(8, 10, 3), (16, 20, 4), (16, 50, 4), (32, 20, 4), (16, 100, 4), (10, 200, 4), (100, 2000, 10)]
#: Zip-DL's sizes (no gossip steps: one message per edge and round).
ZIP_DL_SIZES = [(16, 20), (32, 20), (100, 2000)]


def facts(n: int, rounds: int) -> tuple[RunFacts, Muffliato]:
    network = SimulatedNetwork(build_topology("k-regular", n, k=4, seed=0))
    run = RunFacts(rounds, lambda k: network, lambda k: 0.1, np.full(n, 2.0), np.full(n, 64.0), 1e-5,
                   "add-remove", np.full(n, 4.0))
    return run, network


def measure(n: int, rounds: int, steps: int) -> dict[str, float | int | bool | str]:
    """One size's row: Muffliato with ``steps`` gossip steps, or Zip-DL where ``steps`` is 0."""
    run, _ = facts(n, rounds)
    algorithm = Muffliato(MuffliatoSettings(gossip_steps=steps)) if steps else ZipDL.from_settings(ZipDLSettings())
    recipe = algorithm.view_recipe(run)
    observers = [[v] for v in range(n)]
    cost = dense_cost(recipe.received, recipe.noise_draws, recipe.data_terms)
    memory = 8.0 * sum(recipe.received) * (recipe.noise_draws + recipe.data_terms)
    row: dict[str, float | int | bool | str] = {
        "algorithm": algorithm.name, "agents": n, "rounds": rounds, "gossip_steps": steps,
        "estimated_flops": cost, "view_bytes": memory,
        "within_budget": cost <= VIEW_BUDGET_FLOPS and memory <= VIEW_BUDGET_BYTES}
    start = time.perf_counter()
    view = recipe.recursive().view()
    built = time.perf_counter()
    recursive = recursive_mu(view, observers)
    done = time.perf_counter()
    row |= {"recursive_build_seconds": built - start, "recursive_price_seconds": done - built}
    if row["within_budget"]:
        start = time.perf_counter()
        dense_view = recipe.dense().view()
        built = time.perf_counter()
        dense = observer_mu(dense_view, observers)
        done = time.perf_counter()
        priced = ~np.isnan(dense.mu)
        ratio = recursive.mu[priced] / dense.mu[priced]
        row |= {"build_seconds": built - start, "price_seconds": done - built,
                "bound_ratio_median": float(np.median(ratio)), "bound_ratio_max": float(ratio.max())}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = [measure(*size) for size in SIZES] + [measure(n, rounds, 0) for n, rounds in ZIP_DL_SIZES]
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "budget_flops": VIEW_BUDGET_FLOPS, "rows": rows}))
        return
    print(f"cpu: {cpu_model()}; dense budget {VIEW_BUDGET_FLOPS:.2g} flops, {VIEW_BUDGET_BYTES / 2**30:.3g} GiB")
    print("| algorithm | N | T | K | dense: estimated flops | view | build s | price s "
          "| recursive: build s | price s | recursive / dense mu (median, max) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        dense = (f"{row['build_seconds']:.2f} | {row['price_seconds']:.2f}" if row["within_budget"]
                 else "beyond budget | —")
        ratio = (f"{row['bound_ratio_median']:.3f}, {row['bound_ratio_max']:.3f}" if row["within_budget"] else "—")
        print(f"| {row['algorithm']} | {row['agents']} | {row['rounds']} | {row['gossip_steps'] or '—'} | "
              f"{row['estimated_flops']:.2g} | "
              f"{row['view_bytes'] / 2**20:.3g} MiB | {dense} | {row['recursive_build_seconds']:.2f} | "
              f"{row['recursive_price_seconds']:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
