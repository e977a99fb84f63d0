"""Exact sampling on a grid for secure mode: the discrete Laplace of Canonne, Kamath & Steinke (NeurIPS 2020).

A floating-point Laplace sample added to a floating-point value has gaps in its support: many outputs
can come from one dataset and not from its neighbour, and such a release is not DP for any epsilon
(Mironov 2012; measured here: 82 % of raw noisy sums of a personalized run).  Secure mode therefore
releases values on a grid: the value is rounded to a multiple of ``gamma`` and an integer drawn from
the *discrete* Laplace distribution ``P(y) ∝ exp(-|y| / t)`` is added, every draw made with integer
arithmetic alone from uniform 64-bit words (Algorithms 1 and 2 of CKS 2020, vectorised over rows by
rejection).  Every grid point then has positive probability under any input, and the release is
``(Delta_int / t)``-DP for integer inputs of l1 sensitivity ``Delta_int``.

:func:`grid_release` sizes the grid from the l1 sensitivity ``C`` and the dimension ``d``: ``gamma`` is the
power of two with ``2^GRID_BITS <= C / ((d + 1) gamma) < 2^(GRID_BITS + 1)`` (:func:`laplace_grid_step`), so that
dividing by it and multiplying back are exact in float64.  Rounding moves each coordinate by at most half a
step, so neighbouring sums (l1 distance at most C under add/remove) round to integers at most
``K = C / gamma + d`` apart (``d`` coordinates).  The ledger prices the release as the continuous Laplace of
multiplier ``m`` that it replaces, whose pure epsilon is ``1 / m`` (``2 / m`` under replace-one, where sums are 2C
apart), and whose whole privacy-loss profile the PLD and RDP accountants compose.  At *equal* pure epsilon the discrete
Laplace's profile lies slightly above the continuous one (its total variation is ``1 - e^(-a/2) sech(1/2t)``
against ``1 - e^(-a/2)``: about ``1 / 8t^2`` more), so :func:`grid_scale` takes one step of slack,
``t = ceil(m (K + 1))``: the pure epsilon ``K / t`` is then at least ``1 / (m t)`` below ``1 / m``, far more
than that excess, and the hockey-stick divergence of every grid release stays under the continuous
Laplace's at every epsilon (checked exactly against the closed forms in ``tests/privacy/test_discrete.py``,
one and two coordinates; without the step it was above at some).  The ledger's event is then a sound upper
bound for every accountant.  The noise's scale grows by a factor ``1 + (d + 1) gamma / C``, at most
``1 + 2^-GRID_BITS`` (one part per million) whatever the dimension, because the grid is that much finer than
``C / (d + 1)``: a grid sized from ``C`` alone (``gamma ~ C / 2^20``) made it 1.07 for d = 79 510 (the MLP's
parameters), 7 % more noise than priced.  Where the noise scale ``t`` in steps would pass
:data:`MAX_SCALE_STEPS` (a multiplier times ``d + 1`` of about ``2^35`` or more), the grid is coarsened until it does
not, so that the samplers' 64-bit integer arithmetic stays exact; the factor is then larger, and still sound.
The released value is ``gamma`` times the integer ``rounded input + noise``, formed in 64-bit integers and then
converted to float64: exact up to ``2^53`` steps, and beyond that the nearest float, a function of the
released integer alone (post-processing), never a sum of two rounded floats.

**Gaussian noise** is released as the continuous Gaussian mechanism's output rounded to the grid,
``gamma rint((v + sigma C Z) / gamma)``, sampled exactly (:func:`rounded_gaussian`): a uniform ``U`` is
read as a binary fraction, 53 bits at a time, and ``Z = Phi^{-1}(U)`` is bounded over the cell of
uniforms those bits leave open; when the whole cell rounds to one grid point that point is the
release, otherwise (about once in 10^5 coordinates) 64 more bits are read and the bounds recomputed
with mpmath at matching precision.  The released distribution is exactly the rounded Gaussian, a
post-processing of the Gaussian mechanism: the ledger's sampled-Gaussian events price it as they
are, with no extra sensitivity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import mpmath
import numpy as np
from scipy.special import ndtri

#: Grid steps per clip norm (gamma = C / 2^GRID_BITS), and per clip norm over ``d + 1`` for a Laplace release.
GRID_BITS = 20
#: The largest discrete Laplace scale (in grid steps) the samplers take: their int64 products (the scale times a
#: Bernoulli trial's index, times a geometric count) stay below 2^63 unless that index or count reaches 128,
#: whose probability is below e^-128.
MAX_SCALE_STEPS = 2**56

Words = Callable[[int], np.ndarray]
"""A source of uniform 64-bit words: ``words(n)`` returns the next ``n`` of one stream (``uint64``)."""


def uniform_below(words: Words, bounds: np.ndarray) -> np.ndarray:
    """One uniform integer in ``[0, bounds[i])`` per entry, exactly (rejection of the top partial range of
    64-bit words: no modulo bias).  ``bounds`` are positive int64."""
    bounds = np.asarray(bounds, dtype=np.uint64)
    out = np.zeros(len(bounds), dtype=np.uint64)
    limit = (np.uint64(2**64 - 1) // bounds) * bounds          # the largest multiple of the bound in range
    pending = np.arange(len(bounds))
    while len(pending):
        draws = words(len(pending))
        accept = draws < limit[pending]
        out[pending[accept]] = draws[accept] % bounds[pending[accept]]
        pending = pending[~accept]
    return out.astype(np.int64)


def bernoulli(words: Words, numerators: np.ndarray, denominators: np.ndarray) -> np.ndarray:
    """Bernoulli(n / d) per entry, exactly (``0 <= n <= d``)."""
    return uniform_below(words, denominators) < np.asarray(numerators, dtype=np.int64)


def bernoulli_exp(words: Words, numerators: np.ndarray, denominator: int | np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-n / d)) per entry for ``0 <= n <= d`` (CKS Algorithm 1: the parity of the first K with
    a failed Bernoulli(gamma / K))."""
    numerators = np.asarray(numerators, dtype=np.int64)
    denominators = np.broadcast_to(np.asarray(denominator, dtype=np.int64), numerators.shape)
    k = np.ones(len(numerators), dtype=np.int64)
    result = np.zeros(len(numerators), dtype=bool)
    pending = np.arange(len(numerators))
    while len(pending):
        success = bernoulli(words, numerators[pending], denominators[pending] * k[pending])
        done = pending[~success]
        result[done] = k[done] % 2 == 1
        k[pending[success]] += 1
        pending = pending[success]
    return result


