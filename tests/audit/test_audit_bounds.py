"""Epsilon lower bounds: Clopper-Pearson intervals against scipy's exact binomial intervals, eq. 25 on
hand-made counts, threshold selection, and the split's input checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from decentdp.audit.bounds import (
    MIN_RUNS_PER_PART,
    audit_bound,
    best_threshold,
    clopper_pearson,
    epsilon_from_counts,
    split_sizes,
)
from decentdp.errors import ConfigError


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_clopper_pearson_matches_scipy_exact_intervals(confidence: float) -> None:
    for n in (1, 7, 50, 1000):
        for k in sorted({0, 1, n // 3, n - 1, n}):
            low, high = clopper_pearson(k, n, confidence)
            exact = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
            assert float(low) == pytest.approx(exact.low, abs=1e-12)
            assert float(high) == pytest.approx(exact.high, abs=1e-12)


def test_clopper_pearson_is_vectorised_and_rejects_impossible_counts() -> None:
    low, high = clopper_pearson(np.array([0, 5, 10]), 10)
    assert low.shape == (3,) and low[0] == 0.0 and high[2] == 1.0
    with pytest.raises(ValueError):
        clopper_pearson(11, 10)


def test_epsilon_of_eq25_on_hand_made_counts() -> None:
    # 900 of 1,000 members and 100 of 1,000 non-members called members, delta = 1e-5
    forward, backward = epsilon_from_counts(900, 1000, 100, 1000, delta=1e-5)
    tpr_low = stats.binomtest(900, 1000).proportion_ci(0.95, "exact").low
    fpr_high = stats.binomtest(100, 1000).proportion_ci(0.95, "exact").high
    assert float(forward) == pytest.approx(math.log((tpr_low - 1e-5) / fpr_high))
    # the complementary test: TNR >= 1 - fpr_high, FNR <= 1 - tpr_low
    assert float(backward) == pytest.approx(math.log((1 - fpr_high - 1e-5) / (1 - tpr_low)))
    assert 1.7 < float(forward) < 2.2  # ln(0.9 / 0.1) = 2.197 before the intervals
    # a test that finds nothing bounds nothing, and TPR below delta shows nothing
    assert float(epsilon_from_counts(500, 1000, 500, 1000, 1e-5)[0]) == 0.0
    assert float(epsilon_from_counts(0, 1000, 0, 1000, 0.5)[0]) == 0.0


def test_threshold_is_chosen_on_the_selection_runs_only() -> None:
    rng = np.random.default_rng(0)
    members, non_members = rng.normal(3.0, 1.0, 2000), rng.normal(0.0, 1.0, 2000)
    bound = audit_bound(members, non_members, delta=1e-5, selection_fraction=0.25)
    assert bound.selection_runs == 500 and bound.members == 1500 and bound.non_members == 1500
    assert bound.threshold == best_threshold(members[:500], non_members[:500], 1e-5, evaluation_runs=(1500, 1500))
    # mu = 3 Gaussian DP allows epsilon of about 16.68 at delta 1e-5; 1,500 evaluation runs per world show a few units
    # of it: even a perfect attack (1,500 members found, no false positive) shows only 6.01, and these overlapping
    # normals are not separated perfectly
    perfect = float(epsilon_from_counts(1500, 1500, 0, 1500, 1e-5)[0])
    assert perfect == pytest.approx(6.007, abs=1e-3)
    assert 2.0 < bound.epsilon_lower_bound < perfect
    same = audit_bound(rng.normal(0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5)
    assert same.epsilon_lower_bound < 0.3


def test_the_gaussian_rule_finds_far_tail_thresholds_for_large_evaluations() -> None:
    rng = np.random.default_rng(2)
    mu, runs = 0.5, 22_000
    members, non_members = rng.normal(mu, 1.0, runs), rng.normal(0.0, 1.0, runs)
    empirical = audit_bound(members, non_members, 1e-5, selection_fraction=0.1)
    gaussian = audit_bound(members, non_members, 1e-5, selection_fraction=0.1, rule="gaussian")
    # the best threshold for 19,800 evaluation runs of mu = 0.5 lies near 2.7 standard deviations
    assert 2.0 < gaussian.threshold < 3.5
    assert gaussian.epsilon_lower_bound >= empirical.epsilon_lower_bound - 0.05
    assert gaussian.epsilon_lower_bound < 1.99  # mu = 0.5 Gaussian DP is (1.99, 1e-5)-DP


def test_too_few_runs_for_the_split_is_a_clear_error() -> None:
    assert split_sizes(100, 0.2) == (20, 80)
    with pytest.raises(ConfigError, match="audit.models.*at least.*--models"):
        split_sizes(2 * MIN_RUNS_PER_PART, 0.2)
