"""Noise mechanisms: each adds its noise *and* names the ``dp_accounting`` event of exactly what it released.

A mechanism is the one place where a noise distribution and its accounting meet (the ``DPQuery``
pattern of TensorFlow Privacy): :meth:`Mechanism.perturb` adds noise to the rows being released,
and :meth:`Mechanism.agent_event` / :meth:`Mechanism.receiver_event` describe the release for the
ledger.  The oracle (:mod:`decentdp.privacy.oracle`) calls both, so no noise can be added without
its event being charged, nor an event charged for noise that was not added.

Noise comes from :class:`NoiseDraw`, a single-use key issued by the oracle for one release: every
row's stream is keyed by (seed, agent, round, NOISE, release index[, slot]) and each row may draw
under a key once, so two releases can never share a noise vector by mistake.

Mechanisms here: the Gaussian mechanism (DP-SGD's ``sigma_i C``, optionally sampled and joint over
``k`` sums on one batch) and the Laplace mechanism (Li et al. 2018; Bellet et al. 2018).  Later
variants (TOP-DP's per-receiver residual noise) implement the same protocol.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import dp_accounting
import numpy as np
import torch

from decentdp.privacy.accounting import calibrate_noise_multiplier
from decentdp.privacy.discrete import grid_gaussian_release, grid_release, product_up
from decentdp.privacy.events import gaussian_event, joint_gaussian_event, laplace_event
from decentdp.rng import AgentRandom, Stream

#: Noise is drawn into a buffer of at most this many bytes and added block by block.
NOISE_BLOCK_BYTES = 64 * 2**20
#: Blocks of at least this many draws are filled by several threads.
PARALLEL_NOISE_ELEMENTS = 2**20


GridRelease = Callable[[np.ndarray, float, np.ndarray, Callable[[int], Callable[[int], np.ndarray]]], np.ndarray]
"""An exact grid sampler of :mod:`decentdp.privacy.discrete`: (values, sensitivity, multipliers, words of row)."""


class NoiseReuseError(RuntimeError):
    """A noise key (or a batch) was used a second time: that would release the same noise twice."""


class NoiseDraw:
    """The noise streams of one release: row ``r`` draws from its agent's stream under this key, once.

    ``agent_ids[r]`` is the global id of the agent that owns local row ``r``; ``slots`` (optional,
    one per drawn row) extend the keys of releases with several rows per agent (per-edge messages,
    joint releases).  Drawing twice for the same (row, slot) raises :class:`NoiseReuseError`.
    """

    def __init__(self, rng: AgentRandom, agent_ids: torch.Tensor | Sequence[int], round_index: int,
                 release: int) -> None:
        self.rng = rng
        # Keys are host integers (a device tensor is read back once here; the oracle passes host ids).
        self.agent_ids = agent_ids.tolist() if isinstance(agent_ids, torch.Tensor) else list(agent_ids)
        self.round_index = round_index
        self.release = release
        self._used: set[tuple[int, int | None]] = set()
        self._used_edges: set[tuple[int, int]] = set()

    @property
    def dtype(self) -> torch.dtype:
        """Precision the noise is drawn in: float32 in simulation, float64 in secure mode (see :func:`add_noise`)."""
        return self.rng.noise_dtype

    def _claim(self, rows: Sequence[int], slots: Sequence[int] | None) -> list[int]:
        keys = list(zip(rows, slots if slots is not None else [None] * len(rows), strict=True))
        if len(set(keys)) != len(keys) or not self._used.isdisjoint(keys):
            raise NoiseReuseError(f"noise key (round {self.round_index}, release {self.release}) drawn twice for "
                                  "one row: every release needs fresh noise")
        self._used.update(keys)
        return [self.agent_ids[row] for row in rows]

    def normal(self, rows: Sequence[int], out: torch.Tensor, slots: Sequence[int] | None = None,
               workers: int = 1) -> torch.Tensor:
        """Standard normal draws into ``out`` (``(len(rows), d)``), row by row from each agent's stream."""
        agents = self._claim(rows, slots)
        return self.rng.normal(agents, out.shape[1], self.round_index, Stream.NOISE, self.release, out=out,
                               workers=workers, slots=slots)

    def edge_normal(self, edges: Sequence[tuple[int, int]], dim: int) -> torch.Tensor:
        """Standard normal draws ``(len(edges), dim)``, row ``r`` from the secret the two ends of ``edges[r]``
        (global ids) share, under this release's key (:meth:`~decentdp.rng.AgentRandom.edge_normal`): each
        edge once per release, so that the two ends add the same draw with opposite signs."""
        pairs = [(min(i, j), max(i, j)) for i, j in edges]
        if len(set(pairs)) != len(pairs) or not self._used_edges.isdisjoint(pairs):
            raise NoiseReuseError(f"edge noise key (round {self.round_index}, release {self.release}) drawn twice: "
                                  "every release needs fresh noise")
        self._used_edges.update(pairs)
        return self.rng.edge_normal(pairs, dim, self.round_index, self.release, dtype=self.dtype)

    @property
    def exact(self) -> bool:
        """Whether this draw releases on a grid with exact samplers (secure mode, :mod:`decentdp.privacy.discrete`)."""
        return bool(getattr(self.rng, "secure", False))

    def on_grid(self, release: GridRelease, rows: Sequence[int], values: np.ndarray, sensitivity: float,
                multipliers: np.ndarray, slots: Sequence[int] | None = None) -> np.ndarray:
        """``values`` (float64, one row per entry of ``rows``) released on the grid by an exact sampler of
        :mod:`decentdp.privacy.discrete` (``release``: ``grid_release`` for Laplace, ``grid_gaussian_release``
        for Gaussian noise) with multiplier ``multipliers[r]``, each row's words from its agent's key under
        this draw's key (secure mode only)."""
        agents = self._claim(rows, slots)
        keys = [None] * len(agents) if slots is None else list(slots)
        streams = [self.rng.words(agent, self.round_index, Stream.NOISE, self.release, slot)
                   for agent, slot in zip(agents, keys, strict=True)]
        return release(values, sensitivity, multipliers, lambda row: streams[row])

    def laplace(self, rows: Sequence[int], out: torch.Tensor, slots: Sequence[int] | None = None) -> torch.Tensor:
        """Standard Laplace draws (scale 1) into ``out``, by inverting the CDF of float64 uniforms."""
        agents = self._claim(rows, slots)
        uniform = torch.empty(out.shape, dtype=torch.float64, device=out.device)  # (from the agents' streams)
        self.rng.normal(agents, out.shape[1], self.round_index, Stream.NOISE, self.release, out=uniform,
                        slots=slots, uniform=True)
        centred = uniform - 0.5  # in [-1/2, 1/2): |centred| = 1/2 only for a draw of exactly 0
        magnitude = -torch.log1p(-2 * centred.abs().clamp(max=0.5 - 2**-54))
        return out.copy_(torch.sign(centred) * magnitude)


