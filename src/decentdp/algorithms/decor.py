"""DECOR (Allouah et al., ICML 2024, Alg. 1): pairwise-cancelling noise from edge secrets, pairwise DP.

Allouah, Koloskova, El Firdoussi, Guerraoui, Jaggi, "The privacy power of correlated noise in decentralized
learning" (authors' code ``elfirdoussilab1/DECOR``).

Neighbours share secrets (one key per edge, agreed once: X25519 in secure mode) from which they draw the
same Gaussian vector every round and add it with opposite signs, so the correlated noise cancels in the
network's average while each message still hides its sender behind the noise of its edges::

    g_i = (1 / L_i) (sum_b clip_C(grad l(x_i; b)) + sigma_i C xi_i) + sum_{j in N(i)} s_ij v_ij    (Alg. 1, l. 4-6)
    x_i^{t+1/2} = x_i^t - eta g_i                  (the configured optimizer's step; plain SGD: l. 7)
    x_i^{t+1}   = sum_j w_ij x_j^{t+1/2}                                                           (l. 8)

with ``v_ij = v_ji ~ N(0, (tau C)^2 I)`` fresh each round, ``s_ij = +1`` if ``i < j`` else ``-1``, and
``tau = rho mean_i(sigma_i / L_i)`` (``algorithm.correlation = rho``: the paper's ``sigma_cor / sigma_cdp`` at
equal batches and noise).  The release, own noise and edge noise together, is the mechanism
:class:`~decentdp.privacy.correlated.CorrelatedGaussianMechanism`.

**Privacy.**  ``privacy.epsilon`` is a *pairwise* budget, the headline of the paper: what any single agent, or
any set of ``privacy.colluding``, learns of each sender when it sees every message of every round and holds its
own noise and the keys of its edges (:mod:`decentdp.privacy.correlated`: exact for that observer, an upper
bound for one that sees less).  Calibration picks each ``sigma_i`` so that its worst such observer's epsilon
meets its budget (an agent hidden by many edges needs less own noise than a leaf, whose one neighbour holds
its only edge key), and the ledger charges that observer's event, so budgets are enforced on it.  The
agent's local epsilon (``epsilon_local``: all its neighbours colluding, only its own noise left) is larger and
reported beside it; ``algorithm.local_epsilon`` caps it (a well-hidden agent's own noise is otherwise small,
its local epsilon large: hundreds on an Erdos-Renyi graph at pairwise 1).  So are the external
eavesdropper's (no secret held) and the paper's own bound for it (``paper_epsilon_secldp``, its Algorithm 2:
RDP per iteration, no amplification by sampling).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import (
    FLOAT32_MAX,
    Calibrated,
    Float32,
    NoisePlan,
    RoundContext,
    RunFacts,
    State,
    prefixed,
    unprefixed,
)
from decentdp.algorithms.components.optim import Optimizer, OptimizerAlgorithm, OptimizerSettings
from decentdp.algorithms.registry import register
from decentdp.errors import ConfigError
from decentdp.privacy.accounting import MAX_NOISE_MULTIPLIER, calibrate_noise_multiplier, epsilon_spent
from decentdp.privacy.correlated import (
    CorrelatedGaussianMechanism,
    effective_multipliers,
    epsilon_upper_bounds,
    graph_edges,
)
from decentdp.privacy.mechanisms import round_up_to_float32
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.results.files import epsilon_json

#: Rounds of the per-agent noise search (:meth:`Decor.noise_for`).
NOISE_ITERATIONS = 8
#: Who DECOR's budgets name (``privacy.json``'s ``epsilon_observer``).
PAIRWISE_VIEW = ("the worst single agent or privacy.colluding set for each sender: it sees every message of every "
                 "round, holds its own noise and the keys of its edges, and knows every other agent's data (the "
                 "paper's SecLDP with curious agents); exact for that observer, an upper bound for one that sees "
                 "fewer messages; rounds composed with Poisson amplification")
#: Said when a run uses secure mode (among its warnings): what the pairwise epsilon prices there.
SECURE_EDGE_NOTICE = ("secure mode: each agent's own noise is released exactly on a grid (its local epsilon is exact); "
                      "edge noise comes from X25519-agreed keys through ChaCha20 as hardened float64 Gaussians, and "
                      "the pairwise epsilon prices it as continuous Gaussian noise")


class DecorSettings(OptimizerSettings):
    """DECOR's settings: the local optimizer's, and the correlated noise's size."""

    correlation: Float32 = Field(3.0, ge=0.0, description="rho: std of each edge's shared noise over the agents' "
                                                        "own noise std (the paper's sigma_cor / sigma_cdp at equal "
                                                        "batches)")
    local_epsilon: float | None = Field(None, gt=0.0, description="cap on each agent's local epsilon (all its "
                                                                  "neighbours colluding): its own sigma is at least "
                                                                  "the one this budget needs (none: no cap)")


