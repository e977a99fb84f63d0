"""DPDL: private cross-gradients calibrated by cosine similarity (Yuan, Xiao, Wang, Li, arXiv:2606.04399).

Equations are those of specs A.3 (transcribed by a third party, numbered (8)-(22) by the spec; the
paper's own text was not readable).  Each round (Jacobi, all agents at once):

1. models go to neighbours; each data owner releases noisy self- and cross-gradients on one batch,
   one joint event of ``deg_j + 1`` sums (eqs. 8-12, :mod:`~decentdp.algorithms.components.cross_gradients`);
2. receiver ``i`` weighs each cross-gradient by its cosine similarity with its own noisy gradient::

       S_ij = <g^{i<-j}, g^{i<-i}> / (|g^{i<-j}| |g^{i<-i}|)                      (15)
       C_ij = 1 / (1 + exp(S_ij))                                                  (16)
       g~^{ij} = c_ij g^{i<-j} + alpha w_ij C_ij g^{i<-i}                         (17)
       g~^i = sum_{j in N_i} g~^{ij}                                               (18)

3. momentum-like step and gossip of both the model and the momentum::

       v~_i = beta v_i + g~^i      (19)        x~_i = x_i - eta v~_i      (20)
       v_i = sum_j w_ij v~_j       (21)        x_i = sum_j w_ij x~_j      (22)

Switches for the ambiguities of specs A.7: ``cross_coef`` (A.7.1: ``"zij"`` ``c_ij = 1 / (sqrt(w_ij)
N)`` as transcribed, default; ``"mixing"`` ``c_ij = w_ij``); ``include_self`` (A.7.4, default: the
``j = i`` term of (18), with ``S_ii = 1``).  The self-gradient is always noised (A.7.2: an un-noised
one would leave through ``x~``, ``v~`` unprotected; the oracle refuses such a release), one batch
serves all models (A.7.5) and ``g^{i<-j}`` is always agent i's model on j's data (A.7.3).

``accounting = "joint"`` (default, sound) prices the ``deg_j + 1`` sums on one batch as one Gaussian
of sensitivity ``sqrt(deg_j + 1) C`` (specs A.4); ``"independent"`` is the looser accounting the
paper may use (that many independently sampled releases): the noise is calibrated that way, but the
ledger still charges the true joint event, so such a run spends more than its budget says and is
refused once the true budget is spent.  With ``sigma = 0``, ``calibration_scale = 0`` and
``cross_coef = "mixing"``, a round is NGM (NGC with alpha_NGC = 1; specs A.3 reductions).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import AlgorithmSettings, RoundContext, RunFacts, SettingsAlgorithm, State
from decentdp.algorithms.components.cross_gradients import cross_gradients, self_weights
from decentdp.algorithms.registry import register
from decentdp.privacy.accounting import epsilon_spent
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.results.files import epsilon_json


class DPDLSettings(AlgorithmSettings):
    """DPDL's settings (specs A.2, A.7)."""

    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="beta of eq. 19")
    calibration_scale: float = Field(0.5, ge=0.0, description="alpha of eq. 17: weight of the cosine-calibrated "
                                                              "self-gradient correction")
    cross_coef: Literal["zij", "mixing"] = Field("zij", description="coefficient of g^{i<-j} in eq. 17 (A.7.1)")
    include_self: bool = Field(True, description="the j = i term in the sum of eq. 18 (A.7.4)")
    accounting: Literal["joint", "independent"] = Field(
        "joint", description="joint: one sqrt(k)C Gaussian per batch (sound); independent: the paper's possible "
                             "looser calibration (the ledger still charges the joint event)")


def cross_coefficients(kind: str, weights: torch.Tensor, n_total: int) -> torch.Tensor:
    """``c_ij`` of eq. (17) for mixing weights ``w_ij``: ``1 / (sqrt(w_ij) N)`` (zij) or ``w_ij``."""
    return weights if kind == "mixing" else 1.0 / (weights.sqrt() * n_total)


