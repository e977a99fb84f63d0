"""MovieLens-100K as Bellet et al. (2018, supplementary D.2) use it: one agent per user (specs D.5).

* ``u.data``: 100,000 ratings ``user item rating timestamp`` (tab-separated, ids from 1), 943 users,
  1682 movies (GroupLens; research use only, never redistributed with decentdp).
* Per user, a random 80/20 train/test split of its ratings (``test_fraction``; ``validation=True`` splits the
  training part again by the same fraction and evaluates on that held-out part: the split the paper tunes on).
* Targets are ratings less the public constant 3 (the scale's midpoint), and each movie's features end
  with a constant 1, so each user's model learns its own offset.  The paper centres by each user's mean
  training rating, but then one changed rating moves every target of its user, and the clipped gradient
  sum moves by up to 1.6 times the 2C the accounting assumes (measured on MovieLens-100K at C = 10).
* Movie features phi_j in R^p come from weighted-lambda alternating least squares (Zhou et al. 2008)
  fitted on the training ratings (centred user-wise, as the paper's) only; the paper treats them as
  public (known to every agent), and so does a run here (``public_inputs`` in ``privacy.json``): they
  and the graph are computed from every user's training ratings, and the epsilon does not cover that.
* W_ij = 1 when i is among the k nearest neighbours of j, or j of i, by cosine similarity of the
  users' training rating vectors (k = 10).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np

from decentdp.data.personal import PersonalData, holdout_masks, sort_by_owner
from decentdp.errors import ConfigError, DataError

RATINGS_FILE = "u.data"
#: Subtracted from every rating: a public constant (the 1..5 scale's midpoint), so no rating moves another's target.
RATING_CENTRE = 3.0
#: What a private MovieLens run treats as known to every observer (the paper's assumption), for privacy.json.
PUBLIC_INPUTS = ("the movie features (ALS) and the k-nearest-neighbour graph, as in the paper; both are computed from "
                 "every user's training ratings, and the epsilon does not cover what they reveal")
_SUBDIRS = ("movielens-100k", "ml-100k")
#: An integer as the line-by-line check accepts it: ASCII digits (str.isdigit also passes '²', which int() refuses).
_INTEGER = re.compile(r"[-+]?[0-9]+")
_INT64 = np.iinfo(np.int64)


def ratings_path(data_dir: str | Path | None) -> Path:
    """Where ``u.data`` is: in ``data_dir`` itself or its ``movielens-100k/`` (or ``ml-100k/``) folder."""
    if data_dir is None:
        raise DataError("MovieLens-100K needs a data directory holding u.data (pass --data-dir or set "
                        "data.data_dir); download ml-100k.zip from https://grouplens.org/datasets/movielens/100k/")
    root = Path(data_dir).expanduser()
    for candidate in (root / RATINGS_FILE, *(root / sub / RATINGS_FILE for sub in _SUBDIRS)):
        if candidate.is_file():
            return candidate
    raise DataError(f"no MovieLens-100K ratings file {RATINGS_FILE} in {root} or its "
                    f"{' or '.join(s + '/' for s in _SUBDIRS)} folder (download ml-100k.zip from "
                    "https://grouplens.org/datasets/movielens/100k/ and unpack it there)")


def read_ratings(path: Path) -> np.ndarray:
    """The ``(R, 3)`` int64 array ``user, item, rating`` of ``u.data`` (0-based ids); DataError naming the
    file and line when it is not four integer columns (each within int64) with ids >= 1 and ratings in 1..5."""
    return _read_ratings_and_lines(path)[0]


def _read_ratings_and_lines(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_ratings`'s table and, for each of its rows, the line of ``path`` it came from (1-based).

    Blank lines are skipped, so row indices are not line numbers: every message names the line through these.
    u.data has no comment syntax: a line starting with '#' is refused, as any other malformed line, by both
    numpy's parser (``comments=None``) and the line-by-line check."""
    try:
        text = path.read_text(encoding="latin-1")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    lines = text.splitlines()
    numbers = [number for number, line in enumerate(lines, start=1) if line.strip()]
    rows_text = [lines[number - 1] for number in numbers]
    try:  # numpy's C parser on the non-blank lines; on any failure the line-by-line check names the line
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": reported below
            parsed = np.loadtxt(rows_text, dtype=np.int64, ndmin=2, comments=None)
    except ValueError:
        parsed = None
    if parsed is None or parsed.shape != (len(numbers), 4):
        rows = [(number, line.split()) for number, line in zip(numbers, rows_text, strict=True)]
        if not rows:
            raise DataError(f"{path} holds no ratings")
        for number, row in rows:
            if len(row) != 4 or not all(_INTEGER.fullmatch(value) for value in row):
                raise DataError(f"{path}, line {number}: expected 4 integers 'user item rating timestamp', got "
                                f"{' '.join(row)[:80]!r}")
            outside = [value for value in row if not _INT64.min <= int(value) <= _INT64.max]
            if outside:
                raise DataError(f"{path}, line {number}: {outside[0][:40]} does not fit a 64-bit integer (MovieLens "
                                "ids, ratings and timestamps do)")
        parsed = np.asarray([row for _, row in rows], dtype=np.int64)
    line_numbers = np.asarray(numbers, dtype=np.int64)
    table = parsed[:, :3]
    bad = np.flatnonzero((table[:, 0] < 1) | (table[:, 1] < 1) | (table[:, 2] < 1) | (table[:, 2] > 5))
    if len(bad):
        raise DataError(f"{path}, line {line_numbers[bad[0]]}: user and item ids start at 1 and ratings lie in "
                        f"1..5, got {' '.join(map(str, table[bad[0]]))}")
    return table - np.array([1, 1, 0]), line_numbers