@register
class Decor(OptimizerAlgorithm):
    """Decentralized SGD whose updates carry pairwise-cancelling noise from edge secrets."""

    name: ClassVar[str] = "decor"
    reports_colluding: ClassVar[bool] = True
    budgets_bound_everyone: ClassVar[bool] = False
    Settings = DecorSettings
    samplings: ClassVar[tuple[str, ...]] = ("poisson",)
    sampling_note: ClassVar[str] = "its own calibration plans for Poisson-sampled rounds"
    fixed_graph_reason: ClassVar[str | None] = ("its neighbours agree on one key per edge of a fixed graph; a "
                                                "redrawn graph would need new keys every round")
    finite_budgets_reason: ClassVar[str | None] = ("it calibrates every agent's own noise against its neighbours' "
                                                   "edge noise, and an agent with an infinite budget leaves its "
                                                   "edges unpriced")

    def __init__(self, optimizer: Optimizer, correlation: float, local_epsilon: float | None = None) -> None:
        super().__init__(optimizer)
        self.correlation = correlation
        self.local_epsilon = local_epsilon

    @classmethod
    def from_settings(cls, settings: DecorSettings) -> Decor:
        return cls(settings.build(), settings.correlation, settings.local_epsilon)

    def calibrate(self, plan: NoisePlan) -> Calibrated:
        """Each agent's own ``sigma_i`` (:meth:`noise_for`): its worst observer view stays within its budget over
        the run's rounds; the ledger charges that view's event.  A fixed graph and finite budgets are the config's
        to check (:attr:`fixed_graph_reason`, :attr:`finite_budgets_reason`)."""
        lonely = [agent for agent, neighbours in enumerate(plan.neighbours) if not neighbours]
        if lonely:
            raise ConfigError("topology.graph", f"agent(s) {lonely} have no neighbour: decor's correlated noise "
                                                "cancels between neighbours, and an isolated agent's would not")
        n = len(plan.budgets)
        edges = graph_edges(np.array([(agent, other) for agent, neighbours in enumerate(plan.neighbours)
                                      for other in neighbours]))
        batches = expected_batches(plan)
        observers = [[agent] for agent in range(n)] + [list(members) for members in plan.colluding]
        needed = np.array([0.0 if math.isinf(budget) else
                           calibrate_noise_multiplier(budget, plan.delta, rate, plan.rounds, 1, plan.accountant,
                                                      relation=plan.relation)
                           for budget, rate in zip(plan.budgets, plan.sample_rates, strict=True)])
        sigmas = self.noise_for(needed, batches, edges, observers)
        if self.local_epsilon is not None:  # more own noise only raises every observer's multiplier
            floor = [calibrate_noise_multiplier(self.local_epsilon, plan.delta, rate, plan.rounds, 1, plan.accountant,
                                                relation=plan.relation) for rate in plan.sample_rates]
            sigmas = round_up_to_float32(torch.from_numpy(np.maximum(sigmas, floor))).double().numpy()
        events = self.worst_multipliers(sigmas, batches, edges, observers)  # (lowered by a margin: not above the truth)
        edge_scale = self.edge_scale(sigmas, batches)
        self._refuse_unpriceable_edge_noise(sigmas, batches, edges, edge_scale, observers, plan.clip)
        eavesdropper = effective_multipliers(1.0 / batches, sigmas, edges, edge_scale, [[]])[:, 0]
        mechanism = CorrelatedGaussianMechanism(torch.from_numpy(sigmas).float(), plan.clip, edges, edge_scale,
                                                torch.from_numpy(batches), torch.from_numpy(events), PAIRWISE_VIEW)
        paper = {"paper_epsilon_secldp": paper_secldp_epsilon(eavesdropper, plan.rounds, plan.delta, plan.relation),
                 "paper_epsilon_secldp_view": "an external eavesdropper holding no secret (the paper's Alg. 2: RDP "
                                              "of each iteration, composed and converted with no amplification by "
                                              "sampling)"}
        details = {"sigma_cdp": sigmas.tolist(), "sigma_cor": edge_scale * float(batches.mean()),
                   "edges": int(len(edges)), "effective_multiplier_worst": events.tolist(),
                   "observers": len(observers)}
        return Calibrated(mechanism, sigmas.tolist(), paper, details, PAIRWISE_VIEW,
                          [SECURE_EDGE_NOTICE] if plan.noise == "secure" else [])

    def _refuse_unpriceable_edge_noise(self, sigmas: np.ndarray, batches: np.ndarray, edges: np.ndarray,
                                       edge_scale: float, observers: list[list[int]], clip: float) -> None:
        """Refuse, before any round, a correlation whose edge noise the run could not draw in float32 or whose views
        (each observer's, and the eavesdropper's that :meth:`privacy_results` prices) lie past the accountants'
        largest multiplier: found only after the last round otherwise, with no summary written."""
        priced = effective_multipliers(1.0 / batches, sigmas, edges, edge_scale, [*observers, []])
        largest = float(np.nanmax(priced)) if np.isfinite(priced).any() else 0.0
        if edge_scale * clip > FLOAT32_MAX or largest > MAX_NOISE_MULTIPLIER:
            raise ConfigError("algorithm.correlation", f"{self.correlation:g} makes the edge noise's std "
                                                       f"{edge_scale * clip:.3g} and an observer's noise multiplier "
                                                       f"{largest:.3g}, past what a run can price (the "
                                                       f"accountants take multipliers up to "
                                                       f"{MAX_NOISE_MULTIPLIER:g}, the noise float32): lower it")

    def edge_scale(self, sigmas: np.ndarray, batches: np.ndarray) -> float:
        """tau: each edge's noise std on the update, in units of C (``rho`` times the mean own std on it)."""
        return self.correlation * float(np.mean(sigmas / batches))

    def worst_multipliers(self, sigmas: np.ndarray, batches: np.ndarray, edges: np.ndarray,
                          observers: list[list[int]]) -> np.ndarray:
        """Each sender's smallest ``sigma_eff`` over ``observers`` with own multipliers ``sigmas``."""
        kappa = effective_multipliers(1.0 / batches, sigmas, edges, self.edge_scale(sigmas, batches), observers)
        return np.nanmin(kappa, axis=1)

    def noise_for(self, needed: np.ndarray, batches: np.ndarray, edges: np.ndarray,
                  observers: list[list[int]]) -> np.ndarray:
        """Own multipliers ``sigma_i`` (float32, rounded up) whose worst observer views reach ``needed[i]``:
        from ``sigma = needed`` (feasible: an observer's ``sigma_eff`` is never below the sender's own noise),
        each agent's scaled by ``needed / sigma_eff`` a few times (an agent that others' noise already hides,
        e.g. one of many edges, needs less of its own; a leaf's one neighbour holds its only edge key), then
        all by the largest remaining shortfall, so that every agent is covered."""
        sigmas = needed.astype(np.float64).copy()
        if not (sigmas > 0).any():
            return sigmas
        for _ in range(NOISE_ITERATIONS):
            reached = self.worst_multipliers(sigmas, batches, edges, observers)
            sigmas = np.where(needed > 0, sigmas * needed / np.where(reached > 0, reached, 1.0), 0.0)
        shortfall = float(np.max(needed / np.maximum(self.worst_multipliers(sigmas, batches, edges, observers),
                                                     1e-300)))
        return round_up_to_float32(torch.from_numpy(sigmas * max(shortfall, 1.0))).double().numpy()

    def round(self, state: State, ctx: RoundContext) -> State:
        grad = ctx.oracle.gradient(state["params"])                                   # l. 4-6: own and edge noise
        half, opt = self.optimizer.step(state["params"], grad, unprefixed("opt", state), ctx.lr, inplace=False)  # l. 7
        return {"params": ctx.network.mix(half), **prefixed("opt", opt)}              # l. 8

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """Each sender's epsilon towards every single agent (``epsilon_pairwise_network``) and every colluding set
        (``epsilon_colluding``) under :data:`PAIRWISE_VIEW`, towards an external eavesdropper, and its local
        epsilon (only its own noise: all its neighbours colluding)."""
        sigmas = facts.noise_multipliers
        n = len(sigmas)
        rates = facts.sample_rates if facts.sample_rates is not None else np.ones(n)
        if not (sigmas > 0).all():
            return AlgorithmPrivacy()
        edges = graph_edges(facts.network(0).public_graph().edges)
        batches = facts.expected_batches
        edge_scale = self.edge_scale(sigmas, batches)
        observers = [[agent] for agent in range(n)] + [list(members) for members in facts.colluding] + [[]]
        multipliers = effective_multipliers(1.0 / batches, sigmas, edges, edge_scale, observers)
        epsilons = epsilon_upper_bounds(multipliers, np.asarray(rates), facts.rounds, facts.delta, facts.accountant,
                                        facts.relation)
        pairwise = epsilons[:, :n].copy()
        np.fill_diagonal(pairwise, 0.0)
        local = np.array([epsilon_spent(float(s), facts.delta, float(q), facts.rounds, 1, facts.accountant,
                                        facts.relation) for s, q in zip(sigmas, rates, strict=True)])
        extras: dict[str, Any] = {
            "epsilon_pairwise_max": epsilon_json(float(pairwise.max())),
            "epsilon_pairwise_network": epsilon_json(pairwise),
            "epsilon_pairwise_network_method": PAIRWISE_VIEW,
            "epsilon_eavesdropper_max": epsilon_json(float(np.nanmax(epsilons[:, -1]))),
            "epsilon_local": epsilon_json(local),
            "epsilon_local_max": epsilon_json(float(local.max())),
        }
        if facts.colluding:
            extras["epsilon_colluding"] = [{"agents": list(members), "epsilon": epsilon_json(epsilons[:, n + k])}
                                           for k, members in enumerate(facts.colluding)]
            extras["epsilon_colluding_max"] = epsilon_json(float(np.nanmax(epsilons[:, n:-1])))
        return AlgorithmPrivacy(extras, headline=("epsilon_pairwise_max", "epsilon_eavesdropper_max",
                                                  "epsilon_local_max", "epsilon_colluding_max"), pairwise=pairwise)


def expected_batches(plan: NoisePlan) -> np.ndarray:
    """Each agent's expected batch ``L_i = q_i |D_i|`` as the oracle divides by it (float32), in float64."""
    rates = torch.tensor(plan.sample_rates, dtype=torch.float64)
    return (rates * torch.tensor(plan.sizes, dtype=torch.float64)).float().double().numpy()


def paper_secldp_epsilon(eavesdropper: np.ndarray, iterations: int, delta: float, relation: str) -> float:
    """The paper's Algorithm 2 bound: per iteration the eavesdropper's Renyi divergence is ``alpha rho`` with
    ``rho = Delta^2 / (2 sigma_eff^2)`` (worst sender; ``Delta`` 1 or 2 clip norms), composed over the
    iterations and converted as ``T rho + 2 sqrt(T rho log(1 / delta))``; sampling is not amplified."""
    sensitivity = 2.0 if relation == "replace-one" else 1.0
    rho = float(np.max(sensitivity ** 2 / (2.0 * eavesdropper ** 2)))
    return iterations * rho + 2.0 * math.sqrt(iterations * rho * math.log(1.0 / delta))
