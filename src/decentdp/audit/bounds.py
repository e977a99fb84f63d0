"""Empirical lower bounds on epsilon from a membership test (Bayrooti et al., App. D, eq. 25).

A mechanism that is (epsilon, delta)-DP bounds any test that tells "trained with the record" from
"trained without it" (Kairouz et al. 2015): ``TPR - delta <= e^epsilon FPR`` and, by the same
argument applied to the complementary decision, ``TNR - delta <= e^epsilon FNR``.  Counting the
test's outcomes on runs of both worlds, Clopper-Pearson intervals turn the counts into a bound that
holds with the stated confidence: the lower end of TPR over the upper end of FPR (eq. 25).

The test thresholds a score (higher: more likely a member).  As in Jagielski et al. 2020 and the
paper, the threshold is chosen on a first part of the runs and the bound computed on the rest, so
that the choice cannot overfit the counts it is judged on.  The choice maximises the bound itself
(Clopper-Pearson corrected, for as many runs as the evaluation has), which avoids the degenerate
thresholds with no false positive that the raw ratio ``(TPR - delta) / FPR`` would pick.

The one-run audit (Steinke, Nasr & Jagielski 2023) needs no second training: m canaries are each
included with probability 1/2, the auditor guesses k "in" and k "out" from one run's output, and
Theorem 5.2 bounds how many correct guesses an (epsilon, delta)-DP training allows
(:func:`one_run_epsilon`); the number of guesses is chosen over a fixed grid with a union bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import special, stats

from decentdp.errors import ConfigError

#: Runs per world that each part of the split must hold at least.
MIN_RUNS_PER_PART = 10


def clopper_pearson(successes: np.ndarray | int, trials: np.ndarray | int,
                    confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Exact (Clopper-Pearson) two-sided binomial intervals ``(low, high)`` at ``confidence``, vectorised.

    ``low = Beta(alpha/2; k, n - k + 1)`` (0 when k = 0), ``high = Beta(1 - alpha/2; k + 1, n - k)``
    (1 when k = n): the intervals of ``scipy.stats.binomtest(k, n).proportion_ci(method="exact")``.
    """
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise ValueError("Clopper-Pearson intervals need 0 <= successes <= trials and trials >= 1")
    alpha = 1.0 - confidence
    with np.errstate(divide="ignore", invalid="ignore"):
        low = np.where(k > 0, stats.beta.ppf(alpha / 2, k, n - k + 1), 0.0)
        high = np.where(k < n, stats.beta.ppf(1 - alpha / 2, k + 1, n - k), 1.0)
    return low, high


