"""The observer-view accountant in recursive form: a long run's view priced round by round (a Kalman filter).

:mod:`decentdp.privacy.observer_view` prices an observer's whole view at once, which costs
``(messages) x (noise draws)^2`` and so grows as ``(N T)^2`` (beyond this machine at N = 100, T = 2000).
Here an algorithm declares the same linear structure one round at a time, as a linear state-space model
(:class:`RecursiveViewBuilder`, the same calls as :class:`~decentdp.privacy.observer_view.ViewBuilder` plus
:meth:`~RecursiveViewBuilder.carry`)::

    messages of round t:   y_t     = H_t x_t + J_t xi_t        (each row to one receiver)
    carried state:         x_{t+1} = F_t x_t + L_t xi_t        (e.g. every agent's model; x_0 public)

with ``xi_t`` the round's fresh sources (noise draws and data terms, as in ``observer_view``).  For one
observer ``O`` (an agent or a colluding set: the rows sent to its members, the draws they hold known) the
Kalman filter over ``O``'s messages turns them into innovations ``nu_t = y_t - E[y_t | y_<t]``:
independent Gaussians of covariance ``S_t`` whose mean moves, between neighbouring datasets, by
``H_t e_t + J_t Delta_t`` where ``e_t`` (the filter's error in the state's mean) follows::

    e_{t+1} = A_t e_t + (L_t - K_t J_t) Delta_t,   A_t = F_t - K_t H_t,   K_t the Kalman gain.

By the chain rule the Mahalanobis form of ``observer_view`` is ``Delta^T M Delta = sum_t |S_t^{+1/2}
(H_t e_t + J_t Delta_t)|^2``, the same ``M``: for data changes that keep one direction (every
``Delta_j = s u``) this is computed exactly, ``O(T s^3)`` per observer for every sender at once
(:attr:`~decentdp.privacy.observer_view.ObserverLoss.mu_aligned`).

**The sound bound.**  The supremum over data changes that may turn every round needs every pair of rounds
(``sum |M_rs|``, ``O(T^2)``).  Instead, write the innovation shift of round ``t`` as ``sum_j C_{t,j} Delta_j``
over the sender's data terms ``j`` (released in round ``r_j <= t``) and apply Cauchy-Schwarz with
geometric weights ``rho^(t - r_j)`` (``0 < rho < 1``, at most ``n`` terms per round)::

    |sum_j C_{t,j} Delta_j|^2 <= (n / (1 - rho)) sum_j rho^-(t - r_j) |C_{t,j}|^2 s^2

so that, summed over ``t``, ``mu^2 <= s^2 n / (1 - rho) [sum_j |S^{+1/2} J e_j|^2 + rho^-1 sum_j
beta_j^T Pi_{r_j + 1} beta_j]`` with ``beta_j = (L - K J) e_j`` and the backward recursion
``Pi_t = H_t^T S_t^+ H_t + rho^-1 A_t^T Pi_{t+1} A_t``: ``O(T s^3)`` per observer and ``rho``, every sender
at once.  It is at least ``sum_t (sum_j |C_{t,j}|)^2 >= sum_rs |M_rs| >=`` the supremum (tested against the
dense accountant and against exact enumeration), and the smallest over :data:`RHOS` is reported.

**Noise the observer cannot see through.**  The whitening uses ``S_t``'s pseudo-inverse, which is exact
when every data shift lies in the noise's range.  That is checked once per distinct round: each data term's
column ``[J; L]`` must be a combination of the columns of the noise draws ``O`` does not hold (the sender's
gradient enters where its own noise does); then, by induction, every shift stays in the range of the
filter's covariance.  Where it is not, the sender's ``mu`` is ``inf`` (sound; the dense accountant decides
such cases exactly).  Adaptivity and sampling are as in ``observer_view``.

**Memory.**  Rounds whose matrices repeat (a fixed graph and learning rate) are stored once; per observer the
filter keeps each round's ``A_t``, ``S_t^{+1/2} H_t`` and ``beta`` for the backward pass.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from decentdp.privacy.observer_view import LEAK_TOLERANCE, RANK_TOLERANCE, ObserverLoss, ViewBuilder, sensitivity

#: The weights' ratios tried for the Cauchy-Schwarz bound (each is sound; the smallest result is kept):
#: a small ``rho`` suits views where a release is learnt in its own round (a neighbour), a large one views
#: where it trickles in over several rounds (a distant observer).
RHOS = np.array([0.01, 0.05, 0.15, 0.3, 0.5, 0.7, 0.85])
#: A ``rho`` whose backward matrix ``Pi`` grows past this many times the largest observed term ``H^T S^+ H``
#: is dropped: its bound is useless, and ``Pi`` that large (1e212 was seen, for a filter with a slow momentum
#: mode) loses its symmetry and definiteness to rounding, so ``beta^T Pi beta`` may come out negative.
PI_GROWTH_LIMIT = 1e8


class ViewTooLarge(ValueError):
    """The recursive view would take more memory than its builder was allowed."""


class ViewNotFinite(ValueError):
    """The filter's state overflowed (a carried state that grows without bound): nothing it computes bounds the
    view, so the caller falls back to the senders' local epsilons."""


