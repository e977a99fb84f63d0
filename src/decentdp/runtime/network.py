"""The one interface through which agents exchange messages.

Algorithms never index another agent's rows directly: everything that crosses an edge goes
through a :class:`Network` (message -> aggregate, as in PyTorch Geometric's ``MessagePassing``).
That keeps the privacy boundary visible (what crosses an edge must already be a private release
or a post-processing of one) and lets engines change underneath: the in-process
:class:`SimulatedNetwork` implements it with matrix products over all ``N`` agents, a
multi-machine engine implements the same methods over the shard of agents a process holds.

Conventions: tensors are indexed by agent along dimension 0; an edge ``e = (src, dst)`` is
directed, and every undirected link of the graph appears as two directed edges.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np
import torch

from decentdp.topology import Topology

#: Mixing uses a sparse (CSR) matrix when at most this fraction of its entries is non-zero.  Measured
#: for x of 79,510 columns: at N = 100, CSR took 7.6 ms at 3 non-zeros per row and 12 ms at 11 (dense:
#: 24-33 ms), but 108 ms at 31 per row; at N = 30, CSR won at 3 per row and lost at 11.
_SPARSE_MAX_DENSITY = 0.15
#: Rows per block of a sparse operator (see :meth:`SimulatedNetwork._apply`).
_SPARSE_ROW_BLOCK = 8


class Network(Protocol):
    """Message passing among the agents an engine holds."""

    n_agents: int
    edges: torch.Tensor    # (E, 2) directed edges (src, dst)
    degrees: torch.Tensor  # (N,) number of neighbours, excluding self

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """Gossip averaging ``x_i <- sum_j w_ij x_j`` with the mixing matrix W (DSGD, DSGT).

        Returns a new tensor that the caller owns (DSGD updates it in place)."""
        ...

    def mix_add(self, x: torch.Tensor, into: torch.Tensor, alpha: float) -> torch.Tensor:
        """``W x + alpha * into``, computed in ``into``'s storage (a temporary the caller owns) and
        returned: a gossip step and an update without a second ``(N, d)`` matrix."""
        ...

    def neighbor_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``sum_{j in N(i)} x_j`` over neighbours, excluding ``i`` itself (DiNNO's penalties)."""
        ...

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Each agent sends the same value to all neighbours: the ``(E, ...)`` messages as received."""
        ...

    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        """Deliver per-edge messages ``(E, ...)`` computed by each edge's sender; returns them as received."""
        ...

    def aggregate(self, received: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Sum (optionally weighted by ``weights`` (E,)) the messages each agent received: ``(N, ...)``."""
        ...

    def swap(self, x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        """Pairwise exchange: row ``i`` of the result is ``x[partner[i]]`` (``partner[i] == i``: idle)."""
        ...


class SimulatedNetwork:
    """All agents in one process: every exchange is a tensor operation, messages arrive unchanged."""

    def __init__(self, topology: Topology, dtype: torch.dtype = torch.float32) -> None:
        self.topology = topology
        self.n_agents = topology.n_agents
        self.edges = torch.tensor(topology.edges(), dtype=torch.long).reshape(-1, 2)
        adjacency = topology.adjacency()
        self.degrees = torch.tensor(adjacency.sum(axis=1), dtype=dtype)
        self._mixing = self._operator(topology.mixing, dtype)
        self._adjacency = self._operator(adjacency, dtype)
        self._neighbours = {(int(s), int(d)) for s, d in self.edges.tolist()}

    def _operator(self, matrix: np.ndarray, dtype: torch.dtype) -> torch.Tensor | list[tuple[slice, torch.Tensor]]:
        """The matrix as a dense tensor, or, when sparse enough, as CSR blocks of consecutive rows."""
        dense = torch.tensor(matrix, dtype=dtype)
        if np.count_nonzero(matrix) > _SPARSE_MAX_DENSITY * matrix.size:
            return dense
        with warnings.catch_warnings():  # "sparse CSR support is in beta": matmul with CSR is all we use
            warnings.simplefilter("ignore", UserWarning)
            return [(slice(start, start + _SPARSE_ROW_BLOCK), dense[start:start + _SPARSE_ROW_BLOCK].to_sparse_csr())
                    for start in range(0, self.n_agents, _SPARSE_ROW_BLOCK)]

    @staticmethod
    def _apply(operator: torch.Tensor | list[tuple[slice, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        """``operator @ x``.  torch's CSR product builds its result in a temporary as large as the
        result, so sparse operators are applied block by block of rows, into the output."""
        if isinstance(operator, torch.Tensor):
            return operator @ x
        out = torch.empty(operator[-1][0].start + operator[-1][1].shape[0], *x.shape[1:], dtype=x.dtype)
        for rows, block in operator:
            out[rows] = block @ x
        return out

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(self._mixing, x)

    def mix_add(self, x: torch.Tensor, into: torch.Tensor, alpha: float) -> torch.Tensor:
        if isinstance(self._mixing, torch.Tensor):
            return into.addmm_(self._mixing, x, beta=alpha)
        for rows, block in self._mixing:
            into[rows].mul_(alpha).add_(block @ x)
        return into

    def neighbor_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(self._adjacency, x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return self.exchange(x[self.edges[:, 0]])

    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        return messages

    def aggregate(self, received: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is not None:
            received = received * weights.reshape(-1, *([1] * (received.dim() - 1)))
        out = torch.zeros(self.n_agents, *received.shape[1:], dtype=received.dtype)
        return out.index_add_(0, self.edges[:, 1], received)

    def swap(self, x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        for agent, other in enumerate(partner.tolist()):
            if other != agent and ((agent, other) not in self._neighbours or int(partner[other]) != agent):
                raise ValueError(f"agents {agent} and {other} are not a pair of neighbours in this round")
        return x[partner]
