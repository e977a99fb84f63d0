"""Purely local models, and the private warm start of Bellet et al. (supplementary C; specs D.4).

* :func:`local_models`: each agent's minimiser of L_i(theta) = (1/m_i) sum_k l + lambda_i ||theta||^2
  on its own data alone (the "purely local" baseline; nothing is released).  Squared loss: one
  batched ridge solve; logistic loss: batched Newton steps; with per-sample clipping (the loss
  then is C-Lipschitz, as output perturbation requires), gradient steps on the clipped loss follow.
* :func:`output_perturbation`: Chaudhuri et al. (2011, Theorem 6): the minimiser of
  (1/m) sum l + (Lambda/2)||theta||^2 with a C-Lipschitz loss has l2 sensitivity 2C/(m Lambda) under
  replace-one; adding b with density proportional to exp(-eps ||b|| / Delta) (norm ~ Gamma(p, Delta/eps),
  uniform direction) is pure eps-DP.  Here Lambda = 2 lambda_i, so Delta_i = C / (m_i lambda_i).
  The solver only approximates the minimiser, so :func:`local_models` certifies its output instead: it
  steps until each private model's objective gradient is at most ``tau_i = CERTIFIED_TOLERANCE C / m_i``,
  which puts the model within ``tau_i / Lambda`` of the exact minimiser (strong convexity), and the
  sensitivity becomes ``Delta_i + 2 tau_i / Lambda = (1 + CERTIFIED_TOLERANCE) Delta_i`` (approximate
  minima perturbation, Iyengar et al. 2019): a bound for the model that was computed, not an ideal one.
  In secure mode that float sampler is replaced by an exact one on a grid (Mironov 2012's concern): a
  discrete Laplace per coordinate (:func:`~decentdp.privacy.discrete.grid_release`) for the l1
  sensitivity ``sqrt(p) Delta_i >= ||.||_1`` at the same pure ``eps`` (its expected noise norm is about
  ``sqrt(2)`` times the Gamma mechanism's).
* The warm start is then :func:`~decentdp.personalized.solver.model_propagation` of the private
  local models: post-processing, no further privacy cost.
* :func:`local_dp_release`: the local-DP baseline of the supplementary (D.1, Figure 4): each agent
  perturbs its data points themselves, and models are then learned from the perturbed points.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from decentdp.data.personal import PersonalData
from decentdp.errors import PrivacyError
from decentdp.personalized.objective import Problem, agent_grams, data_gradient_sums
from decentdp.privacy.discrete import grid_release
from decentdp.rng import AgentRandom, Stream, below_on_grid

#: Round of the warm start's noise keys (the setup phase, before any update).
WARM_START_ROUND = -1
#: Share of a record's local-DP budget spent on its label (the rest on its features).
LABEL_SHARE = 0.5
NEWTON_STEPS = 25
#: The certificate of a private local model: its objective gradient norm over the data term's scale C / m_i.
CERTIFIED_TOLERANCE = 1e-3
#: Gradient steps on the clipped loss before an uncertified model is refused.
MAX_CLIPPED_STEPS = 20_000


def local_models(problem: Problem, clip: float | None = None) -> torch.Tensor:
    """Each agent's local minimiser (module docstring), ``(n, p)`` float64; zero for an agent without data.
    With ``clip`` (the private warm start), certified: every agent's gradient of the clipped objective is at
    most ``CERTIFIED_TOLERANCE clip / m_i``, or :class:`~decentdp.errors.PrivacyError` is raised."""
    n, p = problem.n_agents, problem.dim
    eye = torch.eye(p, dtype=torch.float64, device=problem.x.device)
    counts = problem.counts.clamp(min=1).double()[:, None, None]
    ridge = (problem.reg[:, None, None] * eye).expand(n, p, p)
    agents = torch.arange(n, device=problem.x.device)
    if problem.task == "regression":
        gram = agent_grams(problem.x, problem.owner, problem.offsets) / counts
        target = torch.zeros(n, p, dtype=torch.float64, device=problem.x.device)
        target.index_add_(0, problem.owner, problem.x * problem.y.unsqueeze(1))
        theta = torch.linalg.solve(gram + ridge, (target / counts[:, :, 0]).unsqueeze(2))[:, :, 0]
    else:
        theta = torch.zeros(n, p, dtype=torch.float64, device=problem.x.device)
        for _ in range(NEWTON_STEPS):
            margin = torch.einsum("rp,rp->r", problem.x, theta[problem.owner])
            curvature = torch.sigmoid(margin) * torch.sigmoid(-margin)
            hessian = agent_grams(problem.x, problem.owner, problem.offsets, curvature) / counts + 2 * ridge
            gradient = data_gradient_sums(problem, theta, agents) / counts[:, :, 0] + 2 * problem.reg[:, None] * theta
            theta = theta - torch.linalg.solve(hessian, gradient.unsqueeze(2))[:, :, 0]
    if clip is not None:
        step = (1.0 / problem.local_smoothness).unsqueeze(1)
        tolerance = CERTIFIED_TOLERANCE * clip / counts[:, 0, 0]
        for _ in range(MAX_CLIPPED_STEPS):
            gradient = data_gradient_sums(problem, theta, agents, clip, 2) / counts[:, :, 0] \
                + 2 * problem.reg[:, None] * theta
            if bool((torch.linalg.vector_norm(gradient, dim=1) <= tolerance).all()):
                return theta
            theta = theta - step * gradient
        raise PrivacyError(f"personalized.warm_start: the local models' gradients did not fall below "
                           f"{CERTIFIED_TOLERANCE:g} C / m_i in {MAX_CLIPPED_STEPS} steps, so output perturbation's "
                           "sensitivity would not be certified; turn personalized.warm_start off")
    return theta


def output_perturbation(problem: Problem, theta: torch.Tensor, clip: float, epsilon: float,
                        rng: AgentRandom) -> torch.Tensor:
    """``theta`` (certified by :func:`local_models` with the same ``clip``) plus Chaudhuri et al.'s
    output-perturbation noise for its certified sensitivity (module docstring), keyed per agent at
    :data:`WARM_START_ROUND`; agents without data are returned unchanged (nothing to protect)."""
    n, p = theta.shape
    sensitivity = (1.0 + CERTIFIED_TOLERANCE) * clip / (problem.counts.clamp(min=1).double() * problem.reg)
    if rng.secure:
        return _grid_output_perturbation(problem, theta, sensitivity, epsilon, rng)
    ids = list(range(n))
    directions = rng.normal(ids, p, WARM_START_ROUND, Stream.NOISE, 0, dtype=torch.float64)
    uniforms = rng.normal(ids, p, WARM_START_ROUND, Stream.NOISE, 1, dtype=torch.float64, uniform=True)
    gamma = -torch.log1p(-uniforms.to(theta.device)).sum(dim=1)  # Gamma(p, 1): a sum of p Exp(1) draws
    norm = gamma * sensitivity / epsilon
    unit = directions.to(theta.device) / torch.linalg.vector_norm(directions, dim=1, keepdim=True).to(theta.device)
    noise = torch.where((problem.counts > 0).unsqueeze(1), unit * norm.unsqueeze(1), 0.0)
    return theta + noise


def _grid_output_perturbation(problem: Problem, theta: torch.Tensor, sensitivity: torch.Tensor, epsilon: float,
                              rng: AgentRandom) -> torch.Tensor:
    """Secure mode's warm start: each agent's ``theta_i`` released exactly on a grid with discrete Laplace noise
    for the l1 sensitivity ``sqrt(p) Delta_i`` (pure ``epsilon``-DP, module docstring), from its own key."""
    n, p = theta.shape
    out = theta.clone()
    values = theta.detach().cpu().numpy()
    for agent in range(n):
        if int(problem.counts[agent]) == 0:
            continue
        words = rng.words(agent, WARM_START_ROUND, Stream.NOISE, 2)
        released = grid_release(values[agent:agent + 1], math.sqrt(p) * float(sensitivity[agent]),
                                np.array([1.0 / epsilon]), lambda _, stream=words: stream)
        out[agent] = torch.from_numpy(released[0]).to(theta.device)
    return out


def local_dp_release(data: PersonalData, epsilon: float, bound: float, rng: np.random.Generator) -> PersonalData:
    """``data`` with every training record released under pure ``epsilon`` local DP; test records untouched.

    The paper gives no mechanism beyond "adding noise to each data point itself (proportional to the
    sensitivity of its features)"; this is the standard one, with budget ``epsilon`` per record split by
    basic composition: the features are scaled into the l1 ball of radius ``bound`` (two points of it
    differ by at most ``2 bound`` in l1) and get Laplace noise of scale ``2 bound / ((1 - LABEL_SHARE) eps)``
    per coordinate; the label goes through randomized response at ``LABEL_SHARE * eps`` (kept with
    probability e^eps' / (1 + e^eps')).  The released set is public, so whatever is learned from it (local
    models, or coordinate descent on it) costs nothing more.  ``bound`` must not depend on the data (for
    the synthetic problem: the l1 norm its feature distribution gives on average).  Classification only."""
    if data.task != "classification":
        raise ValueError("local_dp_release perturbs labels in {-1, +1} by randomized response: classification only")
    if not (epsilon > 0 and bound > 0):
        raise ValueError(f"local DP needs epsilon > 0 and bound > 0, got epsilon = {epsilon}, bound = {bound}")
    size = np.abs(data.x_train).sum(axis=1, keepdims=True)
    clipped = data.x_train * np.minimum(1.0, bound / np.maximum(size, 1e-300))
    features = clipped + rng.laplace(0.0, 2.0 * bound / ((1.0 - LABEL_SHARE) * epsilon), clipped.shape)
    label_epsilon = LABEL_SHARE * epsilon
    # kept with at most probability e^eps' / (1 + e^eps'): numpy's uniforms lie on the 2^-53 grid
    keep = rng.random(len(data.y_train)) < below_on_grid(1.0 / (1.0 + math.exp(-label_epsilon)))
    info = {**data.info, "local_dp": {"epsilon": epsilon, "l1_bound": bound, "label_share": LABEL_SHARE}}
    return PersonalData(features, np.where(keep, data.y_train, -data.y_train), data.owner_train, data.x_test,
                        data.y_test, data.owner_test, data.weights, data.task, info)
