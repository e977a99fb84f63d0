"""Which observer-view accountant prices a run's pairwise epsilons, within a work and memory budget.

An algorithm whose messages share noise describes its run once, as a :class:`ViewRecipe`: how many
sources and messages it has, and an ``unroll`` that replays its rounds into a builder.  The same unrolling
feeds either accountant:

1. the dense one (:mod:`decentdp.privacy.observer_view`: every message at once, ``min(sum |M|,
   R lambda_max)``, the tighter bound) while it fits :data:`VIEW_BUDGET_FLOPS` / :data:`VIEW_BUDGET_BYTES`;
2. else the recursive one (:mod:`decentdp.privacy.observer_filter`: a Kalman filter per observer, cost
   linear in the rounds) while it fits :data:`RECURSIVE_BUDGET_FLOPS` and the memory budget;
3. else each sender's local epsilon for every observer (sound: every view is post-processing of the
   sender's releases).

Every result is capped by the sender's local epsilon (amplified by sampling where the view's is not), and a
note says which method gave it (``nonadaptive_epsilon_pairwise_network_method``).

**Only for gradients fixed in advance** (hence the ``nonadaptive_`` prefix of every field).  An observer that
sees only the messages sent to it does not see the model at which the sender took its gradient, and that
model carries noise the observer does not hold; an adaptive gradient then shifts the view in a direction
correlated with that noise, which the linear-Gaussian view does not price (the module docstring of
:mod:`decentdp.privacy.observer_view`, "Adaptivity").  The sound bound for every such observer is the
sender's ledger ``epsilon`` (every observer together), which the budgets hold on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from decentdp.privacy.observer_filter import (
    RecursiveViewBuilder,
    ViewNotFinite,
    ViewTooLarge,
    recursive_cost,
    recursive_mu,
)
from decentdp.privacy.observer_view import ViewBuilder, dense_cost, observer_mu
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.results.files import epsilon_json

#: What the ``nonadaptive_`` figures assume, written beside them in ``privacy.json``.
NONADAPTIVE_ASSUMPTION = (
    "exact (dense) or an upper bound (round by round) for gradients fixed in advance: a gradient taken at a model "
    "that carries noise the observer does not hold can exceed it (Muffliato on a 4-agent path: 7.61 where this "
    "reports 7.54, experiments/privacy/adaptive_observer.py); the sound bound for every observer is the "
    "sender's epsilon")

#: Work (:func:`~decentdp.privacy.observer_view.dense_cost`'s floating-point operations) the dense accountant
#: may spend, about half a minute at one thread here (N = 16, T = 100, K = 4: 3.9e11 in 30 s,
#: ``benchmarks/observer_view.py``), and the memory a view (dense or recursive) may take.
VIEW_BUDGET_FLOPS = 4e11
VIEW_BUDGET_BYTES = 2**31
#: Work (:func:`~decentdp.privacy.observer_filter.recursive_cost`, an upper estimate that ignores the rounds
#: reused once the filter is steady) the recursive accountant may spend: Muffliato at N = 100, T = 2000,
#: K = 10 estimates 7.1e12 and takes 25 s here at one thread (``benchmarks/observer_view.py``); a run whose
#: rounds all differ costs about the estimate, which at this budget is tens of minutes.
RECURSIVE_BUDGET_FLOPS = 2e13


class Builder(Protocol):
    """What an unrolling calls: the methods :class:`ViewBuilder` and :class:`RecursiveViewBuilder` share."""

    def zeros(self, rows: int) -> np.ndarray: ...
    def noise(self, scales: Sequence[float] | np.ndarray, holders: Sequence[Collection[int]]) -> np.ndarray: ...
    def data(self, owners: Sequence[int] | np.ndarray, classes: Sequence[int] | np.ndarray | None = None
             ) -> np.ndarray: ...
    def send(self, receivers: Sequence[int] | np.ndarray, expressions: np.ndarray) -> None: ...
    def carry(self, state: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class ViewRecipe:
    """A run's linear view, described before it is built: the messages each agent receives over the run,
    the run's noise draws and data terms, the rows of the state carried between rounds, the most fresh
    sources one round creates, and ``unroll(builder)``, which replays every round into ``builder``."""

    received: Sequence[int]
    noise_draws: int
    data_terms: int
    state_size: int
    round_sources: int
    unroll: Callable[[Builder], None]
    recursive_form: bool = True  # whether unroll also serves the recursive builder (a bounded carried state)

    def dense(self) -> ViewBuilder:
        """The whole run unrolled into a dense :class:`ViewBuilder` (call ``.view()`` on it)."""
        builder = ViewBuilder(len(self.received), capacity=self.noise_draws + self.data_terms)
        self.unroll(builder)
        return builder

    def recursive(self, max_bytes: float = np.inf) -> RecursiveViewBuilder:
        """The run unrolled round by round into a :class:`RecursiveViewBuilder`."""
        builder = RecursiveViewBuilder(len(self.received), self.state_size, self.round_sources, max_bytes)
        self.unroll(builder)
        return builder


def priced_view(local: np.ndarray, recipe: ViewRecipe, observers: Sequence[Collection[int]], relation: str,
                delta: float) -> tuple[np.ndarray, str]:
    """Each sender's epsilon (rows) towards each observer (columns), by the first method of the module
    docstring that fits its budget, capped by the sender's ``local`` epsilon; and a note saying which."""
    cost = dense_cost(recipe.received, recipe.noise_draws, recipe.data_terms)
    memory = 8.0 * sum(recipe.received) * (recipe.noise_draws + recipe.data_terms)
    network = np.full((len(local), len(observers)), np.inf)
    if cost <= VIEW_BUDGET_FLOPS and memory <= VIEW_BUDGET_BYTES:
        network = observer_mu(recipe.dense().view(), observers, relation).epsilon(delta)
        note = "the observer-view accountant over every message of the run"
    elif not recipe.recursive_form:
        note = (f"not computed: the explicit view needs {cost:.2g} floating-point operations and "
                f"{memory / 2**30:.3g} GiB, beyond {VIEW_BUDGET_FLOPS:.2g} and {VIEW_BUDGET_BYTES / 2**30:.3g} GiB, "
                "and has no round-by-round form; each sender's local epsilon")
    else:
        note = _recursive(recipe, observers, relation, delta, network)
    return np.minimum(network, np.asarray(local, dtype=float)[:, None]), note


