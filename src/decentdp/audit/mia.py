"""Membership-inference audit of any algorithm (Bayrooti et al., App. D and Table 5).

D is a small MNIST subset (``per_digit`` training images of each of ``digits``, 300 of 0, 1, 2 in the
paper), one digit per agent; D' = D + {z}, z a blank image (every pixel at the dataset's background
value) labelled with the target agent's digit (``audit.target``, by default agent 0 and the first
digit), held by that agent.  Every training
starts from the same initial parameters, so only batches and noise differ between runs; after
training, the target agent's loss on z is the attack's score (a low loss says "member").  A
threshold chosen on the first runs and Clopper-Pearson intervals on the rest give the bound of
eq. 25 (:mod:`decentdp.audit.bounds`).

The paper trained 5,000 models on each dataset on 4 GPUs; here they are blocks of one simulation
(:mod:`decentdp.audit.blocks`), ``chunk`` trainings of each world (``2 chunk`` blocks) at a time.  Central
baselines (algorithms that pool data) train one agent on the union of D (and z).  The summary's mean losses on z
are over the models whose loss is finite (``run_audit`` accepts up to half NaN scores, a diverged training's);
``loss_non_finite`` counts the others.
"""

from __future__ import annotations

import numpy as np
import torch

from decentdp.audit.blocks import AuditOutcome, BlockRun, ChunkStore, block_simulation, run_audit
from decentdp.audit.settings import AuditSection
from decentdp.errors import ConfigError
from decentdp.experiment.build import Experiment
from decentdp.models import classification_loss


def membership_data(experiment: Experiment, digits: list[int], per_digit: int, target: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """The records of D then z (labelled with the target agent's digit), compactly, and each agent's rows
    (one digit per agent, or all pooled).

    The records of each digit are its first ``per_digit`` training images (a public choice)."""
    labels = experiment.dataset.y_train.cpu().numpy()
    chosen = []
    for digit in digits:
        rows = np.flatnonzero(labels == digit)[:per_digit]
        if len(rows) < per_digit:
            raise ConfigError("audit.per_digit", f"the training set has {len(rows)} images of class {digit}, "
                                                 f"fewer than {per_digit}")
        chosen.append(rows)
    rows = torch.from_numpy(np.concatenate(chosen)).to(experiment.dataset.x_train.device)
    x_train = experiment.dataset.x_train
    blank = torch.full_like(x_train[:1], float(x_train.min()))
    x = torch.cat([x_train[rows], blank])
    y = torch.cat([experiment.dataset.y_train[rows], torch.tensor([digits[target]], device=x.device)])
    offsets = np.cumsum([0] + [per_digit] * len(digits))
    parts = [np.arange(offsets[a], offsets[a + 1]) for a in range(len(digits))]
    return x, y, [np.concatenate(parts)] if experiment.algorithm.pools_data else parts


def run_membership_audit(experiment: Experiment, audit: AuditSection, store: ChunkStore | None = None
                         ) -> AuditOutcome:
    """The audit of App. D with ``audit.models`` trainings on each of D and D' (chunks kept in ``store``, if
    given: see :class:`~decentdp.audit.blocks.ChunkStore`)."""
    agents = experiment.topology.n_agents
    if not experiment.algorithm.pools_data and agents != len(audit.digits):
        raise ConfigError("topology.agents", f"{agents} agents for {len(audit.digits)} digits (audit.digits): "
                                             "the audit gives one digit to each agent")
    target, holders = audit.target, 1 if experiment.algorithm.pools_data else agents
    if target >= holders:
        raise ConfigError("audit.target", f"is {target}, but the audit has {holders} agent(s) (one per digit of "
                                          "audit.digits, or one pooled agent for central training): use 0 to "
                                          f"{holders - 1}")
    x, y, parts = membership_data(experiment, audit.digits, audit.per_digit, target)
    z, label = x[-1:], y[-1:]

    def build(member: np.ndarray, seed: int) -> BlockRun:
        return block_simulation(experiment, x, y, parts, target, len(x) - 1, member, seed)

    def score(run: BlockRun) -> np.ndarray:
        state = run.train()
        logits = experiment.model.predict(state["params"][run.targets], z)     # (M, 1, K)
        loss = classification_loss(logits, label.expand(len(run.targets), 1))  # (M, 1)
        return -loss.squeeze(1).double().cpu().numpy()                        # higher: more likely a member

    outcome = run_audit(experiment, audit, "mia", build, score, store)
    member, losses = outcome.member, -outcome.scores
    finite = np.isfinite(losses)
    outcome.summary.update(loss_member_mean=_mean(losses[member & finite]),
                           loss_non_member_mean=_mean(losses[~member & finite]),
                           loss_non_finite=int((~finite).sum()))
    return outcome


def _mean(values: np.ndarray) -> float | None:
    """The mean of ``values``, None when there are none (every model of a world diverged)."""
    return float(values.mean()) if values.size else None
