"""Public facts about the whole graph, learned through the :class:`~decentdp.algorithms.base.Network` alone.

An algorithm sees the agents its process holds; a few need a fact about the whole (public) graph,
such as its largest in-degree (dp-cga's padding) or its mixing matrix (Muffliato's spectral gap
and pairwise accounting).  :func:`flood_max` computes an elementwise maximum over every agent of
the run by flooding it along the edges: after ``n_total - 1`` neighbour exchanges (at least the
diameter of the connected graph) every agent holds it.  The number of exchanges depends on public
values only, so every process of a sharded run makes the same network calls (each is a collective
step), and the result is exact (a maximum of the same values in any order) and the simulator's.
When one process holds every agent the maximum is taken directly, with no exchange.
"""

from __future__ import annotations

import torch

from decentdp.algorithms.base import Network


def flood_max(network: Network, values: torch.Tensor) -> torch.Tensor:
    """``(n_agents, ...)``: every row the elementwise maximum of ``values`` (one row per local agent) over
    all agents of the run (``-inf`` rows contribute nothing)."""
    if network.n_agents == network.n_total:
        return values.amax(0, keepdim=True).expand_as(values).clone()
    receiver = network.rows(network.in_edges[:, 1])
    index = receiver.reshape(-1, *([1] * (values.dim() - 1))).expand(len(receiver), *values.shape[1:])
    best = values.clone()
    for _ in range(network.n_total - 1):
        best = best.scatter_reduce(0, index, network.broadcast(best), reduce="amax")
    return best
