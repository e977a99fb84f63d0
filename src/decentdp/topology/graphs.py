"""Communication graphs: the graph kinds a config can name, their parameters, and their construction.

Every graph has nodes ``0 .. N-1``; agent ``i`` is node ``i``."""

from __future__ import annotations

from collections.abc import Callable
from math import isqrt

import networkx as nx
import numpy as np
from scipy.sparse.csgraph import connected_components
from scipy.spatial.distance import pdist, squareform

from decentdp.errors import ConfigError, GraphError
from decentdp.topology.checks import _algebraic_connectivity, _check_choice, _require_int, _require_real, _required

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
          A grid needs at least 2 rows and 2 columns (one row is a ``path``); a torus wraps both
          directions and needs at least 3 rows and 3 columns so it is 4-regular.
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
        after this many draws a :class:`GraphError` is raised. A Python-API argument only: a
        config cannot set it, so the error names the config field to change instead.

    Returns
    -------
    networkx.Graph
        Undirected simple graph with integer nodes ``0 .. n_agents-1`` inserted in order.
        Geometric kinds store node positions as node attribute ``"pos"`` and the radius used as
        graph attribute ``"radius"``; except a ``fiedler`` target that only the complete graph
        meets (1, or within ``fiedler_tol`` of 1 and above what any other graph reaches), which
        returns the plain complete graph, without positions or radius.

    Raises
    ------
    ConfigError
        For an unknown kind, an invalid parameter, or parameters no graph of ``kind`` on
        ``n_agents`` satisfies (:func:`check_graph_params`; the error's field names the parameter).
    GraphError
        When no connected draw (or no draw hitting the Fiedler target) is found in ``max_tries``;
        its ``field`` names the config parameter to change (``topology.p``, ``topology.radius``,
        ``topology.k``, ``topology.fiedler``).
    """
    check_graph_params(kind, n_agents, p=p, radius=radius, k=k, fiedler=fiedler, fiedler_tol=fiedler_tol, rows=rows)
    n = int(n_agents)
    _require_int("experiment.seed", seed, minimum=0)
    max_tries = _require_int("max_tries", max_tries, minimum=1)
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
        chords = nx.gnp_random_graph(n, p, seed=int(rng.integers(2**32)))
        graph = nx.compose(nx.cycle_graph(n), chords)
    elif kind == "erdos-renyi":
        graph = _connected_draw(
            lambda s: nx.gnp_random_graph(n, p, seed=s),
            rng,
            max_tries,
            "topology.p",
            f"no connected erdos-renyi graph with n_agents={n}, p={p:g} in {max_tries} draws; "
            f"p is too small for a connected draw: raise it (connectivity needs roughly p > ln(N)/N = "
            f"{np.log(n) / n:.3g})",
        )
    elif kind == "geometric":
        graph = _connected_draw(
            lambda s: _geometric_graph(np.random.default_rng(s).random((n, 2)), radius),
            rng,
            max_tries,
            "topology.radius",
            f"no connected geometric graph with n_agents={n}, radius={radius:g} in {max_tries} "
            f"draws; the radius is too small for a connected draw: raise it",
        )
    elif kind == "fiedler":
        graph = _fiedler_graph(n, float(fiedler), float(fiedler_tol), rng, max_tries)  # type: ignore[arg-type]
    else:
        graph = _k_regular(n, int(k), rng, max_tries)  # type: ignore[arg-type]
    return _canonical(graph)


def check_graph_params(
    kind: str,
    n_agents: int,
    *,
    p: float | None = None,
    radius: float | None = None,
    k: int | None = None,
    fiedler: float | None = None,
    fiedler_tol: float = 0.01,
    rows: int | None = None,
) -> None:
    """Raise the :class:`ConfigError` that :func:`make_graph` raises for these parameters, drawing no graph.

    Every check that does not depend on the random draw: the kind, the agent count (and each kind's
    minimum), parameters given to a kind that does not use them, their ranges, the lattice shape
    (``rows`` dividing ``n_agents``, at least 2x2 for a grid and 3x3 for a torus), the degree of a
    ``k``-regular graph (below ``n_agents``, ``n_agents * k`` even, no perfect matching) and the
    reach of a Fiedler target (at most ``(N - 2) / N`` unless only the complete graph meets it).
    It takes microseconds, so config validation runs it; whether a random search finds a connected
    draw (or one on the Fiedler target) only the search can say (:class:`GraphError` from
    :func:`make_graph`, which ``decentdp run --dry-run`` builds).
    """
    _check_choice("topology.graph", "graph", kind, GRAPH_KINDS)
    n = _require_int("topology.agents", n_agents, minimum=1)
    _check_params_used(kind, {"p": p, "radius": radius, "k": k, "fiedler": fiedler, "rows": rows})
    _check_min_agents(kind, n)
    # checked for every kind, though only ``fiedler`` reads it: a bad value is a mistake wherever it is passed
    tol = _require_real("topology.fiedler_tol", fiedler_tol, kind, "the Fiedler tolerance", low=0.0, high=1.0)
    if kind in ("grid", "torus"):
        _lattice_shape(kind, n, rows)
    elif kind == "partial-mesh":
        _require_real("topology.p", p, kind, "the probability of each non-ring link", low=0.0, high=1.0)
    elif kind == "erdos-renyi":
        _require_real("topology.p", p, kind, "the edge probability", low=0.0, high=1.0)
    elif kind == "geometric":
        _require_real("topology.radius", radius, kind, "the link radius", low=0.0, high=None)
    elif kind == "fiedler":
        target = _require_real(
            "topology.fiedler", fiedler, kind, "the target normalized Fiedler value", low=0.0, high=1.0
        )
        _only_complete_meets(n, target, tol)
    elif kind == "k-regular":
        _check_degree(n, k)


# --------------------------------------------------------------------------------------------
# graph construction helpers


def _lattice(kind: str, n: int, rows: int | None) -> nx.Graph:
    """Grid or torus on ``n`` agents, relabelled row-major to ``0 .. n-1``."""
    rows, cols = _lattice_shape(kind, n, rows)
    lattice = nx.grid_2d_graph(rows, cols, periodic=kind == "torus")
    return nx.relabel_nodes(lattice, {(r, c): r * cols + c for r, c in lattice.nodes})


def _lattice_shape(kind: str, n: int, rows: int | None) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols = n``: the given rows or the most square factorisation.

    Raises a ConfigError naming ``topology.rows`` (when given) or ``topology.agents`` for a shape
    thinner than the kind allows: 2x2 for a grid (one row is a path), 3x3 for a torus.
    """
    field = "topology.agents" if rows is None else "topology.rows"
    if rows is None:
        rows = _most_square_rows(n)
        if rows == 1:
            raise ConfigError(
                "topology.agents",
                f"a {kind} needs n_agents = rows * cols with rows, cols >= 2, and {n} is prime; "
                f"choose a composite n_agents (one row is graph 'path')",
            )
    else:
        rows = _require_int("topology.rows", rows, minimum=1)
        if n % rows:
            raise ConfigError(
                "topology.rows",
                f"rows={rows} does not divide n_agents={n}; a {kind} needs n_agents = rows * cols",
            )
    cols = n // rows
    if kind == "torus" and min(rows, cols) < _TORUS_MIN_SIDE:
        raise ConfigError(
            field,
            f"a torus needs at least {_TORUS_MIN_SIDE} rows and {_TORUS_MIN_SIDE} columns so that it "
            f"is 4-regular; {rows}x{cols} is too thin for n_agents={n}",
        )
    if min(rows, cols) < 2:
        raise ConfigError(
            field,
            f"a {kind} needs rows, cols >= 2, and rows={rows} gives {rows}x{cols}, a path: use graph 'path' "
            f"or a rows that leaves at least 2 columns",
        )
    return rows, cols


def _most_square_rows(n: int) -> int:
    """Largest divisor of ``n`` not above its square root."""
    return max(r for r in range(1, isqrt(n) + 1) if n % r == 0)


def _k_regular(n: int, k: int, rng: np.random.Generator, max_tries: int) -> nx.Graph:
    """Uniformly random connected ``k``-regular graph, redrawn until connected (``k`` checked by
    :func:`_check_degree`)."""
    return _connected_draw(
        lambda s: nx.random_regular_graph(k, n, seed=s),
        rng,
        max_tries,
        "topology.k",
        f"no connected {k}-regular graph on {n} agents in {max_tries} draws; raise k",
    )


def _check_degree(n: int, k: int | None) -> int:
    """``k`` as an int, checked to give a connected ``k``-regular graph on ``n`` agents."""
    k = _require_int("topology.k", _required("topology.k", k, "k-regular", "the degree k"), minimum=1)
    if k >= n:
        raise ConfigError("topology.k", f"degree k={k} must be below n_agents={n}")
    if (n * k) % 2:
        raise ConfigError("topology.k", f"n_agents * k must be even for a k-regular graph, got {n} * {k}")
    if k == 1 and n > 2:
        raise ConfigError(
            "topology.k", f"k=1 gives a perfect matching, which is disconnected for n_agents={n} > 2"
        )
    return k


def _connected_draw(
    draw: Callable[[int], nx.Graph], rng: np.random.Generator, max_tries: int, field: str, failure: str
) -> nx.Graph:
    """Call ``draw`` with seeds from ``rng`` until it returns a connected graph; else a GraphError
    naming ``field``, the config parameter to change."""
    for _ in range(max_tries):
        graph = draw(int(rng.integers(2**32)))
        if nx.is_connected(graph):
            return graph
    raise GraphError(failure, field=field)


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
    if _only_complete_meets(n, target, tol):
        return nx.complete_graph(n)
    for _ in range(max_tries):
        positions = rng.random((n, 2))
        radius = _radius_for_fiedler(positions, target, tol)
        if radius is not None:
            return _geometric_graph(positions, radius)
    raise GraphError(
        f"no geometric graph on {n} agents with normalized Fiedler value within {tol:g} of {target:g} "
        f"in {max_tries} position draws; the values reachable with few agents are discrete, so "
        f"change the target or loosen topology.fiedler_tol",
        field="topology.fiedler",
    )


def _only_complete_meets(n: int, target: float, tol: float) -> bool:
    """Whether only the complete graph meets the Fiedler target ``target +- tol`` on ``n`` agents;
    a ConfigError naming ``topology.fiedler`` when no graph does."""
    # Every non-complete graph has λ₂ <= vertex connectivity <= N - 2 (Fiedler, 1973).
    ceiling = (n - 2) / n
    if target == 1.0 or (target - tol > ceiling and 1.0 - target <= tol):
        return True
    if target - tol > ceiling:
        raise ConfigError(
            "topology.fiedler",
            f"normalized Fiedler value {target:g} +- {tol:g} is unreachable with {n} agents: the "
            f"complete graph has 1 and every other graph at most (N-2)/N = {ceiling:.3g}",
        )
    return False


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
