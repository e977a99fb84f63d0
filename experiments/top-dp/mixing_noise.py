"""Why TOP-DP's private methods do better in the pairing protocol than in the synchronous one: how much of the
agents' gradient noise each protocol's mixing leaves in the network average.

Eq. 3 with the gradient left out keeps only what the noise does: ``x_i <- alpha x_i + (1 - alpha) x_k + xi_i``
with ``xi_i`` standard Gaussian for every active agent.  Synchronously (Alg. 1) each agent picks ``k`` uniformly
among its neighbours: the round's mixing is row-stochastic but not doubly stochastic, so the average moves by
``(1 - alpha) / N * sum_j (c_j - 1) x_j`` besides the noise (``c_j``: how many agents picked ``j``), and the agents'
disagreement, itself made of noise, leaks into the average.  With ``pairing`` (Alg. 2) partners average each other
(doubly stochastic) and the average moves by the active agents' noise alone: ``N_active / N^2`` a round.

This runs the library's own rounds (``SelectMix.round`` of the Optimal baseline, the library's ``Scheduler`` for
the pairing plans and its public selection for the synchronous one) on Fig. 3's graph kind (30 agents,
Erdos-Renyi 0.2, offline probability 0.1 for pairing as in the configs) with a zero gradient and unit noise, each
of ``--replicas`` coordinates an independent replica, and prints per (protocol, alpha): the variance the network
average gains per round and the agents' mean squared distance to the average at the end::

    python experiments/top-dp/mixing_noise.py            # 2000 rounds x 1000 replicas, 3 graphs
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from decentdp.algorithms.base import RoundContext
from decentdp.algorithms.optimal import Optimal
from decentdp.rng import AgentRandom
from decentdp.runtime.network import SimulatedNetwork
from decentdp.runtime.scheduler import Scheduler
from decentdp.topology.build import build_topology

AGENTS, CONNECTION_RATE, OFFLINE = 30, 0.2, 0.1
ALPHAS = (0.25, 0.5, 0.75)
PROTOCOLS = ("synchronous", "pairing")


class UnitNoise:
    """An oracle whose released gradient is standard Gaussian noise alone (the gradient itself left out)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def gradient(self, params: torch.Tensor) -> torch.Tensor:
        return torch.randn(params.shape, generator=self.generator, dtype=params.dtype)


def noise_in_average(protocol: str, alpha: float, graph_seed: int, rounds: int, replicas: int) -> dict[str, float]:
    """Run eq. 3 on noise alone; the per-round variance of the network average and the final disagreement."""
    network = SimulatedNetwork(build_topology("erdos-renyi", AGENTS, seed=graph_seed, p=CONNECTION_RATE),
                               dtype=torch.float64)
    rng = AgentRandom(graph_seed)
    scheduler = Scheduler("pairing", rng, AGENTS, offline_probability=OFFLINE) if protocol == "pairing" else None
    algorithm, oracle = Optimal(alpha), UnitNoise(graph_seed)
    state = algorithm.init_state(torch.zeros(AGENTS, replicas, dtype=torch.float64))
    for k in range(rounds):
        plan = None if scheduler is None else scheduler.plan(k, network)
        # lr = 1: eq. 3 subtracts the released noise, which is as likely as adding it.
        state = algorithm.round(state, RoundContext(k, 1.0, network, oracle, plan, rng))
    x = state["params"]
    average = x.mean(0)
    return {"average_variance_per_round": float(average.var()) / rounds,
            "disagreement": float((x - average).pow(2).mean())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=2000, help="rounds of eq. 3 (default: the configs' 2000)")
    parser.add_argument("--replicas", type=int, default=1000, help="independent replicas (coordinates)")
    parser.add_argument("--graphs", type=int, default=3, help="Erdos-Renyi graphs drawn (seeds 0, 1, ...)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON holding every figure")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {}
    print(f"N = {AGENTS}, Erdos-Renyi {CONNECTION_RATE}, {args.rounds} rounds, {args.replicas} replicas, "
          f"{args.graphs} graphs; 1/N = {1 / AGENTS:.4f}")
    print(f"{'protocol':<12}{'alpha':>6}{'avg variance / round (per graph)':>40}{'x 1/N':>8}{'disagreement':>14}")
    for protocol in PROTOCOLS:
        for alpha in ALPHAS:
            runs = [noise_in_average(protocol, alpha, seed, args.rounds, args.replicas) for seed in range(args.graphs)]
            figures = {key: [run[key] for run in runs] for key in runs[0]}
            results[f"{protocol}-a{alpha}"] = figures
            per_round = figures["average_variance_per_round"]
            print(f"{protocol:<12}{alpha:>6}{', '.join(f'{v:.4f}' for v in per_round):>40}"
                  f"{statistics.mean(per_round) * AGENTS:>8.2f}{statistics.mean(figures['disagreement']):>14.3f}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
