"""Privacy ledgers: every event each agent released, who observed it, and a budget it cannot exceed.

Following ``dp_accounting``'s design, the ledger stores *events* (immutable descriptions of what was
released, :mod:`decentdp.privacy.events`), never a formula computed beforehand; every epsilon we
report is computed from them afterwards.  Mechanisms write the events themselves
(:mod:`decentdp.privacy.mechanisms`), so the ledger holds exactly what ran.

Three views, each a set of *accounts* (one release history each):

* the **agent** view, account ``i``: everything agent ``i`` released, as seen by all observers
  together (colluding neighbours, or the whole network).  Budgets are enforced on this view, and
  its epsilon is the per-agent epsilon every run reports.
* the **broadcast** view: what agent ``i`` released to *everyone*;
* the **pair** view, account ``(i, j)``: what agent ``i`` released to receiver ``j`` alone (a
  per-edge message, e.g. TOP-DP's per-receiver noise or a cross-gradient).

What receiver ``j`` learned about ``i`` is the composition of ``i``'s broadcast and pair accounts:
:meth:`PrivacyLedger.pairwise_epsilon`.  A release sent to one receiver charges the sender's agent
account with the event the mechanism names for all observers together (which may be weaker than
the per-receiver event, as when a receiver's protection relies on noise it does not know) and the
pair account with the event that receiver observed.  The broadcast view is materialised only at the
first per-receiver release (until then it equals the agent view).

Storage keeps a run long enough for a million releases a handful of numbers, and
:meth:`PrivacyLedger.charge` a few array operations over the accounts: each account's history is
run-length encoded as runs of one event (closed runs in a list, the current run in arrays), with a
running RDP total of its closed runs, so that composition stays linear in the number of releases
whatever the events.  Beside it sits each account's *headroom*: how many more releases of one
event fit in the budget, consulted again only when the agent's event changes.  With the RDP
accountant the headroom has a closed form over the orders (checked against dp_accounting's
conversion); with PLD it is an aimed search over cached compositions (:func:`_largest_within`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import dp_accounting
import numpy as np

from decentdp.privacy.accounting import (
    DEFAULT_RELATION,
    RDP_ORDERS,
    History,
    check_epsilon_delta,
    check_relation,
    epsilon_of_history,
    rdp_curve,
    rdp_epsilon,
)
from decentdp.privacy.events import EventTable, gaussian_event

UNLIMITED = 1 << 40
"""Headroom of an agent without a budget."""

_NO_EVENT = -1
NEVER = -(1 << 62)
""":meth:`PrivacyLedger.last_rounds` of an agent that has released nothing."""


class _Accounts:
    """Run-length encoded release histories of a growing number of accounts (event ids of one table)."""

    def __init__(self, size: int = 0) -> None:
        self.closed: list[list[list[int]]] = []  # per account: closed runs [event, count, first_round, last_round]
        self.closed_count = np.zeros(0, dtype=np.int64)
        self.closed_rdp = np.zeros((0, len(RDP_ORDERS)))  # running RDP total of the closed runs, oldest first
        self.event = np.zeros(0, dtype=np.int64)           # the current run (event id, or _NO_EVENT)
        self.count = np.zeros(0, dtype=np.int64)
        self.first = np.zeros(0, dtype=np.int64)
        self.last = np.zeros(0, dtype=np.int64)
        self.grow(size)

    def __len__(self) -> int:
        return len(self.closed)

    def grow(self, extra: int) -> None:
        """Append ``extra`` empty accounts."""
        self.closed.extend([] for _ in range(extra))
        self.closed_count = np.concatenate([self.closed_count, np.zeros(extra, dtype=np.int64)])
        self.closed_rdp = np.concatenate([self.closed_rdp, np.zeros((extra, len(RDP_ORDERS)))])
        self.event = np.concatenate([self.event, np.full(extra, _NO_EVENT, dtype=np.int64)])
        for name in ("count", "first", "last"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype=np.int64)]))

    def copy(self) -> _Accounts:
        other = _Accounts()
        other.closed = [[list(run) for run in runs] for runs in self.closed]
        for name in ("closed_count", "closed_rdp", "event", "count", "first", "last"):
            setattr(other, name, getattr(self, name).copy())
        return other

    def runs(self, account: int) -> list[list[int]]:
        """The account's runs ``[event, count, first_round, last_round]``, oldest first (copies)."""
        current = [[int(self.event[account]), int(self.count[account]), int(self.first[account]),
                    int(self.last[account])]] if self.event[account] != _NO_EVENT else []
        return [list(run) for run in self.closed[account]] + current

    def history(self, account: int, table: EventTable) -> History:
        return tuple((table[event], count) for event, count, _, _ in self.runs(account))

    def releases(self) -> np.ndarray:
        return self.closed_count + np.where(self.event != _NO_EVENT, self.count, 0)

    def rdp(self, account: int, table: EventTable) -> np.ndarray:
        """The account's RDP total, composed in the order :func:`~decentdp.privacy.accounting.rdp_total` uses."""
        if self.event[account] == _NO_EVENT or self.count[account] == 0:
            return self.closed_rdp[account]
        return self.closed_rdp[account] + self.count[account] * rdp_curve(table[int(self.event[account])])

    def record(self, round_index: int, accounts: np.ndarray, events: np.ndarray, count: int,
               table: EventTable) -> None:
        """Append ``count`` releases of ``events[k]`` to ``accounts[k]`` (distinct accounts)."""
        extends = self.event[accounts] == events
        for k in np.flatnonzero(~extends):  # a new run: close the current one (only when the event changes)
            account = int(accounts[k])
            if self.event[account] != _NO_EVENT:
                event = int(self.event[account])
                self.closed[account].append([event, int(self.count[account]), int(self.first[account]),
                                             int(self.last[account])])
                self.closed_count[account] += self.count[account]
                if self.count[account]:  # (0 times an infinite order would be NaN)
                    self.closed_rdp[account] = self.closed_rdp[account] + self.count[account] * rdp_curve(table[event])
        starts = accounts[~extends]
        self.event[starts] = events[~extends]
        self.count[starts] = 0
        self.first[starts] = round_index
        self.count[accounts] += count
        self.last[accounts] = round_index

    def state(self) -> list[list[list[int]]]:
        return [self.runs(account) for account in range(len(self))]

    @classmethod
    def from_state(cls, saved: list[list[list[int]]], table: EventTable) -> _Accounts:
        accounts = cls(len(saved))
        for account, runs in enumerate(saved):
            for event, count, first, last in runs:
                accounts.record(first, np.array([account]), np.array([event]), count, table)
                accounts.last[account] = last
        return accounts


