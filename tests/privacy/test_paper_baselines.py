"""The papers' own calibrations (``privacy/baselines/paper.py``): what each promises about its sigma."""

from __future__ import annotations

import pytest

from decentdp.privacy.accounting import rdp_curve
from decentdp.privacy.baselines.paper import (
    MOMENTS_TOLERANCE,
    moments_accountant_epsilon,
    moments_accountant_noise_multiplier,
    optimal_noise_multiplier,
)
from decentdp.privacy.events import gaussian_event


@pytest.mark.parametrize(("epsilon", "sample_rate", "releases"), [(2.0, 0.05, 100), (0.5, 0.2, 10), (8.0, 1.0, 3)])
def test_the_moments_accountant_sigma_is_the_smallest_that_meets_its_epsilon(epsilon: float, sample_rate: float,
                                                                            releases: int) -> None:
    """Li18 + MA's sigma meets (epsilon, delta) by the classical conversion, a sigma one tolerance below does not,
    and it is at least the improved conversion's ("Optimal"): the classical bound is the looser one."""
    delta = 1e-5

    def spent(sigma: float) -> float:
        return moments_accountant_epsilon(releases * rdp_curve(gaussian_event(sigma, sample_rate)), delta)

    sigma = moments_accountant_noise_multiplier(epsilon, delta, sample_rate, releases)
    assert spent(sigma) <= epsilon
    assert spent(sigma * (1 - 2 * MOMENTS_TOLERANCE)) > epsilon
    assert sigma >= optimal_noise_multiplier(epsilon, delta, sample_rate, releases)
