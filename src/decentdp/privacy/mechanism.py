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

from decentdp.gradients.flat_model import FlatModel
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.sampling import PoissonSampler
from decentdp.rng import AgentRandom, Stream
from decentdp.util.profiling import NO_TIMER, PhaseTimer

#: Noise is drawn into a buffer of at most this many bytes and added block by block.
NOISE_BLOCK_BYTES = 64 * 2**20
#: Blocks of at least this many draws are filled by several threads.
PARALLEL_NOISE_ELEMENTS = 2**20


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
                 rng: AgentRandom, spec: GaussianSpec | None, agents_per_pass: int | None = None) -> None:
        self.model = model
        self.agents_per_pass = agents_per_pass
        self.timer: PhaseTimer = NO_TIMER
        self.sampler = sampler
        self.ledger = ledger
        self.rng = rng
        self.spec = spec
        self.sample_rates = sampler.sample_rates
        self.expected_batch = (sampler.sample_rates.double() * sampler.data.sizes).float()
        if spec is not None:
            self.noise_scales = round_up_to_float32(spec.noise_multipliers.double() * spec.clip)
        self.last: ReleaseStats | None = None

    @property
    def n_agents(self) -> int:
        return len(self.sample_rates)

    def _groups(self) -> list[slice]:
        """Agents whose gradients are computed together (all of them unless memory says otherwise)."""
        step = self.agents_per_pass or self.n_agents
        return [slice(start, min(self.n_agents, start + step)) for start in range(0, self.n_agents, step)]

    def _add_noise(self, sums: torch.Tensor, round_index: int, step: int) -> None:
        """``sums_i += sigma_i C xi_i`` in place, drawn block by block into one buffer, so that the
        noise never occupies a second ``(N, d)`` matrix."""
        scale = self.noise_scales
        dim = self.model.dim
        # At most an eighth of the agents per block, so that small runs do not hold a full second copy either.
        rows = max(1, min(-(-self.n_agents // 8), NOISE_BLOCK_BYTES // (4 * dim)))
        buffer = torch.empty(rows, dim)
        # Threads pay off only on large blocks (starting them costs about a millisecond).
        workers = torch.get_num_threads() if rows * dim >= PARALLEL_NOISE_ELEMENTS else 1
        for start in range(0, self.n_agents, rows):
            stop = min(self.n_agents, start + rows)
            noise = self.rng.normal(range(start, stop), dim, round_index, Stream.NOISE, step,
                                    out=buffer[: stop - start], workers=workers)
            sums[start:stop].add_(noise.mul_(scale[start:stop, None]))

    def __call__(self, params: torch.Tensor, round_index: int, step: int = 0) -> torch.Tensor:
        """The ``(N, d)`` gradients released in round ``round_index``, sub-step ``step``."""
        sigmas = self.spec.noise_multipliers if self.spec is not None else torch.zeros(self.n_agents)
        with self.timer.phase("ledger"):
            authorized = torch.from_numpy(
                self.ledger.spend(round_index, sigmas.numpy(), self.sample_rates.numpy(), releases=1))
        groups = self._groups()
        # The round's largest block first, before the batch and activations take the free memory it
        # would otherwise reuse (fewer fresh pages and less heap growth from round to round).
        grads = torch.empty(params.shape, dtype=params.dtype)
        with self.timer.phase("sampling"):
            batch = self.sampler.sample(round_index, step)
        if self.spec is None:
            weights = batch.mask / batch.sizes.clamp(min=1.0)[:, None]
            with self.timer.phase("gradients"):
                for rows in groups:
                    grads[rows] = self.model.batch_gradients(params[rows], batch.x[rows], batch.y[rows],
                                                             weights[rows])
            clipped_fraction = 0.0
        else:
            norms = torch.empty(batch.mask.shape, dtype=params.dtype)
            with self.timer.phase("gradients"):
                for rows in groups:
                    _, norms[rows] = self.model.clipped_gradient_sums(
                        params[rows], batch.x[rows], batch.y[rows], batch.mask[rows], self.spec.clip, out=grads[rows])
            with self.timer.phase("noise"):
                self._add_noise(grads, round_index, step)                        # Alg. 1 line 9
                grads.div_(self.expected_batch[:, None])
            real = batch.mask.bool() & authorized[:, None]  # refused agents released nothing
            clipped_fraction = float((norms[real] > self.spec.clip).float().mean()) if real.any() else 0.0
        self.last = ReleaseStats(batch.sizes, clipped_fraction, authorized)
        if not bool(authorized.all()):
            grads[~authorized] = 0.0  # refused agents release nothing
        return grads


def round_up_to_float32(values: torch.Tensor) -> torch.Tensor:
    """The smallest float32 values >= ``values`` (float64): the noise is drawn in float32, and neither
    sigma nor the standard deviation ``sigma * C`` may fall below the calibrated value by rounding."""
    single = values.float()
    below = single.double() < values
    return torch.where(below, torch.nextafter(single, torch.tensor(float("inf"))), single)
