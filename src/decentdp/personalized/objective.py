"""The personalized objective of Bellet et al. (2018), eq. (2) (specs D.1), as pure functions over arrays.

    Q_L(Theta) = 1/2 sum_{i<j} W_ij ||Theta_i - Theta_j||^2 + mu sum_i D_ii c_i L_i(Theta_i; S_i),
    L_i(theta) = (1/m_i) sum_k l(theta; x_k, y_k) + lambda_i ||theta||^2,

with D_ii = sum_j W_ij, confidences c_i = m_i / max_j m_j (a small floor for an agent without data),
lambda_i = 1/m_i, and l the squared loss (regression) or the logistic loss (labels in {-1, +1}).
Block i has Lipschitz constant L_i = D_ii (1 + mu c_i L_i^loc) and step alpha_i = 1/(1 + mu c_i L_i^loc).

L_i^loc = l'' sup * lambda_max(X_i^T X_i) / m_i + 2 lambda_i reads agent i's records, so a step made from it
scales the noisy gradient by a factor that depends on the data, and the broadcast is no longer
post-processing of the noisy release (one replaced record changed alpha_i 15-fold on the demo).  A private
run's steps therefore use a public bound instead, l'' sup * B^2 + 2 lambda_i with B a public bound on the
feature norms (``feature_bound``; lambda_max(X_i^T X_i) / m_i <= max_k ||x_k||^2 <= B^2).

Models are one ``(n, p)`` tensor; agents' records are flat, sorted by owner, and a set of agents'
gradients is one gather, one batched loss derivative and one scatter (no loop over agents).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentdp.data.personal import PersonalData, Task
from decentdp.errors import GraphError

#: Confidence of an agent without data (c_i = m_i / max m_j would be 0: its model would ignore its own
#: loss entirely, and alpha_i, the update and the sensitivity 2C/m_i would divide by zero).
CONFIDENCE_FLOOR = 1e-3


@dataclass(frozen=True)
class Problem:
    """One personalized problem on a device: the agents' data (flat, by owner) and every constant of eq. (2)."""

    x: torch.Tensor          # (R, p) training features
    y: torch.Tensor          # (R,) targets
    owner: torch.Tensor      # (R,) agent of each row, non-decreasing
    offsets: torch.Tensor    # (n + 1,) agent i's rows are offsets[i]:offsets[i + 1]
    counts: torch.Tensor     # (n,) m_i
    weights: torch.Tensor    # (n, n) W, symmetric, zero diagonal
    degree: torch.Tensor     # (n,) D_ii
    confidence: torch.Tensor  # (n,) c_i
    reg: torch.Tensor        # (n,) lambda_i
    local_smoothness: torch.Tensor  # (n,) L_i^loc, from the agents' records
    step_smoothness: torch.Tensor  # (n,) what alpha_i and L_i use: L_i^loc, or a public bound on it (private runs)
    mu: float
    task: Task

    @property
    def n_agents(self) -> int:
        return int(self.counts.shape[0])

    @property
    def dim(self) -> int:
        return int(self.x.shape[1])

    @property
    def step(self) -> torch.Tensor:
        """alpha_i = 1 / (1 + mu c_i L_i^loc), the block step (specs D.1); public in a private run."""
        return 1.0 / (1.0 + self.mu * self.confidence * self.step_smoothness)

    @property
    def block_lipschitz(self) -> torch.Tensor:
        """L_i = D_ii (1 + mu c_i L_i^loc); public in a private run."""
        return self.degree * (1.0 + self.mu * self.confidence * self.step_smoothness)

    @property
    def strong_convexity(self) -> float:
        """sigma, a lower bound on Q_L's strong convexity: the regularisers give 2 mu D_ii c_i lambda_i per block
        (the graph term is only positive semi-definite)."""
        return float((2 * self.mu * self.degree * self.confidence * self.reg).min())

    def rows(self, agents: torch.Tensor) -> torch.Tensor:
        """Indices of the training rows of ``agents`` (a 1-D tensor of agent ids), agent by agent."""
        starts, counts = self.offsets[agents], self.counts[agents]
        total = int(counts.sum())
        shift = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts, output_size=total)
        return shift + torch.arange(total, device=shift.device)


def build_problem(data: PersonalData, mu: float, device: torch.device | str = "cpu",
                  feature_bound: float | None = None) -> Problem:
    """The problem's tensors and constants on ``device``; GraphError names an agent without neighbours.

    ``feature_bound`` (a public bound B on the rows' l2 norms, which the caller has made true): the steps and
    block constants use ``l'' sup * B^2 + 2 lambda_i``, which no record moves, instead of L_i^loc."""
    device = torch.device(device)
    n = data.n_agents
    weights = torch.as_tensor(data.weights, dtype=torch.float64, device=device)
    degree = weights.sum(dim=1)
    isolated = torch.nonzero(degree <= 0).flatten()
    if len(isolated):
        raise GraphError(f"agent(s) {isolated[:10].tolist()} have no neighbour in the similarity graph: eq. (2) "
                         "weighs their loss by D_ii = 0, so their models would be undefined")
    counts_np = data.train_counts
    counts = torch.as_tensor(counts_np, dtype=torch.int64, device=device)
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    most = max(int(counts_np.max()), 1)
    confidence = torch.where(counts > 0, counts.double() / most, torch.full_like(degree, CONFIDENCE_FLOOR))
    reg = 1.0 / counts.clamp(min=1).double()
    x = torch.as_tensor(data.x_train, dtype=torch.float64, device=device)
    owner = torch.as_tensor(data.owner_train, dtype=torch.int64, device=device)
    curvature = 2.0 if data.task == "regression" else 0.25  # sup of l'' in the margin
    gram_top = torch.linalg.eigvalsh(agent_grams(x, owner, offsets))[:, -1] / counts.clamp(min=1).double()
    local = curvature * gram_top + 2.0 * reg
    step_smoothness = local if feature_bound is None else curvature * float(feature_bound) ** 2 + 2.0 * reg
    return Problem(x, torch.as_tensor(data.y_train, dtype=torch.float64, device=device), owner, offsets, counts,
                   weights, degree, confidence, reg, local, step_smoothness, float(mu), data.task)


