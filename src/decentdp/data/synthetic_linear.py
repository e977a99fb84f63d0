"""The synthetic personalized linear classification problem of Vanhaesebrouck et al. (2017), as Bellet
et al. (2018, Section 5.1) use it (specs D.7, the generator recommended there).

* Agent i has a target separator theta_i in R^2 ~ N(0, I/2); its points x ~ N(0, I_p / 2) are
  labelled y = sign(x_{1:2} . theta_i), so only the first two coordinates are informative, and each
  label is flipped with probability ``label_noise`` (train and test alike).
* m_i ~ Uniform{min_points..max_points} training points, ``test_points`` test points per agent.
* W_ij = exp((cos phi_ij - 1) / gamma), phi_ij the angle between theta_i and theta_j; weights below
  ``threshold`` are dropped.  An agent left without neighbours keeps its strongest one (the
  objective needs D_ii > 0), which the ``info`` records.
"""

from __future__ import annotations

import numpy as np

from decentdp.data.personal import PersonalData


def synthetic_linear(n_agents: int = 100, dim: int = 100, *, min_points: int = 10, max_points: int = 100,
                     test_points: int = 100, label_noise: float = 0.05, gamma: float = 0.1,
                     threshold: float = 1e-3, seed: int = 0) -> PersonalData:
    """Draw one problem instance (module docstring); deterministic given ``seed``."""
    if dim < 2:
        raise ValueError(f"the synthetic problem needs dim >= 2 (two informative coordinates), got {dim}")
    rng = np.random.default_rng(seed)
    targets = rng.normal(0.0, np.sqrt(0.5), (n_agents, 2))
    sizes = rng.integers(min_points, max_points + 1, n_agents)

    def draw(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        owner = np.repeat(np.arange(n_agents), counts)
        x = rng.normal(0.0, np.sqrt(0.5), (len(owner), dim))
        y = np.sign(np.einsum("rk,rk->r", x[:, :2], targets[owner]))
        y[y == 0] = 1.0
        flip = rng.random(len(owner)) < label_noise
        return x, np.where(flip, -y, y), owner

    x_train, y_train, owner_train = draw(sizes)
    x_test, y_test, owner_test = draw(np.full(n_agents, test_points))
    unit = targets / np.linalg.norm(targets, axis=1, keepdims=True)
    weights = np.exp((unit @ unit.T - 1.0) / gamma)
    np.fill_diagonal(weights, 0.0)
    strongest = weights.argmax(axis=1)
    weights[weights < threshold] = 0.0
    isolated = np.flatnonzero(weights.sum(axis=1) == 0)
    full = np.exp((unit @ unit.T - 1.0) / gamma)
    weights[isolated, strongest[isolated]] = full[isolated, strongest[isolated]]
    weights = np.maximum(weights, weights.T)
    info = {"generator": "synthetic-linear (Vanhaesebrouck et al. 2017)", "agents": n_agents, "dim": dim,
            "points": [min_points, max_points], "label_noise": label_noise, "gamma": gamma, "threshold": threshold,
            "reconnected_agents": isolated.tolist(), "edges": int((weights > 0).sum() // 2)}
    return PersonalData(x_train, y_train, owner_train, x_test, y_test, owner_test, weights, "classification", info)