def epsilon_from_rates(tpr_low: np.ndarray, fpr_high: np.ndarray, delta: float) -> np.ndarray:
    """``ln((TPR - delta) / FPR)`` of eq. 25 (0 where ``TPR <= delta``: such a test shows nothing)."""
    tpr_low, fpr_high = np.asarray(tpr_low, dtype=np.float64), np.asarray(fpr_high, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.log((tpr_low - delta) / fpr_high)
    return np.where(tpr_low > delta, np.maximum(bound, 0.0), 0.0)


def epsilon_from_counts(true_pos: np.ndarray | int, members: int, false_pos: np.ndarray | int, non_members: int,
                        delta: float, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """The bounds of eq. 25 and of its complement, ``ln((TNR - delta) / FNR)``, from a test's counts.

    ``true_pos`` of the ``members`` runs (trained with the record) and ``false_pos`` of the
    ``non_members`` runs were called members.  Both bounds hold for an (epsilon, delta)-DP mechanism.
    """
    tpr_low = clopper_pearson(np.asarray(true_pos), members, confidence)[0]
    fpr_high = clopper_pearson(np.asarray(false_pos), non_members, confidence)[1]
    forward = epsilon_from_rates(tpr_low, fpr_high, delta)
    # the complementary test: TNR = 1 - FPR is at least 1 - fpr_high, FNR = 1 - TPR at most 1 - tpr_low
    backward = epsilon_from_rates(1.0 - fpr_high, 1.0 - tpr_low, delta)
    return forward, backward


@dataclass(frozen=True)
class AuditBound:
    """A lower bound on epsilon and the test that reached it."""

    epsilon_lower_bound: float   # the larger of the two directions, at `confidence`
    epsilon_eq25: float          # ln((TPR - delta) / FPR) alone, as in the paper's Table 5
    threshold: float             # score at or above which a run is called a member
    true_positives: int
    members: int                 # evaluation runs trained with the record
    false_positives: int
    non_members: int             # evaluation runs trained without it
    selection_runs: int          # runs per world used to choose the threshold
    confidence: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_sizes(runs: int, selection_fraction: float) -> tuple[int, int]:
    """Runs per world that choose the threshold and that evaluate it; a ConfigError when a part is too small."""
    selection = int(round(selection_fraction * runs))
    if min(selection, runs - selection) < MIN_RUNS_PER_PART:
        need = math.ceil(MIN_RUNS_PER_PART / min(selection_fraction, 1 - selection_fraction))
        raise ConfigError("audit.models", f"{runs} runs per world leave {selection} to choose the threshold and "
                                          f"{runs - selection} to evaluate it (fraction {selection_fraction:g}); each "
                                          f"part needs at least {MIN_RUNS_PER_PART}: use at least {need} runs per "
                                          f"world (audit.models, or --models on the command line; with "
                                          f"--chunk-dir, the chunks trained so far count)")
    return selection, runs - selection


def _counts_at(thresholds: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """How many of ``scores`` are at or above each threshold."""
    ordered = np.sort(scores)
    return len(ordered) - np.searchsorted(ordered, thresholds, side="left")


def _best(candidates: np.ndarray, tpr: np.ndarray, fpr: np.ndarray, runs: tuple[int, int], delta: float,
          confidence: float) -> float:
    """The candidate whose rates, as counts over ``runs`` evaluation runs, give the largest bound."""
    members, non_members = runs
    forward, backward = epsilon_from_counts(np.round(tpr * members), members, np.round(fpr * non_members),
                                            non_members, delta, confidence)
    return float(candidates[int(np.argmax(np.maximum(forward, backward)))])


def best_threshold(member_scores: np.ndarray, non_member_scores: np.ndarray, delta: float,
                   confidence: float = 0.95, evaluation_runs: tuple[int, int] | None = None,
                   rule: str = "empirical") -> float:
    """The threshold whose Clopper-Pearson bound on ``evaluation_runs = (members, non_members)`` runs
    (default: as many as given here) is largest, judged from these runs' scores.

    ``empirical``: the observed rates at each observed score.  ``gaussian``: the tail rates of a normal
    fitted to each world's scores, which estimates far tails (where large evaluations find their best
    threshold) much better than a few counts do; right when the scores are Gaussian, as the message
    audit's log-likelihood ratio is for unsampled releases (q = 1); constant scores fall back to ``empirical``."""
    runs = evaluation_runs or (len(member_scores), len(non_member_scores))
    finite_m, finite_n = member_scores[np.isfinite(member_scores)], non_member_scores[np.isfinite(non_member_scores)]
    if rule == "gaussian" and min(len(finite_m), len(finite_n)) > 1 and min(finite_m.std(), finite_n.std()) > 0:
        low, high = min(finite_m.min(), finite_n.min()), max(finite_m.max(), finite_n.max())
        spread = max(finite_m.std(), finite_n.std())
        candidates = np.linspace(low - 3 * spread, high + 3 * spread, 4001)
        return _best(candidates, stats.norm.sf(candidates, finite_m.mean(), finite_m.std()),
                     stats.norm.sf(candidates, finite_n.mean(), finite_n.std()), runs, delta, confidence)
    candidates = np.unique(np.concatenate([finite_m, finite_n]))
    if len(candidates) == 0:
        return math.inf
    return _best(candidates, _counts_at(candidates, member_scores) / len(member_scores),
                 _counts_at(candidates, non_member_scores) / len(non_member_scores), runs, delta, confidence)


def audit_bound(member_scores: np.ndarray, non_member_scores: np.ndarray, delta: float,
                selection_fraction: float = 0.2, confidence: float = 0.95, rule: str = "empirical") -> AuditBound:
    """Choose a threshold on the first ``selection_fraction`` of each world's runs, bound epsilon on the rest.

    Scores are ordered as the runs were made (run ``m`` of each world is independent of the others),
    higher meaning "more likely trained with the record"; non-finite scores count as their sign says.
    """
    member_scores = np.nan_to_num(np.asarray(member_scores, dtype=np.float64), nan=-np.inf)
    non_member_scores = np.nan_to_num(np.asarray(non_member_scores, dtype=np.float64), nan=-np.inf)
    runs = min(len(member_scores), len(non_member_scores))
    selection, _ = split_sizes(runs, selection_fraction)
    members, non_members = member_scores[selection:runs], non_member_scores[selection:runs]
    threshold = best_threshold(member_scores[:selection], non_member_scores[:selection], delta, confidence,
                               (len(members), len(non_members)), rule)
    tp, fp = int((members >= threshold).sum()), int((non_members >= threshold).sum())
    forward, backward = epsilon_from_counts(tp, len(members), fp, len(non_members), delta, confidence)
    return AuditBound(float(max(forward, backward)), float(forward), threshold, tp, len(members), fp,
                      len(non_members), selection, confidence)


# -- the one-run audit (Steinke, Nasr & Jagielski, NeurIPS 2023) ---------------------------------------------

def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The largest probability that an (epsilon, delta)-DP training lets ``correct`` or more of ``guesses`` be right.

    Theorem 5.2 of Steinke, Nasr & Jagielski ("Privacy Auditing with One (1) Training Run", NeurIPS 2023):
    when each of ``m = canaries`` records is included independently with probability 1/2 and an auditor
    guesses the inclusion of ``r = guesses`` of them from the output (abstaining on the rest), the
    number W of correct guesses satisfies, for every v,
    ``P[W >= v] <= f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i``, with
    ``f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v]``: the tail of eps-DP randomized response, plus
    delta's share (larger i add nothing: ``f(v - i) = 1`` there).  This is the authors' p-value.
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries ({canaries})")
    right = special.expit(epsilon)  # the accuracy of eps-DP randomized response
    tail = float(stats.binom.sf(correct - 1, guesses, right))  # f(v)
    if delta == 0 or correct == 0:
        return min(tail, 1.0)
    shifts = np.arange(1, correct + 1)
    share = np.max((stats.binom.sf(correct - shifts - 1, guesses, right) - tail) / shifts)
    return min(tail + 2 * canaries * delta * float(share), 1.0)


def one_run_epsilon(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95,
                    tolerance: float = 1e-6) -> float:
    """The largest epsilon that ``correct`` right of ``guesses`` (of ``canaries``) rejects at ``confidence``.

    The numeric procedure of Steinke, Nasr & Jagielski (Theorem 5.2): (epsilon, delta)-DP is rejected
    when :func:`one_run_p_value` is below ``1 - confidence``; the p-value grows with epsilon, so a
    bisection finds the edge, and its lower end (a rejected epsilon, within ``tolerance``) is returned.
    0 when not even epsilon = 0 is rejected (e.g. no better than chance).
    """
    def rejected(epsilon: float) -> bool:
        return one_run_p_value(canaries, guesses, correct, epsilon, delta) < 1.0 - confidence

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2 * high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def guess_grid(per_side: list[int], canaries: int) -> list[int]:
    """The entries ``k`` of ``audit.guesses_per_side`` that ``canaries`` allow (``2 k <= canaries``), sorted;
    a ConfigError when none does.  Fixed before the run: the union bound over them is sound."""
    grid = sorted({k for k in per_side if 2 * k <= canaries})
    if not grid:
        raise ConfigError("audit.guesses_per_side", f"every entry ({', '.join(map(str, sorted(per_side)))}) guesses "
                                                    f"more than the {canaries} canaries: k in and k out need "
                                                    f"2 k <= audit.canaries")
    return grid


def one_run_guesses(scores: np.ndarray, per_side: int) -> np.ndarray:
    """Algorithm 1's guesses: +1 ("in") for the ``per_side`` highest scores, -1 ("out") for the ``per_side``
    lowest, 0 (abstain) for the rest; ties go by canary index, which the inclusion draw does not touch."""
    order = np.argsort(np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf), kind="stable")
    guesses = np.zeros(len(order), dtype=np.int8)
    guesses[order[:per_side]] = -1
    guesses[order[len(order) - per_side:]] = 1
    return guesses


@dataclass(frozen=True)
class OneRunBound:
    """A one-run lower bound on epsilon and the guesses that reached it."""

    epsilon_lower_bound: float  # the best entry's bound, at confidence 1 - (1 - confidence) / len(guess_grid)
    guesses: int                # r = 2 k of the best entry
    correct: int                # its correct guesses
    guesses_per_side: int       # its k
    guess_grid: list[int]       # every k tried
    confidence: float           # of the reported bound, over the whole grid

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def one_run_bound(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float,
                  grid: list[int]) -> OneRunBound:
    """Guess ``k`` in and ``k`` out for each ``k`` of ``grid``, bound epsilon from each, report the best.

    Each entry's bound holds at confidence ``1 - (1 - confidence) / len(grid)``, so by a union bound all
    of them, and hence the best, hold together at ``confidence``: choosing the number of guesses after
    seeing the scores costs a smaller confidence per entry, not soundness."""
    included = np.asarray(included, dtype=bool)
    each = 1.0 - (1.0 - confidence) / len(grid)
    best = OneRunBound(0.0, 0, 0, 0, list(grid), confidence)
    for k in grid:
        guesses = one_run_guesses(scores, k)
        correct = int(((guesses == 1) & included).sum() + ((guesses == -1) & ~included).sum())
        epsilon = one_run_epsilon(len(included), 2 * k, correct, delta, each)
        if epsilon > best.epsilon_lower_bound or best.guesses == 0:
            best = OneRunBound(epsilon, 2 * k, correct, k, list(grid), confidence)
    return best
