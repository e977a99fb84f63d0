"""The synthetic personalized linear classification problem of Vanhaesebrouck et al. (2017), as Bellet
et al. (2018, Section 5.1) use it (specs D.7), with the authors' own generator where the papers are silent.

* Agent i has a target separator theta_i in R^2 ~ N(0, I/2); its points x ~ N(0, I_p / 2) are
  labelled y = sign(x_{1:2} . theta_i), so only the first two coordinates are informative and p - 2
  are noise (Figure 2(c) makes the problem harder by raising p), and each label is flipped with
  probability ``label_noise`` (train and test alike).  These draws are those of the authors' group's
  generator (``generate_models`` / ``generate_samples``, adapted from gitlab.inria.fr/magnet/
  decentralizedpaper into github.com/vzantedeschi/Dada, ``src/utils.py``).
* m_i ~ Uniform{min_points..max_points} training points, ``test_points`` test points per agent.
* W_ij = exp((cos phi_ij - 1) / gamma), phi_ij the angle between theta_i and theta_j (the same weight
  as that code's ``sim_map``).  "Negligible weights are ignored" as that code's ``compute_adjacencies``
  does it: the kept weights are those above the largest cut ``max W * 10^(-k/2)``, k = 1, 2, ..., that
  leaves the graph connected (its Laplacian's second eigenvalue above 1e-3).  With 100 agents that is
  usually the first cut (W > 0.32: targets within about 28 degrees), a sparser and more local graph
  than a fixed small cut; ``threshold`` gives such a fixed cut instead (for comparison only: an agent
  it leaves without neighbours keeps its strongest one, which the ``info`` records).
"""

from __future__ import annotations

import math

import numpy as np

from decentdp.data.personal import PersonalData
from decentdp.errors import ConfigError

#: Connectivity test of the adaptive cut: the second-smallest eigenvalue of the 0/1 graph's Laplacian.
CONNECTED_EIGENVALUE = 1e-3
#: Ratio between successive cuts tried (sqrt(10), as the authors' code).
CUT_RATIO = np.sqrt(10.0)


def connected_cut(similarity: np.ndarray) -> float:
    """The largest cut ``max * CUT_RATIO^-k`` (k >= 1) whose graph {W_ij > cut} is connected."""
    top = float(similarity.max())
    for k in range(1, 200):
        cut = top * CUT_RATIO ** (-k)
        adjacency = (similarity > cut).astype(float)
        laplacian = np.diag(adjacency.sum(axis=1)) - adjacency
        if np.linalg.eigvalsh(laplacian)[1] > CONNECTED_EIGENVALUE:
            return cut
    raise ConfigError("personalized.gamma", "no cut of the similarity weights connects the graph (the weights "
                                            "underflow to zero): raise it")


def synthetic_linear(n_agents: int = 100, dim: int = 100, *, min_points: int = 10, max_points: int = 100,
                     test_points: int = 100, label_noise: float = 0.05, gamma: float = 0.1,
                     threshold: float | None = None, seed: int = 0) -> PersonalData:
    """Draw one problem instance (module docstring); deterministic given ``seed``.  ``threshold = None``
    keeps the weights above the adaptive connected cut, a number keeps those at or above it."""
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
    full = np.exp((unit @ unit.T - 1.0) / gamma)
    np.fill_diagonal(full, 0.0)
    reconnected: list[int] = []
    if threshold is None:
        cut = connected_cut(full)
        weights = np.where(full > cut, full, 0.0)
    else:
        cut = threshold
        weights = np.where(full >= threshold, full, 0.0)
        reconnected = np.flatnonzero(weights.sum(axis=1) == 0).tolist()
        strongest = full.argmax(axis=1)
        weights[reconnected, strongest[reconnected]] = full[reconnected, strongest[reconnected]]
        weights = np.maximum(weights, weights.T)
    info = {"generator": "synthetic-linear (Vanhaesebrouck et al. 2017)", "agents": n_agents, "dim": dim,
            "points": [min_points, max_points], "label_noise": label_noise, "gamma": gamma,
            "cut": "adaptive (largest connected)" if threshold is None else "fixed", "weight_cut": float(cut),
            "reconnected_agents": reconnected, "edges": int((weights > 0).sum() // 2)}
    # the generator's law is public and its rows are N(0, I/2): ||x|| > sqrt(0.5) (sqrt(dim) + 6) has probability
    # below exp(-18) (Gaussian concentration of the norm), so the declared bound rescales essentially no row
    bound = math.sqrt(0.5) * (math.sqrt(dim) + 6.0)
    return PersonalData(x_train, y_train, owner_train, x_test, y_test, owner_test, weights, "classification", info,
                        feature_bound=bound, public_inputs="the similarity graph, made from the generator's target "
                                                           "models (no record enters it)")
