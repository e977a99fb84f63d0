"""Budgets per receiver: a ledger whose budgets hold against each receiver alone (the pairwise view).

:class:`~decentdp.privacy.ledger.PrivacyLedger` enforces budgets on its *agent* view: everything an
agent released, as all observers together see it.  Some protocols promise less, and only against a
single receiver: TOP-DP (Guo et al., eq. 5a) sends each neighbour ``j`` a different message whose
noise is partly a neighbour ``k``'s, which protects the sender against ``j`` only while ``j`` does not
know ``k``'s noise; Muffliato's pairwise network DP bounds what each node learns of each other one.
:class:`ReceiverLedger` enforces the budget of agent ``i`` on every ``(i, j)`` composition of
``i``'s broadcasts with what ``j`` alone received (:meth:`PrivacyLedger.pairwise_epsilon`), and
keeps recording the agent view, which is then the *colluding* worst case (every receiver pooling
what it saw, and knowing every reused noise) and is reported beside it, never enforced.

The same release may therefore be within budget for each receiver and far beyond it for colluders;
both numbers are reported (``epsilon_max`` and ``epsilon_max_colluding`` in a run's summary).

Checks use the running RDP totals of the broadcast and pair accounts (microseconds per message);
a message whose RDP epsilon would exceed the budget is confirmed with the ledger's accountant over
the full history (``tight`` or ``pld`` are never above RDP, so RDP alone would refuse releases the
calibration planned).  Under the replace-one relation the RDP totals do not apply and every check
uses the history.
"""

from __future__ import annotations

import numpy as np

from decentdp.privacy.accounting import RDP_ORDERS, History, epsilon_of_history, rdp_curve, rdp_epsilon
from decentdp.privacy.events import EventTable
from decentdp.privacy.ledger import _NO_EVENT, UNLIMITED, PrivacyLedger, _Accounts


def rdp_epsilon_upper_bound(totals: np.ndarray, delta: float) -> np.ndarray:
    """Epsilon at ``delta`` of each row of ``totals`` (RDP curves at ``RDP_ORDERS``), never below
    dp_accounting's ``compute_epsilon`` (Proposition 12 of Canonne et al. at every order above 1.01, the
    same formula; where dp_accounting returns 0 for an order, its result is 0, and this one is >= 0)."""
    orders = RDP_ORDERS
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = totals + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
    eps[:, orders <= 1.01] = np.inf
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.maximum(0.0, eps.min(axis=1))


def _running_rdp(accounts: _Accounts, ids: np.ndarray, table: EventTable) -> np.ndarray:
    """:meth:`_Accounts.rdp` of every account in ``ids`` at once (rows of zeros for ``-1``: no account yet)."""
    known = ids >= 0
    safe = np.where(known, ids, 0)
    totals = np.where(known[:, None], accounts.closed_rdp[safe], 0.0) if len(accounts) else \
        np.zeros((len(ids), len(RDP_ORDERS)))
    if not len(accounts):
        return totals
    event, count = accounts.event[safe], accounts.count[safe]
    current = known & (event != _NO_EVENT) & (count > 0)
    for value in np.unique(event[current]).tolist():
        rows = current & (event == value)
        totals[rows] += count[rows, None] * rdp_curve(table[value])
    return totals