def discrete_laplace(words: Words, scales: np.ndarray) -> np.ndarray:
    """One draw per entry of the discrete Laplace ``P(y) ∝ exp(-|y| / t)``, ``t = scales[i]`` (positive int64)
    (CKS Algorithm 2 with s = 1): ``U`` uniform below t kept with probability exp(-U / t), plus t times a
    geometric count of Bernoulli(exp(-1)) successes, with a random sign (a negative zero rejected)."""
    scales = np.asarray(scales, dtype=np.int64)
    out = np.zeros(len(scales), dtype=np.int64)
    pending = np.arange(len(scales))
    while len(pending):
        t = scales[pending]
        u = uniform_below(words, t)
        keep = bernoulli_exp(words, u, t)
        pending_kept, u, t = pending[keep], u[keep], t[keep]
        v = np.zeros(len(pending_kept), dtype=np.int64)
        growing = np.arange(len(pending_kept))
        while len(growing):
            more = bernoulli_exp(words, np.ones(len(growing), dtype=np.int64), 1)
            v[growing[more]] += 1
            growing = growing[more]
        magnitude = u + t * v
        negative = bernoulli(words, np.ones(len(magnitude), dtype=np.int64), np.full(len(magnitude), 2))
        valid = ~(negative & (magnitude == 0))
        out[pending_kept[valid]] = np.where(negative[valid], -magnitude[valid], magnitude[valid])
        finished = np.zeros(len(scales), dtype=bool)
        finished[pending_kept[valid]] = True
        pending = pending[~finished[pending]]
    return out


