"""MAFALDA-SGD's factorization: how long the optimiser takes for a run's graph, and how much noise it saves.

For each size (agents N on a random 4-regular graph, or a ring, with Metropolis-Hastings weights, rounds T,
batches b) and each number of bands (``--bands``; dense by default), times the workload's Gram in closed form
(``workload_gram``) and the optimiser (``factorize``, as a run calls it: its iteration cap and stopping test, one
BLAS thread), and prints the iterations, tr(G X^{-1}) of the result and of independent noise at the same
participation (X = I / k), and their ratio.  No data is read.

Run from the repository root (the issue's size, N = 100, T = 1000, is the last; it takes about a minute):

    .venv/bin/python benchmarks/factorization.py [--json] [--sizes N,T,b ...] [--graph ring] [--bands 0 8 32]
"""

from __future__ import annotations

import argparse
import json
import time

import networkx as nx
import torch
from threadpoolctl import threadpool_limits

from _machine import cpu_model
from decentdp.privacy.factorization import MAX_ITERATIONS, factorize, workload_gram
from decentdp.topology.mixing import mixing_matrix

SIZES = [(16, 150, 3), (100, 200, 20), (100, 1000, 100)]
#: BLAS threads (a run uses one: ``run_factorization``); ``--threads`` compares others.
THREADS: int | None = 1


def measure(n: int, rounds: int, period: int, bands: int | None = None, graph: str = "regular4") -> dict[str, float]:
    w = mixing_matrix(nx.cycle_graph(n) if graph == "ring" else nx.random_regular_graph(4, n, seed=0))
    threads = torch.get_num_threads() if THREADS is None else THREADS
    with threadpool_limits(limits=threads, user_api="blas"):
        start = time.perf_counter()
        gram = workload_gram(w, rounds)
        gram_seconds = time.perf_counter() - start
        result = factorize(gram, period, MAX_ITERATIONS, bands)
    return {"agents": n, "rounds": rounds, "batches": period, "bands": result.bands, "blas_threads": threads,
            "gram_seconds": round(gram_seconds, 3), "optimizer_seconds": round(result.seconds, 2),
            "iterations": result.iterations, "loss": result.loss, "loss_independent": result.independent_loss,
            "ratio": round(result.loss / result.independent_loss, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per size")
    parser.add_argument("--sizes", nargs="*", help="N,T,b triples (default: the three above)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1, as a run)")
    parser.add_argument("--graph", choices=("regular4", "ring"), default="regular4", help="the agents' graph")
    parser.add_argument("--bands", type=int, nargs="*", default=[0],
                        help="C's diagonals (algorithm.bands) to try for every size; 0: dense (the default)")
    args = parser.parse_args()
    global THREADS
    THREADS = args.threads
    sizes = [tuple(int(x) for x in size.split(",")) for size in args.sizes] if args.sizes else SIZES
    if not args.json:
        print(f"{cpu_model()}, BLAS threads {THREADS}")
        print(f"graph {args.graph}")
        print("   N     T    b  bands  threads  gram (s)  optimiser (s)  iterations  tr(G X^-1)  independent  ratio")
    for (n, rounds, period), bands in ((size, bands) for size in sizes for bands in args.bands):
        row = measure(n, rounds, period, bands or None, args.graph)
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{n:4d} {rounds:5d} {period:4d} {row['bands']:6d} {row['blas_threads']:8d} "
                  f"{row['gram_seconds']:9.3f} "
                  f"{row['optimizer_seconds']:14.1f} {row['iterations']:11d} {row['loss']:11.4g} "
                  f"{row['loss_independent']:12.4g} {row['ratio']:6.3f}")


if __name__ == "__main__":
    main()
