"""The one-run audit of Steinke, Nasr & Jagielski (NeurIPS 2023): many canaries, each in or out, in ONE training.

The many-run audits (:mod:`~decentdp.audit.messages`) train thousands of times with and without one
record.  Here the target agent holds its records and ``m`` Dirac canaries, each included
independently with probability 1/2 (a seeded draw of its own): canary ``k`` is a record whose
clipped gradient is ``C e_{j_k}``, on a coordinate of its own (:class:`~decentdp.audit.messages.CanaryModel`
reserves all of them), so each canary's presence is tested in the same single run.  The adversary
is the message audit's: a neighbour records every release of the target
(:class:`~decentdp.audit.tap.ReleaseTap`) and scores canary ``k`` by the log-likelihood ratio of the
releases' projections on ``e_{j_k}`` under the claimed mechanism.  It guesses the ``k`` highest
scores "in" and the ``k`` lowest "out" and abstains on the rest; Theorem 5.2 turns the number of
correct guesses into an epsilon lower bound (:func:`~decentdp.audit.bounds.one_run_bound`, the best
over a fixed grid of ``k`` with a union bound).

The run is the library's, through the block machinery with a single block
(:func:`~decentdp.audit.blocks.block_simulation`): sampling rates and noise are those of the target
holding every canary, whichever are drawn, as add/remove DP requires.  The bound is sound but weaker
than the many-run audit's: the theorem prices each canary as if the mechanism were eps-DP randomized
response, which a Gaussian mechanism's tails are not, so a correct Gaussian mechanism shows at most
about half its epsilon (and halved noise is not reliably refuted; quartered noise is).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from decentdp.audit.blocks import block_simulation, chunk_seed
from decentdp.audit.bounds import guess_grid, one_run_bound, one_run_guesses
from decentdp.audit.messages import canary_records, canary_scores
from decentdp.audit.settings import AuditSection
from decentdp.experiment.build import Experiment, agent_budgets
from decentdp.privacy.mechanisms import Mechanism

#: Mixed with the config's seed into the inclusion draw's own numpy stream, a key no other draw uses (batches
#: and noise come from keyed torch streams, the partition and scheduler from numpy streams of other keys), so
#: which canaries are in is independent of everything the adversary sees but the mechanism's output.
INCLUSION_KEY = 0x6F6E652D72756E  # "one-run"


def canary_inclusion(seed: int, canaries: int) -> np.ndarray:
    """Which canaries the target holds: each independently with probability 1/2, reproducible from ``seed``."""
    generator = np.random.default_rng(np.random.SeedSequence([seed, INCLUSION_KEY]))
    return generator.random(canaries) < 0.5


@dataclass(frozen=True)
class OneRunOutcome:
    """The audit's summary (bound, guesses, nominal epsilon, timing) and every canary's coordinate, inclusion,
    score and guess (+1 in, -1 out, 0 abstain, at the reported number of guesses)."""

    summary: dict[str, Any]
    coordinates: np.ndarray
    included: np.ndarray
    scores: np.ndarray
    guesses: np.ndarray


def run_one_run_audit(experiment: Experiment, audit: AuditSection,
                      wrap_mechanism: Callable[[Mechanism], Mechanism] | None = None) -> OneRunOutcome:
    """One training of ``experiment``'s algorithm with ``audit.canaries`` canaries on agent ``audit.target``.

    ``wrap_mechanism`` replaces the calibrated mechanism (tests plant bugs with it, e.g. reduced noise)."""
    config = experiment.config
    grid = guess_grid(audit.guesses_per_side, audit.canaries)
    canaries = canary_records(experiment, audit, audit.canaries)
    included = canary_inclusion(config.experiment.seed, audit.canaries)
    start = time.perf_counter()
    run = block_simulation(experiment, canaries.x, canaries.y, canaries.parts, audit.target, canaries.rows,
                           included[None, :], chunk_seed(config.experiment.seed, 0), model=canaries.model,
                           wrap_mechanism=wrap_mechanism)
    sigma = run.noise_multipliers[audit.target]
    scores = canary_scores(run, canaries.coordinates, sigma, config.privacy.clip)[0]
    bound = one_run_bound(scores, included, config.privacy.delta, audit.confidence, grid)
    wall = time.perf_counter() - start
    summary = {"audit": "one-run", "algorithm": config.algorithm.name, "canaries": audit.canaries,
               "included": int(included.sum()),
               "epsilon_nominal": agent_budgets(config, experiment.topology.n_agents)[audit.target],
               "epsilon_ledger": run.target_epsilon(), "delta": config.privacy.delta,
               "rounds": config.experiment.rounds, "noise_multiplier": sigma, "wall_seconds": wall,
               **bound.as_dict()}
    return OneRunOutcome(summary, canaries.coordinates, included, scores,
                         one_run_guesses(scores, bound.guesses_per_side))
