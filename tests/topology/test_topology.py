"""Tests of decentdp.topology: graph construction, mixing matrices, validation and reports."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decentdp.errors import ConfigError, GraphError
from decentdp.topology import (
    GRAPH_KINDS,
    GRAPH_PARAMS,
    MIXING_KINDS,
    GraphReport,
    Topology,
    build_topology,
    check_connected,
    check_graph_params,
    describe,
    make_graph,
    mixing_matrix,
    topology_from_matrix,
    validate_mixing,
)

# Parameters that build every graph kind on 12 agents.
KIND_PARAMS: dict[str, dict[str, float | int]] = {
    "complete": {},
    "ring": {},
    "star": {},
    "path": {},
    "grid": {},
    "torus": {},
    "erdos-renyi": {"p": 0.3},
    "geometric": {"radius": 0.45},
    "fiedler": {"fiedler": 0.39},
    "complete-bipartite": {},
    "k-regular": {"k": 3},
    "two-star": {},
    "tree": {},
    "partial-mesh": {"p": 0.2},
}
RANDOM_KINDS = ("erdos-renyi", "geometric", "fiedler", "k-regular")
DOUBLY_STOCHASTIC_MIXINGS = ("metropolis-hastings", "max-degree")
ATOL = 1e-12


def assert_valid_doubly_stochastic(w: np.ndarray, graph: nx.Graph) -> None:
    """Non-negative, symmetric, rows and columns summing to 1, zero between non-neighbours."""
    n = graph.number_of_nodes()
    assert w.shape == (n, n) and w.dtype == np.float64
    assert np.all(w >= 0)
    np.testing.assert_allclose(w, w.T, atol=ATOL)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=ATOL)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=ATOL)
    adjacency = nx.to_numpy_array(graph, nodelist=range(n), weight=None)
    off_graph = (adjacency == 0) & ~np.eye(n, dtype=bool)
    assert np.all(w[off_graph] == 0)
    assert np.all(w[adjacency == 1] > 0)


def block_diagonal_matrix() -> np.ndarray:
    """Doubly stochastic matrix of two disconnected pairs of agents."""
    half = np.full((2, 2), 0.5)
    return np.block([[half, np.zeros((2, 2))], [np.zeros((2, 2)), half]])


def test_kind_tables_cover_every_graph_kind() -> None:
    assert set(KIND_PARAMS) == set(GRAPH_KINDS)
    assert MIXING_KINDS == ("metropolis-hastings", "average", "max-degree")


@pytest.mark.parametrize("kind", GRAPH_KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kind_gives_a_connected_graph_on_agents_0_to_n(kind: str, seed: int) -> None:
    graph = make_graph(kind, 12, seed=seed, **KIND_PARAMS[kind])
    assert list(graph.nodes) == list(range(12))
    assert all(type(v) is int for v in graph.nodes)
    assert nx.is_connected(graph)
    assert nx.number_of_selfloops(graph) == 0


@pytest.mark.parametrize("kind", GRAPH_KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mixing", DOUBLY_STOCHASTIC_MIXINGS)
def test_mh_and_max_degree_are_doubly_stochastic_on_every_kind(kind: str, seed: int, mixing: str) -> None:
    graph = make_graph(kind, 12, seed=seed, **KIND_PARAMS[kind])
    w = mixing_matrix(graph, mixing)
    assert_valid_doubly_stochastic(w, graph)
    assert validate_mixing(w, graph) == []


@st.composite
def arbitrary_graphs(draw: st.DrawFn) -> nx.Graph:
    """Any simple graph on 1..12 nodes, including disconnected ones and isolated nodes."""
    n = draw(st.integers(1, 12))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    present = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    graph = nx.empty_graph(n)
    graph.add_edges_from(pair for pair, keep in zip(pairs, present, strict=True) if keep)
    return graph


@settings(max_examples=150, deadline=None)
@given(graph=arbitrary_graphs(), mixing=st.sampled_from(DOUBLY_STOCHASTIC_MIXINGS))
def test_mh_and_max_degree_are_doubly_stochastic_on_any_graph(graph: nx.Graph, mixing: str) -> None:
    w = mixing_matrix(graph, mixing)
    assert_valid_doubly_stochastic(w, graph)
    assert validate_mixing(w, graph) == []


@settings(max_examples=100, deadline=None)
@given(graph=arbitrary_graphs())
def test_average_is_row_stochastic_and_flagged_unless_every_component_is_regular(graph: nx.Graph) -> None:
    w = mixing_matrix(graph, "average")
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=ATOL)
    # (A + I) / (d + 1) is symmetric, hence doubly stochastic, iff neighbours share their degree.
    regular = all(
        len({graph.degree[v] for v in component}) == 1 for component in nx.connected_components(graph)
    )
    warnings = validate_mixing(w, graph, require_doubly_stochastic=False, kind="average")
    assert (warnings == []) == regular


def test_mixing_weights_match_their_formulas_on_a_star() -> None:
    graph = make_graph("star", 5)  # hub 0 with degree 4, leaves with degree 1
    mh = mixing_matrix(graph, "metropolis-hastings")
    assert mh[0, 1] == pytest.approx(1 / 5) and mh[1, 1] == pytest.approx(4 / 5)
    assert mh[0, 0] == pytest.approx(1 - 4 / 5)
    average = mixing_matrix(graph, "average")
    assert average[0, 1] == pytest.approx(1 / 5) and average[1, 0] == pytest.approx(1 / 2)
    max_degree = mixing_matrix(graph, "max-degree")
    assert max_degree[1, 0] == pytest.approx(1 / 5) and max_degree[1, 1] == pytest.approx(1 - 1 / 5)


def test_average_on_a_star_is_flagged_but_accepted() -> None:
    topology = build_topology("star", 6, mixing="average")
    assert topology.warnings
    joined = " ".join(topology.warnings)
    assert "not doubly stochastic" in joined and "high-degree" in joined and "'average'" in joined
    np.testing.assert_allclose(topology.mixing.sum(axis=1), 1.0)


def test_average_on_a_star_is_rejected_when_doubly_stochastic_is_required() -> None:
    with pytest.raises(GraphError, match="not doubly stochastic"):
        build_topology("star", 6, mixing="average", require_doubly_stochastic=True)


def test_average_on_a_ring_is_not_flagged() -> None:
    topology = build_topology("ring", 8, mixing="average")
    assert topology.warnings == ()
    np.testing.assert_allclose(topology.mixing, topology.mixing.T)
    np.testing.assert_allclose(topology.mixing[0, [7, 0, 1]], 1 / 3)


@pytest.mark.parametrize("target", [0.06, 0.39, 0.7])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fiedler_graphs_hit_their_target(target: float, seed: int) -> None:
    topology = build_topology("fiedler", 10, fiedler=target, seed=seed)
    assert abs(topology.report.normalized_fiedler - target) <= 0.01 + 1e-12
    assert nx.is_connected(topology.graph)
    assert 0 < topology.graph.graph["radius"] <= np.sqrt(2)


def test_fiedler_graph_respects_a_custom_tolerance() -> None:
    topology = build_topology("fiedler", 20, fiedler=0.2, fiedler_tol=0.002, seed=5)
    assert abs(topology.report.normalized_fiedler - 0.2) <= 0.002 + 1e-12


def test_fiedler_target_one_gives_the_complete_graph() -> None:
    graph = make_graph("fiedler", 10, fiedler=1.0)
    assert graph.number_of_edges() == 45


def test_unreachable_fiedler_target_is_rejected_before_searching() -> None:
    # With 10 agents every non-complete graph has lambda_2 / N <= 0.8.
    with pytest.raises(ConfigError, match="unreachable") as info:
        make_graph("fiedler", 10, fiedler=0.9)
    assert info.value.field == "topology.fiedler"


def test_fiedler_search_gives_up_after_max_tries() -> None:
    # Reachable in principle, but a tolerance this tight is not met in two position draws.
    with pytest.raises(GraphError, match="2 position draws"):
        make_graph("fiedler", 10, fiedler=0.123456, fiedler_tol=1e-9, max_tries=2)


@pytest.mark.parametrize("n", [2, 5, 10, 30])
def test_complete_graph_has_normalized_fiedler_one_and_unit_spectral_gap(n: int) -> None:
    report = build_topology("complete", n).report
    assert report.normalized_fiedler == pytest.approx(1.0)
    assert report.fiedler == pytest.approx(n)
    assert report.spectral_gap == pytest.approx(1.0)


def test_ring_report_matches_closed_form() -> None:
    n = 10
    report = build_topology("ring", n).report
    assert report.fiedler == pytest.approx(2 * (1 - np.cos(2 * np.pi / n)))
    # Metropolis-Hastings on a ring is (I + A) / 3, with eigenvalues (1 + 2 cos(2 pi k / n)) / 3.
    slem = max(abs(1 + 2 * np.cos(2 * np.pi * k / n)) / 3 for k in range(1, n))
    assert report.spectral_gap == pytest.approx(1 - slem)
    assert (report.n_edges, report.min_degree, report.max_degree, report.mean_degree) == (10, 2, 2, 2.0)


def test_report_of_a_star() -> None:
    report = build_topology("star", 5).report
    assert isinstance(report, GraphReport)
    assert (report.n_agents, report.n_edges, report.min_degree, report.max_degree) == (5, 4, 1, 4)
    assert report.mean_degree == pytest.approx(1.6)
    assert report.fiedler == pytest.approx(1.0)  # the star's algebraic connectivity is 1
    as_dict = report.as_dict()
    assert set(as_dict) == {
        "n_agents",
        "n_edges",
        "min_degree",
        "max_degree",
        "mean_degree",
        "fiedler",
        "normalized_fiedler",
        "spectral_gap",
    }
    assert as_dict["normalized_fiedler"] == pytest.approx(0.2)


def test_single_agent_is_a_complete_graph_with_identity_mixing() -> None:
    topology = build_topology("complete", 1)
    assert topology.n_agents == 1
    np.testing.assert_array_equal(topology.mixing, [[1.0]])
    assert topology.edges().shape == (0, 2) and topology.edges().dtype == np.int64
    assert topology.report.normalized_fiedler == 1.0 and topology.report.spectral_gap == 1.0


@pytest.mark.parametrize("kind", [k for k in GRAPH_KINDS if k != "complete"])
def test_single_agent_is_rejected_for_other_kinds(kind: str) -> None:
    with pytest.raises(ConfigError, match="single agent") as info:
        make_graph(kind, 1, **KIND_PARAMS[kind])
    assert info.value.field == "topology.agents"


def test_ring_needs_three_agents() -> None:
    with pytest.raises(ConfigError, match="'path' or 'complete'") as info:
        make_graph("ring", 2)
    assert info.value.field == "topology.agents"


def test_disconnected_matrix_is_rejected() -> None:
    with pytest.raises(GraphError, match="disconnected: 2 components"):
        topology_from_matrix(block_diagonal_matrix())


def test_check_connected_lists_component_sizes() -> None:
    graph = nx.disjoint_union_all([nx.path_graph(5), nx.path_graph(3), nx.path_graph(2)])
    with pytest.raises(GraphError, match=r"3 components \(sizes 5, 3, 2\)"):
        check_connected(graph)
    check_connected(nx.path_graph(4))  # connected: no error


def test_non_stochastic_matrix_is_rejected_naming_the_row() -> None:
    w = mixing_matrix(nx.cycle_graph(4))
    w[1, 1] += 0.1
    with pytest.raises(GraphError, match=r"row 1 sums to 1\.1"):
        topology_from_matrix(w)


def test_negative_entry_is_rejected() -> None:
    w = np.array([[0.5, 0.5, 0.0], [0.5, 0.7, -0.2], [0.0, -0.2, 1.2]])
    with pytest.raises(GraphError, match=r"negative entry -0\.2 at \(1, 2\)"):
        topology_from_matrix(w)


def test_entry_off_the_graph_is_rejected_naming_the_pair() -> None:
    graph = nx.path_graph(3)
    w = np.full((3, 3), 1 / 3)  # doubly stochastic, but 0 and 2 are not neighbours
    with pytest.raises(GraphError, match=r"at \(0, 2\).*not neighbours"):
        validate_mixing(w, graph)


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (np.eye(3), r"shape \(3, 3\).*4 agents"),
        (np.full((4, 4), np.nan), "non-finite"),
    ],
)
def test_malformed_matrices_are_rejected(w: np.ndarray, message: str) -> None:
    with pytest.raises(GraphError, match=message):
        validate_mixing(w, nx.cycle_graph(4))


def test_asymmetric_but_stochastic_matrix_warns_only_when_allowed() -> None:
    # Directed-cycle averaging on a 3-ring: doubly stochastic but not symmetric.
    w = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])
    with pytest.raises(GraphError, match="not symmetric"):
        topology_from_matrix(w)
    topology = topology_from_matrix(w, require_doubly_stochastic=False)
    assert len(topology.warnings) == 1 and "not symmetric" in topology.warnings[0]
    assert topology.mixing_kind == "custom"


def test_topology_from_matrix_recovers_the_graph() -> None:
    reference = build_topology("grid", 6, seed=3)
    rebuilt = topology_from_matrix(reference.mixing)
    np.testing.assert_array_equal(rebuilt.adjacency(), reference.adjacency())
    assert rebuilt.warnings == ()
    assert rebuilt.report == reference.report


def test_unknown_graph_kind_lists_allowed_names() -> None:
    with pytest.raises(ConfigError) as info:
        make_graph("hypercube", 8)
    assert info.value.field == "topology.graph"
    assert "'hypercube'" in info.value.message
    assert all(kind in info.value.message for kind in GRAPH_KINDS)


def test_unknown_mixing_kind_lists_allowed_names() -> None:
    with pytest.raises(ConfigError) as info:
        build_topology("ring", 8, mixing="laplacian")
    assert info.value.field == "topology.mixing"
    assert all(kind in info.value.message for kind in MIXING_KINDS)


def test_unknown_graph_parameter_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        build_topology("erdos-renyi", 8, probability=0.5)
    assert info.value.field == "topology.probability"
    assert all(name in info.value.message for name in GRAPH_PARAMS)


@pytest.mark.parametrize(
    ("kind", "n", "params", "field"),
    [
        ("ring", 0, {}, "topology.agents"),
        ("ring", 5.0, {}, "topology.agents"),
        ("ring", 5, {"seed": -1}, "experiment.seed"),
        ("erdos-renyi", 8, {"p": 0.5, "max_tries": 0}, "max_tries"),  # (a Python-API argument, no config field)
        ("erdos-renyi", 8, {}, "topology.p"),
        ("erdos-renyi", 8, {"p": 0.0}, "topology.p"),
        ("erdos-renyi", 8, {"p": 1.5}, "topology.p"),
        ("erdos-renyi", 8, {"p": True}, "topology.p"),
        ("geometric", 8, {}, "topology.radius"),
        ("geometric", 8, {"radius": -0.1}, "topology.radius"),
        ("fiedler", 8, {}, "topology.fiedler"),
        ("fiedler", 8, {"fiedler": 0.0}, "topology.fiedler"),
        ("fiedler", 8, {"fiedler": 1.2}, "topology.fiedler"),
        ("fiedler", 8, {"fiedler": 0.3, "fiedler_tol": 0.0}, "topology.fiedler_tol"),
        ("ring", 8, {"fiedler_tol": 5.0}, "topology.fiedler_tol"),   # (a review: ignored, so never checked)
        ("erdos-renyi", 8, {"p": 0.5, "fiedler_tol": -5.0}, "topology.fiedler_tol"),
        ("k-regular", 8, {}, "topology.k"),
        ("k-regular", 7, {"k": 3}, "topology.k"),
        ("k-regular", 8, {"k": 8}, "topology.k"),
        ("k-regular", 8, {"k": 1}, "topology.k"),
        ("ring", 8, {"p": 0.5}, "topology.p"),
        ("complete", 8, {"radius": 0.5}, "topology.radius"),
        ("grid", 7, {}, "topology.agents"),
        ("grid", 12, {"rows": 5}, "topology.rows"),
        ("grid", 12, {"rows": 1}, "topology.rows"),  # (1x12 is a path, as a prime count's only shape)
        ("grid", 12, {"rows": 12}, "topology.rows"),
        ("torus", 10, {}, "topology.agents"),
        ("torus", 18, {"rows": 2}, "topology.rows"),
    ],
)
def test_invalid_parameters_raise_config_error_naming_the_field(
    kind: str, n: int, params: dict[str, float], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        make_graph(kind, n, **params)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    if not {"seed", "max_tries"} & set(params):  # the checks config validation runs, drawing nothing, agree
        with pytest.raises(ConfigError) as checked:
            check_graph_params(kind, n, **params)
        assert checked.value.field == field


@pytest.mark.parametrize(
    ("kind", "n", "params", "field"),
    [
        ("erdos-renyi", 10, {"p": 0.05, "max_tries": 20}, "topology.p"),
        ("geometric", 30, {"radius": 0.01, "max_tries": 5}, "topology.radius"),
        ("fiedler", 4, {"fiedler": 0.45, "fiedler_tol": 0.001, "max_tries": 20}, "topology.fiedler"),
        ("k-regular", 60, {"k": 2, "max_tries": 3}, "topology.k"),
    ],
)
def test_a_search_that_gives_up_names_the_config_field_to_change(
    kind: str, n: int, params: dict[str, float], field: str
) -> None:
    """The CLI prints ``field: message``, as for a ConfigError, and advises only what a config can change:
    ``max_tries`` is a Python-API argument (a review: "raise max_tries" was advised to config users)."""
    with pytest.raises(GraphError) as info:
        make_graph(kind, n, **params)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert "max_tries" not in str(info.value)


def test_erdos_renyi_with_tiny_p_gives_up_after_max_tries() -> None:
    with pytest.raises(GraphError, match="p is too small for a connected draw") as info:
        make_graph("erdos-renyi", 30, p=0.001, max_tries=5)
    assert "5 draws" in str(info.value)


def test_geometric_with_tiny_radius_gives_up_after_max_tries() -> None:
    with pytest.raises(GraphError, match="radius is too small"):
        make_graph("geometric", 30, radius=0.01, max_tries=5)


@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_graphs_are_deterministic_per_seed(kind: str) -> None:
    def edges(seed: int) -> list[tuple[int, int]]:
        return sorted(make_graph(kind, 12, seed=seed, **KIND_PARAMS[kind]).edges)

    assert edges(7) == edges(7)
    assert len({tuple(edges(seed)) for seed in range(5)}) > 1


def test_build_topology_is_deterministic_per_seed() -> None:
    first = build_topology("geometric", 15, seed=4, radius=0.5)
    second = build_topology("geometric", 15, seed=4, radius=0.5)
    np.testing.assert_array_equal(first.mixing, second.mixing)
    assert first.report == second.report


@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_edges_are_consistent_with_adjacency(kind: str) -> None:
    topology = build_topology(kind, 12, seed=1, **KIND_PARAMS[kind])
    adjacency = topology.adjacency()
    edges = topology.edges()
    assert adjacency.dtype == np.float64 and set(np.unique(adjacency)) <= {0.0, 1.0}
    assert np.all(np.diag(adjacency) == 0)
    np.testing.assert_array_equal(adjacency, adjacency.T)
    assert edges.dtype == np.int64 and edges.shape == (2 * topology.graph.number_of_edges(), 2)
    assert np.all(edges[:, 0] != edges[:, 1])
    assert [tuple(e) for e in edges] == sorted(tuple(e) for e in edges)
    rebuilt = np.zeros_like(adjacency)
    rebuilt[edges[:, 0], edges[:, 1]] = 1.0
    np.testing.assert_array_equal(rebuilt, adjacency)


@pytest.mark.parametrize(
    ("n", "rows", "shape"),
    [(12, None, (3, 4)), (12, 2, (2, 6)), (16, None, (4, 4)), (6, 3, (3, 2))],
)
def test_grid_sizes_and_row_major_numbering(n: int, rows: int | None, shape: tuple[int, int]) -> None:
    graph = make_graph("grid", n, rows=rows)
    n_rows, n_cols = shape
    assert graph.number_of_edges() == n_rows * (n_cols - 1) + n_cols * (n_rows - 1)
    expected = {(r * n_cols + c, r * n_cols + c + 1) for r in range(n_rows) for c in range(n_cols - 1)} | {
        (r * n_cols + c, (r + 1) * n_cols + c) for r in range(n_rows - 1) for c in range(n_cols)
    }
    assert set(graph.edges) == expected


@pytest.mark.parametrize(("n", "rows", "shape"), [(9, None, (3, 3)), (20, None, (4, 5)), (12, 3, (3, 4))])
def test_torus_sizes_are_four_regular_with_wraparound(
    n: int, rows: int | None, shape: tuple[int, int]
) -> None:
    graph = make_graph("torus", n, rows=rows)
    n_rows, n_cols = shape
    assert graph.number_of_edges() == 2 * n
    assert {d for _, d in graph.degree} == {4}
    assert graph.has_edge(0, n_cols - 1)  # wraps along the first row
    assert graph.has_edge(0, (n_rows - 1) * n_cols)  # wraps along the first column


def test_topology_is_immutable() -> None:
    topology = build_topology("ring", 5)
    assert isinstance(topology, Topology)
    with pytest.raises(ValueError, match="read-only"):
        topology.mixing[0, 0] = 0.0
    with pytest.raises(nx.NetworkXError, match="Frozen"):
        topology.graph.add_edge(0, 2)


def test_mixing_rejects_graphs_not_labelled_0_to_n() -> None:
    with pytest.raises(GraphError, match="0 .. N-1"):
        mixing_matrix(nx.relabel_nodes(nx.path_graph(3), {0: "a", 1: "b", 2: "c"}))
    with pytest.raises(GraphError, match="undirected"):
        mixing_matrix(nx.DiGraph([(0, 1)]))


def test_describe_reports_zero_gap_for_a_disconnected_graph() -> None:
    graph = nx.disjoint_union(nx.path_graph(2), nx.path_graph(2))
    report = describe(graph, block_diagonal_matrix())
    assert report.fiedler == pytest.approx(0.0, abs=1e-12)
    assert report.spectral_gap == pytest.approx(0.0, abs=1e-12)


def test_a_custom_matrix_that_never_reaches_consensus_is_refused() -> None:
    """A zero-diagonal ring of 4 (weights 1/2 to each neighbour) is symmetric, doubly stochastic and connected,
    but has eigenvalue -1: values swap between the two halves forever.  It was accepted with no warning."""
    w = 0.5 * nx.to_numpy_array(nx.cycle_graph(4), nodelist=range(4))
    with pytest.raises(GraphError, match="never reaches consensus"):
        topology_from_matrix(w)
    assert topology_from_matrix((np.eye(4) + w) / 2).report.spectral_gap > 0.4
