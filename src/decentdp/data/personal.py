"""Personal datasets: every agent holds its own records and a similarity graph links the agents.

The personalized setting of Bellet et al. (2018) gives each agent its own task: agent ``i`` has
``m_i`` records ``(x, y)`` and learns its own linear model; a symmetric weight matrix ``W`` (zero
diagonal) says how similar two agents' tasks are.  :class:`PersonalData` holds all agents' records
as flat arrays sorted by owner (``offsets[i]:offsets[i+1]`` are agent ``i``'s rows), so that every
computation over agents is a vectorised gather or scatter, never a Python loop over agents.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

Task = Literal["regression", "classification"]


@dataclass(frozen=True)
class PersonalData:
    """All agents' training and test records, their similarity graph, and what the task is.

    ``x_*`` are ``(R, p)`` float64 features, ``y_*`` targets (ratings less a public constant, or labels in {-1, +1}),
    ``owner_*`` the agent of each row (non-decreasing).  ``weights`` is the ``(n, n)`` similarity
    matrix ``W``; ``info`` describes how the data was made (for ``setup.json``).  ``feature_bound`` is a
    public bound on every row's l2 norm that the data's maker declares (None: none is known), which a private
    run's step sizes are computed from (:func:`bound_features`); ``public_inputs`` says what a private run
    treats as known to every observer, for ``privacy.json``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    owner_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    owner_test: np.ndarray
    weights: np.ndarray
    task: Task
    info: dict[str, Any] = field(default_factory=dict)
    feature_bound: float | None = None
    public_inputs: str = ""

    @property
    def n_agents(self) -> int:
        return int(self.weights.shape[0])

    @property
    def dim(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def train_counts(self) -> np.ndarray:
        """m_i: the number of training records of each agent."""
        return np.bincount(self.owner_train, minlength=self.n_agents)


def bound_features(data: PersonalData, bound: float) -> tuple[PersonalData, int]:
    """``data`` with every training and test row whose l2 norm exceeds ``bound`` scaled down to it, and how many
    training rows were.  A map of each record alone (no record moves another), so a private run may apply it to
    its data; it makes ``bound`` a true bound on the features, which the run's public step sizes assume."""
    def scaled(x: np.ndarray) -> tuple[np.ndarray, int]:
        norms = np.linalg.norm(x, axis=1)
        over = norms > bound
        return np.where(over[:, None], x * (bound / np.where(over, norms, 1.0))[:, None], x), int(over.sum())

    x_train, rescaled = scaled(data.x_train)
    x_test, _ = scaled(data.x_test)
    return replace(data, x_train=x_train, x_test=x_test, feature_bound=bound), rescaled


def sort_by_owner(x: np.ndarray, y: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows reordered so that each agent's records are contiguous (stable within an agent)."""
    order = np.argsort(owner, kind="stable")
    return x[order], y[order], owner[order]


def holdout_masks(owner: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask of held-out rows: ``round(fraction * m_i)`` random rows of each agent (at least
    one kept for training when the agent has two or more rows), drawn in one vectorised pass."""
    n_rows = len(owner)
    keys = rng.random(n_rows)
    order = np.lexsort((keys, owner))  # by owner, then at random within an owner
    counts = np.bincount(owner)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(n_rows, dtype=np.int64)
    rank[order] = np.arange(n_rows) - np.repeat(starts, counts)
    held = np.round(fraction * counts).astype(np.int64)
    held = np.where(counts >= 2, np.minimum(held, counts - 1), 0)
    return rank < held[owner]
