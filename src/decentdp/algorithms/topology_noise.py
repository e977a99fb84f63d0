"""TOP-DP's two strategies (Guo et al., Section IV), shared by its synchronous and asynchronous protocols.

* **Topology-aware noise reduction** (eqs. 4-5).  A message from ``i`` that mixes in a neighbour
  ``k``'s estimate with weight ``1 - alpha`` already carries ``(1 - alpha)`` times ``k``'s noise; if the
  receiver ``j`` does not know that noise, ``i`` only adds the residual (eq. 5b)::

      sigma_i^j = sqrt(sigma_i^2 - c_ik^2),   c_ik = (1 - alpha) sigma_k L_i / L_k          (5a, 5b)

  (``L_i / L_k`` converts ``k``'s noise, added to its sum of ``L_k`` expected samples, into ``i``'s
  gradient units; it is 1 for equal batches, the paper's setting).  A ``k`` with ``c_ik >= sigma_i``
  (heterogeneous budgets) cannot cover anyone: such edges fall back to full noise and are counted.
* **Time-aware noise decay** (eq. 6b): ``sigma_t = sigma_0 gamma^floor(t / period)``.

**Accounting** (three views, :mod:`decentdp.privacy.receiver_budget`):

(a) *per receiver*, the paper's threat model: ``j`` is honest-but-curious and knows no noise but its
    own, so whatever it receives from ``i`` in round ``t`` carries noise ``sigma_{t,i} C`` unknown to
    it (eq. 5a): one sampled Gaussian of multiplier ``sigma_{t,i}`` per round, for every neighbour.
    Budgets hold on this view, and ``sigma_0`` is calibrated for the decayed sequence actually used
    (the paper's proof skips the decay: "it does not incur any additional privacy loss").  Two
    leaks the paper's argument misses are *not* in view (a): the local estimate (line 19) is a
    second noisy copy of each round's gradient that reaches every neighbour inside later messages,
    and in Algorithm 2 the partner whose noise was reused may see the estimate in a later pairing.
(b) *colluding* (the agent view): receivers pool what they saw and know every reused noise, so each
    message is protected by its residual noise only.  Per round, every noisy copy of ``i``'s sum
    (the local estimate and each per-receiver message, one batch) is one joint Gaussian with
    ``1 / sigma_eff^2 = sum_r 1 / sigma_r^2``.  This bound is sound and covers both leaks above.
(c) the paper's own calibration, Theorem 1 (eq. 7), reported as a labelled baseline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import Calibrated, Network, NoisePlan
from decentdp.algorithms.select_mix import SelectMixSettings
from decentdp.errors import ConfigError
from decentdp.privacy.accounting import calibrate_scale
from decentdp.privacy.events import gaussian_event
from decentdp.privacy.mechanisms import GaussianMechanism, NoiseDraw, round_up_to_float32
from decentdp.privacy.paper_accounting import theorem1_epsilon, theorem1_noise_multiplier


class TopDPSettings(SelectMixSettings):
    """TOP-DP's switches (Figs. 10-11: TOP alone is ``decay_gamma = 1``, ND alone ``topology_aware = false``)."""

    topology_aware: bool = Field(True, description="reuse a neighbour's noise (eqs. 4-5); false: full noise on "
                                                   "every message (time-aware decay alone)")
    decay_gamma: float = Field(0.9, gt=0.0, le=1.0, description="gamma of eq. 6b (1: no decay)")
    decay_period: int = Field(1000, ge=1, description="rounds between two decays (eq. 6b's period)")


