"""The protocol TOP-DP and its baselines share (Guo et al., eq. 3): select one neighbour, mix with alpha, step.

Every agent keeps a noisy estimate ``x~_i``.  Each round it takes one neighbour's estimate ``x~_k`` and::

    x~_i <- alpha x~_i + (1 - alpha) x~_k - lambda * g~_i                  (eq. 3; eq. 5c with k = the cover)

where ``g~_i`` is its released (noisy) gradient.  Synchronously (Algorithm 1's protocol) every agent
broadcasts its estimate and picks ``k`` uniformly among its neighbours (``j*``, lines 18-19); with the
``pairing`` schedule (Algorithm 2's protocol) ``k`` is the agent's partner of the round, an unpaired
online agent steps alone (its own estimate is its "neighbour's") and an offline agent neither
computes, sends, nor moves.  TOP-DP's paper ran all its baselines in this protocol ("we modify their
update rules as Eq. 3"); they differ only in the noise of ``g~_i`` and its accounting, which each
baseline's file states (:meth:`~decentdp.algorithms.base.Algorithm.calibrate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from pydantic import Field

from decentdp.algorithms.base import (
    Algorithm,
    AlgorithmSettings,
    Calibrated,
    Network,
    NoisePlan,
    RoundContext,
    State,
    once_per_graph,
)
from decentdp.privacy.mechanisms import GaussianMechanism, per_agent_multipliers


class SelectMixSettings(AlgorithmSettings):
    """The mixing weight of eq. 3 (called alpha in the paper; alpha_T in specs C.0)."""

    alpha: float = Field(0.5, gt=0.0, lt=1.0, description="weight of the agent's own estimate in eq. 3 "
                                                          "(1 - alpha: the selected neighbour's)")


def mix_step(own: torch.Tensor, other: torch.Tensor, alpha: float, step: torch.Tensor, lr: float) -> torch.Tensor:
    """``alpha * own + (1 - alpha) * other - lr * step`` (eq. 3 / 5c; the noise is inside ``step``), a new tensor."""
    return own.mul(alpha).add_(other, alpha=1 - alpha).add_(step, alpha=-lr)


class InEdges:
    """Each agent's in-edges grouped by receiver, to draw one neighbour per agent in one vector operation.

    The public draw is one uniform per agent *of the run* (``n_total``), of which the agents held here
    take theirs by global id: a shard of a sharded run selects the simulator's neighbours."""

    def __init__(self, network: Network) -> None:
        self.n_total = int(network.n_total)
        self.agent_ids = network.agent_ids
        dst = network.in_edges[:, 1]
        rows = network.rows(dst)
        self.order = torch.argsort(rows, stable=True)               # in-edge indices grouped by receiver row
        counts = torch.bincount(rows, minlength=network.n_agents)
        self.start = torch.cumsum(counts, 0) - counts
        self.count = counts
        # Checked once per graph here, not in every round's choice (a read-back on an accelerator).
        self.isolated = bool((counts == 0).any())

    def choose(self, generator: torch.Generator) -> torch.Tensor:
        """For each agent, the index (into ``in_edges``) of one incoming edge, uniformly at random (public)."""
        if self.isolated:
            raise ValueError("an agent has no neighbour to select")
        draws = torch.rand(self.n_total, generator=generator, device=generator.device)[
            self.agent_ids.to(generator.device)].to(self.count.device)
        pick = torch.minimum((draws * self.count).long(), self.count - 1)
        return self.order[self.start + pick]


class SelectMix(Algorithm):
    """Eq. 3 in the synchronous (Alg. 1) and pairing (Alg. 2) protocols; subclasses choose the noise."""

    Settings: ClassVar[type[AlgorithmSettings]] = SelectMixSettings
    schedules: ClassVar[tuple[str, ...]] = ("synchronous", "pairing")
    follows_plan: ClassVar[bool] = True
    reads_mixing: ClassVar[bool] = False  # eq. 3 weights the one selected neighbour by alpha
    samplings: ClassVar[tuple[str, ...]] = ("poisson",)
    sampling_note: ClassVar[str] = "its own calibration plans for Poisson-sampled rounds"

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    @classmethod
    def from_settings(cls, settings: SelectMixSettings) -> SelectMix:
        return cls(settings.alpha)

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params}

    def in_edges(self, network: Network) -> InEdges:
        """The round network's grouping of in-edges (once per graph: rebuilt when the graph is redrawn)."""
        return once_per_graph(network, "in-edges by receiver", lambda: InEdges(network))

    def selected(self, x: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Each agent's selected neighbour estimate ``x~_k`` and whether it has one (paired / online ``j*``)."""
        net, plan = ctx.network, ctx.plan
        if plan is not None and plan.partner is not None:      # Alg. 2: the partner's estimate, exchanged
            other = net.swap(x, plan.partner)
            return other, plan.active & (plan.partner != net.agent_ids)
        senders = once_per_graph(net, "out-edge senders", lambda: net.rows(net.out_edges[:, 0]))
        received, index = net.exchange_rows(x, senders)         # Alg. 1: every estimate to every neighbour
        chosen = self.in_edges(net).choose(ctx.public_generator())  # line 18: j* uniformly among N_i
        other = received.index_select(0, index.index_select(0, chosen))
        if plan is None:
            return other, torch.ones(net.n_agents, dtype=torch.bool, device=x.device)
        sender_online = plan.neighbour_active(net.in_edges[chosen, 0])  # an offline neighbour sends nothing
        return torch.where(sender_online[:, None], other, x), plan.active & sender_online

    def noisy_step(self, x: torch.Tensor, ctx: RoundContext, paired: torch.Tensor) -> torch.Tensor:
        """Each active agent's released gradient ``g~_i`` (zero for inactive agents): the run's mechanism."""
        return ctx.oracle.gradient(x)

    def round(self, state: State, ctx: RoundContext) -> State:
        x = state["params"]
        other, paired = self.selected(x, ctx)
        step = self.noisy_step(x, ctx, paired)
        new = mix_step(x, torch.where(paired[:, None], other, x), self.alpha, step, ctx.lr)   # eq. 3
        if ctx.plan is not None:
            new = torch.where(ctx.plan.active[:, None], new, x)   # offline agents do not move
        return {"params": new}


def calibrated_gaussian(plan: NoisePlan, sigma_of: Callable[[float, float], float], method: str) -> Calibrated:
    """A baseline's Gaussian mechanism with ``sigma_i = sigma_of(epsilon_i, q_i)`` (its paper's formula; no noise
    for an agent without a budget, as in every algorithm), and the paper's claim (every agent meets its stated
    budget) for the report beside our accounting."""
    sigmas = per_agent_multipliers(list(zip(plan.budgets, plan.sample_rates, strict=True)),
                                   lambda epsilon, rate: 0.0 if math.isinf(epsilon) else sigma_of(epsilon, rate))
    paper = {"method": method, "claimed_epsilon": list(plan.budgets), "noise_multipliers": sigmas}
    return Calibrated(GaussianMechanism(torch.tensor(sigmas, dtype=torch.float32), plan.clip), sigmas, paper)
