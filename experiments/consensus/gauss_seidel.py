"""Does the paper code's in-place (Gauss-Seidel) mixing explain DP-DSGD's gap on sparse graphs?  A measurement.

Bayrooti et al.'s code (``jbayrooti/dp-dec-learning`` at ee5cc2e, ``src/image_systems.py`` lines 722-732) mixes
DSGD's parameters in place, agent 0 to 9 in a fixed order, so agent ``i`` reads the new values of agents
``0 .. i-1``.  With ``W = L + D + U`` (strictly lower, diagonal, strictly upper parts) one such sweep is the
synchronous step ``M = (I - L)^-1 (D + U)``: rows sum to one, and values travel along paths of increasing index
within one round, which spreads them faster over a sparse graph than ``W`` does (docs/reproduction.md, "What we
do differently", item 1).  decentdp mixes synchronously with ``W``, as Algorithm 1 does.

This runs a consensus config with ``M`` in place of the graph's ``W`` (everything else, seed included, as the
config's own run) and prints its final accuracy beside the synchronous run's, from ``results/`` here.  With
``--gradient-at-mixed`` DSGD also takes its gradient at the mixed parameters, ``theta <- M theta - eta G(M theta)``,
as that code does (Algorithm 1, and decentdp, take it at ``theta``).  ``M`` is
dense where ``W`` is sparse: a sweep is sequential, each agent still hearing only its neighbours, but within one
round, so the run's topology here is ``M``'s support, not the graph.  This is a diagnostic of the paper's
numbers, not a protocol the library offers: for non-private configs (``epsilon = inf``) its accuracy is all
that matters; a private one would be priced as if M's support were the graph.

    OMP_NUM_THREADS=1 python experiments/consensus/gauss_seidel.py table1-dsgd-epsinf-fiedler0.06 --seed 0 \\
        [--gradient-at-mixed] [--set topology.mixing=average]

The runs are kept in ``experiments/consensus/mixing/`` (docs/reproduction.md, "Why DP-DSGD lags on the sparse
graphs").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import decentdp
from decentdp.algorithms.base import RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.dp_dsgd import DPDSGD
from decentdp.algorithms.registry import register
from decentdp.config import ExperimentConfig
from decentdp.experiment import build
from decentdp.topology import Topology
from decentdp.topology.build import topology_from_matrix

HERE = Path(__file__).resolve().parent
synchronous_topology = build.config_topology  # the library's: the config's graph and W for a seed


def gauss_seidel_step(w: np.ndarray) -> np.ndarray:
    """``M = (I - L)^-1 (D + U)``: one in-place sweep of ``x_i <- sum_j w_ij x_j`` in index order, as one matrix."""
    lower = np.tril(w, k=-1)
    return np.linalg.solve(np.eye(len(w)) - lower, w - lower)


def in_place_topology(config: ExperimentConfig, seed: int) -> Topology:
    """The config's own graph and ``W`` for this seed, with ``W`` replaced by its Gauss-Seidel sweep."""
    topology = synchronous_topology(config, seed)
    return topology_from_matrix(gauss_seidel_step(topology.mixing), require_doubly_stochastic=False)


class DSGDGradientAtMixed(DPDSGD):
    """The paper code's DSGD step: mix first, then the gradient at the mixed parameters (registered only when
    ``--gradient-at-mixed`` asks for it, so that importing this script adds no algorithm)."""

    name = "dp-dsgd-gradient-at-mixed"

    @property
    def _fused(self) -> bool:
        return False

    def round(self, state: State, ctx: RoundContext) -> State:
        mixed = ctx.network.mix(state["params"])
        grad = ctx.oracle.gradient(mixed)
        params, opt = self.optimizer.step(mixed, grad, unprefixed("opt", state), ctx.lr, inplace=True)
        return {"params": params, **prefixed("opt", opt)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config name in experiments/consensus/ (without .toml)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "mixing", help="the run's results folder goes under this")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--gradient-at-mixed", action="store_true", help="DSGD's gradient at the mixed parameters")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, as for decentdp run (topology.mixing=average: the code's weights)")
    args = parser.parse_args(argv)
    overrides = [f"experiment.seed={args.seed}", "experiment.eval_every=200", *args.set]
    if args.gradient_at_mixed:
        register(DSGDGradientAtMixed)
        overrides.append(f"algorithm.name={DSGDGradientAtMixed.name}")
    config = decentdp.load_config(HERE / f"{args.config}.toml", overrides=overrides)
    build.config_topology = in_place_topology  # every graph of the run mixes by M
    variant = "-".join(["gauss-seidel", *(["gradient-at-mixed"] if args.gradient_at_mixed else []),
                        *(item.replace("=", "-").replace(".", "-") for item in args.set)])
    result = decentdp.run(config, args.out / f"{args.config}-{variant}-s{args.seed}", data_dir=args.data_dir,
                          progress=False)
    synchronous = HERE / "results" / f"{args.config}-s{args.seed}" / "summary.json"
    row = {"config": args.config, "seed": args.seed, "variant": variant,
           "gauss_seidel_accuracy_mean": result.summary["accuracy_mean"],
           "gauss_seidel_accuracy_min": result.summary["accuracy_min"],
           "synchronous_accuracy_mean": json.loads(synchronous.read_text())["accuracy_mean"]
           if synchronous.exists() else None}
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
