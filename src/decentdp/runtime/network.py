"""The in-process implementation of the message-passing protocol, and graphs that change per round.

:class:`~decentdp.algorithms.base.Network` (declared beside the algorithms that use it) is the one
interface through which agents exchange messages.  :class:`SimulatedNetwork` implements its primitives
for all ``N`` agents of one process (agent ids equal rows, out-edges equal in-edges, ``exchange``
delivers every message unchanged) and overrides the helpers built on them with fused tensor operations:
``mix``, ``mix_add`` and ``neighbor_sum`` are one matrix product each, ``swap`` one gather, and
``exchange_rows`` lets the receivers read the senders' rows where they lie.  :class:`GraphSequence`
gives each round its network: the same one throughout, or a graph redrawn every few rounds (Muffliato).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from decentdp.algorithms.base import Network, PublicGraph
from decentdp.topology import Topology

#: Mixing uses a sparse (CSR) matrix when at most this fraction of its entries is non-zero.  Measured
#: for x of 79,510 columns: at N = 100, CSR took 7.6 ms at 3 non-zeros per row and 12 ms at 11 (dense:
#: 24-33 ms), but 108 ms at 31 per row; at N = 30, CSR won at 3 per row and lost at 11.
_SPARSE_MAX_DENSITY = 0.15


class SimulatedNetwork(Network):
    """All agents in one process: every exchange is a tensor operation, messages arrive unchanged."""

    def __init__(self, topology: Topology, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.topology = topology
        self.device = torch.device(device)
        self.n_agents = topology.n_agents
        self.n_total = topology.n_agents
        self.agent_ids = torch.arange(self.n_agents, device=self.device)
        edges = torch.tensor(topology.edges(), dtype=torch.long, device=self.device).reshape(-1, 2)
        self.out_edges = edges  # one process: every edge leaves and arrives here, in one order
        self.in_edges = edges
        adjacency = topology.adjacency()
        self.degrees = torch.tensor(adjacency.sum(axis=1), dtype=dtype, device=self.device)
        self._mixing = self._operator(topology.mixing, dtype)
        self._adjacency = self._operator(adjacency, dtype)
        self.in_weights = torch.tensor(topology.mixing[edges[:, 1].cpu().numpy(), edges[:, 0].cpu().numpy()],
                                       dtype=dtype, device=self.device)
        self._neighbours = {(int(s), int(d)) for s, d in edges.tolist()}

    def rows(self, agent_ids: torch.Tensor) -> torch.Tensor:
        return agent_ids

    def public_graph(self) -> PublicGraph:
        if getattr(self, "_public", None) is None:
            self._public = self._build_public_graph()
        return self._public

    def _build_public_graph(self) -> PublicGraph:
        """The run's graph: here, the network's own topology."""
        return topology_graph(self.topology)

    def _operator(self, matrix: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """The matrix as a dense tensor, or, when sparse enough, as one CSR tensor."""
        dense = torch.tensor(matrix, dtype=dtype, device=self.device)
        if np.count_nonzero(matrix) > _SPARSE_MAX_DENSITY * matrix.size:
            return dense
        with warnings.catch_warnings():  # "sparse CSR support is in beta": matmul with CSR is all we use
            warnings.simplefilter("ignore", UserWarning)
            return dense.to_sparse_csr()

    @staticmethod
    def _apply(operator: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``operator @ x`` in one product written straight into its result (dense or CSR ``operator``).

        ``addmm_`` with ``beta = 0`` ignores the uninitialised output; for CSR it is also the fast
        path: ``csr @ x`` builds its result in a temporary and was 1.4-4.4x slower on the CPU, which
        is why mixing once went in blocks of 8 rows (125 products at N = 1000, one kernel launch
        each on a GPU); one product is 1.1-1.6x faster than those blocks on the CPU, bit for bit
        the same (``benchmarks/gpu.py --only plumbing``)."""
        return torch.empty(operator.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device).addmm_(operator, x,
                                                                                                  beta=0)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """Fused: ``W x`` as one product, no message per edge."""
        return self._apply(self._mixing, x)

    def mix_add(self, x: torch.Tensor, into: torch.Tensor, alpha: float) -> torch.Tensor:
        """Fused: ``W x + alpha * into`` as one ``addmm_`` into ``into``."""
        return into.addmm_(self._mixing, x, beta=alpha)

    def neighbor_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Fused: the adjacency matrix times ``x``, one product."""
        return self._apply(self._adjacency, x)

    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        return messages

    def exchange_rows(self, rows: torch.Tensor, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused: the in-edges are the out-edges and messages arrive unchanged, so the receivers read the rows in
        place (no ``(E, d)`` tensor)."""
        return rows, pick

    def swap(self, x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        """Fused: row ``i`` gets row ``partner[i]``, one gather.  The pairs are checked when ``partner`` is on
        the host, where that is free; on an accelerator the check would read the device back in every pairing
        round, so it is left to the scheduler, the one source of partners, which pairs only along the graph's
        edges (``tests/privacy/test_release_boundary.py`` checks that)."""
        if partner.device.type == "cpu":
            check_pairs(partner.tolist(), self._neighbours)
        return x[partner]


def topology_graph(topology: Topology) -> PublicGraph:
    """A topology's :class:`~decentdp.algorithms.base.PublicGraph`: its edges in order, W's entries on them
    and its diagonal."""
    edges = np.asarray(topology.edges(), dtype=np.int64).reshape(-1, 2)
    mixing = np.asarray(topology.mixing, dtype=np.float64)
    return PublicGraph(topology.n_agents, edges, mixing[edges[:, 1], edges[:, 0]], np.diagonal(mixing).copy())


def check_pairs(partner: list[int], neighbours: set[tuple[int, int]]) -> None:
    """``partner[i] == j`` must mean that ``i`` and ``j`` are neighbours and ``partner[j] == i`` (``j == i``: idle)."""
    for agent, other in enumerate(partner):
        if other != agent and ((agent, other) not in neighbours or partner[other] != agent):
            raise ValueError(f"agents {agent} and {other} are not a pair of neighbours in this round")


class GraphSequence:
    """The network of each round: fixed, or redrawn every ``redraw_every`` rounds by ``build(epoch)``.

    A redrawn graph depends only on its epoch (``round // redraw_every``), so runs stay reproducible
    and resumable; the current epoch's network is kept, not rebuilt every round."""

    def __init__(self, first: SimulatedNetwork, build: Callable[[int], SimulatedNetwork] | None = None,
                 redraw_every: int = 0) -> None:
        if (build is None) != (redraw_every == 0):
            raise ValueError("a redrawn graph needs both a builder and redraw_every > 0")
        self._build = build
        self.redraw_every = redraw_every
        self._epoch, self._network = 0, first

    def at(self, round_index: int) -> SimulatedNetwork:
        if self._build is None or round_index < 0:
            return self._network
        epoch = round_index // self.redraw_every
        if epoch != self._epoch:
            self._epoch, self._network = epoch, self._build(epoch)
        return self._network
