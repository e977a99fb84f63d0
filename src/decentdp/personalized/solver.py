"""Asynchronous block coordinate descent on Q_L (Bellet et al. 2018, eq. (4) and, private, eq. (6)).

When agent i wakes it updates from its neighbours' last broadcasts and broadcasts the result:

    Theta_i <- (1 - alpha_i) Theta_i + alpha_i ( sum_j (W_ij / D_ii) Theta_j - mu c_i (grad L_i(Theta_i) + eta_i) )

with eta_i = 0 (non-private CD) or Laplace/Gaussian noise on the clipped gradient
(:mod:`decentdp.personalized.privacy`).  Levels of the :class:`~decentdp.personalized.schedule.WakeupPlan`
run one after the other, each as one vectorised step over its agents, which reproduces the
one-agent-at-a-time run exactly.  Agent i's noise for all of its planned updates is one draw from
its own stream, keyed (seed, i), made once; its k-th update adds the k-th block.  A run stopped after
any level and continued therefore gives the same models bit for bit.

Also here: model propagation (eq. (16)), the non-private post-processing of the warm start, and Q_L's
minimiser computed centrally (:func:`minimiser`), the reference the decentralized runs approach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch

from decentdp.personalized.objective import Problem, data_gradient_sums, objective, objective_gradient
from decentdp.personalized.privacy import UpdateNoise
from decentdp.personalized.schedule import WakeupPlan
from decentdp.privacy.discrete import grid_gaussian_release, grid_release
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import NoiseDraw, add_noise, round_up_to_float32
from decentdp.rng import AgentRandom

#: The round of the noise key of coordinate-descent updates (one key per agent covers all its updates).
UPDATE_ROUND = 0


@dataclass
class PrivateUpdates:
    """The release step of private updates: clip, charge the ledger, add the agent's noise.

    ``noise`` gives each update's multiplier and event; ``clip`` the per-sample bound C (l1 norm for
    Laplace, l2 for Gaussian).  ``ledger`` charges the releasing agents; those it refuses, and
    agents without data (nothing to protect), release no noise; the refused do not update.

    The standard draws of all updates are made on the first release, one row of ``T * p`` values per
    agent from its stream (one keyed generator per agent instead of one per update: per-update keys
    cost a re-seeded generator and a key derivation for each of the ~10^5 updates of a MovieLens run);
    update (i, k) adds block k of row i, scaled by its own multiplier times C.  In secure mode an update is
    released on a grid instead, sampled exactly when it is made (discrete Laplace, or the rounded
    Gaussian; keyed by agent and update number; :mod:`decentdp.privacy.discrete`): floating-point noise
    leaves gaps in the support of the released sum."""

    noise: UpdateNoise
    clip: float
    ledger: PrivacyLedger
    rng: AgentRandom
    has_data: torch.Tensor

    def __post_init__(self) -> None:
        values, inverse = np.unique(self.noise.multipliers, return_inverse=True)
        ids = np.array([self.ledger.intern(self.noise.event(float(value))) for value in values], dtype=np.int64)
        self._event_ids = ids[inverse].reshape(self.noise.multipliers.shape)
        self._data = self.has_data.cpu().numpy()
        self._draws: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self._exact = NoiseDraw(self.rng, range(len(self._data)), UPDATE_ROUND, 0) \
            if getattr(self.rng, "secure", False) else None

    @property
    def norm(self) -> int:
        return 1 if self.noise.mechanism == "laplace" else 2

    def _draw(self, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard draws ``(n, T, dim)`` (zero for agents without data) and scales ``(n, T)`` of every update."""
        if self._draws is None:
            n, planned = self.noise.multipliers.shape
            rows = np.flatnonzero(self._data).tolist()
            draw = NoiseDraw(self.rng, range(n), UPDATE_ROUND, 0)  # agent ids are host integers (keys)
            block = torch.empty(len(rows), planned * dim, dtype=draw.dtype, device=device)
            (draw.laplace if self.noise.mechanism == "laplace" else draw.normal)(rows, block)
            self._draws = torch.zeros(n, planned, dim, dtype=draw.dtype, device=device)
            self._draws[torch.as_tensor(rows, dtype=torch.long, device=device)] = block.view(len(rows), planned, dim)
            multipliers = torch.as_tensor(self.noise.multipliers, dtype=torch.float64, device=device)
            self._scales = round_up_to_float32(multipliers * self.clip)  # as the library's mechanisms round
        assert self._scales is not None
        return self._draws, self._scales

    def release(self, tick: int, agents: torch.Tensor, index: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """Charge and perturb the clipped sums of ``agents`` (their ``index``-th updates) in place; the mask
        of agents allowed to update (refused agents' sums are zeroed)."""
        n = self.ledger.n_agents
        rows, numbers = agents.cpu().numpy(), index.cpu().numpy()
        data = self._data[rows]
        asking = np.zeros(n, dtype=bool)
        asking[rows[data]] = True
        events = np.zeros(n, dtype=np.int64)
        events[rows] = self._event_ids[rows, numbers]
        allowed = self.ledger.charge(tick, events, agents=asking)[rows] | ~data
        mask = torch.as_tensor(allowed, device=sums.device)
        noisy = torch.as_tensor(allowed & data, device=sums.device)
        if self._exact is not None:
            released = allowed & data
            if released.any():
                picked = torch.from_numpy(np.flatnonzero(released)).to(sums.device)
                exact = grid_release if self.noise.mechanism == "laplace" else grid_gaussian_release
                values = self._exact.on_grid(exact, rows[released].tolist(), sums[picked].double().cpu().numpy(),
                                             self.clip, self.noise.multipliers[rows[released], numbers[released]],
                                             slots=numbers[released].tolist())
                sums[picked] = torch.from_numpy(values).to(sums.device, sums.dtype)
        else:
            draws, scales = self._draw(sums.shape[1], sums.device)
            add_noise(sums, draws[agents, index], torch.where(noisy, scales[agents, index], 0.0))
        sums[~mask] = 0.0
        return mask


def coordinate_descent(problem: Problem, theta: torch.Tensor, plan: WakeupPlan, *, start: int = 0,
                       stop: int | None = None, private: PrivateUpdates | None = None,
                       stopped: torch.Tensor | None = None,
                       after_level: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Run levels ``[start, stop)`` of ``plan`` on ``theta`` (``(n, p)`` float64, updated in place).

    ``stopped`` (bool ``(n,)``, updated in place) marks agents refused by their budget: they make no
    further update.  ``after_level(level, theta)`` is called after each level (metrics), including a level
    whose agents have all stopped: a caller counting levels to find a tick must see every one."""
    stop = plan.n_levels if stop is None else stop
    alpha = problem.step.unsqueeze(1)
    scale = (problem.mu * problem.confidence).unsqueeze(1)
    counts = problem.counts.clamp(min=1).double().unsqueeze(1)
    device = theta.device
    all_agents = torch.as_tensor(plan.agents, device=device)
    all_index = torch.as_tensor(plan.index, device=device)
    filtering = stopped is not None and bool(stopped.any())  # no agent stopped yet: skip the filter
    for level in range(start, stop):
        part = plan.level(level)
        agents, index = all_agents[part], all_index[part]
        if filtering:
            assert stopped is not None
            live = ~stopped[agents]
            agents, index = agents[live], index[live]
            if not len(agents):
                if after_level is not None:
                    after_level(level, theta)
                continue
        own = theta[agents]
        sums = data_gradient_sums(problem, theta, agents, None if private is None else private.clip,
                                  2 if private is None else private.norm)
        if private is not None:
            allowed = private.release(int(plan.ticks[part][0]), agents, index, sums)
            if stopped is not None and not bool(allowed.all()):
                stopped[agents[~allowed]] = True
                filtering = True
        else:
            allowed = torch.ones(len(agents), dtype=torch.bool, device=device)
        gradient = sums / counts[agents] + 2.0 * problem.reg[agents].unsqueeze(1) * own
        neighbours = (problem.weights[agents] @ theta) / problem.degree[agents].unsqueeze(1)
        a = alpha[agents]
        updated = (1.0 - a) * own + a * (neighbours - scale[agents] * gradient)
        theta[agents] = torch.where(allowed.unsqueeze(1), updated, own)
        if after_level is not None:
            after_level(level, theta)
    return theta


def model_propagation(problem: Problem, local: torch.Tensor) -> torch.Tensor:
    """The minimiser of Q_MP(Theta) = 1/2 (sum_{i<j} W_ij ||Theta_i - Theta_j||^2 + mu sum_i D_ii c_i
    ||Theta_i - local_i||^2), the fixed point of eq. (16)'s block update
    Theta_i <- (sum_j W_ij Theta_j / D_ii + mu c_i local_i) / (1 + mu c_i), solved directly: a linear
    system with matrix diag(D (1 + mu c)) - W.  Post-processing of ``local``: no privacy cost."""
    weights, degree = problem.weights, problem.degree
    pull = problem.mu * problem.confidence * degree
    system = torch.diag(degree + pull) - weights
    return torch.linalg.solve(system, pull.unsqueeze(1) * local)


def minimiser(problem: Problem, start: torch.Tensor, *, max_iterations: int = 20000) -> torch.Tensor:
    """Q_L's minimiser, found centrally by L-BFGS from ``start`` (``(n, p)``), to about machine precision.

    Not a decentralized algorithm: the reference point that tells whether a run's accuracy is Q_L's or
    only early stopping's, and what tuning mu (which sets Q_L) can reach.  Q_L is strongly convex
    (the lambda_i ||theta||^2 terms), so the minimiser is unique whatever ``start``."""
    shape = start.shape

    def value_and_gradient(flat: np.ndarray) -> tuple[float, np.ndarray]:
        theta = torch.from_numpy(flat.reshape(shape)).to(start.device)
        return objective(problem, theta), objective_gradient(problem, theta).cpu().numpy().ravel()

    result = scipy.optimize.minimize(value_and_gradient, start.detach().cpu().double().numpy().ravel(), jac=True,
                                     method="L-BFGS-B", options={"maxiter": max_iterations, "maxcor": 20,
                                                                 "gtol": 1e-10, "ftol": 1e-15})
    return torch.from_numpy(result.x.reshape(shape)).to(start.device)
