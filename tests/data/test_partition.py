"""Tests of the agent data splits: equation (8), cover and determinism properties, parameter validation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from decentdp.data.partition import PARTITIONS, class_histograms, hold_out, overlap_matrix, partition
from decentdp.errors import ConfigError

SCHEME_PARAMS = {
    "iid": {},
    "overlap": {"t": 0.5},
    "dirichlet": {"alpha": 0.5},
    "unequal": {"size_skew": 1.0},
    "pathological": {},
}


def make_labels(n: int, n_classes: int, seed: int = 0) -> np.ndarray:
    """Unbalanced labels: class sizes differ so rounding is exercised."""
    rng = np.random.default_rng(seed)
    return rng.choice(n_classes, size=n, p=np.arange(1, n_classes + 1) / np.arange(1, n_classes + 1).sum())


def expected_a(n_agents: int, n_classes: int, t: float) -> np.ndarray:
    """Equation (8) written entry by entry, independently of the library."""
    a = np.zeros((n_agents, n_classes))
    for j in range(n_classes):
        for i in range(n_agents):
            if i != j % n_agents:
                a[i, j] = (1 - t) / n_agents
        owner = j % n_agents
        a[owner, j] = 1 - sum(a[k, j] for k in range(n_agents) if k != owner)
    return a


@pytest.mark.parametrize("t", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_overlap_matrix_matches_equation_8(t: float) -> None:
    a = overlap_matrix(10, 10, t)
    assert a.shape == (10, 10)
    np.testing.assert_allclose(a, expected_a(10, 10, t), atol=1e-12)
    np.testing.assert_allclose(a.sum(axis=0), 1.0, atol=1e-12)


@pytest.mark.parametrize(("n_agents", "n_classes"), [(4, 10), (10, 4), (3, 3), (1, 5)])
def test_overlap_matrix_other_shapes(n_agents: int, n_classes: int) -> None:
    for t in (0.0, 0.3, 1.0):
        a = overlap_matrix(n_agents, n_classes, t)
        np.testing.assert_allclose(a, expected_a(n_agents, n_classes, t), atol=1e-12)
        np.testing.assert_allclose(a.sum(axis=0), 1.0, atol=1e-12)


def test_overlap_matrix_extremes() -> None:
    np.testing.assert_array_equal(overlap_matrix(10, 10, 1.0), np.eye(10))
    np.testing.assert_allclose(overlap_matrix(10, 10, 0.0), np.full((10, 10), 0.1))


@pytest.mark.parametrize("t", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_overlap_partition_realizes_matrix(t: float) -> None:
    labels = make_labels(3000, 10)
    parts = partition(labels, 10, "overlap", seed=1, t=t)
    hist = class_histograms(labels, parts, 10)
    counts = np.bincount(labels, minlength=10)
    np.testing.assert_array_equal(hist.sum(axis=0), counts)
    fractions = hist / counts
    assert np.all(np.abs(fractions - overlap_matrix(10, 10, t)) <= 1.0 / counts + 1e-12)


def test_overlap_t1_gives_one_class_per_agent() -> None:
    labels = make_labels(2000, 10)
    parts = partition(labels, 10, "overlap", seed=0, t=1.0)
    for i, part in enumerate(parts):
        assert set(np.unique(labels[part])) == {i}


def test_overlap_rounding_ties_are_not_biased() -> None:
    # 3 samples per class over 2 agents at t=0: every class has one leftover sample and a tie; random
    # tie-breaking must not hand it to the same agent every time (which would give sizes 80 / 40).
    labels = np.repeat(np.arange(40), 3)
    parts = partition(labels, 2, "overlap", seed=0, t=0.0)
    assert set(class_histograms(labels, parts, 40).ravel()) == {1, 2}
    assert abs(len(parts[0]) - len(parts[1])) < 30


@settings(max_examples=40, deadline=None)
@given(
    scheme=st.sampled_from(PARTITIONS),
    n_agents=st.integers(1, 12),
    n_classes=st.integers(1, 10),
    seed=st.integers(0, 2**31),
)
def test_disjoint_cover(scheme: str, n_agents: int, n_classes: int, seed: int) -> None:
    labels = make_labels(400, n_classes, seed=seed % 7)
    if scheme == "pathological":  # more agents than classes must be a multiple of them (a ConfigError otherwise)
        assume(n_agents <= n_classes or n_agents % n_classes == 0)
    params = dict(SCHEME_PARAMS[scheme])
    if scheme == "overlap":
        params["t"] = 0.3  # some agents own no class when n_agents > n_classes: t must leave them data
    parts = partition(labels, n_agents, scheme, seed=seed, **params)
    assert len(parts) == n_agents
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0)  # sorted, no duplicates
        assert len(part) >= 1
    merged = np.sort(np.concatenate(parts))
    assert np.all(np.diff(merged) > 0)  # pairwise disjoint
    if scheme == "pathological":  # CGA's split trims every class to the smallest class's size, then covers that
        counts = np.bincount(labels, minlength=n_classes)
        kept = np.bincount(labels[merged], minlength=n_classes)
        np.testing.assert_array_equal(kept, np.full(n_classes, counts.min()))
    else:
        np.testing.assert_array_equal(merged, np.arange(len(labels)))


@pytest.mark.parametrize("scheme", PARTITIONS)
def test_deterministic_per_seed(scheme: str) -> None:
    labels = make_labels(1000, 10)
    a = partition(labels, 8, scheme, seed=3, **SCHEME_PARAMS[scheme])
    b = partition(labels, 8, scheme, seed=3, **SCHEME_PARAMS[scheme])
    c = partition(labels, 8, scheme, seed=4, **SCHEME_PARAMS[scheme])
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_near_equal_sizes() -> None:
    parts = partition(make_labels(1003, 10), 10, "iid", seed=0)
    assert sorted(len(p) for p in parts) == [100] * 7 + [101] * 3


def test_dirichlet_min_size_enforced() -> None:
    labels = make_labels(2000, 10)
    parts = partition(labels, 10, "dirichlet", seed=0, alpha=0.1, min_size=60)
    assert min(len(p) for p in parts) >= 60


def test_dirichlet_unreachable_min_size_suggests_larger_alpha() -> None:
    labels = make_labels(1000, 10)
    with pytest.raises(ConfigError) as info:
        partition(labels, 10, "dirichlet", seed=0, alpha=0.01, min_size=99)
    assert info.value.field == "data.dirichlet_alpha"
    assert "larger alpha" in str(info.value)


def test_dirichlet_small_alpha_is_skewed() -> None:
    labels = make_labels(5000, 10)
    hist = class_histograms(labels, partition(labels, 10, "dirichlet", seed=0, alpha=0.05), 10)
    iid = class_histograms(labels, partition(labels, 10, "iid", seed=0), 10)
    # Fraction of each agent's data in its most common class.
    assert (hist.max(axis=1) / hist.sum(axis=1)).mean() > 2 * (iid.max(axis=1) / iid.sum(axis=1)).mean()


def test_unequal_sizes_vary_and_respect_min_size() -> None:
    labels = make_labels(5000, 10)
    sizes = np.array([len(p) for p in partition(labels, 10, "unequal", seed=0, size_skew=1.5, min_size=50)])
    assert sizes.min() >= 50
    assert sizes.max() > 2 * sizes.min()
    flat = np.array([len(p) for p in partition(labels, 10, "unequal", seed=0, size_skew=0.01)])
    assert flat.max() - flat.min() <= 0.05 * flat.mean()


def test_class_histograms_counts() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    hist = class_histograms(labels, [np.array([0, 1]), np.array([2, 3, 4, 5])], 3)
    np.testing.assert_array_equal(hist, [[1, 1, 0], [0, 1, 3]])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"scheme": "bogus"}, "data.partition"),
        ({"scheme": "overlap"}, "data.overlap_t"),
        ({"scheme": "overlap", "t": -0.1}, "data.overlap_t"),
        ({"scheme": "overlap", "t": 1.5}, "data.overlap_t"),
        ({"scheme": "dirichlet"}, "data.dirichlet_alpha"),
        ({"scheme": "dirichlet", "alpha": 0.0}, "data.dirichlet_alpha"),
        ({"scheme": "dirichlet", "alpha": float("nan")}, "data.dirichlet_alpha"),
        ({"scheme": "unequal"}, "data.size_skew"),
        ({"scheme": "unequal", "size_skew": -1.0}, "data.size_skew"),
        ({"scheme": "iid", "n_agents": 0}, "topology.agents"),
        ({"scheme": "iid", "n_agents": 101}, "topology.agents"),
        ({"scheme": "iid", "n_agents": 10, "min_size": 11}, "topology.agents"),
        ({"scheme": "iid", "min_size": 0}, "min_size"),
        ({"scheme": "iid", "seed": -1}, "experiment.seed"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    args = {"n_agents": 4, "seed": 0} | kwargs
    with pytest.raises(ConfigError) as info:
        partition(make_labels(100, 5), **args)
    assert info.value.field == field


def test_unknown_scheme_lists_allowed() -> None:
    with pytest.raises(ConfigError, match=", ".join(PARTITIONS)):
        partition(make_labels(100, 5), 4, "shards", seed=0)


def test_overlap_agent_without_class_rejected() -> None:
    # t=1 with more agents than classes leaves agents 5..9 with nothing: the field to change is t (or the agents)
    with pytest.raises(ConfigError, match="lower t or use fewer agents") as info:
        partition(make_labels(500, 5), 10, "overlap", seed=0, t=1.0)
    assert info.value.field == "data.overlap_t"


def test_overlap_shares_under_one_record_name_the_agents_not_t() -> None:
    """At t = 0 with more agents than records per class each agent's share of a class is under one record, and
    cutting the classes into whole records left some agent none: the hint said "lower t" at t = 0 (a reviewer);
    the field to change is the number of agents."""
    with pytest.raises(ConfigError, match="under one record of 5 of the 5 classes.*use fewer agents") as info:
        partition(make_labels(500, 5), 300, "overlap", seed=0, t=0.0)
    assert info.value.field == "topology.agents" and "lower t" not in info.value.message


@pytest.mark.parametrize("size_skew", [1000.0, 1e4])
def test_an_overflowing_size_skew_names_size_skew_without_warnings(size_skew: float) -> None:
    """Lognormal weights e^(sigma z) past 1e308 are inf: the sizes came out NaN, numpy warned, and the error blamed
    data.partition for an agent with no record (a reviewer).  Every seed either splits every record or names
    data.size_skew; no RuntimeWarning escapes."""
    labels = np.arange(1000) % 10
    refused = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(20):
            try:
                parts = partition(labels, 3, "unequal", seed=seed, size_skew=size_skew)
            except ConfigError as error:
                assert error.field == "data.size_skew" and "use a smaller size_skew" in error.message
                refused += 1
                continue
            assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    assert refused


def test_a_dirichlet_alpha_numpy_cannot_sample_asks_for_a_smaller_one() -> None:
    """Near 1e308 numpy's Dirichlet sampler returns all-zero proportions; the error said "use a larger alpha"."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="use a smaller alpha") as info:
            partition(np.arange(1000) % 10, 3, "dirichlet", seed=0, alpha=1e308)
    assert info.value.field == "data.dirichlet_alpha" and "larger" not in info.value.message