def _fits_rdp(prefix_rdp: np.ndarray, event: dp_accounting.DpEvent, total: int, budget: float,
              delta: float) -> bool:
    """Whether a history of RDP ``prefix_rdp`` followed by ``total`` releases of ``event`` stays within
    ``budget``, decided exactly as dp_accounting's conversion decides it: by the vectorised conversion
    where it is clear of the budget, by dp_accounting's own near it."""
    curve = prefix_rdp + total * rdp_curve(event) if total else prefix_rdp  # (0 * an infinite order is NaN)
    fast = _rdp_epsilon_fast(curve, delta)
    if abs(fast - budget) > 1e-9 * max(1.0, budget):
        return fast <= budget
    return rdp_epsilon(curve, delta) <= budget


def _fits_history(history: History, event: dp_accounting.DpEvent, total: int, budget: float, delta: float,
                  accountant: str, relation: str) -> bool:
    """Whether ``history`` followed by ``total`` releases of ``event`` stays within ``budget`` (any accountant)."""
    return epsilon_of_history((*history, (event, total)), delta, accountant, relation) <= budget


def _rdp_guess(prefix_rdp: np.ndarray, event: dp_accounting.DpEvent, budget: float, delta: float) -> int:
    """The largest total count ``c`` with RDP epsilon of ``prefix + c * curve`` within budget, solved per
    order from dp_accounting's conversion ``eps = r + log1p(-1/a) - log(delta a) / (a - 1)``."""
    curve = rdp_curve(event)
    orders = RDP_ORDERS
    usable = orders > 1.01
    limit = budget - np.log1p(-1 / orders[usable]) + np.log(delta * orders[usable]) / (orders[usable] - 1)
    with np.errstate(divide="ignore", invalid="ignore"):  # infinite or zero orders drop out below
        room = (limit - prefix_rdp[usable]) / curve[usable]
    room = room[np.isfinite(room)]
    return int(min(UNLIMITED, max(-1.0, float(np.floor(room.max()))) if len(room) else -1))


