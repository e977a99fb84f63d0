"""The :class:`Topology` a run uses: a connected graph with its checked mixing matrix, built from config
fields (:func:`build_topology`) or from a given matrix (:func:`topology_from_matrix`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import numpy as np

from decentdp.errors import ConfigError, GraphError
from decentdp.topology.checks import GraphReport, _adjacency, _check_choice, check_connected, describe
from decentdp.topology.graphs import GRAPH_PARAMS, make_graph
from decentdp.topology.mixing import MIXING_KINDS, mixing_matrix, validate_mixing


@dataclass(frozen=True, eq=False)
class Topology:
    """A validated communication graph with its mixing matrix; what the engine consumes.

    Build it with :func:`build_topology` or :func:`topology_from_matrix`. The graph is frozen and
    the mixing matrix read-only, so a validated topology cannot be changed afterwards (copy the
    matrix, e.g. ``torch.tensor(topology.mixing)``, to get a writable tensor).
    """

    graph: nx.Graph
    mixing: np.ndarray
    """``(N, N)`` float64 mixing matrix, read-only."""
    mixing_kind: str
    """One of :data:`MIXING_KINDS`, or ``"custom"`` for :func:`topology_from_matrix`."""
    warnings: tuple[str, ...]
    report: GraphReport

    @property
    def n_agents(self) -> int:
        """Number of agents N."""
        return int(self.mixing.shape[0])

    def edges(self) -> np.ndarray:
        """``(E, 2)`` int64 directed edges: ``(i, j)`` and ``(j, i)`` per link, sorted, no self loops."""
        return np.argwhere(self.adjacency() > 0).astype(np.int64)

    def adjacency(self) -> np.ndarray:
        """``(N, N)`` float64 0/1 adjacency matrix with zero diagonal."""
        return _adjacency(self.graph)


def build_topology(
    kind: str,
    n_agents: int,
    *,
    mixing: str = "metropolis-hastings",
    seed: int = 0,
    require_doubly_stochastic: bool | None = None,
    **graph_params: float | int | None,
) -> Topology:
    """Build, check and describe a graph and its mixing matrix in one step.

    Parameters
    ----------
    kind, n_agents, seed
        As in :func:`make_graph`.
    mixing
        One of :data:`MIXING_KINDS`.
    require_doubly_stochastic
        Default: True for ``metropolis-hastings`` and ``max-degree``, False for ``average``, so
        that ``average`` on an irregular graph (as in the paper's code) gives a warning in
        :attr:`Topology.warnings` rather than an error.
    **graph_params
        Any of :data:`GRAPH_PARAMS`, forwarded to :func:`make_graph`.
    """
    _check_choice("topology.mixing", "mixing matrix", mixing, MIXING_KINDS)
    unknown = sorted(set(graph_params) - set(GRAPH_PARAMS))
    if unknown:
        raise ConfigError(
            f"topology.{unknown[0]}",
            f"unknown graph parameter '{unknown[0]}'; allowed: {', '.join(GRAPH_PARAMS)}",
        )
    graph = make_graph(kind, n_agents, seed=seed, **graph_params)
    check_connected(graph)
    w = mixing_matrix(graph, mixing)
    if require_doubly_stochastic is None:
        require_doubly_stochastic = mixing != "average"
    warnings = validate_mixing(w, graph, require_doubly_stochastic=require_doubly_stochastic, kind=mixing)
    return _freeze_topology(graph, w, mixing, warnings)


def topology_from_matrix(w: np.ndarray, *, require_doubly_stochastic: bool = True) -> Topology:
    """Wrap a user-supplied mixing matrix as a :class:`Topology` (``mixing_kind = "custom"``).

    The graph is the support of the off-diagonal entries: agents ``i`` and ``j`` are neighbours
    when ``w[i, j]`` or ``w[j, i]`` is non-zero. The matrix is validated as in
    :func:`validate_mixing` and the graph must be connected.
    """
    try:
        w = np.array(w, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise GraphError(f"mixing matrix must be a numeric array: {exc}") from exc
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        raise GraphError(f"mixing matrix must be a non-empty square matrix, got shape {w.shape}")
    support = (w != 0) | (w.T != 0)
    graph = nx.Graph()
    graph.add_nodes_from(range(len(w)))
    graph.add_edges_from(np.argwhere(np.triu(support, k=1)).tolist())
    warnings = validate_mixing(w, graph, require_doubly_stochastic=require_doubly_stochastic, kind="custom")
    check_connected(graph)
    topology = _freeze_topology(graph, w, "custom", warnings)
    if topology.n_agents > 1 and topology.report.spectral_gap <= _NO_GAP:
        raise GraphError(
            "mixing matrix 'custom' has an eigenvalue of modulus 1 besides the consensus one (spectral gap "
            f"{topology.report.spectral_gap:.3g}): repeated mixing never reaches consensus (a zero diagonal on a "
            "bipartite graph makes agents swap values forever); give every agent a positive self weight, e.g. "
            "use (I + W) / 2"
        )
    return topology


# Spectral gaps at or below this are zero up to the eigensolver's rounding.
_NO_GAP = 1e-9


def _freeze_topology(graph: nx.Graph, w: np.ndarray, kind: str, warnings: Iterable[str]) -> Topology:
    """Assemble a :class:`Topology` with a frozen graph and a read-only copy of ``w``."""
    mixing = np.array(w, dtype=np.float64)
    mixing.setflags(write=False)
    return Topology(
        graph=nx.freeze(graph),
        mixing=mixing,
        mixing_kind=kind,
        warnings=tuple(warnings),
        report=describe(graph, mixing),
    )
