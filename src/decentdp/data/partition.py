"""Split a training set among N agents.

Each scheme returns, per agent, the sorted indices of its samples (never copies of the data), so the engine
can stack per-agent index tensors and draw batches from one shared tensor. Splits are deterministic for a
given seed: the same ``(labels, n_agents, scheme, seed, parameters)`` always gives the same parts.

Schemes
-------
``iid``
    Uniform shuffle cut into N near-equal parts.
``overlap``
    The class-overlap split :math:`A(t)` of Bayrooti et al., equation (8): ``t = 0`` shares every class
    equally, ``t = 1`` gives each agent exclusively the classes it owns (see :func:`overlap_matrix`).
``dirichlet``
    Per-class agent proportions drawn from ``Dir(alpha * 1_N)``; small ``alpha`` is strongly non-IID.
``unequal``
    IID labels, but lognormally distributed agent sizes (see :func:`partition`).
``pathological``
    CGA's class split (Esfandiari et al. 2021, ``utils.py``; DPDL specs A.5.1 item 6): classes are
    trimmed to the smallest class's size, so every class ``0..max(labels)`` must have a sample (an empty
    one is refused); with N <= classes, class ``c`` goes whole to agent ``c mod N``;
    with N > classes (N a multiple of the classes), agent ``i`` gets an equal slice of class ``i mod C``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NoReturn

import numpy as np

from decentdp.errors import ConfigError
from decentdp.rng import record_hash

PARTITIONS: tuple[str, ...] = ("iid", "overlap", "dirichlet", "unequal", "pathological")

# How many Dirichlet draws to try before concluding that min_size is out of reach for this alpha.
_DIRICHLET_TRIES = 100
#: Largest ``data.dirichlet_alpha`` the config accepts: at 1e6 the proportions ``Dir(alpha 1_N)`` deviate from 1/N
#: by about 0.1 % (relative standard deviation ``sqrt((N - 1) / (N alpha + 1))``), so each class is already cut
#: into equal chunks to within a record for classes of up to about a thousand records per agent; larger values
#: change nothing but, near 1e308, make numpy's sampler return all-zero proportions.
DIRICHLET_ALPHA_MAX = 1e6
#: Largest ``data.size_skew`` the config accepts: at sigma = 20 the largest of 10 or 100 agents holds 99 % or more
#: of the records in a typical draw (the median; min_size aside), so larger values change little, and the weights
#: ``e^(sigma z)`` overflow to infinity once ``sigma |z|`` passes 709 (at sigma = 20 that would take |z| > 35).
SIZE_SKEW_MAX = 20.0


def overlap_matrix(n_agents: int, n_classes: int, t: float) -> np.ndarray:
    """Class-overlap matrix :math:`A(t)` of equation (8) in Bayrooti, Gao and Prorok.

    Row ``i`` is an agent, column ``j`` a class; entry ``a_ij`` is the fraction of class ``j``'s samples
    that agent ``i`` holds::

        a_ij(t) = (1 - t) / N                 if i != j mod N
        a_ij(t) = 1 - sum_{k != i} a_kj       if i == j mod N

    The owner of class ``j`` is agent ``j mod N``; every other agent gets ``(1 - t) / N`` of the class and
    the owner gets the rest, ``(1 + (N - 1) t) / N``. This defines the matrix for any number of classes
    (with more classes than agents an agent owns several; with fewer, some agents own none). Columns sum
    to 1. ``t = 0`` gives every agent ``1/N`` of every class; ``t = 1`` gives each class entirely to its
    owner (the identity when ``n_classes == n_agents``).

    Parameters
    ----------
    n_agents : int
        Number of agents N (rows), at least 1.
    n_classes : int
        Number of classes (columns), at least 1.
    t : float
        Degree of class separation in ``[0, 1]``.

    Returns
    -------
    numpy.ndarray
        float64 array of shape ``(n_agents, n_classes)``.

    Raises
    ------
    ConfigError
        ``data.overlap_t`` when ``t`` is outside ``[0, 1]``; ``topology.agents`` or ``n_classes`` when a
        count is not positive.
    """
    _check_positive_int("topology.agents", n_agents)
    _check_positive_int("n_classes", n_classes)
    t = _check_overlap_t(t)
    a = np.full((n_agents, n_classes), (1.0 - t) / n_agents)
    owners = np.arange(n_classes) % n_agents
    a[owners, np.arange(n_classes)] = 1.0 - (n_agents - 1) * (1.0 - t) / n_agents
    return a


def partition(
    labels: np.ndarray,
    n_agents: int,
    scheme: str,
    *,
    seed: int,
    t: float | None = None,
    alpha: float | None = None,
    size_skew: float | None = None,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Assign the samples of a training set to ``n_agents`` agents.

    Parameters
    ----------
    labels : numpy.ndarray
        Integer class labels ``(n,)`` of the training set, values in ``[0, n_classes)``.
    n_agents : int
        Number of agents N.
    scheme : str
        One of :data:`PARTITIONS`.
    seed : int
        Seed of the numpy ``Generator`` that drives every random choice.
    t : float, optional
        ``overlap`` only: class separation in ``[0, 1]`` of :func:`overlap_matrix`. Each class's samples
        are shuffled and cut into per-agent chunks whose sizes are ``a_ij * n_j`` rounded by the largest
        remainder method (ties broken at random), so they sum exactly to the class count ``n_j``.
    alpha : float, optional
        ``dirichlet`` only: concentration ``> 0``. For each class, agent proportions are drawn from
        ``Dir(alpha * 1_N)``; the whole draw is repeated (with seeds derived from ``seed``, at most
        100 times) until every agent has at least ``min_size`` samples.  The config caps it at
        :data:`DIRICHLET_ALPHA_MAX`; a value so large that numpy's sampler returns all-zero proportions (near
        1e308) is refused here.
    size_skew : float, optional
        ``unequal`` only: ``sigma > 0`` of the lognormal size law. Agent weights are
        ``w_i ~ LogNormal(0, sigma^2)`` i.i.d.; each agent gets ``min_size`` samples plus a share of the
        remaining ``n - N * min_size`` proportional to ``w_i``. Samples are assigned uniformly at random, so
        labels stay IID. ``sigma -> 0`` approaches equal sizes; with ``sigma = 1`` and 10 agents the largest
        agent typically holds about 20 times as many samples as the smallest.  The config caps it at
        :data:`SIZE_SKEW_MAX`; a value so large that the weights overflow to infinity (or all underflow to 0)
        is refused here, naming ``data.size_skew``.
    min_size : int, default 1
        Fewest samples any agent may receive, checked for every scheme (an agent with no data cannot draw
        a batch).

    Returns
    -------
    list of numpy.ndarray
        ``n_agents`` sorted int64 index arrays, pairwise disjoint, whose union is ``range(len(labels))``
        (``pathological``: every class trimmed to the smallest class's size, as CGA's code does).

    Raises
    ------
    ConfigError
        ``data.partition`` for an unknown scheme or an agent left with fewer than ``min_size`` samples (for
        ``overlap``: ``data.overlap_t`` when :math:`A(t)` itself gives it too few, ``topology.agents`` when its
        shares are under one record of each class and rounding took them),
        ``data.overlap_t`` / ``data.dirichlet_alpha`` / ``data.size_skew`` for a missing or invalid
        parameter of the chosen scheme, ``data.labels`` for labels that are not non-negative integers,
        ``min_size``, ``experiment.seed`` or ``topology.agents`` for invalid values (including more agents
        than ``len(labels) / min_size``).
    """
    if scheme not in PARTITIONS:
        raise ConfigError("data.partition",
                          f"unknown scheme {scheme!r}; expected one of {', '.join(PARTITIONS)}")
    labels = _check_labels(labels)
    _check_positive_int("topology.agents", n_agents)
    _check_positive_int("min_size", min_size)
    if n_agents * min_size > len(labels):
        raise ConfigError(
            "topology.agents",
            f"{n_agents} agents with at least {min_size} sample(s) each need {n_agents * min_size} samples, "
            f"but the training set has {len(labels)}",
        )

    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError("experiment.seed", f"must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(len(labels)), n_agents)
    elif scheme == "overlap":
        if t is None:
            raise ConfigError("data.overlap_t", "the 'overlap' partition needs t in [0, 1]")
        n_classes = int(labels.max()) + 1
        fractions = overlap_matrix(n_agents, n_classes, t)
        parts = _split_by_class(labels, fractions, rng)
    elif scheme == "dirichlet":
        parts = _dirichlet(labels, n_agents, alpha, seed, min_size)
    elif scheme == "pathological":
        parts = _pathological(labels, n_agents, rng)
    else:
        parts = _unequal(len(labels), n_agents, size_skew, min_size, rng)

    parts = [np.sort(p).astype(np.int64, copy=False) for p in parts]
    sizes = np.array([len(p) for p in parts])
    if sizes.min() < min_size:
        agent = int(sizes.argmin())
        if scheme == "overlap":
            _refuse_overlap_shortfall(labels, fractions, agent, int(sizes.min()), min_size)
        raise ConfigError("data.partition", f"agent {agent} would get {int(sizes.min())} samples, fewer than "
                                            f"min_size={min_size}")
    return parts


def _refuse_overlap_shortfall(labels: np.ndarray, fractions: np.ndarray, agent: int, size: int,
                              min_size: int) -> NoReturn:
    """Raise the :class:`ConfigError` that says why the overlap split left ``agent`` with ``size < min_size``
    records, naming the field to change.  Either :math:`A(t)` itself gives it too little (it owns no class and
    ``t`` is near 1: lower ``t``), or it gives it enough in expectation but as shares of under one record of each
    class, which the per-class rounding to whole records took from it (the hint said "lower t" even at ``t = 0``,
    where only fewer agents help)."""
    n_agents, n_classes = fractions.shape
    counts = np.bincount(labels, minlength=n_classes)
    expected = float(fractions[agent] @ counts)
    shortfall = f"agent {agent} would get {size} samples, fewer than min_size={min_size}"
    if expected < min_size:
        owns = "owning no class" if agent >= n_classes else "owning only small classes"
        raise ConfigError("data.overlap_t", f"{shortfall}: A(t) gives it {expected:.3g} records in expectation, "
                                            f"{owns}; lower t or use fewer agents")
    under_one = int(np.count_nonzero(fractions[agent] * counts < 1))
    raise ConfigError("topology.agents", f"{shortfall}: A(t) gives it {expected:.3g} records in expectation, but as "
                                         f"shares of under one record of {under_one} of the {n_classes} classes, and "
                                         "cutting each class into whole records left it too few; use fewer agents "
                                         "(or the 'iid' partition)")


#: How a validation split is drawn (``data.validation_split``): see :func:`hold_out`.
VALIDATION_SPLITS: tuple[str, ...] = ("exact-count", "per-record")
_VALIDATION_KEY = 0x56414C  # "VAL": the per-record split's hash key is the seed xor this, apart from other uses


def hold_out(parts: list[np.ndarray], fraction: float, seed: int,
             split: str = "exact-count") -> tuple[list[np.ndarray], np.ndarray]:
    """Carve a validation set out of the agents' training records, for tuning without the test set.

    ``split = "exact-count"``: each agent gives up exactly ``floor(fraction * |D_i|)`` of its own records, the
    product taken exactly on the decimal ``fraction`` as written (0.29 of 100 records is 29, where float arithmetic
    makes it 28.999999999999996),
    chosen by a random permutation of its records from a stream of ``seed`` separate from the partition's, so
    every agent keeps its class mix in expectation.  Adding or removing one record redraws the whole
    permutation, moving other records between the two sides: right for tuning, not for a private selection.

    ``split = "per-record"``: each record is held out with probability ``fraction``, decided by a keyed hash
    of its index and ``seed`` alone (:func:`~decentdp.rng.record_hash`), so a record's side does not depend
    on which other records exist: adding or removing one record adds or removes it on one side and moves no
    other, where a record's identity is its index (a removed record leaves its index unused; the partition
    over agents is public).  This is what a private selection's accounting assumes (its trial ledgers price
    the training side under add/remove, its score noise the validation side); the counts are binomial instead
    of exact, so a small agent may be left with no training record, which is refused, naming the agent.

    Returns the agents' remaining index arrays and the sorted union of the held-out indices.  The held-out
    records are the agents' private data too: tuning on them has a privacy cost (see the README).
    """
    if not 0.0 <= fraction < 1.0:
        raise ConfigError("data.validation_fraction", f"must lie in [0, 1), got {fraction}")
    if split not in VALIDATION_SPLITS:
        raise ConfigError("data.validation_split", f"must be one of {', '.join(VALIDATION_SPLITS)}, got {split!r}")
    rng = np.random.default_rng([seed, 0x5A1])  # a stream of its own, independent of the partition's
    kept, held = [], []
    for part in parts:
        if split == "per-record":
            uniform = (record_hash(part, seed ^ _VALIDATION_KEY) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
            out = uniform < fraction
            held.append(part[out])
            kept.append(np.sort(part[~out]))
            continue
        order = rng.permutation(len(part))
        cut = math.floor(Fraction(str(float(fraction))) * len(part))  # (the float product gives 28 for 0.29 * 100)
        held.append(part[order[:cut]])
        kept.append(np.sort(part[order[cut:]]))
    emptied = [agent for agent, (part, left) in enumerate(zip(parts, kept, strict=True)) if len(part) and not len(left)]
    if emptied:
        raise ConfigError("data.validation_fraction", f"the {split} split at {fraction} holds out every training "
                                                      f"record of agent {emptied[0]} (of {len(parts[emptied[0]])}); "
                                                      "lower it, or give that agent more records")
    validation = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    if fraction > 0 and len(validation) == 0:
        raise ConfigError("data.validation_fraction", f"{fraction} of the agents' records is no record at all; "
                                                      "raise it")
    return kept, validation


def class_histograms(labels: np.ndarray, parts: list[np.ndarray], n_classes: int) -> np.ndarray:
    """Count each agent's samples per class, for logging how non-IID a split is.

    Parameters
    ----------
    labels : numpy.ndarray
        Integer class labels ``(n,)``.
    parts : list of numpy.ndarray
        Index arrays, one per agent, as returned by :func:`partition`.
    n_classes : int
        Number of classes (columns).

    Returns
    -------
    numpy.ndarray
        int64 array ``(len(parts), n_classes)``; entry ``[i, j]`` is how many samples of class ``j``
        agent ``i`` holds.
    """
    labels = np.asarray(labels)
    hist = np.zeros((len(parts), n_classes), dtype=np.int64)
    for i, part in enumerate(parts):
        hist[i] = np.bincount(labels[part], minlength=n_classes)[:n_classes]
    return hist


class _UnusableWeights(ValueError):
    """Weights that :func:`_largest_remainder` cannot share a total by; the caller says which setting made them."""


def _largest_remainder(total: int, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integer sizes proportional to ``weights`` that sum exactly to ``total``.

    Each size is the floor of its exact share; the units left over go to the largest fractional parts,
    ties broken at random so no agent is favoured systematically across classes. Fractional parts are
    rounded before comparing so that floating-point noise (e.g. ``1 - 2/3`` vs ``1/3``) is not a tie-breaker.

    Raises :class:`_UnusableWeights` for weights that are not finite and non-negative with a positive sum
    whose product with ``total`` is finite (lognormal weights overflowed to inf made NaN sizes, and all-zero
    Dirichlet proportions 0/0, which surfaced as an agent with no record, blaming the wrong setting).
    """
    with np.errstate(all="ignore"):  # (the sum of huge finite weights may overflow: that is what is checked)
        weight_sum = weights.sum()
        usable = bool(np.isfinite(weights).all() and (weights >= 0).all() and weight_sum > 0
                      and np.isfinite(total * weight_sum))
    if not usable:
        raise _UnusableWeights(f"weights {weights.tolist()} cannot share {total} records (their sum is {weight_sum})")
    exact = total * weights / weights.sum()
    sizes = np.floor(exact).astype(np.int64)
    leftover = total - int(sizes.sum())
    order = np.lexsort((rng.random(len(weights)), -np.round(exact - sizes, 9)))
    sizes[order[:leftover]] += 1
    return sizes


def _split_by_class(labels: np.ndarray, fractions: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Cut each class's shuffled indices into chunks; agent i gets ``fractions[i, j]`` of class j."""
    n_agents, n_classes = fractions.shape
    chunks: list[list[np.ndarray]] = [[] for _ in range(n_agents)]
    for j in range(n_classes):
        members = rng.permutation(np.flatnonzero(labels == j))
        sizes = _largest_remainder(len(members), fractions[:, j], rng)
        for i, chunk in enumerate(np.split(members, np.cumsum(sizes)[:-1])):
            chunks[i].append(chunk)
    return [np.concatenate(c) for c in chunks]


def _dirichlet(labels: np.ndarray, n_agents: int, alpha: float | None, seed: int,
               min_size: int) -> list[np.ndarray]:
    """Dirichlet label split, redrawn until every agent holds at least ``min_size`` samples."""
    alpha = _check_positive_float("data.dirichlet_alpha", alpha, "dirichlet")
    n_classes = int(labels.max()) + 1
    smallest = 0
    for attempt in range(_DIRICHLET_TRIES):
        rng = np.random.default_rng([seed, attempt])
        fractions = rng.dirichlet(np.full(n_agents, alpha), size=n_classes).T
        try:
            parts = _split_by_class(labels, fractions, rng)
        except _UnusableWeights:  # numpy's sampler returns all-zero proportions for alpha near 1e308
            raise ConfigError("data.dirichlet_alpha", f"alpha={alpha} is too large for numpy's Dirichlet sampler, "
                                                      "which returns no proportions (all zero) at this size; use a "
                                                      f"smaller alpha (at most {DIRICHLET_ALPHA_MAX:g}, which already "
                                                      "splits each class equally), or the 'iid' partition") from None
        smallest = min(len(p) for p in parts)
        if smallest >= min_size:
            return parts
    raise ConfigError(
        "data.dirichlet_alpha",
        f"alpha={alpha} left some agent with {smallest} < min_size={min_size} samples in each of "
        f"{_DIRICHLET_TRIES} draws; use a larger alpha or fewer agents (topology.agents)",
    )


def _unequal(n: int, n_agents: int, size_skew: float | None, min_size: int,
             rng: np.random.Generator) -> list[np.ndarray]:
    """IID split with lognormal agent sizes, each at least ``min_size``."""
    sigma = _check_positive_float("data.size_skew", size_skew, "unequal")
    weights = rng.lognormal(mean=0.0, sigma=sigma, size=n_agents)
    try:
        sizes = min_size + _largest_remainder(n - n_agents * min_size, weights, rng)
    except _UnusableWeights:  # e^(sigma z) past 1e308 (inf), or below 1e-308 for every agent (all 0)
        weights_are = "infinite" if np.isinf(weights).any() else "all 0"
        raise ConfigError("data.size_skew", f"size_skew={sigma} is too large: the lognormal weights e^(size_skew z) "
                                            f"of the {n_agents} agents came out {weights_are} in floating point; use "
                                            f"a smaller size_skew (at most {SIZE_SKEW_MAX:g}, where the largest agent "
                                            "already holds nearly every record)") from None
    return np.split(rng.permutation(n), np.cumsum(sizes)[:-1])


def _pathological(labels: np.ndarray, n_agents: int, rng: np.random.Generator) -> list[np.ndarray]:
    """CGA's pathological split: equal-size classes, whole classes per agent or equal slices of one class."""
    n_classes = int(labels.max()) + 1
    if n_agents > n_classes and n_agents % n_classes:
        raise ConfigError("topology.agents", f"the 'pathological' partition with more agents ({n_agents}) than "
                                             f"classes ({n_classes}) needs a multiple of {n_classes} agents")
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(n_classes)]
    empty = [c for c, members in enumerate(by_class) if not len(members)]
    if empty:  # trimming to the smallest class would leave every agent with nothing
        raise ConfigError("data.partition", f"the 'pathological' partition trims every class 0..{n_classes - 1} to "
                                            f"the smallest class's size, and class {empty[0]} has no sample: it "
                                            "needs every class present (number the classes 0..K-1 without gaps, "
                                            "or use another scheme)")
    size = min(len(members) for members in by_class)  # trimmed to equal size, as the authors' code does
    parts: list[list[np.ndarray]] = [[] for _ in range(n_agents)]
    if n_agents <= n_classes:
        for c, members in enumerate(by_class):
            parts[c % n_agents].append(members[:size])
    else:
        share = n_agents // n_classes
        for agent in range(n_agents):
            slot = agent // n_classes
            parts[agent].append(np.array_split(by_class[agent % n_classes][:size], share)[slot])
    return [np.concatenate(chunks) for chunks in parts]


def _check_labels(labels: np.ndarray) -> np.ndarray:
    """Return ``labels`` as a 1-D integer array of non-negative class ids, or explain what is wrong."""
    arr = np.asarray(labels)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError("data.labels", f"expected a 1-D integer label array, got dtype {arr.dtype} "
                                         f"and shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ConfigError("data.labels", "labels must be non-negative class ids")
    return arr.astype(np.int64, copy=False)


def _check_positive_int(field: str, value: int) -> None:
    """Reject counts that are not positive integers (bools included, which are ints to Python)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")


def _check_overlap_t(t: float) -> float:
    """Return ``t`` as a float after checking it is a real number in ``[0, 1]``."""
    if isinstance(t, bool) or not isinstance(t, (int, float, np.floating, np.integer)) or not 0.0 <= t <= 1.0:
        raise ConfigError("data.overlap_t", f"must be a number in [0, 1], got {t!r}")
    return float(t)


def _check_positive_float(field: str, value: float | None, scheme: str) -> float:
    """Return a scheme's parameter as a float after checking it was given and is finite and positive."""
    is_number = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not is_number or not np.isfinite(value) or value <= 0:
        raise ConfigError(field, f"the {scheme!r} partition needs a finite value > 0, got {value!r}")
    return float(value)