def _refuse_repeated_pairs(path: Path, users: np.ndarray, items: np.ndarray, line_numbers: np.ndarray) -> None:
    """Refuse a (user, item) pair rated twice (a helper's review): the dense rating matrices behind the features
    and the graph would keep one of the ratings while both stayed the user's targets.  (A user id with no
    rating is an agent without data, which runs: it gets the confidence floor and spends nothing.)
    ``line_numbers``: each row's line in ``path`` (blank lines make them differ from row indices)."""
    pairs = users * (int(items.max()) + 1) + items
    order = np.argsort(pairs, kind="stable")
    repeated = np.flatnonzero(pairs[order][1:] == pairs[order][:-1])
    if len(repeated):
        first, second = sorted(order[repeated[0]:repeated[0] + 2])
        raise DataError(f"{path}, lines {line_numbers[first]} and {line_numbers[second]}: user {users[first] + 1} "
                        f"rates item {items[first] + 1} twice; keep one rating per (user, item) pair")


def als_features(users: np.ndarray, items: np.ndarray, ratings: np.ndarray, n_users: int, n_items: int,
                 rank: int, reg: float, iterations: int, seed: int) -> np.ndarray:
    """Item factors ``(n_items, rank)`` of weighted-lambda ALS (Zhou et al. 2008) on the given ratings.

    Each sweep solves, for every user at once and then every item at once, the ridge problem
    ``(V_u^T V_u + reg * n_u I) u = V_u^T r_u`` (``n_u``: ratings of u; items without ratings keep a
    zero factor).  Gram matrices are one product of the rating mask with the outer products of the
    factors, so a sweep is a few dense matrix products and one batched solve."""
    mask = np.zeros((n_users, n_items))
    values = np.zeros((n_users, n_items))
    mask[users, items] = 1.0
    values[users, items] = ratings
    rng = np.random.default_rng(seed)
    item_factors = rng.normal(0.0, 0.1, (n_items, rank))
    user_factors = np.zeros((n_users, rank))

    def solve(weights: np.ndarray, targets: np.ndarray, factors: np.ndarray) -> np.ndarray:
        outer = (factors[:, :, None] * factors[:, None, :]).reshape(len(factors), rank * rank)
        gram = (weights @ outer).reshape(-1, rank, rank)
        counts = weights.sum(axis=1)
        gram += (reg * np.maximum(counts, 1.0))[:, None, None] * np.eye(rank)
        return np.linalg.solve(gram, (targets @ factors)[:, :, None])[:, :, 0]

    for _ in range(iterations):
        user_factors = solve(mask, values, item_factors)
        item_factors = solve(mask.T, values.T, user_factors)
    return item_factors


def knn_graph(vectors: np.ndarray, k: int) -> np.ndarray:
    """Symmetric 0/1 weights: W_ij = 1 when j is among the ``k`` most cosine-similar rows to i, or i to j.

    ``k`` must be below the number of rows: a larger one is refused, not clamped, so that the graph is the one
    ``personalized.neighbours`` (recorded in ``setup.json``) describes (:func:`load_movielens` names the field)."""
    n = len(vectors)
    if not 1 <= k <= n - 1:
        raise ValueError(f"k = {k} nearest neighbours of {n} rows: k must lie in 1..{n - 1}")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = vectors / np.where(norms > 0, norms, 1.0)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
    adjacency = np.zeros((n, n))
    adjacency[np.repeat(np.arange(n), k), nearest.ravel()] = 1.0
    return np.maximum(adjacency, adjacency.T)


