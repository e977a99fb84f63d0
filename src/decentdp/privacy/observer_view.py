"""The observer-view accountant: what one observer learns of each sender when messages share noise.

The per-release ledger (:mod:`decentdp.privacy.ledger`) is exact when every message carries fresh,
independent noise.  When several messages carry the *same* noise draw (Muffliato gossips one noisy
injection through many messages), or noise is reused and re-mixed across rounds (TOP-DP, DECOR), an
observer can combine the messages it sees and cancel noise that per-message composition assumed
independent.  This module prices the observer's whole view instead.

**The model (linear-Gaussian, one coordinate).**  Every message is a linear combination of *sources*:
noise draws ``z_k ~ N(0, s_k^2)`` (``s_k`` the noise multiplier: in units of the clip norm ``C``) and
*data terms* ``x_{u,r}``, agent ``u``'s clipped gradient sum of release ``r`` divided by ``C`` (norm at
most 1; the released update is the same combination coordinate by coordinate).  An observer ``O`` (one
agent, or a colluding set) sees the messages sent to its members and knows the noise its members hold
(their own draws; both ends of an edge secret).  For sender ``u`` outside ``O`` the worst-case DP
adversary also knows every other agent's data, so what remains is ``y = A x_u + B z`` with ``z`` the
noise ``O`` does not hold.  Two neighbouring datasets shift the mean of ``y`` by ``A Delta`` (``Delta_r``
the change of ``u``'s data term of release ``r``: ``|Delta_r| <= 1`` under add/remove, ``<= 2`` under
replace-one) and leave its covariance ``B B^T`` alone, so the view is ``mu``-Gaussian DP with::

    mu^2 = sup_Delta  Delta^T M Delta,        M = A^T (B B^T)^+ A                      (Mahalanobis form)

and ``mu = inf`` when some ``A Delta`` leaves the range of ``B`` (data the observer sees without noise).
With ``d``-dimensional gradients each ``Delta_r`` is a vector, and the supremum over unit vectors is
bounded by ``sum_rs |M_rs|`` and by ``R lambda_max(M)`` (``R`` releases); the smaller is reported
(:func:`observer_mu`).  Both equal the exact supremum, ``1^T M 1``, when ``M`` has no negative entry; the
same-direction value ``1^T M 1`` is reported beside them (:attr:`ObserverLoss.mu_aligned`).  This is the
sensitivity bound of the matrix-mechanism literature (Choquette-Choo et al., ME-MF, ICML 2023; the
MFDL code of Bellet, Cyffers et al., ICLR 2026, uses ``sum |X|`` with ``X = B^+ B``).

**Adaptivity: what is computed here holds for data terms fixed in advance.**  Later data terms depend on
earlier messages (the gradient is taken at the model the messages built).  For causal linear-Gaussian
releases the adaptive view has the non-adaptive view's ``mu`` when each data term is a function of the
*observer's* earlier outputs (Denisov et al., NeurIPS 2022, Thm. 2.1).  An observer that sees only the
messages sent to it does not see the model at which the sender took its gradient, and that model carries
noise the observer does not hold; the shift then correlates with noise in the view, and the loss can exceed
this ``mu``: Muffliato on a path 0-1-2-3 (K = 1, T = 3, full batches, sigma = 30, 0.2, 0.2, 0.2), sender 1,
observer 3, a record whose clipped gradient steps with the sender's model: exact epsilon 7.61 at delta 1e-5
where this computes 7.54 (``experiments/privacy/adaptive_observer.py``, by quadrature).  So callers report
these figures as ``nonadaptive_`` ones (:mod:`decentdp.privacy.observer_pricing`), and the sound bound for
every observer is the sender's own epsilon: an observer of *every* message sees every model, every data term
is a function of its view, and Denisov's theorem applies to it (DECOR's observer, :mod:`decentdp.privacy.
correlated`, is of that kind).

**Sampling.**  No amplification by Poisson sampling is claimed for a correlated view (none is proven for
these structures in general): ``mu`` is the full-batch value, an upper bound for a sampled run too.  A
caller may report the smaller of this and a sound per-release bound (e.g. the sender's local epsilon,
which every observer's view is post-processing of).

**Cost.**  One SVD of ``B`` per observer: the view is built explicitly (:class:`ViewBuilder`), so this
accountant serves small and medium runs (tests, quick starts, the N = 10 tables); :func:`dense_cost`
estimates the work before anything is built.  Longer runs are priced round by round by the recursive form
(:mod:`decentdp.privacy.observer_filter`); :mod:`decentdp.privacy.observer_pricing` chooses.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from decentdp.privacy.accounting import gaussian_dp_epsilon

#: Relative size below which a singular value of the noise map counts as zero (no noise in that direction).
RANK_TOLERANCE = 1e-10
#: Relative size of the part of the data map outside the noise's range above which the observer is
#: said to see the sender's data without noise (``mu = inf``); below it, the part is rounding error.
LEAK_TOLERANCE = 1e-7


@dataclass(frozen=True)
class LinearView:
    """Every message of a run as a linear combination of noise draws and data terms (one coordinate).

    ``noise_scale[k]`` is draw ``k``'s standard deviation in units of C, ``noise_holders[k, a]`` whether
    agent ``a`` knows draw ``k``; ``data_owner[x]`` is the agent whose clipped sum data term ``x`` is;
    message ``m`` goes to agent ``receivers[m]`` and equals ``noise[m] . z + data[m] . x``.  ``data_class[x]``
    is the participation class of data term ``x`` (cyclic sampling: its round mod ``b``): one record of an
    agent takes part in the terms of one class of that agent only."""

    n_agents: int
    noise_scale: np.ndarray      # (Z,) float64
    noise_holders: np.ndarray    # (Z, N) bool
    data_owner: np.ndarray       # (X,) int64
    receivers: np.ndarray        # (M,) int64
    noise: np.ndarray            # (M, Z) float64
    data: np.ndarray             # (M, X) float64
    data_class: np.ndarray | None = None  # (X,) int64: a record moves the terms of one class of its owner (None: all)


class ViewBuilder:
    """Unrolls an algorithm's releases into a :class:`LinearView`.

    An *expression* is a row of coefficients over every source created so far (``capacity`` columns,
    an upper bound the caller gives): :meth:`noise` and :meth:`data` return fresh sources as unit
    rows, algorithms combine rows with ordinary numpy arithmetic (stacked agent rows, as their rounds
    combine tensors) and :meth:`send` records what each receiver sees.  The first ``reserved`` columns
    are not sources: the recursive builder of :mod:`decentdp.privacy.observer_filter` keeps one round's
    carried state there."""

    def __init__(self, n_agents: int, capacity: int, reserved: int = 0) -> None:
        self.n_agents = n_agents
        self.reserved = reserved
        self.capacity = reserved + capacity
        self._used = reserved
        self._is_noise = np.zeros(self.capacity, dtype=bool)
        self._scale = np.zeros(self.capacity)
        self._holders = np.zeros((self.capacity, n_agents), dtype=bool)
        self._owner = np.full(self.capacity, -1, dtype=np.int64)
        self._class = np.zeros(self.capacity, dtype=np.int64)
        self._messages: list[np.ndarray] = []
        self._receivers: list[np.ndarray] = []

    def zeros(self, rows: int) -> np.ndarray:
        """``rows`` expressions equal to zero (public constants, such as the common initial model)."""
        return np.zeros((rows, self.capacity))

    def _fresh(self, count: int) -> np.ndarray:
        if self._used + count > self.capacity:
            raise ValueError(f"the view needs more than its capacity of {self.capacity} sources")
        columns = np.arange(self._used, self._used + count)
        self._used += count
        return columns

    def noise(self, scales: Sequence[float] | np.ndarray, holders: Sequence[Collection[int]]) -> np.ndarray:
        """One fresh noise draw per entry, of standard deviation ``scales[i]`` (units of C), known to the
        agents ``holders[i]``: unit expressions, one row each."""
        scales = np.asarray(scales, dtype=np.float64)
        columns = self._fresh(len(scales))
        self._is_noise[columns] = True
        self._scale[columns] = scales
        for column, agents in zip(columns.tolist(), holders, strict=True):
            self._holders[column, list(agents)] = True
        return self._units(columns)

    def data(self, owners: Sequence[int] | np.ndarray, classes: Sequence[int] | np.ndarray | None = None
             ) -> np.ndarray:
        """One fresh data term per entry: agent ``owners[i]``'s clipped sum of one release, over C, in participation
        class ``classes[i]`` (default 0: one record may move every term of its owner)."""
        owners = np.asarray(owners, dtype=np.int64)
        columns = self._fresh(len(owners))
        self._owner[columns] = owners
        if classes is not None:
            self._class[columns] = np.broadcast_to(np.asarray(classes, dtype=np.int64), (len(owners),))
        return self._units(columns)

    def _units(self, columns: np.ndarray) -> np.ndarray:
        rows = np.zeros((len(columns), self.capacity))
        rows[np.arange(len(columns)), columns] = 1.0
        return rows

    def carry(self, state: np.ndarray) -> np.ndarray:
        """The state an algorithm carries into its next round: unchanged here, where every source keeps its
        own column for the whole run (the recursive builder of :mod:`decentdp.privacy.observer_filter`
        starts a new round's basis instead)."""
        return state

    def send(self, receivers: Sequence[int] | np.ndarray, expressions: np.ndarray) -> None:
        """Record that agent ``receivers[i]`` receives the message ``expressions[i]``."""
        receivers = np.asarray(receivers, dtype=np.int64)
        if len(receivers):
            self._messages.append(np.asarray(expressions, dtype=np.float64).reshape(len(receivers), -1))
            self._receivers.append(receivers)

    def messages(self) -> tuple[np.ndarray, np.ndarray]:
        """Every message recorded so far: ``(receivers, expressions)``."""
        messages = np.concatenate(self._messages) if self._messages else np.zeros((0, self.capacity))
        receivers = np.concatenate(self._receivers) if self._receivers else np.zeros(0, dtype=np.int64)
        return receivers, messages

    def split(self, expressions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``expressions``' coefficients on the reserved columns, on the noise draws and on the data terms."""
        used = np.arange(self.reserved, self._used)
        noise, data = used[self._is_noise[used]], used[~self._is_noise[used]]
        return expressions[:, :self.reserved], expressions[:, noise], expressions[:, data]

    def sources(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The noise draws' scales and holders, and the data terms' owners, in :meth:`split`'s order."""
        used = np.arange(self.reserved, self._used)
        noise, data = used[self._is_noise[used]], used[~self._is_noise[used]]
        return self._scale[noise], self._holders[noise], self._owner[data]

    def view(self) -> LinearView:
        """The messages recorded so far, as one :class:`LinearView`."""
        receivers, messages = self.messages()
        _, noise, data = self.split(messages)
        used = np.arange(self.reserved, self._used)
        classes = self._class[used[~self._is_noise[used]]]
        return LinearView(self.n_agents, *self.sources(), receivers, noise, data, classes)


@dataclass(frozen=True)
class ObserverLoss:
    """Per sender (rows) and observer (columns): the Gaussian-DP ``mu`` of the observer's view of the
    sender (the sound bound, and the same-direction value), ``nan`` where the sender is in the observer."""

    mu: np.ndarray
    mu_aligned: np.ndarray

    def epsilon(self, delta: float) -> np.ndarray:
        """``(senders, observers)`` epsilons at ``delta`` of the sound ``mu`` (exact Gaussian conversion)."""
        out = np.full(self.mu.shape, np.nan)
        for index, mu in np.ndenumerate(self.mu):
            if not np.isnan(mu):
                out[index] = gaussian_dp_epsilon(float(mu), delta)
        return out


def sensitivity(relation: str) -> float:
    """How far one data term moves between neighbouring datasets, in units of C: a record added or
    removed changes a clipped sum by at most C, a replaced one by at most 2C."""
    return 2.0 if relation == "replace-one" else 1.0


def dense_cost(observed_rows: Sequence[int], noise_columns: int, data_columns: int) -> float:
    """Floating-point operations of :func:`observer_mu` for observers that see ``observed_rows[o]`` messages
    each, over ``noise_columns`` unknown draws and ``data_columns`` data terms (the SVDs dominate): to
    decide before building a view whether it is affordable."""
    return sum(4.0 * rows * noise_columns * min(rows, noise_columns)
               + 2.0 * rows * data_columns * min(rows, noise_columns) for rows in observed_rows)


def observer_mu(view: LinearView, observers: Sequence[Collection[int]], relation: str = "add-remove",
                ) -> ObserverLoss:
    """The Gaussian-DP ``mu`` of each sender towards each observer (a collection of agents that pool
    their messages and noise), as described in the module docstring."""
    scale = sensitivity(relation)
    mu = np.full((view.n_agents, len(observers)), np.nan)
    aligned = np.full_like(mu, np.nan)
    for column, observer in enumerate(observers):
        members = sorted(set(observer))
        seen = np.isin(view.receivers, members)
        unknown = ~view.noise_holders[:, members].any(axis=1) & (view.noise_scale > 0)
        noise = view.noise[seen][:, unknown] * view.noise_scale[unknown]
        basis, singular = _range(noise)
        data = view.data[seen]
        classes = np.zeros(len(view.data_owner), dtype=np.int64) if view.data_class is None else view.data_class
        for sender in range(view.n_agents):
            if sender in members:
                continue
            own = view.data_owner == sender
            values = [_sender_mu(data[:, own & (classes == k)], basis, singular) for k in np.unique(classes[own])]
            mu[sender, column] = max((value[0] for value in values), default=0.0)  # a record is in one class
            aligned[sender, column] = max((value[1] for value in values), default=0.0)
    return ObserverLoss(mu * scale, aligned * scale)


def _range(noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An orthonormal basis of the noise map's range and its singular values (zero ones dropped)."""
    if noise.size == 0:
        return np.zeros((noise.shape[0], 0)), np.zeros(0)
    u, s, _ = np.linalg.svd(noise, full_matrices=False)
    keep = s > RANK_TOLERANCE * s[0] if len(s) and s[0] > 0 else np.zeros(len(s), dtype=bool)
    return u[:, keep], s[keep]


def _sender_mu(a: np.ndarray, basis: np.ndarray, singular: np.ndarray) -> tuple[float, float]:
    """``(sqrt(min(sum |M|, R lambda_max(M))), sqrt(1^T M 1))`` for data map ``a`` (rows: messages, columns:
    the sender's releases), or ``inf`` for both when part of ``a`` lies outside the noise's range."""
    if a.size == 0 or not np.any(a):
        return 0.0, 0.0
    coordinates = basis.T @ a
    outside = np.linalg.norm(a - basis @ coordinates)
    if not outside <= LEAK_TOLERANCE * np.linalg.norm(a):  # (NaN: nothing shows the data is hidden)
        return np.inf, np.inf
    whitened = coordinates / singular[:, None]
    m = whitened.T @ whitened
    if not np.all(np.isfinite(m)):
        return np.inf, np.inf
    bound = min(float(np.abs(m).sum()), m.shape[0] * float(np.linalg.eigvalsh(m)[-1]))
    return float(np.sqrt(max(bound, 0.0))), float(np.sqrt(max(float(m.sum()), 0.0)))

