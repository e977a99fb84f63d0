"""Secure mode's exact samplers (privacy/discrete.py): distributions, the grid, and no support gap."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from decentdp.personalized.privacy import calibrate_updates
from decentdp.personalized.solver import PrivateUpdates
from decentdp.privacy.discrete import (
    bernoulli_exp,
    discrete_laplace,
    grid_release,
    grid_scale,
    grid_step,
    uniform_below,
)
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import LaplaceMechanism, NoiseDraw
from decentdp.rng import AgentKeys, SecureRandom


def _words(seed: int):
    rng = np.random.default_rng(seed)
    return lambda count: rng.integers(0, 2**64, size=count, dtype=np.uint64)


def test_uniform_below_covers_its_range_without_bias() -> None:
    draws = uniform_below(_words(0), np.full(60_000, 6))
    counts = np.bincount(draws, minlength=6)
    assert draws.min() == 0 and draws.max() == 5
    assert np.abs(counts / 10_000 - 1).max() < 0.05
    huge = uniform_below(_words(1), np.full(1000, 3 * 2**61))   # a bound with a large rejected top range
    assert (huge >= 0).all() and (huge < 3 * 2**61).all()


@pytest.mark.parametrize(("numerator", "denominator"), [(0, 1), (1, 1), (1, 3), (5, 7)])
def test_bernoulli_exp_has_probability_exp_minus_gamma(numerator: int, denominator: int) -> None:
    draws = bernoulli_exp(_words(2), np.full(100_000, numerator), denominator)
    assert draws.mean() == pytest.approx(math.exp(-numerator / denominator), abs=0.006)


@pytest.mark.parametrize("scale", [1, 3, 40])
def test_discrete_laplace_matches_its_probability_mass(scale: int) -> None:
    """P(y) = (1 - e^(-1/t)) / (1 + e^(-1/t)) e^(-|y|/t): the empirical frequencies of 200,000 draws."""
    draws = discrete_laplace(_words(3), np.full(200_000, scale))
    ratio = math.exp(-1 / scale)
    for y in range(-2 * scale, 2 * scale + 1, max(1, scale // 4)):
        mass = (1 - ratio) / (1 + ratio) * ratio ** abs(y)
        assert (draws == y).mean() == pytest.approx(mass, abs=4 * math.sqrt(mass / 200_000) + 1e-4), y


def test_grid_release_lies_on_the_grid_and_neighbours_round_within_the_priced_sensitivity() -> None:
    """Every output is an integer number of grid steps, so every output of one dataset is an output of its
    neighbour (the discrete Laplace gives every integer positive mass: no support gap); neighbouring
    sums (l1 distance <= C) round to integers at most C / gamma + d apart, which ``grid_scale`` prices
    at no more than the continuous multiplier's epsilon."""
    rng = np.random.default_rng(4)
    clip, dim, multiplier = 1.7, 9, 2.5
    gamma = grid_step(clip)
    for _ in range(200):
        v = rng.normal(scale=rng.choice([1e-3, 1.0, 1e4]), size=dim)
        direction = rng.normal(size=dim)
        w = v + clip * rng.uniform() * direction / np.abs(direction).sum()
        steps = np.abs(np.rint(v / gamma) - np.rint(w / gamma)).sum()
        assert steps <= clip / gamma + dim
    t = grid_scale(multiplier, dim, clip)
    assert (clip / gamma + dim) / t <= 1 / multiplier
    released = grid_release(rng.normal(size=(3, dim)), clip, np.full(3, multiplier), lambda row: _words(10 + row))
    assert np.array_equal(released / gamma, np.rint(released / gamma))
    assert np.std(released) == pytest.approx(math.sqrt(2) * multiplier * clip, rel=0.8)


def test_secure_laplace_mechanism_and_personalized_updates_release_on_the_grid() -> None:
    """In secure mode the Laplace mechanism and a personalized run's private updates release grid values;
    in simulation mode they keep the continuous draws (results of earlier runs unchanged)."""
    keys = AgentKeys.generate(range(3))
    secure = SecureRandom(0, keys)
    mechanism = LaplaceMechanism(torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64), 1.5)
    values = torch.randn(3, 7, dtype=torch.float64)
    mechanism.perturb(values, torch.arange(3), NoiseDraw(secure, torch.arange(3), 0, 0))
    steps = values.numpy() / grid_step(1.5)
    assert np.array_equal(steps, np.rint(steps))

    noise = calibrate_updates("laplace", "tight", 1.0, 1e-5, np.ones((3, 4)), "pld", "add-remove")
    ledger = PrivacyLedger(3, 1.0, 1e-5, budget_accountant="pld")
    updates = PrivateUpdates(noise, 1.0, ledger, secure, torch.ones(3, dtype=torch.bool))
    sums = torch.randn(2, 5, dtype=torch.float64)
    updates.release(0, torch.tensor([0, 2]), torch.tensor([0, 0]), sums)
    steps = sums.numpy() / grid_step(1.0)
    assert np.array_equal(steps, np.rint(steps))
    assert (ledger.releases() == np.array([1, 0, 1])).all()
