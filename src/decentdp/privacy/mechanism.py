"""The gradient oracle: every agent's (private) stochastic gradient, with its privacy accounted.

One call is one *release* per agent, following DP-SGD (Abadi et al. 2016) and line 9 of
Algorithm 1 in Bayrooti et al.::

    G_i = (1 / L_i) * ( sum_{d in batch_i} clip_C(grad l(theta_i; d)) + sigma_i * C * xi ),   xi ~ N(0, I_d)

with a Poisson batch of rate ``q_i`` and expected size ``L_i = q_i |D_i|``.  Before computing it,
the oracle asks each agent's ledger for authorisation, so the mechanism and its accounting live
in one place (the ``DPQuery`` pattern of TensorFlow Privacy): an agent whose budget cannot cover
the release gets a zero gradient and releases nothing.

Without a privacy spec the oracle returns the plain mean gradient of the same Poisson batches and
records non-private releases (``sigma = 0``, reported as infinite epsilon).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentdp.engine.flat_model import FlatModel
from decentdp.engine.rng import AgentRandom, Stream
from decentdp.engine.sampling import PoissonSampler
from decentdp.privacy.clipping import clipped_sum
from decentdp.privacy.ledger import PrivacyLedger


@dataclass(frozen=True)
class GaussianSpec:
    """Parameters of each agent's sampled Gaussian mechanism."""

    noise_multipliers: torch.Tensor  # (N,) sigma_i
    clip: float                      # C


@dataclass
class ReleaseStats:
    """Diagnostics of the last call (for logging, never used by algorithms)."""

    batch_sizes: torch.Tensor
    clipped_fraction: float
    authorized: torch.Tensor


class GradientOracle:
    """Computes every agent's stochastic gradient at given parameters, privately if ``spec`` is set."""

    def __init__(self, model: FlatModel, sampler: PoissonSampler, ledger: PrivacyLedger,
                 rng: AgentRandom, spec: GaussianSpec | None) -> None:
        self.model = model
        self.sampler = sampler
        self.ledger = ledger
        self.rng = rng
        self.spec = spec
        self.sample_rates = sampler.sample_rates
        self.expected_batch = (sampler.sample_rates.double() * sampler.data.sizes).float()
        self.last: ReleaseStats | None = None

    @property
    def n_agents(self) -> int:
        return len(self.sample_rates)

    def __call__(self, params: torch.Tensor, round_index: int, step: int = 0) -> torch.Tensor:
        """The ``(N, d)`` gradients released in round ``round_index``, sub-step ``step``."""
        sigmas = self.spec.noise_multipliers if self.spec is not None else torch.zeros(self.n_agents)
        authorized = torch.from_numpy(
            self.ledger.spend(round_index, sigmas.numpy(), self.sample_rates.numpy(), releases=1))
        batch = self.sampler.sample(round_index, step)
        if self.spec is None:
            sizes = batch.sizes.clamp(min=1.0)
            grads = self.model.batch_gradients(params, batch.x, batch.y, batch.mask / sizes[:, None])
            clipped_fraction = 0.0
        else:
            per_sample = self.model.per_sample_gradients(params, batch.x, batch.y)
            summed, norms = clipped_sum(per_sample, batch.mask, self.spec.clip)
            agents = list(range(self.n_agents))
            noise = self.rng.normal(agents, self.model.dim, round_index, Stream.NOISE, step)
            noisy = summed + noise * (self.spec.noise_multipliers * self.spec.clip)[:, None]  # Alg. 1 line 9
            grads = noisy / self.expected_batch[:, None]
            real = batch.mask.bool()
            clipped_fraction = float((norms[real] > self.spec.clip).float().mean()) if real.any() else 0.0
        self.last = ReleaseStats(batch.sizes, clipped_fraction, authorized)
        return torch.where(authorized[:, None], grads, torch.zeros_like(grads))
