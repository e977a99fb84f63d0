"""The decentralized gossip ADMM of Vanhaesebrouck et al. (2017), Bellet et al.'s non-private baseline (specs D.8).

**Reconstructed**: the papers state only its structure (an agent and a random neighbour are
activated together; four dual variables per edge, updated only when the edge is activated; ten
local gradient steps per primal update; initialised with the purely local models).  The update
rules below are the standard partial-consensus ADMM (Wei & Ozdaglar 2013) on Q_L, as specs D.8
reconstructs them, with one correction; rho is not reported (default 1).

Agent a keeps its own model and a copy of each neighbour's; edge e = (i, j) keeps secondary
variables Z_e = (Z_e^i, Z_e^j) and duals lambda_{ie}^i, lambda_{ie}^j, lambda_{je}^i, lambda_{je}^j.
When e is activated, for a in {i, j}: ``local_steps`` gradient steps on

    Q_a + sum_{e' containing a} sum_{k in e'} [ lambda_{ae'}^k . (copy_a^k - Z_e'^k) + rho/2 ||copy_a^k - Z_e'^k||^2 ]

with Q_a = 1/4 sum_j W_aj ||own_a - copy_a^j||^2 + mu D_aa c_a L_a(own_a); then
Z_e^k = ((copy_i^k + copy_j^k) + (lambda_ie^k + lambda_je^k) / rho) / 2 and
lambda_ae^k += rho (copy_a^k - Z_e^k), for a, k in {i, j} (copy_a^a is own_a).

**The correction.** Specs D.8 writes Q_a with 1/2 sum_j W_aj.  ADMM converges to the minimiser of
sum_a Q_a under the consensus constraints, and in that sum every edge (i, j) appears twice, once in
Q_i and once in Q_j: with 1/2 the graph term is sum_{i<j} W_ij ||Theta_i - Theta_j||^2, twice eq. (2)'s,
so the limit is argmin Q_L at mu/2 (a reviewer measured ADMM within 1e-15 of it and 0.34 away from
argmin Q_L(mu)).  With 1/4, sum_a Q_a = Q_L(mu) at consensus, so the baseline solves the same
objective as coordinate descent.

Activations are sequential (one edge per tick, the activated agent's clock from the ``poisson-clocks``
scheduler and the neighbour from the public stream of that tick), each vectorised over the agent's edges.
"""

from __future__ import annotations

import numpy as np
import torch

from decentdp.personalized.objective import Problem, local_gradients
from decentdp.rng import Stream, round_stream_seed


def gossip_admm(problem: Problem, local: torch.Tensor, woken: np.ndarray, seed: int, *, rho: float = 1.0,
                local_steps: int = 10) -> torch.Tensor:
    """Run one activation per entry of ``woken`` from the local models ``local``; the agents' own models."""
    weights = problem.weights.cpu().numpy()
    source, target = np.nonzero(np.triu(weights, 1))
    n_edges = len(source)
    device = local.device
    ends = torch.as_tensor(np.stack([source, target], 1), device=device)         # (E, 2) agents of each edge
    edge_weight = torch.as_tensor(weights[source, target], dtype=torch.float64, device=device)
    own = local.clone()
    copy = local[ends.flip(1)].clone()                                   # copy[e, s]: side s's copy of the other end
    z = torch.stack([local[ends[:, 0]], local[ends[:, 1]]], 1)                  # z[e, k]: Z_e of endpoint k
    dual = torch.zeros(n_edges, 2, 2, local.shape[1], dtype=torch.float64, device=device)  # lambda_{ae}^k at [e, a, k]
    incident = [np.flatnonzero((source == a) | (target == a)) for a in range(problem.n_agents)]
    pull = problem.mu * problem.degree * problem.confidence
    for tick, agent in enumerate(woken.tolist()):
        edges = incident[agent]
        if not len(edges):
            continue
        draw = np.random.default_rng(round_stream_seed(seed, tick, Stream.PUBLIC))
        edge = int(edges[draw.integers(len(edges))])
        for endpoint in (int(ends[edge, 0]), int(ends[edge, 1])):
            _primal(problem, endpoint, incident[endpoint], ends, edge_weight, own, copy, z, dual, pull, rho,
                    local_steps)
        i, j = int(ends[edge, 0]), int(ends[edge, 1])
        held = torch.stack([torch.stack([own[i], copy[edge, 0]]),                 # i's values of (i, j)
                            torch.stack([copy[edge, 1], own[j]])])                # j's values of (i, j)
        z[edge] = 0.5 * (held.sum(0) + dual[edge].sum(0) / rho)
        dual[edge] += rho * (held - z[edge].unsqueeze(0))
    return own


def _primal(problem: Problem, agent: int, edges: np.ndarray, ends: torch.Tensor, edge_weight: torch.Tensor,
            own: torch.Tensor, copy: torch.Tensor, z: torch.Tensor, dual: torch.Tensor, pull: torch.Tensor,
            rho: float, steps: int) -> None:
    """``steps`` gradient steps on agent ``agent``'s augmented Lagrangian (module docstring), in place."""
    index = torch.as_tensor(edges, device=own.device)
    side = (ends[index, 1] == agent).long()                                      # the agent's side of each edge
    other = 1 - side
    w = edge_weight[index].unsqueeze(1)
    rows = torch.arange(len(index), device=own.device)
    z_own, z_other = z[index, side], z[index, other]
    dual_own, dual_other = dual[index, side, side], dual[index, side, other]
    # 1 / (a Gershgorin bound on the Hessian's largest eigenvalue): the graph term's rows sum to D_aa (own model)
    # and W_aj (a copy), the loss adds mu D_aa c_a L_a^loc to the own model, the penalties rho per constraint
    step = 1.0 / float(problem.degree[agent] + pull[agent] * problem.local_smoothness[agent] + rho * len(edges))
    mine = own[agent].clone()
    theirs = copy[index, side].clone()
    for _ in range(steps):
        graph = 0.5 * w * (mine.unsqueeze(0) - theirs)     # gradient of 1/4 W_aj ||own - copy_j||^2 in own, per edge
        local = _one_gradient(problem, agent, mine)
        grad_own = graph.sum(0) + pull[agent] * local + (dual_own + rho * (mine - z_own)).sum(0)
        grad_theirs = -graph + dual_other + rho * (theirs - z_other)
        mine = mine - step * grad_own
        theirs = theirs - step * grad_theirs
    own[agent] = mine
    copy[index[rows], side] = theirs


def _one_gradient(problem: Problem, agent: int, theta: torch.Tensor) -> torch.Tensor:
    """grad L_agent at ``theta`` (the agent's own rows only)."""
    models = torch.zeros(problem.n_agents, problem.dim, dtype=theta.dtype, device=theta.device)
    models[agent] = theta
    return local_gradients(problem, models, torch.tensor([agent], device=theta.device))[0]