@dataclass(frozen=True)
class RoundBlock:
    """One round of a :class:`RecursiveView`: its fresh sources, its messages ``H x + J xi`` and the carry
    ``x' = F x + L xi`` (``None`` for the last round).  Columns of ``J`` and ``L`` are split into the
    round's noise draws and its data terms."""

    noise_scale: np.ndarray      # (Z,) float64, units of C
    noise_holders: np.ndarray    # (Z, N) bool
    data_owner: np.ndarray       # (X,) int64
    receivers: np.ndarray        # (M,) int64
    h: np.ndarray                # (M, s)
    j_noise: np.ndarray          # (M, Z)
    j_data: np.ndarray           # (M, X)
    f: np.ndarray | None         # (s, s)
    l_noise: np.ndarray | None   # (s, Z)
    l_data: np.ndarray | None    # (s, X)

    def same_as(self, other: RoundBlock) -> bool:
        """Whether ``other`` has exactly these sources, messages and carry (then it is stored once)."""
        return all(_equal(getattr(self, name), getattr(other, name)) for name in self.__dataclass_fields__)

    @property
    def nbytes(self) -> int:
        """Memory the block's arrays take."""
        return sum(getattr(self, name).nbytes for name in self.__dataclass_fields__
                   if getattr(self, name) is not None)


def _equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(np.array_equal(a, b))


@dataclass(frozen=True)
class RecursiveView:
    """A run's messages as a linear state-space model: ``blocks[schedule[t]]`` is round ``t``."""

    n_agents: int
    state_size: int
    blocks: tuple[RoundBlock, ...]
    schedule: np.ndarray  # (T,) int64