#: The most memory the dense user x item (and user x user) matrices of a ratings file may ask for (ids are indices).
MAX_DENSE_BYTES = 4 * 2**30
#: How many such matrices the loader holds at its peak: 5.1 times one matrix's size in resident memory, measured by
#: a reviewer (2.45 GB for 6 users and item ids up to 1e7, one matrix 0.48 GB).
DENSE_COPIES = 5


def load_movielens(data_dir: str | Path | None, seed: int, *, test_fraction: float = 0.2,
                   validation: bool = False, rank: int = 20, als_reg: float = 0.1, als_iterations: int = 15,
                   neighbours: int = 10) -> PersonalData:
    """MovieLens-100K as one regression task per user (module docstring); deterministic given ``seed``."""
    path = ratings_path(data_dir)
    table, line_numbers = _read_ratings_and_lines(path)
    users, items, ratings = table[:, 0], table[:, 1], table[:, 2].astype(np.float64)
    n_users, n_items = int(users.max()) + 1, int(items.max()) + 1
    needed = DENSE_COPIES * 8 * max(n_users * n_items, n_users * n_users)  # ratings, similarities: dense
    if needed > MAX_DENSE_BYTES:
        line = line_numbers[int(np.argmax(users if n_users >= n_items else items))]
        raise DataError(f"{path}, line {line}: ids are used as indices, and ids up to {n_users} users and "
                        f"{n_items} items make {needed / 2**30:.3g} GiB of dense matrices (at most "
                        f"{MAX_DENSE_BYTES / 2**30:.3g}); number the users and items from 1 without large gaps")
    _refuse_repeated_pairs(path, users, items, line_numbers)
    if neighbours > n_users - 1:
        raise ConfigError("personalized.neighbours", f"is {neighbours}, but {path} has {n_users} user ids: each user "
                                                     f"can have at most {n_users - 1} neighbours")
    rng = np.random.default_rng(seed)
    test = holdout_masks(users, test_fraction, rng)
    if validation:  # tune on test_fraction of the training ratings; the test ratings are never read
        keep = ~test
        held = np.zeros(len(users), dtype=bool)
        held[np.flatnonzero(keep)] = holdout_masks(users[keep], test_fraction, rng)
        users, items, ratings, test = users[keep | held], items[keep | held], ratings[keep | held], held[keep | held]
    if not test.any():  # checked here, before the results folder exists: evaluate() has nothing to average
        split = "validation split (of the training ratings the test split leaves)" if validation else "test split"
        raise ConfigError("personalized.test_fraction", f"is {test_fraction:g}, and the {split} holds out no rating "
                                                        f"of {path}: each user with m >= 2 ratings gives "
                                                        "round(test_fraction * m) of them, at most m - 1, and a "
                                                        "user with one gives none, so there is nothing to evaluate")
    train = ~test
    counts = np.bincount(users[train], minlength=n_users)
    means = np.bincount(users[train], weights=ratings[train], minlength=n_users) / np.maximum(counts, 1)
    centred = ratings - means[users]
    features = als_features(users[train], items[train], centred[train], n_users, n_items, rank, als_reg,
                            als_iterations, seed)
    vectors = np.zeros((n_users, n_items))
    vectors[users[train], items[train]] = ratings[train]
    weights = knn_graph(vectors, neighbours)
    features = np.hstack([features, np.ones((n_items, 1))])  # the user's offset
    targets = ratings - RATING_CENTRE
    x_train, y_train, owner_train = sort_by_owner(features[items[train]], targets[train], users[train])
    x_test, y_test, owner_test = sort_by_owner(features[items[test]], targets[test], users[test])
    info = {"source": str(path), "users": n_users, "items": n_items, "ratings": len(table),
            "train_ratings": int(train.sum()), "evaluation_ratings": int(test.sum()),
            "evaluated_on": f"validation ({test_fraction:g} of the training ratings)" if validation else "test",
            "als": {"rank": rank, "reg": als_reg, "iterations": als_iterations}, "neighbours": neighbours,
            "edges": int(weights.sum() // 2), "targets": f"rating - {RATING_CENTRE:g}, features with a constant 1"}
    bound = float(np.linalg.norm(features, axis=1).max())  # every movie's, so it reads no user's choice of movies
    return PersonalData(x_train, y_train, owner_train, x_test, y_test, owner_test, weights, "regression", info,
                        feature_bound=bound, public_inputs=PUBLIC_INPUTS)
