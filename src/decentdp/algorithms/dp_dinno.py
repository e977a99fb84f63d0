"""DP-DiNNO: Bayrooti et al., Algorithm 3 (the DP version of DiNNO's consensus ADMM, eqs. 6-7).

Per round ``k = 0, 1, ...``, with penalty ``rho = rho_0 * growth^(k+1)`` (grown before the dual
update, as in DiNNO's code) and graph neighbours ``N(i)``.  The paper's ``N_i`` includes ``i``
itself; its ``j = i`` term vanishes in (6) but would add a proximal term ``rho ||psi - theta_i||^2``
to (7).  We follow DiNNO's original method and code, which sum over neighbours only::

    y_i^{k+1} = y_i^k + rho sum_{j in N(i)} (theta_i^k - theta_j^k)                      (6; Alg. 3 line 8)
    psi^0 = theta_i^k;  for t = 1..T:                                                     (lines 9-15)
        G(psi) = g~(psi; D_i) + y_i^{k+1} + 2 rho sum_{j in N(i)} (psi - (theta_i^k + theta_j^k) / 2)
        psi <- optimizer_step(psi, G(psi))
    theta_i^{k+1} = psi^T                                                                 (line 16)

``G`` is the gradient of the primal objective (7); only ``g~`` depends on private data, so only it
is clipped and noised.  Each of the ``T`` primal steps is one noisy release (each draws its own
Poisson batch), so ``releases_per_round == T`` and the noise is calibrated for ``K * T`` releases
(the paper code accounted for ``K``).  The optimizer (Adam in the paper) keeps its state across
rounds unless ``reset_each_round`` reproduces the paper code's re-created optimizer.

With one primal step, the penalty's dual ascent and an optimizer's momentum make a feedback loop on the
agents' disagreement that can grow whatever the loss does; :meth:`DPDiNNO.stability_warnings` says so
before a run starts (see :func:`disagreement_map`).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import Float32, RoundContext, State, prefixed, unprefixed
from decentdp.algorithms.components.optim import Adam, Optimizer, OptimizerAlgorithm, OptimizerSettings
from decentdp.algorithms.components.schedules import Schedule
from decentdp.algorithms.registry import register
from decentdp.errors import ConfigError
from decentdp.topology import Topology, laplacian_spectrum

#: A disagreement the linearised round amplifies by more than this over a run is announced as divergent.
GROWTH_LIMIT = 10.0


def disagreement_map(a: np.ndarray, momentum: float, nesterov: bool) -> np.ndarray:
    """``(M, 3, 3)``: one round's linear map of a disagreement mode ``(e, lr y, lr b)``, for ``a = lr rho lambda``.

    With one primal step ``psi = theta``, so the penalty's gradient in (7) is ``rho L theta`` for the graph
    Laplacian ``L``.  Along an eigenvector of ``L`` (eigenvalue ``lambda > 0``), with the loss and weight decay
    left out, a round with heavy-ball momentum ``m`` (buffer ``b``) is::

        y' = y + rho lambda e                                (6)
        G  = y' + rho lambda e                               (7 at psi = theta)
        b' = m b + G;  d = b', or G + m b' with Nesterov
        e' = e - lr d

    and scaling ``y`` and ``b`` by ``lr`` leaves ``a`` as the only parameter.  Without momentum the map is
    stable exactly for ``0 < a < 4/3`` (Jury's test on ``z^2 - (2 - 2a) z + (1 - a)``); with ``m > 0.5`` its
    spectral radius exceeds 1 for every ``a`` (the dual integrates the disagreement and the momentum delays the
    correction)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    one, zero = np.ones_like(a), np.zeros_like(a)
    gradient = np.stack([2 * a, one, zero], -1)                      # lr G over (e, lr y, lr b)
    buffer = gradient + np.array([0.0, 0.0, momentum])                # lr b'
    direction = gradient + momentum * buffer if nesterov else buffer  # lr d
    return np.stack([np.array([1.0, 0.0, 0.0]) - direction, np.stack([a, one, zero], -1), buffer], 1)


def spectral_radius(a: np.ndarray, momentum: float, nesterov: bool) -> np.ndarray:
    """The spectral radius of :func:`disagreement_map` for each ``a`` (flattened)."""
    return np.abs(np.linalg.eigvals(disagreement_map(a, momentum, nesterov))).max(-1)


def disagreement_growth(a: np.ndarray, momentum: float, nesterov: bool) -> float:
    """The largest factor by which a disagreement injected in some round has grown by the end of the run.

    ``a`` is ``(rounds, eigenvalues)``; a mode's growth from round ``k`` is taken as the product of the rounds'
    spectral radii from ``k`` on (exact for a constant map up to a transient, and close for the slowly varying
    steps and penalties of a schedule).  ``a`` is rounded to 0.1 % before the eigenvalues are taken, so the cost
    is bounded by the range of ``a``, not by rounds times eigenvalues."""
    keys, inverse = np.unique(np.round(np.log(a), 3), return_inverse=True)
    log_radius = np.log(spectral_radius(np.exp(keys), momentum, nesterov))[inverse.reshape(a.shape)]
    from_round = np.cumsum(log_radius[::-1], axis=0)  # row j: log growth over the last j + 1 rounds
    return math.exp(min(float(from_round.max()), 700.0))


class DiNNOSettings(OptimizerSettings):
    """DiNNO's penalty schedule and inexact primal solver."""

    rho: Float32 = Field(0.5, gt=0.0, description="penalty rho_0")
    rho_growth: float = Field(1.0, ge=1.0, description="rho in round k (from 0) is rho * rho_growth^(k+1)")
    primal_steps: int = Field(1, ge=1, description="T noisy primal steps per round")
    reset_optimizer_each_round: bool = Field(False, description="re-create the optimizer every round, as the "
                                                                "paper code does")


@register
class DPDiNNO(OptimizerAlgorithm):
    """Consensus ADMM with an inexact, private primal solver."""

    samplings: ClassVar[tuple[str, ...]] = ("poisson", "cyclic")  # one release a round, the run's mechanism
    reads_mixing: ClassVar[bool] = False  # (6) and line 14 sum the neighbours unweighted, with the degree

    name: ClassVar[str] = "dp-dinno"
    Settings = DiNNOSettings

    def __init__(self, optimizer: Optimizer, rho: float, rho_growth: float = 1.0, primal_steps: int = 1,
                 reset_each_round: bool = False) -> None:
        super().__init__(optimizer)
        self.rho0 = rho
        self.rho_growth = rho_growth
        self.primal_steps = primal_steps
        self.reset_each_round = reset_each_round

    @classmethod
    def from_settings(cls, settings: DiNNOSettings) -> DPDiNNO:
        return cls(settings.build(), rho=settings.rho, rho_growth=settings.rho_growth,
                   primal_steps=settings.primal_steps, reset_each_round=settings.reset_optimizer_each_round)

    @property
    def releases_per_round(self) -> int:
        return self.primal_steps

    def stability_warnings(self, topology: Topology, schedule: Schedule) -> list[str]:
        """A warning when one primal step per dual update makes the agents' disagreement grow (see
        :func:`disagreement_map`).  Not checked: several primal steps (the map above assumes ``psi = theta``),
        and Adam rebuilt every round, whose step is ``lr * sign(G)`` coordinate-wise and so bounded.  A penalty
        schedule that leaves float32 before the last round is refused (a ConfigError naming ``rho_growth``)."""
        log_last = math.log(self.rho0) + schedule.rounds * math.log(self.rho_growth)
        if log_last > math.log(torch.finfo(torch.float32).max):
            raise ConfigError("algorithm.rho_growth", f"the penalty rho * rho_growth^{schedule.rounds} = "
                                                      f"{self.rho0:g} * {self.rho_growth:g}^{schedule.rounds} = "
                                                      f"1e{log_last / math.log(10):.0f} by the last round overflows "
                                                      "float32: lower rho_growth (or rho, or the rounds)")
        if self.primal_steps > 1 or (isinstance(self.optimizer, Adam) and self.reset_each_round):
            return []
        spectrum = laplacian_spectrum(topology.adjacency())  # dense, O(N^3): only for the settings checked
        eigenvalues = spectrum[spectrum > 1e-9]
        if not eigenvalues.size:  # one agent: nothing to disagree on
            return []
        if isinstance(self.optimizer, Adam):  # its step lr / sqrt(v) is unknown before the run: all a > 0
            beta1 = self.optimizer.beta1
            if spectral_radius(np.logspace(-6, 2, 801), beta1, False).min() <= 1:
                return []
            return [f"algorithm.reset_optimizer_each_round = false: with one primal step per dual update, Adam's "
                    f"first moment (beta1 = {beta1:g}) and DiNNO's dual ascent make the agents' disagreement grow at "
                    "every step size (linearised, second moments frozen); set reset_optimizer_each_round = true "
                    "(the paper code's choice), or use optimizer = 'sgd' without momentum"]
        momentum, nesterov = self.optimizer.momentum, self.optimizer.nesterov
        steps = np.array([schedule(k) for k in range(schedule.rounds)])
        rhos = self.rho0 * self.rho_growth ** (np.arange(schedule.rounds) + 1.0)
        growth = disagreement_growth(np.outer(steps * rhos, eigenvalues), momentum, nesterov)
        if growth <= GROWTH_LIMIT:
            return []
        size = f"about 1e{math.floor(math.log10(growth))}"
        if momentum:
            return [f"algorithm.momentum = {momentum:g}: with one primal step per dual update, heavy-ball momentum "
                    "and DiNNO's dual ascent make the agents' disagreement grow (linearised, the loss left out: "
                    f"by {size} over the run; for momentum above 0.5 at every step size); use momentum = 0, or Adam "
                    "with reset_optimizer_each_round = true"]
        worst = float(np.max(steps * rhos)) * float(eigenvalues.max())
        return [f"algorithm.lr: with one primal step per dual update, DiNNO's agents drift apart (linearised, the "
                f"loss left out: their disagreement grows by {size} over the run) because lr * rho_k * lambda "
                f"reaches {worst:.3g}, above the 4/3 that plain SGD needs (lambda_max = {eigenvalues.max():.4g}, "
                "the largest Laplacian eigenvalue); lower algorithm.lr, algorithm.rho or algorithm.rho_growth"]

    def init_state(self, params: torch.Tensor) -> State:
        return {**super().init_state(params), "dual": torch.zeros_like(params)}

    def round(self, state: State, ctx: RoundContext) -> State:
        net = ctx.network
        theta = state["params"]
        rho = self.rho0 * self.rho_growth ** (ctx.round_index + 1)
        degrees = net.degrees[:, None]
        neighbours = net.neighbor_sum(theta)
        dual = state["dual"] + rho * (degrees * theta - neighbours)              # (6), line 8
        anchor = (degrees * theta + neighbours) / 2                               # sum_j (theta_i + theta_j) / 2
        opt = self.optimizer.init(theta) if self.reset_each_round else unprefixed("opt", state)
        psi = theta                                                               # line 9
        for _ in range(self.primal_steps):                                        # line 10
            private = ctx.oracle.gradient(psi)                                    # lines 11-13 (a fresh batch)
            grad = private + dual + 2 * rho * (degrees * psi - anchor)            # line 14
            psi, opt = self.optimizer.step(psi, grad, opt, ctx.lr)                # line 15
        return {"params": psi, "dual": dual, **prefixed("opt", opt)}              # line 16
