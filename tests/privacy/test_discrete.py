"""Secure mode's exact samplers (privacy/discrete.py): distributions, the grid, and no support gap."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

from decentdp.personalized.privacy import calibrate_updates
from decentdp.personalized.solver import PrivateUpdates
from decentdp.privacy.discrete import (
    _resolve,
    bernoulli_exp,
    discrete_laplace,
    discrete_scale,
    grid_release,
    grid_scale,
    grid_step,
    laplace_grid_step,
    product_up,
    rounded_gaussian,
    uniform_below,
)
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import GaussianMechanism, LaplaceMechanism, NoiseDraw
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
    gamma = laplace_grid_step(clip, dim, multiplier)
    for _ in range(200):
        v = rng.normal(scale=rng.choice([1e-3, 1.0, 1e4]), size=dim)
        direction = rng.normal(size=dim)
        w = v + clip * rng.uniform() * direction / np.abs(direction).sum()
        steps = np.abs(np.rint(v / gamma) - np.rint(w / gamma)).sum()
        assert steps <= clip / gamma + dim
    t = grid_scale(multiplier, dim, clip)
    assert (clip / gamma + dim) / t <= 1 / multiplier
    assert t == discrete_scale(multiplier, clip / gamma + dim)
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
    steps = values.numpy() / grid_step(1.5 / 8)  # the finest Laplace grid of 7 coordinates: every row lies on it
    assert np.array_equal(steps, np.rint(steps))

    noise = calibrate_updates("laplace", "tight", 1.0, 1e-5, np.ones((3, 4)), "pld", "add-remove")
    ledger = PrivacyLedger(3, 1.0, 1e-5, budget_accountant="pld")
    updates = PrivateUpdates(noise, 1.0, ledger, secure, torch.ones(3, dtype=torch.bool))
    sums = torch.randn(2, 5, dtype=torch.float64)
    updates.release(0, torch.tensor([0, 2]), torch.tensor([0, 0]), sums)
    steps = sums.numpy() / grid_step(1.0 / 6)
    assert np.array_equal(steps, np.rint(steps))
    assert (ledger.releases() == np.array([1, 0, 1])).all()


@pytest.mark.parametrize(("fraction", "scale"), [(0.0, 0.3), (0.31, 0.8), (-0.45, 2.5)])
def test_rounded_gaussian_matches_the_gaussian_mass_of_each_grid_cell(fraction: float, scale: float) -> None:
    """P(offset = k) = Phi((k + 1/2 - f) / s) - Phi((k - 1/2 - f) / s): the continuous Gaussian mechanism's
    output rounded to the grid, over 200,000 draws."""
    from scipy.stats import norm

    draws = rounded_gaussian(_words(5), np.full(200_000, fraction), np.full(200_000, scale))
    for k in range(-3, 4):
        mass = norm.cdf((k + 0.5 - fraction) / scale) - norm.cdf((k - 0.5 - fraction) / scale)
        assert (draws == k).mean() == pytest.approx(mass, abs=4 * math.sqrt(max(mass, 1e-6) / 200_000) + 1e-4), k


def test_an_ambiguous_cell_is_resolved_to_the_point_the_float_path_would_pick() -> None:
    """A uniform cell the float bounds cannot place is refined with mpmath; for cells the float path does
    place, the refinement (with any further bits) lands on the same grid point."""
    rng = np.random.default_rng(6)
    for _ in range(40):
        fraction, scale = rng.uniform(-0.5, 0.5), rng.uniform(0.1, 50)
        cell = int(rng.integers(1, 2**53 - 1))
        words = lambda count, c=cell: np.array([c << 11], dtype=np.uint64)   # noqa: E731 (the first 53 bits)
        fast = rounded_gaussian(words, np.array([fraction]), np.array([scale]))[0]
        assert _resolve(_words(7), fraction, scale, cell) == fast


def test_secure_gaussian_mechanism_releases_on_the_grid() -> None:
    secure = SecureRandom(0, AgentKeys.generate(range(2)))
    mechanism = GaussianMechanism(torch.tensor([1.0, 2.0]), 1.3)
    values = torch.randn(2, 11, dtype=torch.float64)
    before = values.clone()
    mechanism.perturb(values, torch.arange(2), NoiseDraw(secure, torch.arange(2), 0, 0))
    steps = values.numpy() / grid_step(1.3)
    assert np.array_equal(steps, np.rint(steps)) and not torch.equal(values, before)


def test_a_cell_on_a_rounding_boundary_resolves_to_either_side_by_its_further_bits() -> None:
    fraction, scale = 0.2, 3.0
    with mpmath.workprec(200):                             # f + s z + 1/2 = 0: between offsets -1 and 0
        cell = int(mpmath.floor(mpmath.ncdf(-(mpmath.mpf(fraction) + mpmath.mpf(0.5)) / scale) * 2**53))
    words = lambda count: np.array([cell << 11], dtype=np.uint64)   # noqa: E731
    results = {_resolve(_words(seed), fraction, scale, cell) for seed in range(40)}
    assert results == {-1, 0}
    assert rounded_gaussian(words, np.array([fraction]), np.array([scale]))[0] in (-1, 0)


@pytest.mark.parametrize(("relation_factor", "budget_factor"), [(1.0, 1.0), (2.0, 2.0)])
def test_the_exact_loss_of_a_grid_laplace_release_is_within_its_ledger_event(relation_factor: float,
                                                                              budget_factor: float) -> None:
    """The true privacy loss of the released grid point, computed from the discrete Laplace mass itself:
    max over outputs of log P(o | v) / P(o | v') = sum_j |q_j - q'_j| / t (q = the rounded inputs), for
    neighbouring sums l1-apart by C (add/remove) or 2C (replace-one).  It must not exceed what the ledger
    charges, 1 / m (2 / m under replace-one)."""
    rng = np.random.default_rng(8)
    for _ in range(300):
        clip, dim, multiplier = rng.uniform(0.1, 10), int(rng.integers(1, 50)), rng.uniform(0.2, 20)
        gamma, t = laplace_grid_step(clip, dim, multiplier), grid_scale(multiplier, dim, clip)
        v = rng.normal(scale=rng.choice([1e-3, 1.0, 1e3]) * clip, size=dim)
        direction = rng.normal(size=dim)
        w = v + relation_factor * clip * rng.uniform() * direction / np.abs(direction).sum()
        exact = np.abs(np.rint(v / gamma) - np.rint(w / gamma)).sum() / t
        assert exact <= budget_factor / multiplier * (1 + 1e-12)


@pytest.mark.parametrize("dim", [1, 9, 79_510, 10**7])
def test_a_grid_laplace_release_adds_at_most_a_part_per_million_of_noise_at_any_dimension(dim: int) -> None:
    """The rounding of ``d`` coordinates adds up to ``d + 1`` steps to the l1 distance the noise is sized for, so
    the noise's scale ``t gamma`` is ``m C (1 + (d + 1) gamma / C)``: with a grid sized from ``C`` alone it was 1.07
    times the priced ``m C`` for the MLP's 79 510 parameters.  The grid is finer by ``d + 1``: at most one part per
    million more at any dimension, and still within the priced epsilon (``K / t <= 1 / m``)."""
    for clip, multiplier in ((1.0, 1.0), (0.7, 0.37), (282.0, 429.0)):
        gamma, t = laplace_grid_step(clip, dim, multiplier), grid_scale(multiplier, dim, clip)
        assert Fraction(t) * Fraction(gamma) <= Fraction(multiplier) * Fraction(clip) * (1 + Fraction(1, 2**19))
        assert (Fraction(clip) / Fraction(gamma) + dim) / t <= 1 / Fraction(multiplier)


def test_the_released_noise_has_the_priced_scale_on_a_large_model() -> None:
    """A release of the MLP's 79 510 coordinates: the noise's standard deviation is the priced Laplace's,
    sqrt(2) m C (sample spread about 0.4 %; it was 7 % above with a grid sized from C alone)."""
    clip, multiplier, dim = 3.0, 2.0, 79_510
    released = grid_release(np.zeros((1, dim)), clip, np.array([multiplier]), lambda row: _words(21))
    assert float(np.std(released)) == pytest.approx(math.sqrt(2) * multiplier * clip, rel=0.02)


def test_a_huge_noise_scale_coarsens_the_grid_and_the_release_is_its_integer_times_the_step() -> None:
    """Where ``m (d + 1)`` is so large that the scale in steps would leave the samplers' 64-bit range, the grid is
    coarsened (a power of two, so still on the finest grid) and the release keeps within the priced epsilon; the
    released value is the integer ``rounded input + noise`` times the step, formed in integers (beyond 2^53 steps
    the nearest float of that integer, never a sum of two rounded floats)."""
    clip, dim, multiplier = 1.0, 3, 2.0**34
    gamma = laplace_grid_step(clip, dim, multiplier)
    t = grid_scale(multiplier, dim, clip)
    assert gamma > grid_step(clip / (dim + 1)) and t < 2**56
    assert (Fraction(clip) / Fraction(gamma) + dim) / t <= 1 / Fraction(multiplier)
    values = np.array([[0.3, -1.7, 12345.6789]])
    released = grid_release(values, clip, np.array([multiplier]), lambda row: _words(22))
    noise = discrete_laplace(_words(22), np.full(dim, t))
    assert (np.abs(noise) > 2**53).any()  # (these words draw one beyond float64's exact integers)
    expected = (np.rint(values[0] / gamma).astype(np.int64) + noise).astype(np.float64) * gamma
    assert np.array_equal(released[0], expected)


def test_noise_scales_are_never_rounded_below_the_priced_product() -> None:
    """A review: sigma = 3 at C = nextafter(1/3, 1) gave a float64 product of exactly 1.0, below the true
    1.00000000000000005, and rounding that up to float32 kept 1.0: the noise ran a rounding below its price.
    ``product_up`` rounds the product up exactly (in rationals), and the mechanisms scale by it."""
    clip = math.nextafter(1 / 3, 1)
    scale = float(GaussianMechanism(torch.tensor([3.0]), clip).scales[0])
    assert Fraction(scale) >= 3 * Fraction(clip)
    generator = random.Random(0)
    for _ in range(2000):
        a, b = generator.uniform(0.01, 100), generator.uniform(0.01, 100)
        up = product_up(a, b)
        assert Fraction(up) >= Fraction(a) * Fraction(b) and up in (a * b, math.nextafter(a * b, math.inf))


def _laplace_atoms(shift: int, t: int) -> list[tuple[mpmath.mpf, mpmath.mpf, mpmath.mpf]]:
    """The privacy-loss atoms ``(loss, P-mass, Q-mass)`` of the discrete Laplace of scale ``t`` at 0 (P) against
    it shifted by the integer ``shift >= 0`` (Q), exactly: outputs at or below 0 share loss ``shift / t``, those
    at or above ``shift`` share ``-shift / t``, each output between has its own."""
    r = mpmath.exp(-mpmath.mpf(1) / t)
    c = (1 - r) / (1 + r)
    if shift == 0:
        return [(mpmath.mpf(0), mpmath.mpf(1), mpmath.mpf(1))]
    atoms = [(mpmath.mpf(shift) / t, 1 / (1 + r), r**shift / (1 + r)),
             (-mpmath.mpf(shift) / t, r**shift / (1 + r), 1 / (1 + r))]
    atoms += [(mpmath.mpf(shift - 2 * y) / t, c * r**y, c * r ** (shift - y)) for y in range(1, shift)]
    return atoms


def _product(first: list, second: list) -> list:
    """The atoms of two independent releases together (losses add, masses multiply), equal losses merged."""
    merged: dict[str, list] = {}
    for la, pa, qa in first:
        for lb, pb, qb in second:
            key = mpmath.nstr(la + lb, 30)
            entry = merged.setdefault(key, [la + lb, mpmath.mpf(0), mpmath.mpf(0)])
            entry[1] += pa * pb
            entry[2] += qa * qb
    return [tuple(entry) for entry in merged.values()]


def _largest_excess(atoms: list, epsilon: mpmath.mpf) -> mpmath.mpf:
    """The largest ``delta_P,Q(e) - delta_Lap(e)`` over ``e >= 0``, exactly: the continuous Laplace of pure
    ``epsilon`` has ``delta(e) = max(0, 1 - e^((e - epsilon) / 2))``.  Between two consecutive losses the
    discrete one is ``A - B x`` in ``x = e^e`` (linear) and the continuous one ``1 - sqrt(x) e^(-epsilon/2)``
    (convex), so their difference is concave there: its maximum is at an end or where the slope is zero."""
    atoms = sorted(atoms, key=lambda atom: -atom[0])
    worst, above_p, above_q = mpmath.mpf(-1), mpmath.mpf(0), mpmath.mpf(0)
    for index, (loss, p, q) in enumerate(atoms):
        above_p, above_q = above_p + p, above_q + q
        low = atoms[index + 1][0] if index + 1 < len(atoms) else mpmath.mpf(0)
        if loss <= 0:
            break
        low = max(low, mpmath.mpf(0))
        ends = [mpmath.exp(low), mpmath.exp(loss)]
        inner = mpmath.exp(-epsilon) / (4 * above_q**2)
        points = ends + ([inner] if ends[0] < inner < ends[1] else [])
        for x in points:
            continuous = max(mpmath.mpf(0), 1 - mpmath.sqrt(x) * mpmath.exp(-epsilon / 2))
            worst = max(worst, above_p - above_q * x - continuous)
    return worst


@pytest.mark.parametrize("slack", [True, False])
def test_a_grid_laplace_release_has_its_whole_loss_profile_under_the_priced_laplace(slack: bool) -> None:
    """The ledger prices a grid release as the continuous Laplace of pure epsilon 1 / m (PLD and RDP compose its
    whole profile, not only the pure epsilon), so the discrete Laplace's hockey-stick divergence must lie under
    that Laplace's at every epsilon, for every integer shift the rounded inputs can take.  Exactly, in 40 digits,
    on one coordinate (every shift up to K) and on two (every pair of shifts with |k1| + |k2| <= K).  Without
    ``discrete_scale``'s step of slack (t = ceil(m K)) the profile is above somewhere: a review found 2e-10
    relative at d = 1 on the real grid, and on these small grids it is plain."""
    with mpmath.workdps(40):
        worst = _worst_small_grid_excess(slack)
    if slack:
        assert worst <= 0
    else:
        assert worst > 1e-3


def _worst_small_grid_excess(slack: bool) -> mpmath.mpf:
    """The largest excess over every shift, on grids of 1-13 steps and four multipliers."""
    worst = mpmath.mpf(-1)
    for distance in (1, 2, 3, 5, 8, 13):
        for multiplier in (0.37, 1.0, 2.5, 10.0):
            t = discrete_scale(multiplier, distance) if slack else math.ceil(multiplier * distance)
            epsilon = 1 / mpmath.mpf(multiplier)
            for shift in range(distance + 1):
                worst = max(worst, _largest_excess(_laplace_atoms(shift, t), epsilon))
            if distance <= 8:
                for first in range(distance + 1):
                    for second in range(distance - first + 1):
                        atoms = _product(_laplace_atoms(first, t), _laplace_atoms(second, t))
                        worst = max(worst, _largest_excess(atoms, epsilon))
    return worst


def test_the_real_grid_keeps_its_loss_profile_under_the_priced_laplace() -> None:
    """The same check at the real grid (one coordinate: C / gamma >= 2 * 2^20, so the shift K is about two million
    steps and the excess the slack covers is about 1 / 8t^2): one coordinate at the full shift, in closed form over
    a spread of the loss intervals (all of them would be millions), with the concave maximum inside each."""
    with mpmath.workdps(50):
        for clip, multiplier in ((1.0, 1.0), (0.7, 0.37), (3.3, 12.0)):
            distance = int(clip / laplace_grid_step(clip, 1, multiplier)) + 1
            t = grid_scale(multiplier, 1, clip)
            r = mpmath.exp(-mpmath.mpf(1) / t)
            c = (1 - r) / (1 + r)
            epsilon = 1 / mpmath.mpf(multiplier)
            for y in sorted({0, 1, 2, 3, distance // 4, distance // 3, distance // 2 - 1, distance // 2}
                            | set(range(0, distance // 2, max(1, distance // 300)))):
                above_p = 1 / (1 + r) + c * r * (1 - r**y) / (1 - r)       # outputs <= y: losses (K - 2y') / t
                above_q = r**distance / (1 + r) + c * r ** (distance - y) * (1 - r**y) / (1 - r)
                low, high = mpmath.mpf(max(distance - 2 * (y + 1), 0)) / t, mpmath.mpf(distance - 2 * y) / t
                ends = [mpmath.exp(low), mpmath.exp(high)]
                inner = mpmath.exp(-epsilon) / (4 * above_q**2)
                for x in ends + ([inner] if ends[0] < inner < ends[1] else []):
                    continuous = max(mpmath.mpf(0), 1 - mpmath.sqrt(x) * mpmath.exp(-epsilon / 2))
                    assert above_p - above_q * x - continuous <= 0, (clip, multiplier, y)
