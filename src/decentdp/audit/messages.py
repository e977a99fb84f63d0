"""A tight, message-level audit: a neighbour records an agent's releases and tests for a Dirac gradient canary.

The adversary of decentralized learning is a neighbour: it sees what the agent releases (tapped by
:class:`~decentdp.audit.tap.ReleaseTap`).  The audited record is a *canary* whose clipped gradient
is ``C e_j``, a fixed direction of norm C (the "Dirac canary" of Nasr et al. 2023, the worst case
for the Gaussian mechanism): :class:`CanaryModel` plants it in the gradient engine for records
labelled :data:`CANARY_LABEL`, and reserves coordinate ``j`` for it (the other records' clipped
gradients lose that coordinate, which only lowers their norms, so every guarantee holds as it is).
What the neighbour sees of coordinate ``j`` in each release is then ``k C b + N(0, k sigma^2 C^2)``
for ``k`` sums on one batch, with ``b ~ Bernoulli(q)`` when the canary is present and ``b = 0``
when not: exactly the subsampled Gaussian mechanism the accountant prices.

The test statistic is the Neyman-Pearson log-likelihood ratio of the whole transcript,
``sum_t log(1 - q + q exp(mu z_t - mu^2 / 2))`` with ``z_t`` the standardised projection and
``mu = sqrt(k) / sigma`` (the sum of the projections when sigma = 0), computed from the *claimed*
mechanism; many trainings of each world (blocks of one simulation, :mod:`decentdp.audit.blocks`)
and Clopper-Pearson intervals turn it into an epsilon lower bound (:mod:`decentdp.audit.bounds`).
A lower bound above the nominal epsilon means the noise or the accounting is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from decentdp.audit.blocks import AuditOutcome, BlockRun, block_simulation, run_audit
from decentdp.audit.settings import AuditSection
from decentdp.audit.tap import ReleaseTap
from decentdp.errors import ConfigError
from decentdp.gradients.flat_model import FlatModel
from decentdp.privacy.mechanisms import Mechanism
from decentdp.run.build import Experiment

#: The label that marks the canary record; the gradient engine plants ``C e_j`` for it.
CANARY_LABEL = -1


def canary_coordinate(model: FlatModel, parameter: str | None, index: int) -> int:
    """The flat coordinate of ``index`` within ``parameter`` (or of the flat vector); a ConfigError if absent."""
    if parameter is None:
        if index >= model.dim:
            raise ConfigError("audit.canary_index", f"{index} is not a coordinate of this model "
                                                    f"({model.dim} parameters)")
        return index
    if parameter not in model.names:
        raise ConfigError("audit.canary_parameter", f"this model has no parameter {parameter!r}; its parameters: "
                                                    f"{', '.join(model.names)}")
    position = model.names.index(parameter)
    if index >= model.numels[position]:
        raise ConfigError("audit.canary_index", f"{index} is not a coordinate of {parameter!r} "
                                                f"({model.numels[position]} entries)")
    return sum(model.numels[:position]) + index


class CanaryModel:
    """A gradient engine whose records labelled :data:`CANARY_LABEL` have the clipped gradient ``C e_j``.

    Coordinate ``j`` is reserved for the canary: the other records' gradients there are dropped.
    Everything else is the wrapped engine's (forward passes, predictions, memory estimates).
    """

    def __init__(self, model: FlatModel, coordinate: int, clip: float) -> None:
        self.model = model
        self.coordinate = coordinate
        self.clip = float(clip)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def _split(self, y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        canary = (y == CANARY_LABEL) & (mask > 0)
        return canary, mask * ~canary, torch.where(y == CANARY_LABEL, torch.zeros_like(y), y)

    def clipped_gradient_sums(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                              clip: float, out: torch.Tensor | None = None,
                              copies: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if copies != 1:  # a canary is one row; its augmented copies would need their own labels
            raise ValueError("the message audit plants canaries in single records: run it without augmentation")
        canary, real, labels = self._split(y, mask)
        sums, norms = self.model.clipped_gradient_sums(params, x, labels, real, clip, out=out)
        sums[:, self.coordinate] = clip * canary.sum(dim=1).to(sums.dtype)
        return sums, torch.where(canary, torch.full_like(norms, clip), norms)

    def batch_gradients(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        canary, real, labels = self._split(y, weights)
        grads = self.model.batch_gradients(params, x, labels, real)
        grads[:, self.coordinate] = self.clip * (weights * canary).sum(dim=1).to(grads.dtype)
        return grads


def likelihood_ratio_scores(projections: np.ndarray, rows: np.ndarray, sigma: float, clip: float,
                            rate: float) -> np.ndarray:
    """Log-likelihood ratio of "canary present" over "absent" for each run's transcript.

    ``projections[t, m]`` is what run ``m``'s release ``t`` shows on the canary coordinate (summed over
    its ``rows[t, m]`` rows); ``sigma`` the claimed noise multiplier of one row, ``rate`` the sampling
    rate.  With ``sigma = 0`` (no noise) the sum of the projections is returned.
    """
    if sigma == 0.0:
        return projections.sum(axis=0)
    k = np.maximum(rows, 1).astype(np.float64)
    z = projections / (np.sqrt(k) * sigma * clip)
    mu = np.sqrt(k) / sigma
    shift = mu * z - mu**2 / 2
    if rate >= 1.0:
        terms = shift
    else:  # log(1 - q + q e^s) = logaddexp(log(1 - q), log q + s)
        terms = np.logaddexp(math.log1p(-rate), math.log(rate) + shift)
    return np.where(rows > 0, terms, 0.0).sum(axis=0)


def run_message_audit(experiment: Experiment, audit: AuditSection,
                      wrap_mechanism: Callable[[Mechanism], Mechanism] | None = None) -> AuditOutcome:
    """The message audit of ``experiment``'s algorithm with ``audit.models`` trainings per world.

    ``wrap_mechanism`` replaces the calibrated mechanism (tests plant bugs with it, e.g. halved noise)."""
    config = experiment.config
    block = experiment.topology.n_agents
    if audit.target >= block:
        raise ConfigError("audit.target", f"agent {audit.target} is not in a block of {block} agents")
    coordinate = canary_coordinate(experiment.model, audit.canary_parameter, audit.canary_index)
    model = CanaryModel(experiment.model, coordinate, config.privacy.clip)
    parts, x, y = _small_parts(experiment, audit.records)
    x = torch.cat([x, torch.zeros_like(x[:1])])  # the canary's image is never used: its gradient is planted
    y = torch.cat([y, torch.full_like(y[:1], CANARY_LABEL)])

    def build(member: np.ndarray, seed: int) -> BlockRun:
        return block_simulation(experiment, x, y, parts, audit.target, len(x) - 1, member, seed, model=model,
                                wrap_mechanism=wrap_mechanism)

    noise: list[float] = []  # the target's claimed multiplier, for the summary

    def score(run: BlockRun) -> np.ndarray:
        noise[:] = [run.noise_multipliers[audit.target]]
        tap = ReleaseTap(run.oracle, run.targets, lambda rows: rows[:, coordinate])
        run.train()
        tap.detach()
        rate = float(run.oracle.sample_rates[int(run.targets[0])])
        projections = torch.stack(tap.values).double().cpu().numpy()
        rows = torch.stack(tap.rows).cpu().numpy()
        return likelihood_ratio_scores(projections, rows, noise[0], config.privacy.clip, rate)

    outcome = run_audit(experiment, audit, "messages", build, score)
    outcome.summary["canary_coordinate"] = coordinate
    outcome.summary["noise_multiplier"] = noise[0] if noise else 0.0
    return outcome


def _small_parts(experiment: Experiment, records: int) -> tuple[list[np.ndarray], torch.Tensor, torch.Tensor]:
    """The first ``records`` records of each agent's part of the config's partition, gathered compactly."""
    owned = [idx[:records].cpu() for idx in experiment.data.indices]
    rows = torch.cat(owned)
    x, y = experiment.data.x[rows.to(experiment.data.x.device)], experiment.data.y[rows.to(experiment.data.x.device)]
    offsets = np.cumsum([0] + [len(idx) for idx in owned])
    return [np.arange(offsets[a], offsets[a + 1]) for a in range(len(owned))], x, y

