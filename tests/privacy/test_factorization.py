"""MAFALDA-SGD's factorization (privacy/factorization.py): the workload's Gram in closed form, the optimiser's
constraints, and that it beats independent noise and the authors' uncorrected objective."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import scipy.linalg

from decentdp.privacy import factorization as mf
from decentdp.topology.mixing import mixing_matrix


def _w(n: int, seed: int, kind: str = "metropolis-hastings") -> np.ndarray:
    graph = nx.connected_watts_strogatz_graph(n, 4, 0.3, seed=seed) if n > 4 else nx.cycle_graph(n)
    return mixing_matrix(graph, kind)


@pytest.mark.parametrize(("n", "rounds", "offset", "kind"), [
    (6, 7, 1, "metropolis-hastings"), (9, 5, 0, "metropolis-hastings"), (7, 6, 1, "average"), (4, 9, 0, "average")])
def test_the_closed_form_gram_is_the_explicit_workloads(n: int, rounds: int, offset: int, kind: str) -> None:
    """G = sum_i A_i^T A_i of the explicit nT x nT workload (symmetric W by eigenvalues, others by powers)."""
    w = _w(n, n + rounds, kind)
    np.testing.assert_allclose(mf.workload_gram(w, rounds, offset), mf.explicit_workload_gram(w, rounds, offset),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("rounds", "period"), [(12, 1), (12, 3), (13, 4), (10, 10)])
def test_the_optimised_factor_is_lower_triangular_masked_of_sensitivity_one_and_beats_independent_noise(
        rounds: int, period: int) -> None:
    gram = mf.workload_gram(_w(8, period), rounds)
    result = mf.factorize(gram, period)
    c = result.c
    assert np.array_equal(c, np.tril(c))
    np.testing.assert_allclose(c @ result.c_inverse, np.eye(rounds), atol=1e-9)
    x = c.T @ c
    classes = np.arange(rounds) % period
    same = (classes[:, None] == classes[None, :]) & ~np.eye(rounds, dtype=bool)
    assert np.abs(x[same]).max(initial=0.0) <= 1e-12 * np.abs(x).max()     # the mask: no within-class correlation
    np.testing.assert_allclose(np.bincount(classes, weights=np.diag(x)), 1.0, rtol=1e-12)  # each class's sum is 1
    assert result.sensitivity == pytest.approx(1.0, abs=1e-12)
    assert result.loss == pytest.approx(mf.noise_loss(gram, x), rel=1e-10)
    assert result.loss <= result.independent_loss * (1 + 1e-12)
    if period < rounds:
        assert result.loss < 0.95 * result.independent_loss
    independent = mf.factorize(gram, period, max_iterations=0)
    np.testing.assert_allclose(independent.c, np.diag(np.diag(independent.c)))
    assert independent.loss == pytest.approx(independent.independent_loss)


def test_the_corrected_objective_beats_the_authors_on_the_true_noise() -> None:
    """The authors' code minimises tr(X^{-1} L^T L), L = chol(P G P) (optimal_factorization.py:114-122), which is
    not tr(G X^{-1}) for a decentralized workload: its optimum carries more noise than ours."""
    rounds, period = 12, 3
    gram = mf.workload_gram(mixing_matrix(nx.cycle_graph(8)), rounds)
    flipped = np.linalg.cholesky(gram[::-1, ::-1])
    theirs, _ = mf.optimal_gram(flipped.T @ flipped, period, max_iterations=400)
    ours = mf.factorize(gram, period, max_iterations=400)
    assert not np.allclose(flipped.T @ flipped, gram)
    assert ours.loss < mf.noise_loss(gram, theirs) * (1 - 1e-4)


def test_the_factorization_is_deterministic_and_cached() -> None:
    w = _w(10, 1)
    first = mf.run_factorization(w, 20, 4)
    assert mf.run_factorization(w.copy(), 20, 4) is first
    again = mf.factorize(mf.workload_gram(w, 20), 4)
    assert np.array_equal(again.c, first.c)
    assert scipy.linalg.norm(first.c_inverse @ first.c - np.eye(20)) < 1e-9


@pytest.mark.parametrize(("rounds", "period", "bands"), [(12, 4, 2), (12, 4, 4), (13, 3, 5), (10, 10, 3)])
def test_a_banded_factor_keeps_its_bands_the_constraints_and_lies_between_independent_and_dense_noise(
        rounds: int, period: int, bands: int) -> None:
    """A C of k diagonals (BandMF): C and C^T C vanish k or more rounds apart, sens(C) = 1 under the same mask,
    and its noise lies between independent noise's and the dense optimum's (the dense problem has more freedom;
    both optimisers start from independent noise)."""
    gram = mf.workload_gram(_w(8, rounds), rounds)
    banded = mf.factorize(gram, period, max_iterations=400, bands=bands)
    dense = mf.factorize(gram, period, max_iterations=400)
    c = banded.c
    assert banded.bands == bands and dense.bands == rounds
    assert np.array_equal(c, np.tril(c)) and np.count_nonzero(np.tril(c, -bands)) == 0
    assert np.count_nonzero(np.diag(c, -(bands - 1)))
    x = c.T @ c
    classes = np.arange(rounds) % period
    same = (classes[:, None] == classes[None, :]) & ~np.eye(rounds, dtype=bool)
    assert np.abs(x[same]).max(initial=0.0) <= 1e-12 * np.abs(x).max()
    assert banded.sensitivity == pytest.approx(1.0, abs=1e-12)
    assert dense.loss * (1 - 1e-6) <= banded.loss <= banded.independent_loss * (1 + 1e-12)
    full = mf.factorize(gram, period, max_iterations=400, bands=rounds + 3)
    assert full.bands == rounds and np.array_equal(full.c, dense.c)