def decay_factors(rounds: int, gamma: float, period: int) -> np.ndarray:
    """``gamma^floor(t / period)`` for ``t = 0 .. rounds - 1`` (eq. 6b)."""
    return gamma ** (np.arange(rounds) // period).astype(np.float64)


def decayed_history_event(sigma0: float, sample_rate: float, rounds: int, gamma: float, period: int,
                          setup_releases: int) -> dp_accounting.DpEvent:
    """The releases one receiver observes over a run: the setup phase's at ``sigma_0``, then one per round
    at ``sigma_0 gamma^floor(t / period)``."""
    parts = [dp_accounting.SelfComposedDpEvent(gaussian_event(sigma0, sample_rate), setup_releases)] \
        if setup_releases else []
    epochs, counts = np.unique(np.arange(rounds) // period, return_counts=True)
    parts += [dp_accounting.SelfComposedDpEvent(gaussian_event(sigma0 * gamma ** int(e), sample_rate), int(c))
              for e, c in zip(epochs, counts, strict=True)]
    return dp_accounting.ComposedDpEvent(tuple(parts))  # a tuple: events are cached by hash


def calibrate_top_dp(plan: NoisePlan, gamma: float, period: int, setup_releases: int) -> Calibrated:
    """sigma_0 per agent such that view (a) meets (epsilon_i, delta) with every round at its decayed sigma."""
    if min(plan.degrees) < 1:
        agent = plan.degrees.index(min(plan.degrees))
        raise ConfigError("topology.graph", f"agent {agent} has no neighbour: TOP-DP needs at least one per agent")
    # RDP prices a decayed sequence in microseconds (PLD composes one distribution per decay step, seconds
    # each); its sigma is safe for every accountant, since tight and PLD are never above RDP.
    accountant = "rdp" if plan.relation == "add-remove" else plan.accountant
    cache: dict[tuple[float, float], float] = {}
    sigmas = []
    for epsilon, rate in zip(plan.budgets, plan.sample_rates, strict=True):
        if (epsilon, rate) not in cache:
            cache[(epsilon, rate)] = calibrate_scale(
                lambda s, q=rate: decayed_history_event(s, q, plan.rounds, gamma, period, setup_releases), 1,
                epsilon, plan.delta, accountant, describe=f"{plan.rounds} decayed rounds at rate {rate}",
                relation=plan.relation)
        sigmas.append(float(round_up_to_float32(torch.tensor(cache[(epsilon, rate)], dtype=torch.float64))))
    paper = {
        "method": "TOP-DP Theorem 1 (eq. 7), the paper's calibration, reported beside ours",
        "noise_multiplier_theorem1": [theorem1_noise_multiplier(e, plan.delta, plan.rounds, n)
                                      for e, n in zip(plan.budgets, plan.sizes, strict=True)],
        "epsilon_theorem1": [theorem1_epsilon(s, plan.delta, plan.rounds, n)
                             for s, n in zip(sigmas, plan.sizes, strict=True)],
        "decay": {"gamma": gamma, "period": period},
    }
    return Calibrated(GaussianMechanism(torch.tensor(sigmas, dtype=torch.float32), plan.clip), sigmas, paper)


def reuse_coefficients(alpha: float, sigma: np.ndarray, expected_batch: np.ndarray, src: np.ndarray,
                       via: np.ndarray) -> np.ndarray:
    """``c_ik = (1 - alpha) sigma_k L_i / L_k`` for sender ``src[e]`` and reused neighbour ``via[e]`` (eq. 5a)."""
    return (1 - alpha) * sigma[via] * expected_batch[src] / expected_batch[via]


def residual_multipliers(sigma_sender: np.ndarray, reused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sqrt(sigma_i^2 - c_ik^2)`` (eq. 5b) and whether it is usable; where it is not (the neighbour's
    noise alone would exceed the sender's), the full ``sigma_i`` is returned instead."""
    variance = sigma_sender**2 - reused**2
    usable = variance > 1e-12 * sigma_sender**2
    return np.where(usable, np.sqrt(np.where(usable, variance, 1.0)), sigma_sender), usable


@dataclass(frozen=True)
class Cover:
    """One round's cover (Algorithm 1 lines 10-17) over the out-edges ``(i, j)``: ``via[e]`` is the
    in-edge ``(k, i)`` whose estimate the message to ``j`` reuses (-1: ``j`` gets the local estimate,
    lines 20-22), ``multiplier[e]`` its residual sigma, and the counts the run reports."""

    via: np.ndarray
    multiplier: np.ndarray
    fallback: int      # coverable edges left uncovered because every candidate's noise was too large
    uncoverable: int   # edges whose receiver is adjacent to all the sender's other neighbours


class CoverPlanner:
    """The greedy cover of eq. 4, per agent over its neighbours in a random (public) order."""

    def __init__(self, network: Network) -> None:
        edges = network.out_edges.cpu().numpy()
        n = int(network.n_total)
        self.edges = edges
        self.neighbours: list[list[int]] = [[] for _ in range(n)]
        for src, dst in edges.tolist():
            self.neighbours[src].append(dst)
        self.sets = [set(nb) for nb in self.neighbours]
        in_edges = network.in_edges.cpu().numpy()
        self.in_index = {(int(s), int(d)): e for e, (s, d) in enumerate(in_edges.tolist())}
        self.out_index = {(int(s), int(d)): e for e, (s, d) in enumerate(edges.tolist())}
        # N_i^j = N_i \ ({j} u N_j): the neighbours of i that can cover j
        self.coverable = np.array([bool(self.sets[i] - {j} - self.sets[j]) for i, j in edges.tolist()])

    def plan(self, alpha: float, sigma: np.ndarray, expected_batch: np.ndarray, generator: torch.Generator,
             senders: Sequence[int]) -> Cover:
        via = np.full(len(self.edges), -1, dtype=np.int64)
        multiplier = sigma[self.edges[:, 0]].astype(np.float64).copy()
        for i in senders:
            uncovered = set(self.neighbours[i])
            order = torch.randperm(len(self.neighbours[i]), generator=generator,                  # line 12
                                   device=generator.device).tolist()
            for position in order:
                if not uncovered:
                    break
                k = self.neighbours[i][position]
                reused = reuse_coefficients(alpha, sigma, expected_batch, np.array([i]), np.array([k]))
                residual, usable = residual_multipliers(sigma[[i]], reused)                  # line 13
                if not usable[0]:
                    continue
                targets = uncovered & (self.sets[i] - {k} - self.sets[k])                     # N_i^* n N_i^k
                for j in targets:                                                             # lines 14-16
                    edge = self.out_index[(i, j)]
                    via[edge], multiplier[edge] = self.in_index[(k, i)], residual[0]
                uncovered -= targets                                                          # line 17
        left = via < 0
        mine = np.isin(self.edges[:, 0], np.asarray(list(senders), dtype=np.int64))
        return Cover(via, multiplier, int((left & mine & self.coverable).sum()),
                     int((left & mine & ~self.coverable).sum()))


@dataclass(frozen=True)
class CoverGroups:
    """A cover's messages (lines 14-16): one per in-edge ``(k, i)`` that covers some receivers of ``i``.

    ``via[g]`` is group ``g``'s in-edge, ``first[g]`` the first out-edge it covers (its residual
    multiplier and noise key), and ``edge_group[e]`` the group of out-edge ``e`` (-1: uncovered)."""

    via: np.ndarray
    first: np.ndarray
    edge_group: np.ndarray


def cover_groups(via: np.ndarray) -> CoverGroups:
    """Group a cover's out-edges by the neighbour estimate they reuse (``via``, -1 for uncovered)."""
    covered = np.flatnonzero(via >= 0)
    group_via, first, inverse = np.unique(via[covered], return_index=True, return_inverse=True)
    edge_group = np.full(len(via), -1, dtype=np.int64)
    edge_group[covered] = inverse.reshape(-1)
    return CoverGroups(group_via.astype(np.int64), covered[first].astype(np.int64), edge_group)


class RowGaussian:
    """Gaussian noise with a multiplier per released row, and what each view observes of it.

    ``multipliers[r]`` (float64, rounded up to float32 when drawn) is row ``r``'s noise; ``full[i]``
    is agent ``i``'s sigma_t, what each receiver is charged in view (a); ``edges`` are the out-edges
    ``(i, j)`` whose receivers observe ``i`` this round."""

    def __init__(self, multipliers: np.ndarray, owners: np.ndarray, full: np.ndarray, clip: float,
                 edges: np.ndarray) -> None:
        self.multipliers = np.asarray(multipliers, dtype=np.float64)
        self.owners = np.asarray(owners, dtype=np.int64)
        self.full = np.asarray(full, dtype=np.float64)
        self.clip = float(clip)
        self.edges = edges
        self.scales = round_up_to_float32(torch.from_numpy(self.multipliers * self.clip))

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        buffer = torch.empty_like(values)
        noise.normal(owners.tolist(), buffer, slots)
        values.add_(buffer.mul_(self.scales.to(values.device)[:, None]))

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        """View (b): all of the owner's rows on one batch, one Gaussian with ``sum_r sigma_r^-2``."""
        mine = self.multipliers[self.owners == owner]
        return gaussian_event(float(np.sum(mine**-2.0) ** -0.5), sample_rate)

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        """View (a): the noise a receiver does not know, sigma_{t,i} (eq. 5a)."""
        return gaussian_event(float(self.full[owner]), sample_rate)

    def observed_by(self, senders: np.ndarray, receivers: np.ndarray,
                    rates: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[dp_accounting.DpEvent]]:
        """Every neighbour of a releasing agent observes it this round (now, or inside a later estimate)."""
        keep = np.isin(self.edges[:, 0], np.unique(senders))
        src, dst = self.edges[keep, 0], self.edges[keep, 1]
        events = {int(i): self.receiver_event(int(i), float(rates[i])) for i in np.unique(src)}
        return src, dst, [events[int(i)] for i in src]


def report(counts: dict[str, int]) -> dict[str, Any]:
    """The run report's TOP-DP counters, with the fraction of messages that reused a neighbour's noise."""
    total = counts["reduced"] + counts["full"]
    return {**counts, "reduced_fraction": counts["reduced"] / total if total else math.nan}


#: Names of the counters TOP-DP keeps in its state (checkpointed with it): messages with residual noise,
#: with full noise, coverable ones that fell back to full noise, and uncoverable ones.
COUNTERS: tuple[str, ...] = ("reduced", "full", "fallback", "uncoverable")