def _recursive(recipe: ViewRecipe, observers: Sequence[Collection[int]], relation: str, delta: float,
               out: np.ndarray) -> str:
    """Fill ``out`` by the recursive accountant when it fits its budgets; the note either way."""
    try:
        view = recipe.recursive(VIEW_BUDGET_BYTES).view()
    except ViewTooLarge as error:
        return f"not computed ({error}): each sender's local epsilon"
    flops, memory = recursive_cost(view, len(observers))
    if flops > RECURSIVE_BUDGET_FLOPS or memory > VIEW_BUDGET_BYTES:
        return (f"not computed: the recursive accountant needs {flops:.2g} floating-point operations and "
                f"{memory / 2**30:.3g} GiB per observer, beyond {RECURSIVE_BUDGET_FLOPS:.2g} and "
                f"{VIEW_BUDGET_BYTES / 2**30:.3g} GiB; each sender's local epsilon")
    try:
        out[:] = recursive_mu(view, observers, relation).epsilon(delta)
    except ViewNotFinite as error:
        return f"not computed ({error}): each sender's local epsilon"
    return ("the observer-view accountant, round by round (a Kalman filter per observer and a "
            "Cauchy-Schwarz bound over rounds: sound, looser than the dense form)")


def pairwise_results(capped: np.ndarray, colluding: Sequence[Sequence[int]], note: str,
                     labelled: dict[str, Any] | None = None) -> AlgorithmPrivacy:
    """An algorithm's results from :func:`priced_view`'s ``capped`` epsilons (columns: each single agent, then
    each ``privacy.colluding`` set), all prefixed ``nonadaptive_`` (:data:`NONADAPTIVE_ASSUMPTION`):
    ``epsilon_pairwise_network`` (0 on the diagonal), its largest entry (the headline), the ``note``, the
    ``labelled`` entries (e.g. a paper's figure), then ``epsilon_colluding``."""
    n = capped.shape[0]
    pairwise = capped[:, :n].copy()
    np.fill_diagonal(pairwise, 0.0)
    off = pairwise[~np.eye(n, dtype=bool)]
    report: dict[str, Any] = {"nonadaptive_epsilon_pairwise_max": epsilon_json(float(off.max()) if off.size else 0.0),
                              "nonadaptive_epsilon_pairwise_network": epsilon_json(pairwise),
                              "nonadaptive_epsilon_pairwise_network_method": note,
                              "nonadaptive_assumption": NONADAPTIVE_ASSUMPTION, **(labelled or {})}
    if colluding:  # privacy.colluding: each set's view, members' own rows not priced (nan)
        report["nonadaptive_epsilon_colluding"] = [{"agents": list(members), "epsilon": epsilon_json(capped[:, n + k])}
                                                   for k, members in enumerate(colluding)]
    return AlgorithmPrivacy(report, headline=("nonadaptive_epsilon_pairwise_max",), pairwise=pairwise)