def calibration(received: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``C_ij = sigmoid(-S_ij)`` for the cosine ``S_ij`` of each received row and its receiver's own row
    (eqs. 15-16; a zero vector has cosine 0)."""
    dot = torch.einsum("ed,ed->e", received, own)  # one batched product, no (E, d) temporary
    norms = received.norm(dim=1) * own.norm(dim=1)
    cosine = torch.where(norms > 0, dot / norms.clamp(min=torch.finfo(norms.dtype).tiny), torch.zeros_like(dot))
    return torch.sigmoid(-cosine)


@register
class DPDL(SettingsAlgorithm):
    """DPDL: noisy cross-gradients, cosine calibration, momentum and gossip of (x~, v~)."""

    name: ClassVar[str] = "dpdl"
    Settings = DPDLSettings

    def sums_per_batch(self, degrees: np.ndarray) -> np.ndarray:
        return np.asarray(degrees, dtype=np.int64) + 1  # own model and each neighbour's, on one batch

    @property
    def joint_accounting(self) -> bool:
        return self.settings.accounting == "joint"

    @property
    def round_temporaries(self) -> int:
        return 7  # own models and gradients (the cross-gradient call's), the aggregate, v~, x~, two mixing outputs
        #           (edge rows come on top)

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params, "momentum": torch.zeros_like(params)}

    def round(self, state: State, ctx: RoundContext) -> State:
        s, net = self.settings, ctx.network
        params = state["params"]
        grads = cross_gradients(params, ctx)                                      # (8)-(12)
        receiver = net.rows(net.in_edges[:, 1])
        own_at_edge = grads.own[receiver]
        weights = net.in_weights.to(params.dtype)
        calib = calibration(grads.received, own_at_edge)                         # (15)-(16)
        del own_at_edge
        scaled = grads.received.mul_(cross_coefficients(s.cross_coef, weights, net.n_total)[:, None])
        aggregate = net.aggregate(scaled)                                        # (17)-(18), cross terms
        own_coef = s.calibration_scale * net.aggregate((weights * calib)[:, None]).squeeze(1)
        if s.include_self:                                                       # j = i: S_ii = 1 (A.7.4)
            w_self = self_weights(net).clamp(min=0.0)
            coef = cross_coefficients(s.cross_coef, w_self, net.n_total)
            own_coef += torch.where(w_self > 0, coef, torch.zeros_like(coef))
            own_coef += s.calibration_scale * w_self * torch.sigmoid(params.new_tensor(-1.0))
        aggregate.add_(grads.own * own_coef[:, None])                            # g~^i, eq. (18)
        velocity = aggregate.add_(state["momentum"], alpha=s.momentum)           # (19)
        moved = torch.add(params, velocity, alpha=-ctx.lr)                        # (20)
        return {"params": net.mix(moved), "momentum": net.mix(velocity)}          # (22), (21)

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """The paper's own accounting beside the sound one, labelled ``paper_``: its Appendix A prices each agent's
        aggregate gradient g~^i as one sampled Gaussian a round (eqs. 39-40) and composes nothing else, so at the
        multiplier each message carries it charges one release a round.  That bounds an observer of one message
        alone: a neighbour also sees, inside x~, the agent's own noisy gradient on the same batch, and all the
        neighbours together see all ``deg + 1`` sums, one release of sensitivity ``sqrt(deg + 1) C``, which is
        what the ledger charges."""
        sigmas, rates = facts.noise_multipliers, facts.sample_rates
        if rates is None or not (sigmas > 0).all():
            return AlgorithmPrivacy()
        paper = np.array([epsilon_spent(float(sigma), facts.delta, float(rate), facts.rounds, 1, facts.accountant,
                                        facts.relation) for sigma, rate in zip(sigmas, rates, strict=True)])
        return AlgorithmPrivacy({
            "paper_epsilon": epsilon_json(paper), "paper_epsilon_max": epsilon_json(float(paper.max())),
            "paper_epsilon_view": "the paper's Appendix A: each agent's aggregate gradient as one release a round at "
                                  "the multiplier of one message; the N_i + 1 messages on one batch not composed "
                                  "(it bounds an observer of one message alone)"},
            headline=("paper_epsilon_max", "paper_epsilon_view"))