@pytest.mark.parametrize(("fraction", "records", "held"), [(0.29, 100, 29), (0.57, 100, 57), (0.1, 30, 3),
                                                           (0.2, 7, 1), (0.5, 9, 4)])
def test_the_exact_count_split_holds_out_the_documented_floor(fraction: float, records: int, held: int) -> None:
    """The docs promise floor(fraction * |D_i|) records; int(0.29 * 100) is 28 in floating point."""
    kept, validation = hold_out([np.arange(records)], fraction, seed=0)
    assert len(validation) == held and len(kept[0]) == records - held


@pytest.mark.parametrize(("labels", "n_agents", "empty"), [
    ([0] * 50 + [2] * 50, 2, 1),
    ([0] * 30 + [1] * 30 + [3] * 30, 4, 2),
    ([1] * 40 + [2] * 40, 1, 0),
])
def test_a_pathological_partition_refuses_an_empty_class_by_name(labels, n_agents, empty) -> None:
    """Every class is trimmed to the smallest class's size, so an empty class left every agent with nothing, and
    the message blamed agent 0 (a reviewer); the message names the class instead."""
    with pytest.raises(ConfigError, match=rf"class {empty} has no sample: it needs every class present") as info:
        partition(np.array(labels), n_agents, "pathological", seed=0)
    assert info.value.field == "data.partition"


def test_a_pathological_partition_says_how_many_records_it_trains_on() -> None:
    """CGA's split trims every class to the smallest class's size (a helper's review: 5,790 of MNIST's 60,000
    records dropped without a word); the run's warnings say so, and no such warning comes from a split that
    uses every record."""
    from tests.conftest import tiny_config

    from decentdp.config import validate_config
    from decentdp.experiment.build import build_experiment

    trimmed = build_experiment(validate_config(tiny_config(data={"partition": "pathological"})))
    assert any(f"trains on {sum(len(p) for p in trimmed.data.indices)} of the 1437 training" in line
               for line in trimmed.warnings)
    whole = build_experiment(validate_config(tiny_config(data={"partition": "iid"})))
    assert not any("pathological" in line for line in whole.warnings)


def test_overlap_matrix_rejects_bad_t() -> None:
    with pytest.raises(ConfigError) as info:
        overlap_matrix(10, 10, 2.0)
    assert info.value.field == "data.overlap_t"


def test_bad_labels_rejected() -> None:
    with pytest.raises(ConfigError):
        partition(np.array([0.5, 1.5, 2.0]), 2, "iid", seed=0)
    with pytest.raises(ConfigError):
        partition(np.array([0, -1, 2]), 2, "iid", seed=0)