@lru_cache(maxsize=4096)
def _max_count(history: History, event: dp_accounting.DpEvent, budget: float, delta: float, accountant: str,
               relation: str, fits_already: int = 0) -> int:
    """Largest count of ``event`` after ``history`` within ``budget``, by any accountant (cached compositions).

    ``fits_already`` is a count known to fit (RDP's, for the tight accountant under add-remove: tight
    epsilon is never above RDP's), else 0.  Each composition costs tens of milliseconds to a second, so the
    count is aimed at rather than searched for (:func:`_largest_within`): the epsilon at a count that fits
    predicts, with epsilon growing as the square root of the count (Gaussian composition), where the budget
    runs out, and interpolation between the counts on either side closes in.  About four compositions from
    RDP's count, where doubling and bisecting from zero took eighteen for the demo; six to ten from zero (a
    replace-one ledger, or the ``pld`` accountant), where the first version, predicting only from the count
    it started at, took 27 to 31."""
    epsilons: dict[int, float] = {}

    def epsilon(total: int) -> float:
        if total not in epsilons:
            epsilons[total] = epsilon_of_history((*history, (event, total)), delta, accountant, relation)
        return epsilons[total]

    if fits_already > 0 and epsilon(fits_already) > budget:  # not a count that fits after all: start from none
        fits_already = 0
    return _largest_within(epsilon, budget, fits_already)


#: Interpolation steps of :func:`_largest_within` once it has a bracket, before it bisects (which always ends).
_AIMED_STEPS = 8


def _largest_within(epsilon: Callable[[int], float], budget: float, fits: int) -> int:
    """Largest ``c >= 0`` with ``epsilon(c) <= budget`` (``-1`` if none, :data:`UNLIMITED` if every count fits) for
    ``epsilon`` increasing in ``c``, given that ``fits`` (0 or more) does.

    Until some count is known not to fit, each step aims where the budget would run out if epsilon grew as the
    square root of the count (Gaussian composition) from the largest count measured to fit, and at least at
    twice that count after the first prediction, so that a slower growth still brackets the answer quickly.
    Starting from ``fits = 0`` (every replace-one ledger, the ``pld`` accountant: no RDP count to start from)
    the first measured count is 1, and the prediction is made from it.  Once bracketed, each step interpolates
    between the largest count that fits and the smallest that does not on a power law ``epsilon ~ c^p``
    (exponent fitted through the two; linear where a power law cannot be fitted), and bisects after
    :data:`_AIMED_STEPS` such steps, so that it always ends.  Only the interpolations count against that limit:
    a long approach (many predictions) still leaves them all.  About 4 compositions from RDP's count, 6 to 10
    from zero, where predicting only at the first step and then doubling took 27 to 31 from zero."""
    low, low_eps = fits, epsilon(fits)
    if fits == 0 and low_eps > budget:
        return -1
    high, high_eps = UNLIMITED + 1, math.inf  # the smallest count known not to fit (none yet)
    predicted, interpolated = False, 0
    while high - low > 1:
        if high > UNLIMITED:  # no bracket yet
            if low >= UNLIMITED:
                return UNLIMITED
            aim = 2 * low
            if low > 0 and low_eps > 0:
                ratio = budget / low_eps  # (squared by a product, which overflows to inf, not to an error)
                prediction = int(min(float(UNLIMITED), low * ratio * ratio))
                aim = max(aim, prediction) if predicted else prediction
                predicted = True
            aim = min(UNLIMITED, max(low + 1, aim))
        elif interpolated < _AIMED_STEPS and math.isfinite(high_eps) and high_eps > low_eps:
            aim = min(high - 1, max(low + 1, _interpolated_count(low, low_eps, high, high_eps, budget)))
            interpolated += 1
        else:
            aim = (low + high) // 2
        value = epsilon(aim)
        if value <= budget:
            low, low_eps = aim, value
        else:
            high, high_eps = aim, value
    return low