class Mechanism(Protocol):
    """A noise distribution together with the privacy event of each release it makes."""

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        """Add noise in place to ``values`` (``(R, d)``), row ``r`` released by local agent ``owners[r]``
        (``owners`` on the host, as the oracle gives them: noise keys and scales are host bookkeeping)."""
        ...

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        """What all observers together learn from the ``rows`` sums agent ``owner`` released on one batch."""
        ...

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        """What a receiver of one of the agent's rows (a per-edge message) learns from it alone."""
        ...


def add_noise(values: torch.Tensor, draws: torch.Tensor, scale: torch.Tensor) -> None:
    """``values += draws * scale`` in place (``scale`` per row).  Secure-mode draws are float64: the sum is
    formed in float64 and the released value rounded once, so that its low-order bits depend on the
    noise as a whole rather than on the raw sample (the floating-point attacks of Mironov 2012)."""
    if draws.dtype == values.dtype:
        values.add_(draws.mul_(scale[:, None].to(draws.dtype)))
    else:
        values.copy_(values.to(draws.dtype).add_(draws.mul_(scale[:, None].to(draws.dtype))))


def round_up_to_float32(values: torch.Tensor) -> torch.Tensor:
    """The smallest float32 values >= ``values`` (float64): the noise is drawn in float32, and neither
    sigma nor the standard deviation ``sigma * C`` may fall below the calibrated value by rounding."""
    single = values.float()
    below = single.double() < values
    return torch.where(below, torch.nextafter(single, torch.tensor(float("inf"), device=single.device)), single)


def per_agent_multipliers(requests: Sequence[tuple[float, ...]], sigma_of: Callable[..., float]) -> list[float]:
    """``sigma_of(*request)`` for each agent's request (e.g. its budget and sample rate), computed once per
    distinct request (agents often share one), rounded up to the float32 the noise is drawn in."""
    cache: dict[tuple[float, ...], float] = {}
    sigmas = []
    for request in requests:
        if request not in cache:
            cache[request] = sigma_of(*request)
        sigmas.append(float(round_up_to_float32(torch.tensor(cache[request], dtype=torch.float64))))
    return sigmas


def calibrate_agents(budgets: Sequence[float], rates: Sequence[float], releases: int, delta: float, accountant: str,
                     relation: str, sums: Sequence[int] | None = None, joint: bool = True) -> list[float]:
    """Each agent's Gaussian noise multiplier for ``releases`` planned releases at its rate ``q_i`` within its
    budget ``epsilon_i`` (:func:`per_agent_multipliers`).

    An agent releasing ``k_i = sums[i]`` sums per batch makes one Gaussian release of multiplier
    ``sigma_i / sqrt(k_i)`` (specs A.4): the calibrated multiplier is scaled by ``sqrt(k_i)``.  With
    ``joint = False`` (an algorithm's labelled loose option) they are priced as ``k_i`` releases."""
    def sigma(epsilon: float, rate: float, k: int) -> float:
        count = releases if joint else releases * k
        return calibrate_noise_multiplier(epsilon, delta, rate, count, 1, accountant, relation=relation) * \
            (math.sqrt(k) if joint else 1.0)

    counts = [1] * len(budgets) if sums is None else [int(k) for k in sums]
    return per_agent_multipliers(list(zip(budgets, rates, counts, strict=True)), sigma)


