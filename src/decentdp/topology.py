"""Communication graphs and mixing matrices for decentralized learning.

Consensus-based algorithms only reach agreement when agents talk over a connected graph and mix
their parameters with a matrix whose rows sum to one (every update is a weighted average) and, for
the consensus to be the *plain* mean, whose columns sum to one as well. This module builds the
graphs used in the experiments, derives mixing matrices from them, checks those assumptions, and
summarises a graph by the quantities the paper reports, chiefly the normalized Fiedler value
λ₂(Laplacian) / N, which is 1 for the complete graph and approaches 0 as the graph thins out.

Every graph has nodes ``0 .. N-1``; agent ``i`` is node ``i``, and row ``i`` of a mixing matrix is
the averaging weights agent ``i`` applies to itself and its neighbours.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from math import isqrt

import networkx as nx
import numpy as np
from scipy.sparse.csgraph import connected_components
from scipy.spatial.distance import pdist, squareform

from decentdp.errors import ConfigError, GraphError

GRAPH_KINDS: tuple[str, ...] = (
    "complete",
    "ring",
    "star",
    "path",
    "grid",
    "torus",
    "erdos-renyi",
    "geometric",
    "fiedler",
    "complete-bipartite",
    "k-regular",
    "two-star",
    "tree",
    "partial-mesh",
)
MIXING_KINDS: tuple[str, ...] = ("metropolis-hastings", "average", "max-degree")

#: Keyword parameters of :func:`make_graph` that :func:`build_topology` forwards.
GRAPH_PARAMS: tuple[str, ...] = ("p", "radius", "k", "fiedler", "fiedler_tol", "rows", "max_tries")

# Optional parameters (default None) and the graph kinds that use them; passing one to another
# kind is an error rather than silently ignored, since it almost always means a typo in the kind.
PARAM_USERS: dict[str, tuple[str, ...]] = {
    "p": ("erdos-renyi", "partial-mesh"),
    "radius": ("geometric",),
    "k": ("k-regular",),
    "fiedler": ("fiedler",),
    "rows": ("grid", "torus"),
}
_MIN_AGENTS: dict[str, int] = {"complete": 1, "ring": 3, "torus": 9, "two-star": 3, "partial-mesh": 3}
_TORUS_MIN_SIDE = 3
_SIZES_SHOWN = 8


def make_graph(
    kind: str,
    n_agents: int,
    *,
    seed: int = 0,
    p: float | None = None,
    radius: float | None = None,
    k: int | None = None,
    fiedler: float | None = None,
    fiedler_tol: float = 0.01,
    rows: int | None = None,
    max_tries: int = 1000,
) -> nx.Graph:
    """Build a connected communication graph on agents ``0 .. n_agents-1``.

    Parameters
    ----------
    kind
        One of :data:`GRAPH_KINDS`:

        - ``complete``, ``ring`` (cycle, needs >= 3 agents; with 2 use ``path`` or ``complete``),
          ``star`` (hub is agent 0), ``path``.
        - ``grid`` / ``torus``: ``rows x cols`` lattice with ``rows * cols = n_agents``, numbered
          row-major (agent ``r * cols + c``). ``rows`` defaults to the most square factorisation.
          A torus wraps both directions and needs at least 3 rows and 3 columns so it is 4-regular.
        - ``erdos-renyi``: each edge present with probability ``p``.
        - ``geometric``: agents uniform in the unit square, linked when at distance <= ``radius``.
        - ``fiedler``: a geometric graph whose normalized Fiedler value λ₂/N is within
          ``fiedler_tol`` of ``fiedler`` (in (0, 1]; 1 gives the complete graph). This is how the
          paper selects graphs of a given connectivity.
        - ``complete-bipartite``: halves of sizes ``n // 2`` and ``n - n // 2``.
        - ``k-regular``: uniformly random ``k``-regular graph (``n_agents * k`` must be even).
        - The other topologies of TOP-DP's Fig. 8 (Guo et al.; besides ``ring``): ``two-star``, a star
          with two star agents (hubs 0 and 1 linked, agent ``i >= 2`` a leaf of hub ``i % 2``);
          ``tree``, the complete binary tree in heap order (agent ``i``'s parent is ``(i - 1) // 2``);
          ``partial-mesh``, a ring with every other pair linked with probability ``p``.
    n_agents
        Number of agents, >= 1. A single agent (central training) is only allowed for ``complete``.
    seed
        Non-negative seed; the same seed always gives the same graph.
    p, radius, k, fiedler, rows
        Parameters of the kinds above; passing one to a kind that does not use it is an error.
    fiedler_tol
        Accepted distance of λ₂/N from ``fiedler``.
    max_tries
        Random kinds are redrawn until connected (``fiedler``: until the target is reachable);
        after this many draws a :class:`GraphError` is raised.

    Returns
    -------
    networkx.Graph
        Undirected simple graph with integer nodes ``0 .. n_agents-1`` inserted in order.
        Geometric kinds store node positions as node attribute ``"pos"`` and the radius used as
        graph attribute ``"radius"``.

    Raises
    ------
    ConfigError
        For an unknown kind, an invalid parameter, or a Fiedler target that no graph on
        ``n_agents`` can reach (the error's field names the parameter).
    GraphError
        When no connected draw (or no draw hitting the Fiedler target) is found in ``max_tries``.
    """
    _check_choice("topology.graph", "graph", kind, GRAPH_KINDS)
    n = _require_int("topology.agents", n_agents, minimum=1)
    _require_int("experiment.seed", seed, minimum=0)
    max_tries = _require_int("topology.max_tries", max_tries, minimum=1)
    _check_params_used(kind, {"p": p, "radius": radius, "k": k, "fiedler": fiedler, "rows": rows})
    _check_min_agents(kind, n)
    rng = np.random.default_rng(seed)

    if kind == "complete":
        graph = nx.complete_graph(n)
    elif kind == "ring":
        graph = nx.cycle_graph(n)
    elif kind == "star":
        graph = nx.star_graph(n - 1)
    elif kind == "path":
        graph = nx.path_graph(n)
    elif kind in ("grid", "torus"):
        graph = _lattice(kind, n, rows)
    elif kind == "complete-bipartite":
        graph = nx.complete_bipartite_graph(n // 2, n - n // 2)
    elif kind == "two-star":
        graph = nx.Graph([(0, 1), *((i % 2, i) for i in range(2, n))])
    elif kind == "tree":
        graph = nx.Graph((i, (i - 1) // 2) for i in range(1, n))
    elif kind == "partial-mesh":
        p = _require_real("topology.p", p, kind, "the probability of each non-ring link", low=0.0, high=1.0)
        chords = nx.gnp_random_graph(n, p, seed=int(rng.integers(2**32)))
        graph = nx.compose(nx.cycle_graph(n), chords)
    elif kind == "erdos-renyi":
        p = _require_real("topology.p", p, kind, "the edge probability", low=0.0, high=1.0)
        graph = _connected_draw(
            lambda s: nx.gnp_random_graph(n, p, seed=s),
            rng,
            max_tries,
            f"no connected erdos-renyi graph with n_agents={n}, p={p:g} in {max_tries} draws; "
            f"p is too small for a connected draw (connectivity needs roughly p > ln(N)/N = "
            f"{np.log(n) / n:.3g})",
        )
    elif kind == "geometric":
        radius = _require_real("topology.radius", radius, kind, "the link radius", low=0.0, high=None)
        graph = _connected_draw(
            lambda s: _geometric_graph(np.random.default_rng(s).random((n, 2)), radius),
            rng,
            max_tries,
            f"no connected geometric graph with n_agents={n}, radius={radius:g} in {max_tries} "
            f"draws; the radius is too small for a connected draw",
        )
    elif kind == "fiedler":
        target = _require_real(
            "topology.fiedler", fiedler, kind, "the target normalized Fiedler value", low=0.0, high=1.0
        )
        tol = _require_real(
            "topology.fiedler_tol", fiedler_tol, kind, "the Fiedler tolerance", low=0.0, high=1.0
        )
        graph = _fiedler_graph(n, target, tol, rng, max_tries)
    else:
        graph = _k_regular(n, k, rng, max_tries)
    return _canonical(graph)


def mixing_matrix(graph: nx.Graph, kind: str = "metropolis-hastings") -> np.ndarray:
    """Mixing matrix ``W`` of a graph, ``W[i, j]`` being the weight agent ``i`` gives agent ``j``.

    Parameters
    ----------
    graph
        Undirected simple graph with nodes ``0 .. N-1``.
    kind
        One of :data:`MIXING_KINDS`, with ``d_i`` the degree of agent ``i``:

        - ``metropolis-hastings``: ``w_ij = 1 / (1 + max(d_i, d_j))`` on edges, ``w_ii = 1 - sum``.
          Symmetric and doubly stochastic on every graph; needs only neighbours' degrees.
        - ``average``: ``w_ij = 1 / (d_i + 1)`` for ``j`` in ``N_i ∪ {i}``. What the paper's code
          uses; row stochastic only, doubly stochastic only on regular graphs.
        - ``max-degree``: ``w_ij = 1 / (1 + d_max)`` on edges, ``w_ii = 1 - d_i / (1 + d_max)``.
          Symmetric and doubly stochastic, but needs the global maximum degree.

    Returns
    -------
    numpy.ndarray
        ``(N, N)`` float64 matrix, zero off the graph.
    """
    _check_choice("topology.mixing", "mixing matrix", kind, MIXING_KINDS)
    adj = _adjacency(graph)
    degree = adj.sum(axis=1)
    if kind == "average":
        return (adj + np.eye(len(adj))) / (degree + 1.0)[:, None]
    if kind == "metropolis-hastings":
        w = adj / (1.0 + np.maximum.outer(degree, degree))
    else:
        w = adj / (1.0 + degree.max())
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def validate_mixing(
    w: np.ndarray,
    graph: nx.Graph,
    *,
    require_doubly_stochastic: bool = True,
    atol: float = 1e-9,
    kind: str | None = None,
) -> list[str]:
    """Check that ``w`` is a valid mixing matrix on ``graph``.

    Hard requirements (always a :class:`GraphError`): shape ``(N, N)``, finite, no entry below
    ``-atol``, exactly zero between agents that are not neighbours (a non-zero weight would mean
    communicating along a missing link), and every row summing to 1 within ``atol``. Symmetry and
    unit column sums are what make consensus converge to the plain mean of the agents' values;
    without them the consensus is a weighted mean, so they raise when
    ``require_doubly_stochastic`` and are otherwise returned as warnings.

    Parameters
    ----------
    w
        Candidate mixing matrix.
    graph
        The communication graph (nodes ``0 .. N-1``).
    require_doubly_stochastic
        Raise instead of warn when ``w`` is not symmetric or not column stochastic.
    atol
        Absolute tolerance for negativity, row sums, column sums and symmetry.
    kind
        Name of the mixing rule, used only to make messages specific.

    Returns
    -------
    list of str
        Warnings; empty when ``w`` is symmetric and doubly stochastic.
    """
    adj = _adjacency(graph)
    w = _as_square(w, len(adj))
    label = "mixing matrix" if kind is None else f"mixing matrix '{kind}'"
    _check_entries(w, adj, label, atol)

    row_sums = w.sum(axis=1)
    bad_rows = np.flatnonzero(np.abs(row_sums - 1.0) > atol)
    if bad_rows.size:
        i = int(bad_rows[0])
        raise GraphError(
            f"{label}: row {i} sums to {row_sums[i]:.6g}, not 1 ({bad_rows.size} row(s) off); every "
            f"row must sum to 1 so that each agent's update is a weighted average"
        )

    problems = _doubly_stochastic_problems(w, adj, label, atol, average=kind == "average")
    if problems and require_doubly_stochastic:
        raise GraphError(
            "; ".join(problems) + " (pass require_doubly_stochastic=False to accept it with a warning)"
        )
    return problems


def check_connected(graph: nx.Graph) -> None:
    """Raise :class:`GraphError` unless ``graph`` is connected, listing its component sizes."""
    _check_simple(graph)
    if graph.number_of_nodes() == 0:
        raise GraphError("graph has no nodes; decentralized learning needs at least one agent")
    sizes = sorted((len(c) for c in nx.connected_components(graph)), reverse=True)
    if len(sizes) > 1:
        more = ", ..." if len(sizes) > _SIZES_SHOWN else ""
        shown = ", ".join(str(s) for s in sizes[:_SIZES_SHOWN]) + more
        raise GraphError(
            f"graph is disconnected: {len(sizes)} components (sizes {shown}); "
            f"decentralized algorithms need a connected graph"
        )


@dataclass(frozen=True)
class GraphReport:
    """Summary of a communication graph and its mixing matrix, as reported in experiment tables.

    For a single agent, which is trivially in consensus, the complete-graph values are reported:
    ``fiedler = N = 1``, ``normalized_fiedler = 1`` and ``spectral_gap = 1``.
    """

    n_agents: int
    n_edges: int
    min_degree: int
    max_degree: int
    mean_degree: float
    fiedler: float
    """λ₂ of the unnormalized Laplacian (algebraic connectivity)."""
    normalized_fiedler: float
    """λ₂ / N: 1 for the complete graph, near 0 for poorly connected graphs."""
    spectral_gap: float
    """1 - second largest eigenvalue modulus of W; larger means faster consensus."""

    def as_dict(self) -> dict[str, float | int]:
        """Plain dict of the fields, e.g. for logging or JSON."""
        return asdict(self)


def describe(graph: nx.Graph, w: np.ndarray) -> GraphReport:
    """Compute the :class:`GraphReport` of ``graph`` and its mixing matrix ``w``."""
    adj = _adjacency(graph)
    n = len(adj)
    w = _as_square(w, n)
    degree = adj.sum(axis=1).astype(int)
    if n == 1:
        fiedler, slem = 1.0, 0.0
    else:
        fiedler = _algebraic_connectivity(adj)
        eigenvalues = np.linalg.eigvalsh(w) if np.array_equal(w, w.T) else np.linalg.eigvals(w)
        slem = float(np.sort(np.abs(eigenvalues))[-2])
    return GraphReport(
        n_agents=n,
        n_edges=graph.number_of_edges(),
        min_degree=int(degree.min()),
        max_degree=int(degree.max()),
        mean_degree=float(degree.mean()),
        fiedler=fiedler,
        normalized_fiedler=fiedler / n,
        spectral_gap=1.0 - slem,
    )


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
    return _freeze_topology(graph, w, "custom", warnings)


# --------------------------------------------------------------------------------------------
# graph construction helpers


def _lattice(kind: str, n: int, rows: int | None) -> nx.Graph:
    """Grid or torus on ``n`` agents, relabelled row-major to ``0 .. n-1``."""
    field = "topology.agents" if rows is None else "topology.rows"
    rows, cols = _lattice_shape(kind, n, rows)
    if kind == "torus" and min(rows, cols) < _TORUS_MIN_SIDE:
        raise ConfigError(
            field,
            f"a torus needs at least {_TORUS_MIN_SIDE} rows and {_TORUS_MIN_SIDE} columns so that it "
            f"is 4-regular; {rows}x{cols} is too thin for n_agents={n}",
        )
    lattice = nx.grid_2d_graph(rows, cols, periodic=kind == "torus")
    return nx.relabel_nodes(lattice, {(r, c): r * cols + c for r, c in lattice.nodes})


def _lattice_shape(kind: str, n: int, rows: int | None) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols = n``: the given rows or the most square factorisation."""
    if rows is None:
        rows = _most_square_rows(n)
        if rows == 1:
            raise ConfigError(
                "topology.agents",
                f"a {kind} needs n_agents = rows * cols with rows, cols >= 2, and {n} is prime; "
                f"choose a composite n_agents or pass rows",
            )
    else:
        rows = _require_int("topology.rows", rows, minimum=1)
        if n % rows:
            raise ConfigError(
                "topology.rows",
                f"rows={rows} does not divide n_agents={n}; a {kind} needs n_agents = rows * cols",
            )
    return rows, n // rows


def _most_square_rows(n: int) -> int:
    """Largest divisor of ``n`` not above its square root."""
    return max(r for r in range(1, isqrt(n) + 1) if n % r == 0)


def _k_regular(n: int, k: int | None, rng: np.random.Generator, max_tries: int) -> nx.Graph:
    """Uniformly random connected ``k``-regular graph, redrawn until connected."""
    k = _require_int("topology.k", _required("topology.k", k, "k-regular", "the degree k"), minimum=1)
    if k >= n:
        raise ConfigError("topology.k", f"degree k={k} must be below n_agents={n}")
    if (n * k) % 2:
        raise ConfigError("topology.k", f"n_agents * k must be even for a k-regular graph, got {n} * {k}")
    if k == 1 and n > 2:
        raise ConfigError(
            "topology.k", f"k=1 gives a perfect matching, which is disconnected for n_agents={n} > 2"
        )
    return _connected_draw(
        lambda s: nx.random_regular_graph(k, n, seed=s),
        rng,
        max_tries,
        f"no connected {k}-regular graph on {n} agents in {max_tries} draws; raise k or max_tries",
    )


def _connected_draw(
    draw: Callable[[int], nx.Graph], rng: np.random.Generator, max_tries: int, failure: str
) -> nx.Graph:
    """Call ``draw`` with seeds from ``rng`` until it returns a connected graph."""
    for _ in range(max_tries):
        graph = draw(int(rng.integers(2**32)))
        if nx.is_connected(graph):
            return graph
    raise GraphError(failure)


def _geometric_graph(positions: np.ndarray, radius: float) -> nx.Graph:
    """Graph linking the points of ``positions`` (``(N, 2)``) at distance <= ``radius``."""
    adj = squareform(pdist(positions)) <= radius
    graph = nx.Graph(radius=float(radius))
    graph.add_nodes_from((i, {"pos": (float(x), float(y))}) for i, (x, y) in enumerate(positions))
    graph.add_edges_from(np.argwhere(np.triu(adj, k=1)).tolist())
    return graph


def _fiedler_graph(n: int, target: float, tol: float, rng: np.random.Generator, max_tries: int) -> nx.Graph:
    """Geometric graph with ``|λ₂/N - target| <= tol``.

    For fixed positions λ₂ can only grow with the radius (a larger radius only adds edges, each
    adding a positive semi-definite term to the Laplacian), so the radius is found by bisection.
    The values reachable from one set of positions are discrete; when none lies within ``tol`` of
    the target, new positions are drawn.
    """
    # Every non-complete graph has λ₂ <= vertex connectivity <= N - 2 (Fiedler, 1973).
    ceiling = (n - 2) / n
    if target == 1.0 or (target - tol > ceiling and 1.0 - target <= tol):
        return nx.complete_graph(n)
    if target - tol > ceiling:
        raise ConfigError(
            "topology.fiedler",
            f"normalized Fiedler value {target:g} +- {tol:g} is unreachable with {n} agents: the "
            f"complete graph has 1 and every other graph at most (N-2)/N = {ceiling:.3g}",
        )
    for _ in range(max_tries):
        positions = rng.random((n, 2))
        radius = _radius_for_fiedler(positions, target, tol)
        if radius is not None:
            return _geometric_graph(positions, radius)
    raise GraphError(
        f"no geometric graph on {n} agents with normalized Fiedler value within {tol:g} of {target:g} "
        f"in {max_tries} position draws; the values reachable with few agents are discrete, so "
        f"change the target, loosen fiedler_tol or raise max_tries"
    )


def _radius_for_fiedler(positions: np.ndarray, target: float, tol: float) -> float | None:
    """Radius whose graph on ``positions`` has λ₂/N closest to ``target``, if within ``tol``.

    The graph only changes at the pairwise distances, so the bisection runs over their sorted
    list and is exact: it finds the first radius reaching the target, and by monotonicity the
    closest value is at that radius or the one before it.
    """
    n = len(positions)
    distances = squareform(pdist(positions))
    radii = np.unique(distances[np.triu_indices(n, k=1)])

    def normalized_fiedler(index: int) -> float:
        adj = (distances <= radii[index]).astype(np.float64)
        np.fill_diagonal(adj, 0.0)
        if connected_components(adj, directed=False, return_labels=False) > 1:
            return -1.0  # further from any target in (0, 1] than any tolerance in (0, 1]
        return _algebraic_connectivity(adj) / n

    # The largest radius gives the complete graph, whose value 1 reaches every target.
    low, high = 0, len(radii) - 1
    while low < high:
        middle = (low + high) // 2
        if normalized_fiedler(middle) >= target:
            high = middle
        else:
            low = middle + 1
    candidates = {index: normalized_fiedler(index) for index in (low - 1, low) if index >= 0}
    best = min(candidates, key=lambda index: abs(candidates[index] - target))
    return float(radii[best]) if abs(candidates[best] - target) <= tol else None


def _canonical(graph: nx.Graph) -> nx.Graph:
    """Copy of ``graph`` with nodes inserted in sorted order and plain-int labels."""
    canonical = nx.Graph(**graph.graph)
    canonical.add_nodes_from(sorted((int(v), data) for v, data in graph.nodes(data=True)))
    canonical.add_edges_from(sorted((int(min(u, v)), int(max(u, v))) for u, v in graph.edges()))
    return canonical


# --------------------------------------------------------------------------------------------
# matrix helpers


def _check_simple(graph: nx.Graph) -> None:
    """Raise unless ``graph`` is an undirected simple graph with nodes ``0 .. N-1``."""
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise GraphError(f"expected an undirected simple networkx.Graph, got {type(graph).__name__}")
    if set(graph.nodes) != set(range(graph.number_of_nodes())):
        raise GraphError("graph nodes must be the integers 0 .. N-1 (agent i is node i)")
    if nx.number_of_selfloops(graph):
        raise GraphError("graph has self loops; self weights belong on the mixing matrix diagonal")


def _adjacency(graph: nx.Graph) -> np.ndarray:
    """``(N, N)`` float64 0/1 adjacency matrix of a checked simple graph."""
    _check_simple(graph)
    return nx.to_numpy_array(graph, nodelist=range(graph.number_of_nodes()), dtype=np.float64, weight=None)


def laplacian_spectrum(adj: np.ndarray) -> np.ndarray:
    """Eigenvalues of the Laplacian ``diag(degree) - adj`` of a symmetric adjacency matrix, ascending."""
    return np.linalg.eigvalsh(np.diag(adj.sum(axis=1)) - adj)


def _algebraic_connectivity(adj: np.ndarray) -> float:
    """Second smallest eigenvalue λ₂ of the Laplacian ``diag(degree) - adj`` (needs N >= 2)."""
    return float(laplacian_spectrum(adj)[1])


def _as_square(w: np.ndarray, n: int) -> np.ndarray:
    """``w`` as a float64 array, checked to be ``(n, n)`` and finite."""
    w = np.asarray(w, dtype=np.float64)
    if w.shape != (n, n):
        raise GraphError(
            f"mixing matrix has shape {w.shape}, but the graph has {n} agents; expected ({n}, {n})"
        )
    if not np.all(np.isfinite(w)):
        i, j = np.argwhere(~np.isfinite(w))[0]
        raise GraphError(f"mixing matrix has a non-finite entry {w[i, j]} at ({i}, {j})")
    return w


def _check_entries(w: np.ndarray, adj: np.ndarray, label: str, atol: float) -> None:
    """Raise on negative entries and on non-zero weights between non-neighbours."""
    negative = np.argwhere(w < -atol)
    if negative.size:
        i, j = negative[0]
        raise GraphError(
            f"{label} has a negative entry {w[i, j]:.6g} at ({i}, {j}) ({len(negative)} negative in all); "
            f"mixing weights must be non-negative"
        )
    off_graph = (w != 0) & (adj == 0)
    np.fill_diagonal(off_graph, False)
    bad = np.argwhere(off_graph)
    if bad.size:
        i, j = bad[0]
        raise GraphError(
            f"{label} has weight {w[i, j]:.6g} at ({i}, {j}), but agents {i} and {j} are not neighbours "
            f"in the graph ({len(bad)} such entries); weights off the graph must be exactly 0"
        )


def _doubly_stochastic_problems(
    w: np.ndarray, adj: np.ndarray, label: str, atol: float, *, average: bool
) -> list[str]:
    """Messages for asymmetry and column sums off 1 (rows are already known to sum to 1).

    ``average`` marks the 'average' rule, whose consensus weights are known: degree + 1.
    """
    problems = []
    asymmetry = np.abs(w - w.T)
    if asymmetry.max() > atol:
        i, j = np.unravel_index(np.argmax(asymmetry), w.shape)
        problems.append(
            f"{label} is not symmetric: |W[{i}, {j}] - W[{j}, {i}]| = {asymmetry[i, j]:.3g}; "
            f"algorithms analysed for symmetric mixing may lose their guarantees"
        )
    column_sums = w.sum(axis=0)
    if np.abs(column_sums - 1.0).max() > atol:
        degree = adj.sum(axis=1)
        where = " on this irregular graph" if degree.min() != degree.max() else ""
        bias = (
            "consensus will be biased toward high-degree agents (weights proportional to degree + 1)"
            if average
            else "consensus converges to a weighted, not the plain, mean of the agents' values"
        )
        problems.append(
            f"{label} is not doubly stochastic{where}: column sums range "
            f"{column_sums.min():.3g}..{column_sums.max():.3g}; {bias}"
        )
    return problems


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


# --------------------------------------------------------------------------------------------
# parameter checks


def _check_choice(field: str, what: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise a ConfigError listing ``allowed`` when ``value`` is not one of them."""
    if value not in allowed:
        raise ConfigError(field, f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")


def _check_params_used(kind: str, values: dict[str, object]) -> None:
    """Raise when a parameter is given to a graph kind that does not use it."""
    for name, value in values.items():
        if value is not None and kind not in PARAM_USERS[name]:
            users = " and ".join(f"'{u}'" for u in PARAM_USERS[name])
            raise ConfigError(f"topology.{name}", f"{name} is only used by graph {users}, not '{kind}'")


def _check_min_agents(kind: str, n: int) -> None:
    """Raise when ``kind`` cannot be built on ``n`` agents."""
    minimum = _MIN_AGENTS.get(kind, 2)
    if n < minimum:
        hint = {
            1: "; a single agent (central training) needs graph 'complete'",
            2: "; with 2 agents use 'path' or 'complete'",
        }.get(n, "")
        raise ConfigError(
            "topology.agents", f"graph '{kind}' needs at least {minimum} agents, got {n}{hint}"
        )


def _required(field: str, value: object, kind: str, meaning: str) -> object:
    """``value``, or a ConfigError saying that ``kind`` needs it."""
    if value is None:
        name = field.rsplit(".", 1)[-1]
        raise ConfigError(field, f"graph '{kind}' needs {name}, {meaning}")
    return value


def _require_int(field: str, value: object, *, minimum: int) -> int:
    """``value`` as an int, checked to be an integer (not a bool) and >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {value}")
    return int(value)


def _require_real(
    field: str, value: object, kind: str, meaning: str, *, low: float, high: float | None
) -> float:
    """``value`` as a float in ``(low, high]`` (``(low, inf)`` when ``high`` is None)."""
    value = _required(field, value, kind, meaning)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(field, f"{meaning} must be a number, got {value!r}")
    interval = f"({low:g}, {high:g}]" if high is not None else f"({low:g}, inf)"
    if not (value > low and (high is None or value <= high)):
        raise ConfigError(field, f"{meaning} must be in {interval}, got {value!r}")
    return float(value)
