"""Private cross-gradients (DPDL specs A.3 step 2, eqs. 8-12; CGA A.5.1 step 2; B.4), shared by DPDL and DP-CGA.

The data owner ``j`` draws one Poisson batch and, on that same batch, computes the clipped
per-sample gradient sums of its own model and of every neighbour's model it was sent; all of them
are released together, one joint event per owner (``k_j = deg_j + 1`` sums: sensitivity
``sqrt(k_j) C``, specs A.4), and each cross-gradient travels back to the model's owner::

    g_b^{i<-j} = grad l(x_i; xi_{j,b})                      (8)   per-sample cross-gradient
    clip_C(g_b^{i<-j})                                       (9)
    z^{i<-j} ~ N(0, sigma_j^2 C^2 I)                         (10)
    g^{i<-j} = (sum_b clip_C(g_b^{i<-j}) + z^{i<-j}) / L_j   (11)  sent from j to i
    g^{j<-j} = (sum_b clip_C(g_b^{j<-j}) + z^{j<-j}) / L_j   (12)  noised self-gradient (A.7.2)

All ``(model, owner)`` pairs of a round are one stacked computation (one row per agent for its own model,
then one per in-edge) through the oracle's gradient engine, not a loop over edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentdp.algorithms.base import Network, RoundContext, host_graph, once_per_graph


def reverse_edges(network: Network) -> torch.Tensor:
    """For each out-edge ``(j, i)``, the position in ``in_edges`` of its reverse ``(i, j)``.

    A message computed at ``j`` on in-edge ``(i -> j)`` is sent back to ``i`` along out-edge ``(j -> i)``.
    Found once per graph, on the host (where the check that every link is undirected reads it), and
    kept on the network's device."""
    def find() -> torch.Tensor:
        host = host_graph(network)
        n = network.n_total
        inward = host.in_edges[:, 0] * n + host.in_edges[:, 1]
        wanted = host.out_edges[:, 1] * n + host.out_edges[:, 0]
        order = torch.argsort(inward)
        position = torch.searchsorted(inward[order], wanted).clamp(max=len(order) - 1)
        found = order[position]
        if not bool((inward[found] == wanted).all()):
            raise ValueError("cross-gradients need undirected links: some out-edge has no reverse in-edge")
        return found.to(network.in_edges.device)

    return once_per_graph(network, "reverse edges", find)


@dataclass(frozen=True)
class CrossGradients:
    """One round's released gradients: ``own[i] = g^{i<-i}`` and, for each in-edge ``(j -> i)`` held at
    receiver ``i``, ``received[e] = g^{i<-j}`` (agent i's model on j's data, computed and noised by j)."""

    own: torch.Tensor       # (n_agents, d)
    received: torch.Tensor  # (E_in, d)


def cross_gradients(params: torch.Tensor, ctx: RoundContext) -> CrossGradients:
    """Eqs. (8)-(12): every agent's self-gradient and the cross-gradients its neighbours computed for it.

    Each owner's own model and the models it was sent are one stacked call, its own row first: a neighbour's
    model equal to the owner's, bit for bit, is then computed once (the complete graph, where every agent
    holds the same model after a round; :func:`~decentdp.util.rows.repeated_rows`).  Every row still
    gets its own noise (keyed by owner and slot, as two calls would) and counts in the owner's joint event."""
    net, oracle = ctx.network, ctx.oracle
    host = host_graph(net)                                # owners and noise keys: bookkeeping on the host
    n = net.n_agents
    models = torch.cat([params, net.broadcast(params)])   # step 1: in-edge (i -> j) carries x_i to owner j
    # x_j on j's batch, then each x_i on j's batch: local rows, on the host with the rest of the bookkeeping
    owners = torch.cat([torch.arange(n, device=host.in_rows.device), host.in_rows])
    slots = host.agent_ids.tolist() + host.in_edges[:, 0].tolist()   # noise keyed by the model's agent
    key = oracle.batch()                                  # one batch per owner for all its models (A.7.5)
    sums = oracle.clip(key, models, owners=owners, slots=slots)                      # (8)-(9)
    del models
    (released,) = oracle.release(sums)                    # (10): one joint event per owner, sqrt(k_j) C
    if oracle.mechanism is not None:                      # (11)-(12): divide by the expected batch L_j
        released.div_(oracle.expected_batch[owners].to(released.device)[:, None])
    own = released[:n].clone()                            # g^{j<-j}; the edge rows are freed after the exchange
    received = net.exchange(released[n:][reverse_edges(net)])  # j sends g^{i<-j} to i
    return CrossGradients(own, received)


def self_weights(network: Network) -> torch.Tensor:
    """``w_ii = 1 - sum_{j != i} w_ij`` of a row-stochastic mixing matrix, from the in-edge weights."""
    return 1.0 - network.aggregate(network.in_weights[:, None]).squeeze(1)
