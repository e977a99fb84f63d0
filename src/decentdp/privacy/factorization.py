"""Matrix-factorization noise for decentralized SGD (MAFALDA-SGD, Bellet, Cyffers et al., ICLR 2026).

Every agent adds, in round ``t``, the row ``t`` of ``C^{-1} Z`` to its clipped gradient sum (``Z`` a ``T x d``
matrix of i.i.d. Gaussian draws, ``C`` a ``T x T`` lower-triangular matrix common to all agents).  What its
stream of noisy gradients reveals is the matrix mechanism ``C x + Z`` (``x`` its ``T`` gradient sums): one
Gaussian mechanism over the whole run, of sensitivity

    sens(C) = max over participation classes c of  sqrt( sum_{s, t in c} |(C^T C)_st| )

when a record takes part in the rounds of one class only (cyclic participation: ``b`` fixed batches, round ``t``
uses batch ``t mod b``; authors' ``workloads_generator.py:84-181``).  ``C`` is chosen to minimise the noise the
run's *models* carry, as the authors do (``optimal_factorization.py:54-209``, a port of Google's multi-epoch
primal optimiser)::

    min_X  tr(G X^{-1})   s.t.  X > 0,  X_rs = 0 for r != s in one class,  sum_{t in c} X_tt = 1 for every c
    C = P chol(P X P)^T P                     (lower triangular, C^T C = X, P the anti-identity; :187-194)

so that ``sens(C) = 1``, with ``G`` the Gram matrix of the workload (:func:`workload_gram`): the agents' models
after averaging, ``x(t+1) = W (x(t) - eta (g(t) + noise(t)))``, whose noise is ``sum_{s <= t} W^{t-s+1} noise(s)``
(``workloads_generator.py:264-294`` with ``p = 1``, ``:507-509``).  Two differences from the authors' code:

* ``W`` is the run's own mixing matrix (the one the simulation multiplies by), not their self-loop-free
  ``D^{-1} Adj`` (``utils.py:285-303``), which disagrees with their own averaging over ``deg + 1``;
* the objective is ``tr(G X^{-1})``: their code minimises ``tr(X^{-1} L^T L)`` with ``L = chol(P G P)``
  (``:114-122`` fed by ``workloads_generator.py:418-426``), which equals it only for persymmetric workloads.

The optimiser is the authors' (one-pair L-BFGS direction, backtracking by a quarter, the diagonal projected
onto each class's constant sum and the mask kept), stopped by a relative-improvement test and an iteration cap
rather than their ``max |grad| <= 1e-8`` (hundreds of seconds at ``T = 200``): deterministic, so a run is
reproducible, and within about a minute at ``N = 100``, ``T = 1000`` (``docs/reproduction.md``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import dp_accounting
import numpy as np
import scipy.linalg
import torch
from threadpoolctl import threadpool_limits

from decentdp.privacy.events import gaussian_event
from decentdp.privacy.mechanisms import round_up_to_float32

#: Relative loss improvement per iteration below which the optimiser counts an iteration as stalled, and how
#: many stalled iterations in a row end it.
TOLERANCE = 1e-6
PATIENCE = 5
#: Iterations the optimiser makes at most (about a minute at T = 1000 on two cores).
MAX_ITERATIONS = 150
#: Backtracking trials per iteration (each shrinks the step by 4), as the authors' code.
LINE_SEARCH = 30


def participation_classes(rounds: int, period: int) -> np.ndarray:
    """The participation class of each round: ``t mod b`` (cyclic participation over ``b`` fixed batches)."""
    if period < 1:
        raise ValueError(f"the period of cyclic participation must be at least 1, got {period}")
    return np.arange(rounds) % period


def participation_mask(rounds: int, period: int) -> np.ndarray:
    """Where ``X = C^T C`` may be non-zero: off the diagonal, only between rounds of different classes
    (authors' ``utils.get_orthogonal_mask``, ``utils.py:261-274``)."""
    classes = participation_classes(rounds, period)
    return (classes[:, None] != classes[None, :]) | np.eye(rounds, dtype=bool)


def band_mask(rounds: int, bands: int) -> np.ndarray:
    """Where ``X = C^T C`` may be non-zero for a ``C`` of ``bands`` diagonals (BandMF, Choquette-Choo et al. 2023):
    ``|r - s| < bands``.  A banded ``X`` has a banded Cholesky factor (no fill-in outside the band), so ``C`` has the
    same ``bands`` diagonals and ``(C^{-1} Z)_t`` needs only the ``bands - 1`` previous outputs."""
    if bands < 1:
        raise ValueError(f"a factorization needs at least one band (the diagonal), got {bands}")
    rounds_apart = np.abs(np.subtract.outer(np.arange(rounds), np.arange(rounds)))
    return rounds_apart < bands


def sensitivity(c: np.ndarray, period: int) -> float:
    """``sens(C)``: the largest ``sqrt(sum |X_st|)`` over a class's rounds, ``X = C^T C`` (a record's clipped
    gradient changes by at most one clip norm in each round of its class, and in no other round)."""
    x = c.T @ c
    classes = participation_classes(len(x), period)
    return float(np.sqrt(max(np.abs(x[np.ix_(classes == k, classes == k)]).sum() for k in np.unique(classes))))


def workload_gram(w: np.ndarray, rounds: int, offset: int = 1) -> np.ndarray:
    """``G[s, s'] = sum_{t >= max(s, s')} tr((W^{t-s+p})^T W^{t-s'+p})``, ``p = offset``: the sum over agents
    ``i`` of ``A_i^T A_i``, ``A_i`` the columns of agent ``i``'s noise in the block lower-triangular workload
    ``A[(t, j), (s, i)] = (W^{t-s+p})_{ji}`` (``s <= t``).

    With ``F[a, b] = tr((W^{a+p})^T W^{b+p})`` (from the eigenvalues, ``sum lambda^{a+b+2p}``, when ``W`` is
    symmetric; else the Frobenius Gram of its powers) and ``D = |s - s'|``,
    ``G[s, s'] = sum_{j=0}^{T-1-max(s, s')} F[j + D, j]``: cumulative sums along ``F``'s diagonals."""
    w = np.asarray(w, dtype=np.float64)
    t = rounds
    if np.array_equal(w, w.T):
        eigenvalues = np.linalg.eigvalsh(w)
        powers = np.arange(2 * t + 2 * offset - 1)
        with np.errstate(under="ignore"):
            traces = (eigenvalues[None, :] ** powers[:, None]).sum(axis=1)      # tr(W^n)
        f = traces[np.add.outer(np.arange(t), np.arange(t)) + 2 * offset]
    else:
        power = np.linalg.matrix_power(w, offset)
        flat = np.empty((t, w.size))
        for k in range(t):
            flat[k] = power.ravel()
            power = power @ w
        f = flat @ flat.T
    j = np.arange(t)
    lag = np.arange(t)
    inside = (j[None, :] + lag[:, None]) < t
    diagonals = np.where(inside, f[np.minimum(j[None, :] + lag[:, None], t - 1), j[None, :]], 0.0)
    cumulative = np.cumsum(diagonals, axis=1)                                  # [D, J] = sum_{j <= J} F[j+D, j]
    s = np.arange(t)
    latest = np.maximum.outer(s, s)
    return cumulative[np.abs(np.subtract.outer(s, s)), t - 1 - latest]


def explicit_workload_gram(w: np.ndarray, rounds: int, offset: int = 1) -> np.ndarray:
    """:func:`workload_gram` from the explicit ``nT x nT`` workload (for tests and small runs)."""
    n = len(w)
    powers = [np.linalg.matrix_power(w, k + offset) for k in range(rounds)]
    a = np.zeros((n * rounds, n * rounds))
    for t in range(rounds):
        for s in range(t + 1):
            a[t * n:(t + 1) * n, s * n:(s + 1) * n] = powers[t - s]
    gram = np.zeros((rounds, rounds))
    for i in range(n):
        columns = a[:, i::n]
        gram += columns.T @ columns
    return gram


def noise_loss(gram: np.ndarray, x: np.ndarray) -> float:
    """``tr(G X^{-1})``: the models' total noise variance (per unit noise std and coordinate) with ``X = C^T C``."""
    return float(np.trace(scipy.linalg.solve(x, gram, assume_a="pos")))


def independent_gram(rounds: int, period: int) -> np.ndarray:
    """``X`` of independent noise at sensitivity 1 under cyclic participation: ``I / k_c`` (``k_c`` the rounds of
    class ``c``), DP-D-SGD's noise (the authors' initial point, ``optimal_factorization.py:18-33``)."""
    classes = participation_classes(rounds, period)
    return np.diag(1.0 / np.bincount(classes)[classes])


@dataclass(frozen=True)
class Factorization:
    """A lower-triangular ``C`` (``sens(C) = 1`` under the participation), its inverse, and how it was found."""

    c: np.ndarray
    c_inverse: np.ndarray
    period: int
    bands: int               # C's non-zero diagonals (len(c): dense)
    loss: float              # tr(G X^{-1})
    independent_loss: float  # the same for independent noise (X = I / k_c)
    iterations: int
    seconds: float

    @property
    def sensitivity(self) -> float:
        return sensitivity(self.c, self.period)


def optimal_gram(gram: np.ndarray, period: int, max_iterations: int = MAX_ITERATIONS,
                 tolerance: float = TOLERANCE, bands: int | None = None) -> tuple[np.ndarray, int]:
    """``X`` minimising ``tr(G X^{-1})`` under the constraints of the module docstring (authors'
    ``MatrixFactorizer.optimize``, objective corrected), from independent noise; and the iterations made.
    ``bands``: ``X`` (hence ``C``) also kept to that many diagonals (:func:`band_mask`; ``None``: dense)."""
    rounds = len(gram)
    classes = participation_classes(rounds, period)
    counts = np.bincount(classes).astype(float)
    mask = participation_mask(rounds, period)
    if bands is not None:
        mask &= band_mask(rounds, bands)
    try:
        m = np.linalg.cholesky(gram).T                                   # M^T M = G
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(gram)
        m = (vectors * np.sqrt(np.clip(values, 0.0, None))).T

    def project(dx: np.ndarray) -> np.ndarray:                           # :75-93: X + a dX keeps the constraints
        diagonal = np.diag(dx).copy()
        diagonal -= (np.bincount(classes, weights=diagonal) / counts)[classes]
        dx[np.diag_indices_from(dx)] = diagonal
        dx *= mask
        return dx

    def loss_and_gradient(x: np.ndarray) -> tuple[float, np.ndarray | None]:  # :114-122 with M^T M = G
        try:
            factor = scipy.linalg.cho_factor(x, lower=True, check_finite=False)
        except np.linalg.LinAlgError:
            return np.nan, None
        h = scipy.linalg.cho_solve(factor, m.T, check_finite=False)      # X^{-1} M^T
        return float(np.einsum("ij,ji->", m, h)), project(-(h @ h.T))    # tr(M X^{-1} M^T), -X^{-1} G X^{-1}

    x = independent_gram(rounds, period)
    loss, gradient = loss_and_gradient(x)
    previous_x, previous_gradient, direction = x, gradient, gradient
    stalled, iterations = 0, 0
    while iterations < max_iterations:                                   # :124-185
        iterations += 1
        step, accepted = 1.0, False
        for _ in range(LINE_SEARCH):
            candidate = previous_x - step * direction
            value, candidate_gradient = loss_and_gradient(candidate)
            if candidate_gradient is not None and np.isfinite(value) and value < loss:
                accepted = True
                break
            step *= 0.25
        if not accepted:
            break
        stalled = stalled + 1 if (loss - value) <= tolerance * abs(loss) else 0
        loss, x, gradient = value, candidate, candidate_gradient
        if stalled >= PATIENCE:
            break
        s, y = x - previous_x, gradient - previous_gradient               # lbfgs_direction, :95-112
        sy = float(np.sum(y * s))
        if sy <= 0:
            direction = gradient
        else:
            rho = 1.0 / sy
            alpha = rho * float(np.sum(s * gradient))
            gamma = sy / float(np.sum(y * y))
            z = gamma * (gradient - alpha * y)
            beta = rho * float(np.sum(y * z))
            direction = z + s * (alpha - beta)
        previous_x, previous_gradient = x, gradient
    return (x + x.T) / 2, iterations


def factor_of(x: np.ndarray) -> np.ndarray:
    """The lower-triangular ``C`` with ``C^T C = X``: ``P chol(P X P)^T P`` (``optimal_factorization.py:187-194``)."""
    flipped = x[::-1, ::-1]
    lower = np.linalg.cholesky(flipped)
    return np.ascontiguousarray(lower.T[::-1, ::-1])


def factorize(gram: np.ndarray, period: int, max_iterations: int = MAX_ITERATIONS,
              bands: int | None = None) -> Factorization:
    """The optimised factorization for workload Gram ``gram`` under cyclic participation of period ``period``,
    scaled to sensitivity 1 exactly (``max_iterations = 0``: independent noise, ``C = sqrt(k_c)``-diagonal), with
    at most ``bands`` diagonals (``None``: dense)."""
    start = time.perf_counter()
    rounds = len(gram)
    bands = rounds if bands is None else min(bands, rounds)
    if max_iterations > 0:
        x, iterations = optimal_gram(gram, period, max_iterations, bands=bands)
    else:
        x, iterations = independent_gram(rounds, period), 0
    c = factor_of(x)
    c /= sensitivity(c, period)                                            # rounding: sens(C) = 1 exactly
    c = np.tril(c) * band_mask(rounds, bands)                              # exact zeros outside the band
    c_inverse = scipy.linalg.solve_triangular(c, np.eye(rounds), lower=True)
    x = c.T @ c
    return Factorization(c, c_inverse, period, bands, noise_loss(gram, x),
                         noise_loss(gram, independent_gram(rounds, period)), iterations, time.perf_counter() - start)


@lru_cache(maxsize=8)
def _cached(w_bytes: bytes, shape: tuple[int, int], rounds: int, period: int, offset: int,
            max_iterations: int, bands: int | None) -> Factorization:
    w = np.frombuffer(w_bytes, dtype=np.float64).reshape(shape)
    with threadpool_limits(limits=1, user_api="blas"):  # see run_factorization
        return factorize(workload_gram(w, rounds, offset), period, max_iterations, bands)


def run_factorization(w: np.ndarray, rounds: int, period: int, offset: int = 1,
                      max_iterations: int = MAX_ITERATIONS, bands: int | None = None) -> Factorization:
    """:func:`factorize` of the workload of mixing matrix ``w`` over ``rounds`` rounds, cached per
    (``W``, ``T``, ``b``, bands) in this process (a build, its audit and its privacy results ask for the same).

    Its linear algebra runs on one BLAS thread: the result is then the same whatever the machine's cores, and on
    two busy cores one thread was four times faster than two at ``T = 1000`` (20.7 s against 85.8 s; two threads
    wait for each other; ``benchmarks/factorization.py``)."""
    w = np.ascontiguousarray(w, dtype=np.float64)
    return _cached(w.tobytes(), w.shape, rounds, period, offset, max_iterations, bands)


class MatrixFactorizationMechanism:
    """Correlated Gaussian noise: agent ``i`` adds ``sigma_i C_clip (C^{-1} Z_i)_t`` to its clipped sum of round
    ``t`` (authors' ``mfdl_optimizer.py:77-110``: the noise ``C^+ Z`` drawn for the whole run, there as here
    ``Z`` with i.i.d. entries), and the whole run is priced at once (:attr:`prepaid`): before round 0 the ledger
    charges each agent :meth:`run_event`, one Gaussian mechanism of multiplier ``sigma_i / sens(C)``
    (``C x + sigma Z``, of which every message is post-processing), and no release after it.

    ``Z_i``'s row ``t`` is drawn in round ``t`` under that release's own key (:class:`~decentdp.privacy.mechanisms.
    NoiseDraw`, once, like every release's noise), and ``y_t = (C^{-1} Z_i)_t`` follows by forward substitution,

        y_t = (z_t - sum_{t - bands < s < t} C_ts y_s) / C_tt,

    from the previous outputs, which a history in the algorithm's state keeps (:attr:`history_rows` of them, a
    ring: ``y_s`` in row ``s mod history_rows``).  A dense ``C`` needs all ``T``; a banded one ``bands``, so a
    long run's state stays small.  :meth:`with_history` binds a round's history (``(agents, rows, d)``) and returns
    the mechanism the release uses."""

    prepaid = True

    def __init__(self, noise_multipliers: torch.Tensor, clip: float, factorization: Factorization) -> None:
        self.noise_multipliers = noise_multipliers
        self.sensitivity = float(clip)
        self.scales = round_up_to_float32(noise_multipliers.double() * self.sensitivity)
        self.factorization = factorization
        self.run_sensitivity = factorization.sensitivity
        self.c = torch.from_numpy(factorization.c)

    @property
    def rounds(self) -> int:
        return int(self.c.shape[0])

    @property
    def history_rows(self) -> int:
        """The past outputs ``y_s`` a round needs, with room for its own: ``C``'s bands (``T`` when dense)."""
        return self.factorization.bands

    def run_event(self, agent: int) -> dp_accounting.DpEvent:
        """What every observer together learns of agent ``agent`` (global id) over the whole run: one Gaussian of
        multiplier ``sigma / sens(C)`` (the clip norm moves ``C x`` by at most ``sens(C)`` clip norms)."""
        return gaussian_event(float(self.noise_multipliers[agent]) / self.run_sensitivity)

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        raise TypeError("a matrix-factorization mechanism is priced once for the whole run (run_event), not per "
                        "release")

    receiver_event = agent_event

    def with_history(self, history: torch.Tensor) -> _BoundFactorization:
        """This mechanism over a round's history of outputs (``(agents, history_rows, d)``, local rows, the
        algorithm's state)."""
        if history.shape[1] != self.history_rows:
            raise ValueError(f"the history holds {history.shape[1]} rows; this factorization needs "
                             f"{self.history_rows}")
        return _BoundFactorization(self, history)


class _BoundFactorization:
    """A :class:`MatrixFactorizationMechanism` with the history of outputs of the agents it releases for."""

    prepaid = True

    def __init__(self, mechanism: MatrixFactorizationMechanism, history: torch.Tensor) -> None:
        self.mechanism = mechanism
        self.history = history

    def run_event(self, agent: int) -> dp_accounting.DpEvent:
        return self.mechanism.run_event(agent)

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: Any,
                slots: Sequence[int] | None = None) -> None:
        """Draw ``z_t`` for the rows (their round-``t`` key), solve for ``y_t = (C^{-1} Z)_t`` from the kept
        outputs, keep it, add ``sigma_i C_clip y_t``."""
        if slots is not None:
            raise ValueError("a matrix-factorization release is one sum per agent (no slots)")
        t = int(noise.round_index)
        mechanism = self.mechanism
        if not 0 <= t < mechanism.rounds:
            raise ValueError(f"round {t} is outside the {mechanism.rounds} rounds the factorization was made for")
        history, ring = self.history, mechanism.history_rows
        rows = owners.tolist()
        fresh = torch.empty(len(rows), values.shape[1], dtype=noise.dtype, device=values.device)
        noise.normal(rows, fresh)
        index = owners.to(history.device)
        everyone = len(rows) == history.shape[0] and rows == list(range(len(rows)))
        used = min(t, ring)                                                # the ring's rows written so far
        past = history[:, :used] if everyone else history.index_select(0, index)[:, :used]
        earlier = torch.arange(max(0, t - ring + 1), t, device=mechanism.c.device)  # y_s, C_ts in the band
        weights = torch.zeros(used, dtype=history.dtype, device=history.device)  # row t mod ring (y_{t-ring}): 0
        weights[(earlier % ring).to(history.device)] = mechanism.c[t, earlier].to(history.device, history.dtype)
        combined = torch.matmul(weights, past)
        output = (fresh.to(history.dtype) - combined) / float(mechanism.c[t, t])
        if everyone:
            history[:, t % ring] = output
        else:
            history[index, t % ring] = output
        scales = mechanism.scales
        agents = torch.as_tensor([noise.agent_ids[row] for row in rows], dtype=torch.long, device=scales.device)
        scale = scales[agents].to(values.device, non_blocking=True)
        values.add_(output.to(values.dtype).mul_(scale[:, None].to(values.dtype)))

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        return self.mechanism.agent_event(owner, sample_rate, rows)

    receiver_event = agent_event