class RecursiveViewBuilder:
    """Records an algorithm's rounds as a :class:`RecursiveView`, with the calls of
    :class:`~decentdp.privacy.observer_view.ViewBuilder` (which records each round, its first
    ``state_size`` columns the carried state, ``round_capacity`` more the round's fresh sources).

    The algorithm starts from public constants (:meth:`zeros`) and calls :meth:`carry` at the start of
    every round with the state expressions the last round left (which records ``F`` and ``L``); it gets
    back the state as unit rows over the new round's basis."""

    def __init__(self, n_agents: int, state_size: int, round_capacity: int, max_bytes: float = np.inf) -> None:
        self.n_agents = n_agents
        self.state_size = state_size
        self.round_capacity = round_capacity
        self.max_bytes = max_bytes
        self._blocks: list[RoundBlock] = []
        self._schedule: list[int] = []
        self._round: ViewBuilder | None = None

    @property
    def _current(self) -> ViewBuilder:
        if self._round is None:
            raise ValueError("a round's sources and messages come after carry() opens it")
        return self._round

    def zeros(self, rows: int) -> np.ndarray:
        """``rows`` expressions equal to zero (public constants, such as the common initial model)."""
        return np.zeros((rows, self.state_size + self.round_capacity))

    def noise(self, scales: Sequence[float] | np.ndarray, holders: Sequence[Collection[int]]) -> np.ndarray:
        """Fresh noise draws of this round (as :meth:`ViewBuilder.noise`)."""
        return self._current.noise(scales, holders)

    def data(self, owners: Sequence[int] | np.ndarray, classes: Sequence[int] | np.ndarray | None = None
             ) -> np.ndarray:
        """Fresh data terms of this round (as :meth:`ViewBuilder.data`; ``classes`` are not used here, where every
        term of a sender may move together: sound, and looser under cyclic participation)."""
        return self._current.data(owners)

    def send(self, receivers: Sequence[int] | np.ndarray, expressions: np.ndarray) -> None:
        """Record that agent ``receivers[i]`` receives the message ``expressions[i]`` this round."""
        self._current.send(receivers, expressions)

    def carry(self, state: np.ndarray) -> np.ndarray:
        """Close the current round with ``state`` (its expressions of the next round's carried state) and
        open the next: the state as unit rows over the new basis.  The first call takes public constants."""
        state = np.asarray(state, dtype=np.float64)
        width = self.state_size + self.round_capacity
        if state.shape != (self.state_size, width):
            raise ValueError(f"the carried state must be {self.state_size} expressions, not {state.shape[0]}")
        if self._round is not None:
            self._close(state)
        elif np.any(state):
            raise ValueError("the first carried state must be public constants (the common initial model)")
        self._round = ViewBuilder(self.n_agents, self.round_capacity, reserved=self.state_size)
        return np.eye(self.state_size, width)

    def _close(self, carry: np.ndarray | None) -> None:
        round_ = self._current
        receivers, messages = round_.messages()
        h, j_noise, j_data = round_.split(messages)
        f, l_noise, l_data = (None, None, None) if carry is None else round_.split(carry)
        scale, holders, owners = round_.sources()
        block = RoundBlock(scale, holders, owners, receivers, h, j_noise, j_data, f, l_noise, l_data)
        if self._blocks and self._blocks[-1].same_as(block):
            self._schedule.append(len(self._blocks) - 1)
            return
        if sum(b.nbytes for b in self._blocks) + block.nbytes > self.max_bytes:
            raise ViewTooLarge(f"the recursive view needs more than {self.max_bytes / 2**30:.3g} GiB")
        self._blocks.append(block)
        self._schedule.append(len(self._blocks) - 1)

    def view(self) -> RecursiveView:
        """Every round recorded, the last one closed without a carry."""
        if self._round is not None:
            self._close(None)
            self._round = None
        return RecursiveView(self.n_agents, self.state_size, tuple(self._blocks), np.array(self._schedule))


def recursive_cost(view: RecursiveView, observers: int) -> tuple[float, float]:
    """Upper estimates of (floating-point operations, bytes) of :func:`recursive_mu` for ``observers``
    observers, as if no round were reused: the forward filter and :data:`RHOS`' backward passes cost
    ``~(2 + 4 len(RHOS)) s^3`` per round and observer, and one observer's stored rounds take ``2 s^2 + s X``
    numbers each (``X`` data terms per round).  Rounds reused once the filter is steady cost far less."""
    s, rounds = view.state_size, len(view.schedule)
    data = max((len(block.data_owner) for block in view.blocks), default=0)
    messages = max((len(block.receivers) for block in view.blocks), default=0)
    per_round = (2 + 4 * len(RHOS)) * s**3 + 4.0 * s * s * (messages / max(view.n_agents, 1) + data)
    return observers * rounds * per_round, 8.0 * rounds * (2 * s * s + s * data)