def grid_step(sensitivity: float) -> float:
    """``gamma``: the power of two with ``2^GRID_BITS <= C / gamma < 2^(GRID_BITS + 1)``: the Gaussian release's
    grid, whose rounding is post-processing and costs no noise (a finer one would only send more uniform cells
    to the slow exact path of :func:`rounded_gaussian`)."""
    return 2.0 ** (math.floor(math.log2(sensitivity)) - GRID_BITS)


def laplace_grid_step(sensitivity: float, dim: int, multiplier: float) -> float:
    """``gamma`` of a Laplace release of ``dim`` coordinates and l1 sensitivity ``C`` (module docstring): the power
    of two with ``2^GRID_BITS <= C / ((dim + 1) gamma) < 2^(GRID_BITS + 1)``, so that the rounding's ``dim + 1``
    extra steps add at most ``2^-GRID_BITS`` to the noise, coarsened (doubled) while the noise scale in steps for
    ``multiplier`` would reach :data:`MAX_SCALE_STEPS`.  Every such step is a power of two at least
    ``grid_step(C / (dim + 1))``, so each release lies on that grid."""
    gamma = grid_step(sensitivity / (dim + 1))
    while discrete_scale(multiplier, _grid_distance(sensitivity, gamma, dim)) >= MAX_SCALE_STEPS:
        gamma *= 2
    return gamma


def _grid_distance(sensitivity: float, gamma: float, dim: int) -> Fraction:
    """``K = C / gamma + dim``, exactly: the largest l1 distance, in steps, between neighbouring rounded inputs."""
    return Fraction(sensitivity) / Fraction(gamma) + dim


def product_up(a: float, b: float) -> float:
    """``a * b`` rounded up: the float64 product rounds to nearest, up to half an ulp below the true product, and a
    noise scale priced at ``a * b`` must never be drawn below it (checked exactly, in rationals)."""
    product = a * b
    if math.isfinite(product) and Fraction(a) * Fraction(b) > Fraction(product):
        return math.nextafter(product, math.inf)
    return product


def grid_scale(multiplier: float, dim: int, sensitivity: float) -> int:
    """``t`` (in steps of :func:`laplace_grid_step`) of the discrete Laplace that replaces a continuous Laplace of
    multiplier ``m`` (scale ``m C``) on ``dim`` coordinates with a privacy-loss profile under it:
    ``ceil(m (C / gamma + dim + 1))``, the rounded inputs' largest l1 distance plus one step of slack (module
    docstring)."""
    gamma = laplace_grid_step(sensitivity, dim, multiplier)
    return discrete_scale(multiplier, _grid_distance(sensitivity, gamma, dim))


def discrete_scale(multiplier: float, distance: float | Fraction) -> int:
    """``t = ceil(m (K + 1))``, computed exactly (in rationals): the discrete Laplace scale for integer inputs at
    most ``K`` apart in l1 whose privacy-loss profile lies under the continuous Laplace of pure epsilon ``1 / m``
    (module docstring)."""
    return math.ceil(Fraction(multiplier) * (Fraction(distance) + 1))


def grid_release(values: np.ndarray, sensitivity: float, multipliers: np.ndarray,
                 words_of_row: Callable[[int], Words]) -> np.ndarray:
    """``values`` (rows, d; float64) of l1 sensitivity ``C`` released on the grid :func:`laplace_grid_step`
    ``(C, d, m_r)`` of each row's multiplier ``m_r``: each row rounded to its grid plus ``gamma`` times a discrete
    Laplace integer of scale :func:`grid_scale`, drawn from ``words_of_row(r)``.  Every result is ``gamma``
    times the released integer (exactly below 2^53 steps, the nearest float beyond: module docstring)."""
    rows, dim = values.shape
    out = np.empty_like(values)
    for row in range(rows):
        multiplier = float(multipliers[row])
        gamma = laplace_grid_step(sensitivity, dim, multiplier)
        steps = np.rint(values[row] / gamma)
        if np.abs(steps).max(initial=0.0) >= 2**52:
            raise ValueError(f"a released value is beyond the grid's exact range (2^52 steps of {gamma:g})")
        noise = discrete_laplace(words_of_row(row), np.full(dim, grid_scale(multiplier, dim, sensitivity)))
        out[row] = (steps.astype(np.int64) + noise).astype(np.float64) * gamma
    return out