def _interpolated_count(low: int, low_eps: float, high: int, high_eps: float, budget: float) -> int:
    """Where ``epsilon`` reaches ``budget`` between ``(low, low_eps)`` and ``(high, high_eps)`` (``low_eps <= budget
    < high_eps``, finite), rounded up: on the power law ``epsilon = a c^p`` through both points where both are
    positive (a composition's epsilon is close to one, with ``p`` near 1/2; a straight line converges slowly on
    such a concave curve, the new count landing again and again on the same side), else on the straight line
    through them.  A composition's exponent grows a little with the count, so the power law through the ends
    falls a little short of the crossing, and rounding up lands on it or just past it (measured over 11 searches:
    77 compositions rounding up, 79 rounding down)."""
    if low > 0 and low_eps > 0:
        exponent = math.log(high_eps / low_eps) / math.log(high / low)
        return math.ceil(low * math.exp(math.log(budget / low_eps) / exponent))
    return low + math.ceil((budget - low_eps) * (high - low) / (high_eps - low_eps))


def _search(fits: Callable[[int], bool], guess: int) -> int:
    """Largest ``c >= 0`` with ``fits(c)`` (``-1`` if none), for monotone ``fits``, starting from ``guess``:
    two checks when the guess is exact, as the closed form's almost always is."""
    low = max(0, guess)
    if fits(low):
        step, high = 1, low + 1
        while fits(high):
            if high >= UNLIMITED:
                return UNLIMITED
            low, step = high, step * 2
            high = low + step
    else:
        if low == 0 or not fits(0):
            return -1
        high, low = low, 0
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _rdp_epsilon_fast(total: np.ndarray, delta: float) -> float:
    """dp_accounting's RDP-to-epsilon conversion (``compute_epsilon``) in one vectorised expression: the
    same formula and cases, equal up to the last bits of the logarithms; a NaN order counts as infinite (as in
    :func:`~decentdp.privacy.accounting.rdp_epsilon`)."""
    orders = RDP_ORDERS
    total = np.where(np.isnan(total), np.inf, total)
    with np.errstate(all="ignore"):
        epsilon = total + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
        epsilon = np.where(orders > 1.01, epsilon, np.inf)
        epsilon = np.where(delta**2 + np.expm1(-total) > 0, 0.0, epsilon)
        epsilon = np.where(total < 0, 0.0, epsilon)
    return max(0.0, float(epsilon.min()))