def recursive_mu(view: RecursiveView, observers: Sequence[Collection[int]], relation: str = "add-remove",
                 ) -> ObserverLoss:
    """Each sender's Gaussian-DP ``mu`` towards each observer: the sound bound (rows: senders) and the exact
    same-direction value, as described in the module docstring."""
    scale = sensitivity(relation)
    n = view.n_agents
    mu = np.full((n, len(observers)), np.nan)
    aligned = np.full_like(mu, np.nan)
    per_round = _terms_per_round(view)
    for column, observer in enumerate(observers):
        members = sorted(set(observer))
        bound, same = _observer(view, members, per_round)
        others = np.setdiff1d(np.arange(n), members)
        mu[others, column], aligned[others, column] = bound[others], same[others]
    return ObserverLoss(scale * np.sqrt(mu), scale * np.sqrt(aligned))


def _terms_per_round(view: RecursiveView) -> np.ndarray:
    """Each agent's largest number of data terms in one round (``n`` of the bound)."""
    counts = np.zeros(view.n_agents, dtype=np.int64)
    for block in view.blocks:
        counts = np.maximum(counts, np.bincount(block.data_owner, minlength=view.n_agents))
    return counts


@dataclass
class _Round:
    """One filtered round: what the same-direction pass and the backward pass need of it."""

    a: np.ndarray | None        # A_t = F - K H (None: the last round)
    whitened_h: np.ndarray      # S^{+1/2} H
    whitened_j: np.ndarray      # S^{+1/2} J on the data terms
    beta: np.ndarray | None     # (L - K J) on the data terms
    owners: np.ndarray          # (data terms, N) one-hot: whose data term each is

    @property
    def direct(self) -> np.ndarray:
        """``|S^{+1/2} J e_j|^2`` per data term."""
        return np.einsum("ij,ij->j", self.whitened_j, self.whitened_j)