class _ScaledNoise:
    """Shared by the Gaussian and Laplace mechanisms: per-agent noise multipliers times a sensitivity."""

    def __init__(self, noise_multipliers: torch.Tensor, sensitivity: float) -> None:
        self.noise_multipliers = noise_multipliers
        self.sensitivity = float(sensitivity)
        self.scales = round_up_to_float32(torch.tensor(
            [product_up(value, self.sensitivity) for value in noise_multipliers.double().tolist()],
            dtype=torch.float64, device=noise_multipliers.device))

    def multiplier(self, owner: int) -> float:
        return float(self.noise_multipliers[owner])

    def _on_grid(self, release: GridRelease, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                 slots: Sequence[int] | None) -> None:
        """Secure mode: ``values`` replaced by their exact grid release (:meth:`NoiseDraw.on_grid`)."""
        multipliers = self.noise_multipliers.double().numpy()[owners.numpy()]
        released = noise.on_grid(release, owners.tolist(), values.double().cpu().numpy(), self.sensitivity,
                                 multipliers, slots)
        values.copy_(torch.from_numpy(released))

    def _row_scales(self, owners: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Each row's noise scale on ``device``, picked on the host (the scales live there)."""
        return self.scales[owners.cpu()].to(device, non_blocking=True)


class GaussianMechanism(_ScaledNoise):
    """``N(0, (sigma_i C)^2)`` per coordinate, for sums with l2 sensitivity ``C`` (DP-SGD; Alg. 1 line 9).

    Released on a Poisson batch of rate ``q``, one sum is ``PoissonSampled(q, Gaussian(sigma))``;
    ``k`` sums of one agent on one batch are one Gaussian of sensitivity ``sqrt(k) C``
    (:func:`~decentdp.privacy.events.joint_gaussian_event`).  The noise is drawn block by block into
    one buffer and added in place, so that it never occupies a second ``(N, d)`` matrix.
    """

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        if noise.exact:  # secure mode: the rounded Gaussian release, sampled exactly on a grid
            self._on_grid(grid_gaussian_release, values, owners, noise, slots)
            return
        count, dim = values.shape
        scale = self._row_scales(owners, values.device)
        owner_rows = owners.tolist()
        # At most an eighth of the rows per block, so that small runs do not hold a full second copy either.
        rows = max(1, min(-(-count // 8), NOISE_BLOCK_BYTES // (4 * dim)))
        buffer = torch.empty(rows, dim, dtype=noise.dtype, device=values.device)
        # Threads pay off only on large blocks (starting them costs about a millisecond).
        workers = torch.get_num_threads() if rows * dim >= PARALLEL_NOISE_ELEMENTS else 1
        for start in range(0, count, rows):
            stop = min(count, start + rows)
            draws = noise.normal(owner_rows[start:stop], buffer[: stop - start],
                                 None if slots is None else slots[start:stop], workers=workers)
            add_noise(values[start:stop], draws, scale[start:stop])

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        return joint_gaussian_event(self.multiplier(owner), sample_rate, rows)

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        return gaussian_event(self.multiplier(owner), sample_rate)


class LaplaceMechanism(_ScaledNoise):
    """``Laplace(b_i)`` per coordinate with ``b_i = m_i * Delta_1``, for values of l1 sensitivity
    ``Delta_1``: pure ``1 / m_i``-DP per release (Li et al. 2018; Bellet et al. 2018, Theorem 1).

    ``k`` values of one agent computed on one batch: the l1 sensitivity of the whole is ``k Delta_1``,
    so together they are ``Laplace(m_i / k)``."""

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        if noise.exact:  # secure mode: on a grid, exact discrete Laplace (no floating-point support gaps)
            self._on_grid(grid_release, values, owners, noise, slots)
            return
        draws = noise.laplace(owners.tolist(), torch.empty_like(values, dtype=noise.dtype), slots)
        add_noise(values, draws, self._row_scales(owners, values.device))

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        return laplace_event(self.multiplier(owner) / rows, sample_rate)

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        return laplace_event(self.multiplier(owner), sample_rate)


class NoNoise:
    """No mechanism: the values are released as they are, and every release is non-private (epsilon = inf)."""

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        return None

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        return dp_accounting.NonPrivateDpEvent()

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        return dp_accounting.NonPrivateDpEvent()