class PrivacyLedger:
    """The release histories and (epsilon, delta) budgets of the agents an engine holds.

    Parameters
    ----------
    agent_ids:
        Global ids of the agents this ledger covers, in the order of their local rows (a shard of a
        multi-machine run holds only its own agents'; the simulator holds ``0..N-1``).  An int ``n``
        means ``range(n)``.
    epsilon:
        Budget per agent (one number for all, or one per agent); ``math.inf`` means no budget.
    delta:
        The delta at which budgets are enforced and epsilon is reported.
    budget_accountant:
        Accountant used to enforce budgets; it should be the one that calibrated the noise, so that
        an agent can make exactly its planned releases and no more (``tight`` by default, which is
        also what :meth:`reported_epsilon` uses, so the reported epsilon never exceeds a budget).
    relation:
        The neighbouring relation every epsilon is computed under (``add-remove`` or ``replace-one``).
    """

    def __init__(self, agent_ids: int | Sequence[int], epsilon: float | Sequence[float], delta: float,
                 budget_accountant: str = "tight", relation: str = DEFAULT_RELATION) -> None:
        check_relation(relation)
        ids = np.arange(agent_ids) if isinstance(agent_ids, int | np.integer) else np.asarray(agent_ids)
        n = len(ids)
        budgets = np.broadcast_to(np.asarray(epsilon, dtype=np.float64), (n,)).copy()
        for value in budgets:
            check_epsilon_delta(float(value), delta)
        self.agent_ids = ids.astype(np.int64)
        self.budgets = budgets
        self.delta = float(delta)
        self.budget_accountant = budget_accountant
        self.relation = relation
        self.refused = np.zeros(n, dtype=np.int64)
        self.events = EventTable()
        self._agents = _Accounts(n)
        self._broadcast: _Accounts | None = None  # materialised at the first per-receiver release
        self._pairs = _Accounts()
        self._pair_index: dict[tuple[int, int], int] = {}  # (local row, receiver id) -> pair account
        self._room_event = np.full(n, _NO_EVENT, dtype=np.int64)  # headroom cache: `_room` more releases
        self._room = np.zeros(n, dtype=np.int64)                 # of event `_room_event` fit
        self._room_exact = np.ones(n, dtype=bool)  # False: `_room` is RDP's count, a lower bound of tight's

    @property
    def n_agents(self) -> int:
        return len(self.agent_ids)

    def intern(self, event: dp_accounting.DpEvent) -> int:
        """The id under which this ledger stores ``event``."""
        return self.events.intern(event)

    def releases(self) -> np.ndarray:
        """Number of releases per agent (agent view)."""
        return self._agents.releases()

    def last_rounds(self) -> np.ndarray:
        """Each agent's (local row) round of its latest charged release (agent view), or :data:`NEVER`."""
        accounts = self._agents
        return np.where(accounts.event != _NO_EVENT, accounts.last, NEVER)

    def history(self, agent: int) -> History:
        """Agent ``agent``'s (local row) releases in the agent view, as ``(event, count)`` runs."""
        return self._agents.history(agent, self.events)

    # -- charging ------------------------------------------------------------------------------------------
    def _headroom(self, agent: int, event_id: int, quick: bool = False) -> tuple[int, bool]:
        """How many more releases of ``event_id`` agent ``agent`` may make within its budget, and whether
        that count is exact.  ``quick`` with the ``tight`` accountant answers from the running RDP totals
        (constant work): tight epsilon is never above RDP's, so what fits under RDP fits, and the exact
        (PLD) count, never smaller, is asked for only when an agent would otherwise be refused."""
        budget = float(self.budgets[agent])
        if math.isinf(budget):
            return UNLIMITED, True
        event = self.events[event_id]
        if isinstance(event, dp_accounting.NonPrivateDpEvent):
            return 0, True
        accounts = self._agents
        extends = accounts.event[agent] == event_id
        done = int(accounts.count[agent]) if extends else 0
        by_rdp = self._rdp_totals_apply(self.budget_accountant)
        under_rdp = self.budget_accountant == "tight" and self._rdp_totals_apply("rdp")  # RDP's count fits tight
        rdp_count = 0
        if by_rdp or under_rdp:
            prefix = accounts.closed_rdp[agent] if extends else accounts.rdp(agent, self.events)
            guess = _rdp_guess(prefix, event, budget, self.delta)
            rdp_count = _search(lambda total: _fits_rdp(prefix, event, total, budget, self.delta), guess)
            if by_rdp or quick:
                return rdp_count - done, by_rdp
        history = self.history(agent)
        return _max_count(history[:-1] if extends else history, event, budget, self.delta, self.budget_accountant,
                          self.relation, max(0, rdp_count)) - done, True

    def _rdp_totals_apply(self, accountant: str) -> bool:
        """The running RDP totals price the events as they are, which is the add-remove relation."""
        return accountant == "rdp" and self.relation == "add-remove"

    def charge(self, round_index: int, events: np.ndarray, *, agents: np.ndarray | None = None, count: int = 1,
               senders: np.ndarray | None = None, receivers: np.ndarray | None = None,
               receiver_events: np.ndarray | None = None) -> np.ndarray:
        """Record ``count`` releases of ``events[i]`` (event ids) by every asking agent whose budget allows them.

        ``agents`` (a boolean mask over local rows) says who asks; by default all.  Returns the mask of
        agents authorised (and recorded): the caller must discard the data-dependent output of every
        other agent, which has released nothing; its refusal is counted in ``refused``.

        Without ``receivers`` the release is a broadcast: every observer sees ``events[i]``.  With
        them, it is a set of per-receiver messages: message ``m`` goes from local row ``senders[m]``
        to global id ``receivers[m]``, which observes ``receiver_events[m]``, while ``events[i]``
        describes what all of ``i``'s receivers learn together (the budgeted agent view).
        """
        n = self.n_agents
        asking = np.ones(n, dtype=bool) if agents is None else np.asarray(agents, dtype=bool).reshape(n)
        events = np.asarray(events, dtype=np.int64).reshape(n)
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        if receivers is not None:  # checked before anything is recorded, so that an error leaves no trace
            if senders is None or receiver_events is None:
                raise ValueError("a per-receiver release needs senders, receivers and receiver_events")
            pairs = set(zip(np.asarray(senders).tolist(), np.asarray(receivers).tolist(), strict=True))
            if len(pairs) != len(senders):
                raise ValueError("a per-receiver release sends at most one message per (sender, receiver) pair")
        stale = asking & (events != self._room_event)
        for agent in np.flatnonzero(stale):
            self._room[agent], self._room_exact[agent] = self._headroom(int(agent), int(events[agent]), quick=True)
            self._room_event[agent] = events[agent]
        for agent in np.flatnonzero(asking & (self._room < count) & ~self._room_exact):  # refuse on exact counts only
            self._room[agent], self._room_exact[agent] = self._headroom(int(agent), int(events[agent]))
        allowed = asking & (self._room >= count)
        self.refused[asking & ~allowed] += 1
        rows = np.flatnonzero(allowed)
        if receivers is None:
            self._agents.record(round_index, rows, events[rows], count, self.events)
            if self._broadcast is not None:
                self._broadcast.record(round_index, rows, events[rows], count, self.events)
        else:
            if self._broadcast is None:
                self._broadcast = self._agents.copy()  # everything so far was broadcast
            self._agents.record(round_index, rows, events[rows], count, self.events)
            self._charge_pairs(round_index, allowed, senders, receivers, receiver_events, count)
        self._room[allowed & np.isfinite(self.budgets)] -= count  # an infinite budget stays UNLIMITED
        return allowed

    def _charge_pairs(self, round_index: int, allowed: np.ndarray, senders: np.ndarray, receivers: np.ndarray,
                      receiver_events: np.ndarray, count: int) -> None:
        """Record each authorised sender's message in its (sender, receiver) account (inputs checked by charge)."""
        senders = np.asarray(senders, dtype=np.int64)
        receivers = np.asarray(receivers, dtype=np.int64)
        receiver_events = np.asarray(receiver_events, dtype=np.int64)
        keep = allowed[senders]
        pairs = list(zip(senders[keep].tolist(), receivers[keep].tolist(), strict=True))
        new = [pair for pair in pairs if pair not in self._pair_index]
        for pair in new:
            self._pair_index[pair] = len(self._pair_index)
        self._pairs.grow(len(new))
        accounts = np.array([self._pair_index[pair] for pair in pairs], dtype=np.int64)
        self._pairs.record(round_index, accounts, receiver_events[keep], count, self.events)

    # -- reporting -----------------------------------------------------------------------------------------
    def epsilon(self, accountant: str = "tight", delta: float | None = None) -> np.ndarray:
        """Epsilon each agent has spent so far against all observers together (agent view)."""
        at = self.delta if delta is None else float(delta)
        if self._rdp_totals_apply(accountant):
            return np.array([rdp_epsilon(self._agents.rdp(agent, self.events), at) for agent in range(self.n_agents)])
        return np.array([epsilon_of_history(self.history(agent), at, accountant, self.relation)
                         for agent in range(self.n_agents)])

    def rdp_curves(self) -> np.ndarray:
        """``(n_agents, len(RDP_ORDERS))``: each agent's composed RDP at :data:`RDP_ORDERS` (agent view, against
        all observers together), e.g. for the private selection of ``decentdp sweep``.  A copy: read-only."""
        return np.array([self._agents.rdp(agent, self.events) for agent in range(self.n_agents)]).reshape(
            self.n_agents, len(RDP_ORDERS))

    def reported_epsilon(self) -> tuple[np.ndarray, str]:
        """Epsilon per agent by the run's accountant (``privacy.accountant``: ``tight`` by default, the smaller
        of PLD and RDP), with its name: the accountant that calibrated sigma and enforces budgets, and that
        the run's log and metrics use, so one accountant is named throughout and no epsilon exceeds a
        budget."""
        return self.epsilon(self.budget_accountant), self.budget_accountant

    @property
    def has_receiver_releases(self) -> bool:
        """Whether any release went to a single receiver (else the pairwise view equals the agent view)."""
        return self._broadcast is not None

    def pairwise_epsilon(self, accountant: str = "rdp", n_total: int | None = None,
                         delta: float | None = None) -> np.ndarray:
        """``(n_local, n_total)``: entry ``(i, j)`` is the epsilon of what global agent ``j`` observed of
        local agent ``i`` (its broadcasts and the messages sent to ``j`` alone); 0 on the diagonal."""
        at = self.delta if delta is None else float(delta)
        width = int(n_total if n_total is not None else self.agent_ids.max() + 1)
        broadcast = self._broadcast if self._broadcast is not None else self._agents
        table = self.events

        def epsilon(history: History, rdp: np.ndarray) -> float:
            if self._rdp_totals_apply(accountant):
                return rdp_epsilon(rdp, at)
            return epsilon_of_history(history, at, accountant, self.relation)

        out = np.empty((self.n_agents, width))
        for agent in range(self.n_agents):
            out[agent] = epsilon(broadcast.history(agent, table), broadcast.rdp(agent, table))
        for (agent, receiver), account in self._pair_index.items():
            out[agent, receiver] = epsilon((*broadcast.history(agent, table), *self._pairs.history(account, table)),
                                           broadcast.rdp(agent, table) + self._pairs.rdp(account, table))
        out[np.arange(self.n_agents), self.agent_ids] = 0.0
        return out

    # -- persistence ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (for checkpoints and the results folder)."""
        return {
            "agent_ids": self.agent_ids.tolist(),
            "budgets": [float(b) for b in self.budgets],
            "delta": self.delta,
            "budget_accountant": self.budget_accountant,
            "relation": self.relation,
            "refused": self.refused.tolist(),
            "events": self.events.to_json(),
            "agent_runs": self._agents.state(),
            "broadcast_runs": self._broadcast.state() if self._broadcast is not None else None,
            "pairs": [[agent, receiver, self._pairs.runs(account)]
                      for (agent, receiver), account in self._pair_index.items()],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger saved with :meth:`state_dict` (the headroom cache is rebuilt on first use).

        Ledgers saved by earlier versions (runs of ``(noise_multiplier, sample_rate, count)``
        sampled Gaussian releases) load as the same events, so their checkpoints resume."""
        if "runs" in state:
            state = _from_runs_format(state)
        ledger = cls(state["agent_ids"], state["budgets"], state["delta"], state["budget_accountant"],
                     state.get("relation", DEFAULT_RELATION))
        ledger.refused = np.asarray(state["refused"], dtype=np.int64).reshape(ledger.n_agents).copy()
        ledger.events = EventTable.from_json(state["events"])
        ledger._agents = _Accounts.from_state(state["agent_runs"], ledger.events)
        if state["broadcast_runs"] is not None:
            ledger._broadcast = _Accounts.from_state(state["broadcast_runs"], ledger.events)
        ledger._pair_index = {(int(agent), int(receiver)): k for k, (agent, receiver, _) in enumerate(state["pairs"])}
        ledger._pairs = _Accounts.from_state([runs for _, _, runs in state["pairs"]], ledger.events)
        return ledger


def _from_runs_format(state: dict[str, Any]) -> dict[str, Any]:
    """An earlier version's ledger state in the event format."""
    table = EventTable()
    runs = [[[table.intern(gaussian_event(run["noise_multiplier"], run["sample_rate"])), run["count"],
              run["first_round"], run["last_round"]] for run in agent_runs] for agent_runs in state["runs"]]
    return {"agent_ids": list(range(len(state["budgets"]))), "budgets": state["budgets"], "delta": state["delta"],
            "budget_accountant": state["budget_accountant"], "refused": state["refused"], "events": table.to_json(),
            "agent_runs": runs, "broadcast_runs": None, "pairs": []}