def _observer(view: RecursiveView, members: list[int], per_round: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu^2 bound, exact same-direction mu^2) of every sender towards one observer, in units of the
    sensitivity; ``inf`` for a sender whose data the observer may see without noise.

    Where a round repeats the last one (a fixed graph and learning rate) and the filter's covariance has
    stopped moving (:data:`STEADY_TOLERANCE`), the last filtered round is reused as it is."""
    n, s = view.n_agents, view.state_size
    covariance = np.zeros((s, s))                  # the initial state is public
    error = np.zeros((s, n))                       # e_t for every sender's same-direction change
    aligned = np.zeros(n)
    leaks = np.zeros(n, dtype=bool)
    checked: dict[int, np.ndarray] = {}
    rounds: list[_Round] = []
    previous, steady = -1, False
    for index in view.schedule.tolist():
        steady = steady and index == previous
        if not steady:
            block = view.blocks[index]
            if index not in checked:
                checked[index] = _leaking_owners(block, members, n)
            leaks |= checked[index]
            step, updated = _filter_round(block, members, covariance, n)
            steady = index == previous and _same(updated, covariance)
            covariance = updated
        rounds.append(step)
        shift = step.whitened_h @ error + step.whitened_j @ step.owners
        aligned += np.einsum("ij,ij->j", shift, shift)
        if step.a is not None:
            error = step.a @ error + step.beta @ step.owners
        previous = index
    bound = _backward(rounds, n, s) * per_round
    bound[leaks] = np.inf
    aligned[leaks] = np.inf
    return bound, aligned


def _filter_round(block: RoundBlock, members: list[int], covariance: np.ndarray, n: int,
                  ) -> tuple[_Round, np.ndarray]:
    """One Kalman step over the messages ``members`` receive: the round's terms and the next state's
    covariance given every message so far (the noise the members hold is known, so left out)."""
    seen = np.isin(block.receivers, members)
    unknown = ~block.noise_holders[:, members].any(axis=1) & (block.noise_scale > 0)
    h, j_data = block.h[seen], block.j_data[seen]
    j_noise = block.j_noise[seen][:, unknown] * block.noise_scale[unknown]
    whiten = _whitening(h @ covariance @ h.T + j_noise @ j_noise.T)           # S^{+1/2}: S^+ = W^T W
    owners = np.zeros((len(block.data_owner), n))
    owners[np.arange(len(block.data_owner)), block.data_owner] = 1.0
    a = beta = None
    if block.f is not None:
        l_noise = block.l_noise[:, unknown] * block.noise_scale[unknown]
        gain = (block.f @ covariance @ h.T + l_noise @ j_noise.T) @ whiten.T @ whiten
        a = block.f - gain @ h
        residual = l_noise - gain @ j_noise
        covariance = a @ covariance @ a.T + residual @ residual.T               # Joseph form: stays PSD
        covariance = (covariance + covariance.T) / 2
        beta = block.l_data - gain @ j_data
    return _Round(a, whiten @ h, whiten @ j_data, beta, owners), covariance


#: Relative change below which a repeated computation counts as converged: the filter's covariance between
#: two identical rounds, or the backward matrices within a stretch of identical rounds; past it the last
#: round is reused (the difference is rounding error of the same size as the computation's own).
STEADY_TOLERANCE = 1e-12


def _same(new: np.ndarray, old: np.ndarray) -> bool:
    """Whether ``new`` equals ``old`` up to :data:`STEADY_TOLERANCE` of its largest entry (both finite)."""
    scale = float(np.max(np.abs(new))) if new.size else 0.0
    return bool(np.all(np.isfinite(new)) and np.max(np.abs(new - old), initial=0.0) <= STEADY_TOLERANCE * scale)


def _whitening(innovation: np.ndarray) -> np.ndarray:
    """``W`` with ``W^T W`` the pseudo-inverse of the PSD matrix ``innovation`` (zero directions dropped)."""
    if innovation.size == 0:
        return np.zeros((0, innovation.shape[0]))
    if not np.all(np.isfinite(innovation)):  # eigh would give NaN and drop the round's messages
        raise ViewNotFinite("the filter's innovation covariance is not finite")
    values, vectors = np.linalg.eigh((innovation + innovation.T) / 2)
    keep = values > RANK_TOLERANCE * max(float(values[-1]), 0.0) if values[-1] > 0 else np.zeros(len(values), bool)
    return (vectors[:, keep] / np.sqrt(values[keep])).T


def _leaking_owners(block: RoundBlock, members: list[int], n: int) -> np.ndarray:
    """Senders with a data term of this round outside the range of the noise the observer does not hold
    (over its messages and the carry): the sufficient check of the module docstring."""
    seen = np.isin(block.receivers, members)
    unknown = ~block.noise_holders[:, members].any(axis=1) & (block.noise_scale > 0)
    def stack(messages: np.ndarray, carried: np.ndarray | None) -> np.ndarray:
        return messages if carried is None else np.concatenate([messages, carried])

    data = stack(block.j_data[seen], block.l_data)
    noise = stack(block.j_noise[seen][:, unknown], None if block.l_noise is None else block.l_noise[:, unknown])
    leaks = np.zeros(n, dtype=bool)
    if data.size == 0 or not np.any(data):
        return leaks
    if noise.size:
        u, singular, _ = np.linalg.svd(noise, full_matrices=False)
        basis = u[:, singular > RANK_TOLERANCE * singular[0]] if singular[0] > 0 else u[:, :0]
        outside = data - basis @ (basis.T @ data)
    else:
        outside = data
    far = ~(np.linalg.norm(outside, axis=0) <= LEAK_TOLERANCE * np.maximum(np.linalg.norm(data, axis=0), 1e-300))
    leaks[block.data_owner[far & np.any(data, axis=0)]] = True
    return leaks


def _backward(rounds: list[_Round], n: int, s: int) -> np.ndarray:
    """``min over rho of (1 / (1 - rho)) [sum_j direct_j + rho^-1 sum_j beta_j^T Pi_{r_j+1} beta_j]`` per
    sender (``n`` of the bound left to the caller), with ``Pi`` the backward recursion of the docstring
    run for every ``rho`` of :data:`RHOS` at once.

    A stretch of identical rounds is iterated until ``Pi`` stops moving, then its remaining rounds are
    counted at once.  For such a stretch the ``rho`` at or below ``|eig(A)|^2`` (where ``Pi`` would grow
    without bound) are dropped, and so is any ``rho`` whose ``Pi`` outgrows :data:`PI_GROWTH_LIMIT` or gives
    a clearly negative ``beta^T Pi beta`` (rounding has taken over): leaving a ``rho`` out of the minimum
    is always sound.  A sender left with no ``rho`` gets ``inf``, never NaN."""
    pi = np.zeros((len(RHOS), s, s))
    later = np.zeros((len(RHOS), n))
    direct = np.zeros(n)
    active = np.ones(len(RHOS), dtype=bool)
    observed_scale = 0.0
    for step, count in _stretches(rounds):
        if step.a is not None and count > 1 and s:
            active &= RHOS > float(np.max(np.abs(np.linalg.eigvals(step.a)))) ** 2
        observed_scale = max(observed_scale, float(np.linalg.norm(step.whitened_h.T @ step.whitened_h)))
        done = 0
        while done < count:
            updated = _backward_step(step, pi, active, direct, later, repeat=1)
            done += 1
            if done < count and _same(updated[active], pi[active]):
                _backward_step(step, updated, active, direct, later, repeat=count - done)
                done = count
            pi = updated
            with np.errstate(over="ignore", invalid="ignore"):
                size = np.linalg.norm(pi.reshape(len(RHOS), s * s), axis=1)
            active &= np.isfinite(size) & (size <= PI_GROWTH_LIMIT * observed_scale)
    with np.errstate(over="ignore", invalid="ignore"):
        totals = (direct + later) / (1 - RHOS[:, None])
    totals[~active] = np.inf
    totals = np.where(np.isfinite(totals) & (totals >= 0), totals, np.inf)
    return totals.min(axis=0)


def _stretches(rounds: list[_Round]) -> list[tuple[_Round, int]]:
    """The rounds from last to first, consecutive repeats of one filtered round counted together."""
    out: list[tuple[_Round, int]] = []
    for step in reversed(rounds):
        if out and out[-1][0] is step:
            out[-1] = (step, out[-1][1] + 1)
        else:
            out.append((step, 1))
    return out


def _backward_step(step: _Round, pi: np.ndarray, active: np.ndarray, direct: np.ndarray, later: np.ndarray,
                   repeat: int) -> np.ndarray:
    """Add ``repeat`` times round ``step``'s terms (given ``Pi_{t+1} = pi``) to ``direct`` and ``later``;
    return ``Pi_t`` (for the active ``rho``; the others are left as they were).  A ``rho`` whose terms come
    out clearly negative is switched off in ``active``."""
    np.add.at(direct, step.owners.argmax(axis=1), repeat * step.direct)
    observed = step.whitened_h.T @ step.whitened_h
    if step.beta is None:
        return np.broadcast_to(observed, pi.shape).copy()
    updated = pi.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        if step.beta.size:
            terms = np.einsum("rij,ij->rj", pi[active] @ step.beta, step.beta) / RHOS[active, None]
            # beta^T Pi beta >= 0 for the PSD Pi: a term below -1e-9 |Pi| |beta|^2 is rounding gone wild
            scale = np.linalg.norm(pi[active].reshape(int(active.sum()), pi[0].size), axis=1)[:, None] \
                * np.einsum("ij,ij->j", step.beta, step.beta)[None, :] / RHOS[active, None]
            broken = np.any(terms < -1e-9 * scale, axis=1)
            later[active] += repeat * np.maximum(terms, 0.0) @ step.owners
            active[np.flatnonzero(active)[broken]] = False
        product = step.a.T @ pi[active] @ step.a
        updated[active] = observed + (product + product.transpose(0, 2, 1)) / (2 * RHOS[active, None, None])
    return updated