class ReceiverLedger(PrivacyLedger):
    """A :class:`PrivacyLedger` whose budgets are enforced on the pairwise (per-receiver) view."""

    budget_view = "pairwise"

    def _headroom(self, agent: int, event_id: int, quick: bool = False) -> tuple[int, bool]:
        # The agent (colluding) view is recorded and reported, not enforced: :meth:`charge` decides.
        return UNLIMITED, True

    @property
    def _relation(self) -> str:
        return getattr(self, "relation", "add-remove")

    def charge(self, round_index: int, events: np.ndarray, *, agents: np.ndarray | None = None, count: int = 1,
               senders: np.ndarray | None = None, receivers: np.ndarray | None = None,
               receiver_events: np.ndarray | None = None) -> np.ndarray:
        """As :meth:`PrivacyLedger.charge`, authorising an agent when every receiver's view of it stays
        within its budget: for a per-receiver release, each of its messages composed with what that
        receiver already observed; for a broadcast, every view of the agent (its broadcasts alone, and
        composed with each receiver's messages)."""
        n = self.n_agents
        asking = np.ones(n, dtype=bool) if agents is None else np.asarray(agents, dtype=bool).reshape(n)
        events = np.asarray(events, dtype=np.int64).reshape(n)
        fits = np.ones(n, dtype=bool)
        if receivers is None:
            for agent in np.flatnonzero(asking & np.isfinite(self.budgets)):
                views = [None, *self._pair_accounts(int(agent))]
                fits[agent] = all(self._fits(int(agent), view, int(events[agent]), count) for view in views)
        elif senders is not None and receiver_events is not None:
            senders, receivers = np.asarray(senders, dtype=np.int64), np.asarray(receivers, dtype=np.int64)
            receiver_events = np.asarray(receiver_events, dtype=np.int64)
            pairs = np.array([self._pair_index.get(pair, -1) for pair in zip(senders.tolist(), receivers.tolist(),
                                                                              strict=True)], dtype=np.int64)
            check = asking[senders] & np.isfinite(self.budgets[senders])
            check &= ~self._fits_by_rdp_bound(senders, pairs, receiver_events, count)
            for edge in np.flatnonzero(check):  # only messages the vectorised bound could not clear
                sender = int(senders[edge])
                if fits[sender]:
                    pair = int(pairs[edge])
                    fits[sender] = self._fits(sender, pair if pair >= 0 else None, int(receiver_events[edge]), count)
        allowed = asking & fits
        super().charge(round_index, events, agents=allowed, count=count, senders=senders, receivers=receivers,
                       receiver_events=receiver_events)
        self.refused[asking & ~allowed] += 1  # after the parent's checks, so that a rejected call leaves no trace
        return allowed

    def _pair_accounts(self, agent: int) -> list[int]:
        return [account for (sender, _), account in self._pair_index.items() if sender == agent]

    def _broadcast_view(self) -> _Accounts:
        return self._broadcast if self._broadcast is not None else self._agents

    def _fits_by_rdp_bound(self, senders: np.ndarray, pairs: np.ndarray, events: np.ndarray,
                           count: int) -> np.ndarray:
        """Per message, whether ``count`` more releases of ``events[m]`` keep ``senders[m]``'s view (broadcasts
        + pair account ``pairs[m]``, -1 for none yet) within budget by an upper bound on the RDP epsilon: one
        vectorised conversion for all messages instead of one accountant call each (False is "not
        sure": :meth:`_fits` decides those).  Add-remove only (RDP does not price replace-one here)."""
        if self._relation != "add-remove" or len(senders) == 0:
            return np.zeros(len(senders), dtype=bool)
        broadcast = self._broadcast_view()
        unique, inverse = np.unique(senders, return_inverse=True)
        totals = np.stack([broadcast.rdp(int(agent), self.events) for agent in unique])[inverse.reshape(-1)]
        totals = totals + _running_rdp(self._pairs, pairs, self.events)
        for event in np.unique(events).tolist():
            totals[events == event] += count * rdp_curve(self.events[event])
        return rdp_epsilon_upper_bound(totals, self.delta) <= self.budgets[senders]

    def _fits(self, agent: int, pair: int | None, event_id: int, count: int) -> bool:
        """Whether ``count`` more releases of ``event_id`` keep the view (agent's broadcasts + pair account
        ``pair``, or the broadcasts alone) within the agent's budget."""
        budget, event = float(self.budgets[agent]), self.events[event_id]
        broadcast = self._broadcast_view()
        if self._relation == "add-remove":
            total = broadcast.rdp(agent, self.events) + count * rdp_curve(event)
            if pair is not None:
                total = total + self._pairs.rdp(pair, self.events)
            if rdp_epsilon(total, self.delta) <= budget:
                return True
            if self.budget_accountant == "rdp":
                return False
        history: History = broadcast.history(agent, self.events)
        if pair is not None:
            history = (*history, *self._pairs.history(pair, self.events))
        return epsilon_of_history((*history, (event, count)), self.delta, self.budget_accountant,
                                  self._relation) <= budget

    # -- reporting -----------------------------------------------------------------------------------------
    def epsilon(self, accountant: str = "tight", delta: float | None = None) -> np.ndarray:
        """Per agent, the epsilon of its most exposed single receiver: the view budgets hold on here (as the
        agent view's is in :class:`PrivacyLedger`); :meth:`colluding_epsilon` gives the agent view."""
        return self.pairwise_epsilon(accountant, n_total=int(self.agent_ids.max()) + 1, delta=delta).max(axis=1)

    def reported_epsilon(self) -> tuple[np.ndarray, str]:
        return self.epsilon(self.budget_accountant), self.budget_accountant

    def colluding_epsilon(self) -> tuple[np.ndarray, str]:
        """Per agent, the epsilon against all its receivers together (the agent view, the worst case), by
        RDP's running totals (PLD would compose one distribution per distinct joint event, and colluding
        views have many; RDP is a sound upper bound), or the ledger's accountant under replace-one."""
        accountant = "rdp" if self._relation == "add-remove" else self.budget_accountant
        return PrivacyLedger.epsilon(self, accountant), accountant
