"""The ``[personalized]`` config section: Bellet et al. (2018) personalized peer-to-peer learning.

A config with this section runs :func:`decentdp.personalized.runner.run_personalized` instead of
the round-based simulator: per-agent linear models on a similarity graph, asynchronous block
coordinate descent under Poisson clocks, and its baselines.  The privacy budget, delta, clipping
bound, accountant and neighbouring relation come from ``[privacy]`` as in every other run
(``epsilon`` is each agent's budget epsilon-bar over its own wake-ups, ``delta`` its delta-bar).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Method = Literal["cd", "local", "admm", "propagation"]

#: The fields that describe one dataset's problem, which the other dataset's loader never reads.
DATASET_FIELDS: dict[str, tuple[str, ...]] = {
    "movielens-100k": ("test_fraction", "als_rank", "als_reg", "als_iterations", "neighbours"),
    "synthetic": ("agents", "dim", "min_points", "max_points", "test_points", "label_noise", "gamma"),
}


class PersonalizedSection(BaseModel):
    """What to learn, how, and on which data (every field typed and ranged; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    method: Method = Field("cd", description="cd: (private) coordinate descent, eq. (6); local: purely local "
                                             "models; admm: the decentralized ADMM of Vanhaesebrouck et al. "
                                             "(non-private); propagation: model propagation of local models, eq. (16)")
    dataset: Literal["movielens-100k", "synthetic"] = Field("synthetic", description="movielens-100k (u.data "
                                                            "under the data directory) or the synthetic generator")
    mu: float = Field(0.04, gt=0.0, description="trade-off between smoothness over the graph and local loss")
    wakeups: int = Field(10, ge=1, description="T_i = T/n: updates per agent; the run lasts T = wakeups * n "
                                               "Poisson-clock ticks and an agent stops after its T_i updates")
    mechanism: Literal["laplace", "gaussian"] = Field("laplace", description="noise of the private updates: "
                                                      "Laplace (Theorem 1, l1 clipping) or Gaussian (Remark 2, l2)")
    allocation: Literal["equal", "optimal"] = Field("equal", description="an agent's budget across its wake-ups: "
                                                    "equal, or Proposition 2's allocation for a known schedule")
    calibration: Literal["tight", "paper"] = Field(
        "tight", description="tight: the per-update noise is the smallest whose composition, priced by "
                             "privacy.accountant, stays within epsilon-bar; paper: the Kairouz et al. composition "
                             "of Theorem 1 (looser: more noise for the same budget), its per-update epsilons "
                             "scaled down where privacy.accountant prices the planned releases above the budget "
                             "(setup.json: calibration_notice)")
    warm_start: bool = Field(False, description="start from DP local models (output perturbation) smoothed by "
                                                "model propagation (supplementary C)")
    warm_start_epsilon: float = Field(0.05, gt=0.0, description="pure epsilon of the warm start's local models, "
                                                                "spent inside epsilon-bar whatever the method: at "
                                                                "most privacy.epsilon (below it for cd, whose "
                                                                "updates get the rest, by composition)")
    admm_rho: float = Field(1.0, gt=0.0, description="ADMM penalty (not reported by the papers)")
    admm_local_steps: int = Field(10, ge=1, description="gradient steps of each ADMM primal update")
    feature_bound: float | None = Field(
        None, gt=0.0, description="B, a public bound on the feature rows' l2 norm (rows above it are scaled to it): "
                                  "the step sizes use l'' sup * B^2 + 2 lambda_i instead of the records' own "
                                  "smoothness, which would leak through the step; default: the dataset's declared "
                                  "bound in private cd runs (the largest movie-feature norm; the synthetic "
                                  "generator's sqrt(0.5) (sqrt(dim) + 6)), none in the others")
    validation: bool = Field(False, description="evaluate on a held-out share (test_fraction) of each user's "
                                                "training ratings instead of its test ratings (MovieLens; for "
                                                "tuning wakeups)")
    # MovieLens-100K (specs D.5)
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    als_rank: int = Field(20, ge=1, description="rank of the public movie features (p = als_rank + 1: a constant 1 "
                                                 "is appended for the user's offset)")
    als_reg: float = Field(0.1, gt=0.0)
    als_iterations: int = Field(15, ge=1)
    neighbours: int = Field(10, ge=1, description="k of the k-nearest-neighbour similarity graph")
    # synthetic (specs D.7)
    agents: int = Field(100, ge=2, le=5000, description="users of the synthetic problem (the paper: 100); at "
                                                       "most 5000: its similarity graph is a dense n x n matrix "
                                                       "whose eigenvalues are computed")
    dim: int = Field(100, ge=2)
    min_points: int = Field(10, ge=0)
    max_points: int = Field(100, ge=1)
    test_points: int = Field(100, ge=1)
    label_noise: float = Field(0.05, ge=0.0, lt=0.5)
    gamma: float = Field(0.1, gt=0.0)

    @model_validator(mode="after")
    def _consistent(self) -> PersonalizedSection:
        # a field of the other dataset's problem would be silently ignored (a method's knobs, such as cd's
        # mechanism under method = 'local', are kept quietly: switching the method leaves them behind)
        fields = type(self).model_fields
        for dataset, names in DATASET_FIELDS.items():
            unread = [name for name in names if dataset != self.dataset and getattr(self, name) != fields[name].default]
            if unread:
                raise ValueError(f"{unread[0]}: describes the {dataset} problem, not {self.dataset}'s; remove "
                                 f"{', '.join(unread)}")
        if self.validation and self.dataset == "synthetic":
            raise ValueError("validation: the synthetic generator draws fresh problems: tune on another seed instead")
        if self.min_points > self.max_points:
            raise ValueError(f"min_points: {self.min_points} exceeds max_points = {self.max_points}")
        if self.allocation == "optimal" and self.calibration != "paper":
            raise ValueError("allocation: 'optimal' is Proposition 2's allocation under the paper's composition; "
                             "set personalized.calibration = 'paper' (the tight accountants price every release "
                             "separately, so they would allocate differently)")
        return self


def warm_start_overspend(settings: PersonalizedSection, budget: float) -> str | None:
    """Why a private warm start's ``warm_start_epsilon`` does not fit ``privacy.epsilon`` (``budget``), or None.

    The warm start is spent inside the budget, whatever the method (README): ``local`` and ``propagation``
    spend nothing else, so it may take the whole budget; ``cd``'s updates get the rest, so it must leave some;
    ``admm`` adds no noise (its run is not private) but starts from the same release, so the same bound holds."""
    if not settings.warm_start or math.isinf(budget):
        return None
    spent = settings.warm_start_epsilon
    if settings.method == "cd" and spent >= budget:
        return (f"{spent:g} leaves nothing of privacy.epsilon = {budget:g} for the updates: the warm start is spent "
                "inside the budget")
    if spent > budget:
        return (f"{spent:g} exceeds privacy.epsilon = {budget:g}: the warm start is spent inside the budget (method "
                f"'{settings.method}' spends nothing else, so it may take all of it)")
    return None