#: The float path's bounds on ``f + s Phi^{-1}(U) + 1/2`` are widened by this much, relative to their size:
#: scipy's ``ndtri`` is accurate to a few units in the last place (about 1e-16 relative) and the sums
#: add a few more; a thousand times that margin keeps every bound rigorous.
FLOAT_MARGIN = 1e-12


def rounded_gaussian(words: Words, fractions: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``floor(f + s Z + 1/2)`` per entry for a standard normal ``Z``, exactly: the grid offset of the rounded
    Gaussian release of a value ``f`` steps from a grid point (``|f| <= 1/2``) with noise of ``s`` steps."""
    fractions = np.asarray(fractions, dtype=np.float64)
    scales = np.asarray(scales, dtype=np.float64)
    cells = words(len(fractions)) >> np.uint64(11)                 # the first 53 bits of each uniform
    low, high = cells.astype(np.float64) * 2.0**-53, (cells + np.uint64(1)).astype(np.float64) * 2.0**-53
    with np.errstate(over="ignore", invalid="ignore"):
        a = fractions + scales * ndtri(low) + 0.5
        b = fractions + scales * ndtri(high) + 0.5
        margin = FLOAT_MARGIN * (1.0 + np.abs(a) + np.abs(b))
        first, last = np.floor(a - margin), np.floor(b + margin)
    determined = np.isfinite(first) & np.isfinite(last) & (first == last)
    out = np.where(determined, first, 0.0).astype(np.int64)
    for index in np.flatnonzero(~determined):
        out[index] = _resolve(words, float(fractions[index]), float(scales[index]), int(cells[index]))
    return out


def _resolve(words: Words, fraction: float, scale: float, cell: int) -> int:
    """The rounded offset for a uniform whose first 53 bits are ``cell`` and whose cell straddles a rounding
    boundary: read 64 more bits at a time and bound ``Phi^{-1}`` over the narrower cell with mpmath at
    64 bits more than the cell's width, until one grid point holds the whole cell."""
    bits, numerator = 53, cell
    while True:
        numerator = (numerator << 64) | int(words(1)[0])
        bits += 64
        with mpmath.workprec(bits + 64):
            low = mpmath.mpf(numerator) / mpmath.mpf(2) ** bits
            high = mpmath.mpf(numerator + 1) / mpmath.mpf(2) ** bits
            if low == 0:
                continue
            root2 = mpmath.sqrt(2)
            a = fraction + scale * root2 * mpmath.erfinv(2 * low - 1) + mpmath.mpf(0.5)
            b = fraction + scale * root2 * mpmath.erfinv(2 * high - 1) + mpmath.mpf(0.5)
            if not (mpmath.isfinite(a) and mpmath.isfinite(b)):
                continue
            margin = mpmath.mpf(2) ** (-bits) * (1 + abs(a) + abs(b))
            first, last = mpmath.floor(a - margin), mpmath.floor(b + margin)
            if first == last:
                return int(first)


def grid_gaussian_release(values: np.ndarray, sensitivity: float, multipliers: np.ndarray,
                          words_of_row: Callable[[int], Words]) -> np.ndarray:
    """``values`` (rows, d; float64) released as ``gamma rint((v + m_r C Z) / gamma)`` on the grid
    :func:`grid_step` ``(C)``, sampled exactly by :func:`rounded_gaussian` from ``words_of_row(r)``."""
    gamma = grid_step(sensitivity)
    steps = values / gamma                                           # exact: gamma is a power of two
    if np.abs(steps).max(initial=0.0) >= 2**52:
        raise ValueError(f"a released value is beyond the grid's exact range (2^52 steps of {gamma:g})")
    nearest = np.rint(steps)
    fractions = steps - nearest                                      # exact (Sterbenz)
    out = np.empty_like(values)
    for row in range(values.shape[0]):
        scale = np.full(values.shape[1], product_up(float(multipliers[row]), sensitivity) / gamma)  # gamma: 2^k
        out[row] = (nearest[row] + rounded_gaussian(words_of_row(row), fractions[row], scale)) * gamma
    return out