def agent_grams(problem_x: torch.Tensor, owner: torch.Tensor, offsets: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_k x_k x_k^T over each agent's rows, ``(n, p, p)``: rows scattered into an ``(n, max m_i, p)``
    zero-padded block, then one batched product (no ``(R, p, p)`` outer products)."""
    n, p = len(offsets) - 1, problem_x.shape[1]
    counts = offsets[1:] - offsets[:-1]
    position = torch.arange(len(owner), device=owner.device) - offsets[owner]
    padded = torch.zeros(n, max(int(counts.max()), 1), p, dtype=problem_x.dtype, device=problem_x.device)
    padded[owner, position] = problem_x if row_weights is None else problem_x * row_weights.sqrt().unsqueeze(1)
    return padded.transpose(1, 2) @ padded


def loss_derivative(margin: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
    """dl/dz at z = theta . x for each row: 2 (z - y) (squared loss) or -y sigmoid(-y z) (logistic)."""
    if task == "regression":
        return 2.0 * (margin - y)
    return -y * torch.sigmoid(-y * margin)


def loss_value(margin: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
    """l at z = theta . x for each row."""
    if task == "regression":
        return (margin - y) ** 2
    return torch.nn.functional.softplus(-y * margin)


def clip_rows(gradients: torch.Tensor, bound: float, norm: int) -> torch.Tensor:
    """Per-sample gradients scaled to l_``norm`` at most ``bound`` (l1 for Laplace, l2 for Gaussian noise)."""
    size = gradients.abs().sum(dim=1) if norm == 1 else torch.linalg.vector_norm(gradients, dim=1)
    return gradients * (bound / size.clamp(min=bound)).unsqueeze(1)


def data_gradient_sums(problem: Problem, theta: torch.Tensor, agents: torch.Tensor,
                       clip: float | None = None, norm: int = 2) -> torch.Tensor:
    """sum_k grad l(theta_i; x_k, y_k) over each agent's records, per-sample clipped when ``clip`` is given:
    ``(len(agents), p)``, row r for ``agents[r]`` at its own model ``theta[agents[r]]``."""
    rows = problem.rows(agents)
    local_owner = torch.repeat_interleave(torch.arange(len(agents), device=theta.device), problem.counts[agents],
                                          output_size=len(rows))
    x = problem.x[rows]
    margin = torch.einsum("rp,rp->r", x, theta[agents][local_owner])
    per_sample = loss_derivative(margin, problem.y[rows], problem.task).unsqueeze(1) * x
    if clip is not None:
        per_sample = clip_rows(per_sample, clip, norm)
    sums = torch.zeros(len(agents), problem.dim, dtype=theta.dtype, device=theta.device)
    return sums.index_add_(0, local_owner, per_sample)


def local_gradients(problem: Problem, theta: torch.Tensor, agents: torch.Tensor, clip: float | None = None,
                    norm: int = 2) -> torch.Tensor:
    """grad L_i(theta_i) = (1/m_i) sum_k grad l + 2 lambda_i theta_i for each of ``agents`` (zero data term
    for an agent without records)."""
    sums = data_gradient_sums(problem, theta, agents, clip, norm)
    counts = problem.counts[agents].clamp(min=1).double().unsqueeze(1)
    return sums / counts + 2.0 * problem.reg[agents].unsqueeze(1) * theta[agents]


def local_losses(problem: Problem, theta: torch.Tensor) -> torch.Tensor:
    """L_i(theta_i) for every agent, ``(n,)``."""
    margin = torch.einsum("rp,rp->r", problem.x, theta[problem.owner])
    losses = torch.zeros(problem.n_agents, dtype=theta.dtype, device=theta.device)
    losses.index_add_(0, problem.owner, loss_value(margin, problem.y, problem.task))
    return losses / problem.counts.clamp(min=1).double() + problem.reg * (theta * theta).sum(dim=1)


def objective_gradient(problem: Problem, theta: torch.Tensor) -> torch.Tensor:
    """grad Q_L(Theta), ``(n, p)``: block i is D_ii (Theta_i + mu c_i grad L_i(Theta_i)) - sum_j W_ij Theta_j
    (eq. (3)); the central minimiser (:func:`~decentdp.personalized.solver.minimiser`) descends it."""
    agents = torch.arange(problem.n_agents, device=theta.device)
    pull = (problem.mu * problem.confidence).unsqueeze(1) * local_gradients(problem, theta, agents)
    return problem.degree.unsqueeze(1) * (theta + pull) - problem.weights @ theta


def objective(problem: Problem, theta: torch.Tensor) -> float:
    """Q_L(Theta), eq. (2)."""
    squared = (theta * theta).sum(dim=1)
    # sum_{i<j} W_ij ||t_i - t_j||^2 = sum_i D_ii ||t_i||^2 - sum_ij W_ij t_i . t_j
    smooth = float((problem.degree * squared).sum() - (theta * (problem.weights @ theta)).sum())
    local = float((problem.degree * problem.confidence * local_losses(problem, theta)).sum())
    return 0.5 * smooth + problem.mu * local
