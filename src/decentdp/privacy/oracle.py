"""The privacy boundary: the only way an algorithm touches private data, and the only way data leaves.

Three steps, each impossible to misuse by construction:

1. :meth:`DataOracle.batch` draws the round's next Poisson batch and returns a :class:`BatchKey`.
   Keys are issued by the round (an algorithm cannot name one), each batch is drawn once, and a
   batch may be *released* once.
2. :meth:`DataOracle.clip` computes clipped per-sample gradient sums of some models on a batch
   (each agent's own model on its own batch by default; any ``(model row, data owner)`` pairs for
   cross-gradients).  The result is :class:`Clipped`: a sealed value, not a tensor, so it cannot be
   sent, mixed or stored in a state by mistake.
3. :meth:`DataOracle.release` adds a mechanism's noise to sealed sums and charges the owners'
   ledgers with the event the mechanism names, then unseals them.  Every sum computed on one batch
   must be released together, in one call, as one *joint* event (``k`` Gaussian sums on one batch:
   sensitivity ``sqrt(k) C``); releasing a batch a second time raises.  Each release draws fresh
   noise under its own single-use key (:class:`~decentdp.privacy.mechanisms.NoiseDraw`).

Only agents active in the round's plan are sampled, computed and charged; an agent whose budget
cannot cover a release is refused and releases zeros.  :meth:`DataOracle.gradient` is the DP-SGD
gradient of Bayrooti et al., Alg. 1 line 9, all three steps in one call::

    G_i = (1 / L_i) * ( sum_{d in batch_i} clip_C(grad l(theta_i; d)) + sigma_i * C * xi ),   xi ~ N(0, I_d)

with ``L_i = q_i |D_i|`` the expected batch.  In a non-private run (no mechanism) it is the mean
gradient of the same Poisson batch, and releases are recorded as non-private (epsilon = inf).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decentdp.data.augment import Augmentation
from decentdp.gradients.flat_model import FlatModel
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import Mechanism, NoiseDraw, NoiseReuseError, NoNoise
from decentdp.privacy.sampling import Batch, PoissonSampler
from decentdp.rng import AgentRandom
from decentdp.util.profiling import NO_TIMER, PhaseTimer
from decentdp.util.rows import repeated_rows

SETUP_ROUND = -1
"""The round index of a run's setup phase (e.g. a private warm start), before round 0."""

MESSAGE_NOISE = 1 << 20
"""First key index of :meth:`DataOracle.message_noise` draws, beyond any round's count of releases."""


def _unshared(tensor: torch.Tensor) -> bool:
    """Whether nothing but the caller's one name holds ``tensor`` or its memory: no other reference to the
    object (compared with a fresh tensor's count taken the same way, so that the interpreter's counting
    conventions cancel) and no other tensor on its storage (views, ``detach``)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it, nothing is reused
    if use_count is None:
        return False
    fresh = torch.empty(0)
    return (sys.getrefcount(tensor) == sys.getrefcount(fresh) + 1  # + 1: the caller's name for it
            and use_count(tensor.untyped_storage()._cdata) == use_count(fresh.untyped_storage()._cdata))


@dataclass(frozen=True)
class BatchKey:
    """The ``index``-th Poisson batch drawn in round ``round_index``; issued by :meth:`DataOracle.batch` only."""

    round_index: int
    index: int


class Clipped:
    """Clipped per-sample gradient sums on one batch, sealed until :meth:`DataOracle.release` adds noise.

    Row ``r`` is a sum over the batch of local agent ``owners[r]``; ``slots[r]`` (optional) names the
    model it was computed for (a receiver's id for cross-gradients) and keys its noise stream.
    ``owners`` is a host (CPU) tensor: it is bookkeeping (ledger rows, noise keys), which never reads
    the device, while the sums stay on it.
    """

    __slots__ = ("key", "owners", "slots", "_sums", "_open")

    def __init__(self, key: BatchKey, sums: torch.Tensor, owners: torch.Tensor, slots: Sequence[int] | None) -> None:
        self.key = key
        self.owners = owners
        self.slots = slots
        self._sums = sums
        self._open = True

    def __repr__(self) -> str:
        return f"Clipped(round {self.key.round_index}, batch {self.key.index}, {len(self.owners)} rows, sealed)"


class DataOracle:
    """Private data access for the agents an engine holds: Poisson batches, clipping, noisy releases.

    ``agent_ids`` are the global ids of the local rows (noise keys and ledger rows use them).
    ``mechanism`` is the run's calibrated gradient mechanism (``None``: a non-private run).
    ``augmentation`` (optional) replaces each sampled record by the mean gradient of its augmented
    copies before clipping (:mod:`decentdp.data.augment`): the same sensitivity, so the same events.
    """

    def __init__(self, model: FlatModel, sampler: PoissonSampler, ledger: PrivacyLedger, rng: AgentRandom,
                 mechanism: Mechanism | None, clip: float, agents_per_pass: int | None = None,
                 agent_ids: torch.Tensor | None = None, augmentation: Augmentation | None = None) -> None:
        self.model = model
        self.sampler = sampler
        self.ledger = ledger
        self.rng = rng
        self.mechanism = mechanism
        self.clip_norm = float(clip)
        self.agents_per_pass = agents_per_pass
        self.augmentation = augmentation
        self.timer: PhaseTimer = NO_TIMER
        self.sample_rates = sampler.sample_rates
        self.expected_batch = sampler.expected_batches
        self.device = rng.device
        self.agent_ids = agent_ids if agent_ids is not None else torch.arange(len(self.sample_rates))
        # Host copies, read once: a round's bookkeeping (who is active, who owns a row, noise keys, the
        # ledger) runs on the host from values known before the round, never from a device read-back.
        self._host_ids = self.agent_ids.cpu()
        self._every_row = torch.arange(self.n_agents)
        self._expected_batch_here = self.expected_batch.to(self.device)
        self._rates = self.sample_rates.numpy()
        self._event_cache: dict[tuple[int, bytes], tuple[Mechanism, np.ndarray]] = {}
        self._prepaid: np.ndarray | None = None  # agents whose whole-run event is charged (prepaid mechanisms)
        self._spare: torch.Tensor | None = None  # the last gradient() call's params, reused once nobody holds them
        self._opened: int | None = None  # the last round opened: rounds open once, in increasing order
        self._reset(SETUP_ROUND, None)

    @property
    def n_agents(self) -> int:
        return len(self.sample_rates)

    # -- the round ---------------------------------------------------------------------------------------
    def begin(self, round_index: int, active: np.ndarray | torch.Tensor | None = None) -> None:
        """Start a round: only ``active`` agents (a boolean mask; default all) sample, compute and are charged.

        Give the mask on the host (the scheduler's own array, :attr:`RoundPlan.active_on_host`): a mask
        on an accelerator is read back once here, which waits for the device's queue.

        Keys of earlier rounds become invalid.  Each oracle opens a round once, and rounds in increasing
        order: reopening one would draw its batches and noise keys again (a resumed run opens its next
        round in a new oracle, so that it continues exactly where the interrupted run stopped)."""
        if self._opened is not None and round_index <= self._opened:
            raise NoiseReuseError(f"round {round_index} cannot be opened after round {self._opened}: its batches "
                                  "and noise keys would be drawn again")
        self._opened = round_index
        self._reset(round_index, active)

    def _reset(self, round_index: int, active: np.ndarray | torch.Tensor | None) -> None:
        self.round_index = round_index
        mask = None if active is None else np.asarray(
            active.cpu() if isinstance(active, torch.Tensor) else active, dtype=bool)
        everyone = mask is None or bool(mask.all())
        self._active_on_host = None if everyone else mask
        #: Active local rows on the host and on the device (``None``: every agent is active).
        self._active_rows_host = None if everyone else torch.from_numpy(np.flatnonzero(mask))
        self._active_rows = None if everyone else self._active_rows_host.to(self.device, non_blocking=True)
        self._batches: dict[int, Batch] = {}
        self._pending: dict[int, int] = {}  # batch index -> sealed sums computed on it, not yet released
        self._released: set[int] = set()
        self._releases = 0
        self._norms: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.last_authorized: torch.Tensor | None = None  # diagnostics of the last release, for operators:
        self.last_batch_sizes: torch.Tensor | None = None  # never read by algorithms
        self._clipping: torch.Tensor | float | None = None  # (clipped, total) of the last release

    def batch(self) -> BatchKey:
        """Draw the round's next Poisson batch (for the active agents) and return its single-use key."""
        key = BatchKey(self.round_index, len(self._batches))
        with self.timer.phase("sampling"):
            self._batches[key.index] = self.sampler.sample(self.round_index, key.index)
        self._pending[key.index] = 0
        return key

    def _check_open(self, key: BatchKey) -> Batch:
        if key.round_index != self.round_index or key.index not in self._batches:
            raise NoiseReuseError(f"batch {key} was not issued in this round (round {self.round_index})")
        if key.index in self._released:
            raise NoiseReuseError(f"batch {key} was already released; a batch is released once, jointly")
        return self._batches[key.index]

    def clip(self, key: BatchKey, params: torch.Tensor, owners: torch.Tensor | None = None,
             slots: Sequence[int] | None = None, out: torch.Tensor | None = None) -> Clipped:
        """Clipped per-sample gradient sums (the batch mean gradient in a non-private run) of ``params``.

        Without ``owners``, ``params`` is ``(N, d)`` and each active agent's row is evaluated on its own
        batch (the result has one row per active agent).  With ``owners`` (local rows of active agents),
        row ``r`` of ``params`` is a model evaluated on ``owners[r]``'s batch: cross-gradients.
        ``out`` may receive the sums when every agent is active and ``owners`` is not given.
        """
        batch = self._check_open(key)
        if owners is None:
            host, rows = (self._every_row, None) if self._active_rows is None else \
                (self._active_rows_host, self._active_rows)
            models = params if rows is None else params.index_select(0, rows)
        else:
            if len(owners) != params.shape[0]:
                raise ValueError(f"{params.shape[0]} model rows for {len(owners)} data owners")
            host = owners.cpu()  # (given on the host, as algorithms do, this reads nothing back)
            if self._active_on_host is not None and not self._active_on_host[host.numpy()].all():
                raise ValueError("an inactive agent's data cannot be used in this round")
            rows, models = owners.to(self.device, non_blocking=True), params
        result = out if out is not None and models is params else torch.empty_like(models)
        self._compute(models, batch, rows, host, result, key.index)
        self._pending[key.index] += 1
        return Clipped(key, result, host, slots)

    def _compute(self, models: torch.Tensor, batch: Batch, owners: torch.Tensor | None, host: torch.Tensor,
                 out: torch.Tensor, index: int) -> None:
        """Per-sample gradients of ``models[r]`` on ``owners[r]``'s batch (device rows; ``None``: every
        agent on its own, in order; ``host``: the same local rows on the host), ``agents_per_pass`` rows
        at a time.  Rows that repeat another row of their owner (the same model on the same batch) are
        computed once (:func:`repeated_rows`)."""
        repeated = repeated_rows(models, host) if owners is not None else None
        if repeated is None:
            self._compute_rows(models, batch, owners, host, out, index)
            return
        distinct, inverse = repeated
        sums = torch.empty((len(distinct), models.shape[1]), dtype=out.dtype, device=out.device)
        self._compute_rows(models[distinct], batch, owners[distinct], host[distinct], sums, index)
        torch.index_select(sums, 0, inverse, out=out)
        if self.mechanism is not None:  # the clipping diagnostic counts every row, as if computed again
            _, norms, mask = self._norms[index].pop()
            self._norms[index].append((owners, norms[inverse], mask[inverse]))

    def _compute_rows(self, models: torch.Tensor, batch: Batch, owners: torch.Tensor | None, host: torch.Tensor,
                      out: torch.Tensor, index: int) -> None:
        """:meth:`_compute` for every row, ``agents_per_pass`` rows at a time."""
        x, y, mask = (batch.x, batch.y, batch.mask) if owners is None else \
            (batch.x[owners], batch.y[owners], batch.mask[owners])
        copies = 1
        if self.augmentation is not None:
            with self.timer.phase("augmentation"):
                x, y = self.augmentation.expand(x, y, self.rng, self._host_ids[host].tolist(), self.round_index,
                                                index)
            copies = self.augmentation.copies
        norms = torch.empty(mask.shape, dtype=models.dtype, device=models.device)
        count = len(models)
        step = max(1, self.agents_per_pass or count)
        start = 0
        with self.timer.phase("gradients"):
            while start < count:
                rows = slice(start, min(count, start + step))
                try:
                    if self.mechanism is None:
                        weights = mask[rows] / mask[rows].sum(dim=1).clamp(min=1.0)[:, None]
                        if copies > 1:  # each copy weighs 1/K of its record
                            weights = weights.repeat_interleave(copies, dim=1) / copies
                        out[rows] = self.model.batch_gradients(models[rows], x[rows], y[rows], weights)
                    else:
                        _, norms[rows] = self.model.clipped_gradient_sums(models[rows], x[rows], y[rows], mask[rows],
                                                                          self.clip_norm, out=out[rows],
                                                                          copies=copies)
                except torch.OutOfMemoryError:
                    if rows.stop - rows.start == 1:
                        raise  # not even one agent's batch fits: a real shortage
                    step = self._smaller_passes(rows.stop - rows.start)
                    # the same rows again, fewer at a time: each row's sum is its own, equal up to rounding
                    # (the convolution kernels chosen depend on how many agents share a pass)
                    continue
                start = rows.stop
        if self.mechanism is not None:
            self._norms.setdefault(index, []).append((owners, norms, mask))

    def _smaller_passes(self, failed: int) -> int:
        """Halve the agents per gradient pass after a pass of ``failed`` agents ran out of accelerator memory.

        The memory plan sizes passes from the memory free when the run starts; on a GPU shared with other
        processes that started at the same time (a grid run side by side), the free memory it saw is
        counted twice.  The new size is kept for the rest of the run (and its checkpoints).
        """
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.agents_per_pass = failed // 2
        print(f"out of {self.device.type} memory in a gradient pass of {failed} agents: {self.agents_per_pass} "
              "agents per pass from now on (engine.agents_per_pass sets it)", file=sys.stderr)
        return self.agents_per_pass

    def repeat(self, clipped: Clipped, index: torch.Tensor) -> Clipped:
        """Row ``r`` of the result is row ``index[r]`` of ``clipped``, which it replaces (the same batch,
        computed once): several messages that carry one sum, each to get its own noise in the release."""
        self._check_open(clipped.key)
        if not clipped._open:
            raise NoiseReuseError("a Clipped value is released once: it was already released")
        rows = index.to(clipped._sums.device, non_blocking=True)
        result = Clipped(clipped.key, clipped._sums.index_select(0, rows), clipped.owners[index.cpu()], None)
        clipped._sums, clipped._open = None, False
        return result

    def release(self, *sums: Clipped, mechanism: Mechanism | None = None,
                receivers: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Add noise to every sum computed on one batch and charge their owners: one joint event per owner.

        ``mechanism`` defaults to the run's.  ``receivers`` (global ids, one per row of a single
        ``Clipped``) makes each row a message to one receiver, recorded in the ledger's pairwise view,
        with noise keyed per receiver.  Rows of refused (out of budget) agents are zero.  Returns the
        released tensors, one per ``Clipped``, row for row.
        """
        if not sums:
            raise ValueError("release needs at least one Clipped")
        key = sums[0].key
        if any(item.key != key for item in sums):
            raise NoiseReuseError("sums computed on different batches cannot be released as one event")
        self._check_open(key)
        if any(not item._open for item in sums) or len({id(item) for item in sums}) != len(sums):
            raise NoiseReuseError("a Clipped value is released once: it was already released, or given twice")
        if self._pending[key.index] != len(sums):
            raise NoiseReuseError(f"{self._pending[key.index]} sums were computed on batch {key}, {len(sums)} "
                                  "given: every sum on one batch must be released together, as one joint event")
        if receivers is not None and (len(sums) != 1 or len(receivers) != len(sums[0].owners)):
            raise ValueError("per-receiver releases take one Clipped and one receiver per row")
        if self.mechanism is None and mechanism is not None and not isinstance(mechanism, NoNoise):
            raise ValueError("this run is non-private: its sums are unclipped batch means, whose sensitivity no "
                             "mechanism's event describes")
        mechanism = mechanism if mechanism is not None else (self.mechanism or NoNoise())
        owners = torch.cat([item.owners for item in sums])  # on the host
        rows = np.bincount(owners.numpy(), minlength=self.n_agents)
        with self.timer.phase("ledger"):
            if getattr(mechanism, "prepaid", False):  # charged once for the whole run (prepay)
                if receivers is not None:
                    raise ValueError("a prepaid mechanism's releases go to every neighbour, not to single receivers")
                authorized = self._paid_up(rows > 0)
            else:
                authorized = self._charge(mechanism, rows, owners, receivers)
        noise = NoiseDraw(self.rng, self._host_ids, self.round_index, self._releases)
        self._releases += 1
        self._released.add(key.index)
        released = []
        refused_rows = ~authorized[owners.numpy()]  # on the host: the ledger decided there
        offsets = np.cumsum([0, *[len(item.owners) for item in sums]])
        with self.timer.phase("noise"):
            for position, item in enumerate(sums):
                values, item._sums, item._open = item._sums, None, False
                slots = item.slots
                if receivers is not None and slots is None:
                    slots = receivers.tolist()
                elif len(sums) > 1 and slots is None:
                    slots = [position] * len(item.owners)
                mechanism.perturb(values, item.owners, noise, slots)
                refused = refused_rows[offsets[position]:offsets[position + 1]]
                if refused.any():  # refused agents release nothing (rows found on the host: no mask on the device)
                    values.index_fill_(0, torch.from_numpy(np.flatnonzero(refused)).to(values.device), 0.0)
                released.append(values)
        self.last_authorized = torch.from_numpy(authorized)
        self.last_batch_sizes = self._batches[key.index].sizes
        self._record_clipping(key.index, authorized)
        return tuple(released)

    def _charge(self, mechanism: Mechanism, rows: np.ndarray, owners: torch.Tensor,
                receivers: torch.Tensor | None) -> np.ndarray:
        """Charge each owner of ``rows[o] > 0`` sums its joint event (and each receiver's event of a per-receiver
        release); the authorised mask.  Under cyclic sampling an agent is charged once per pass over its ``b``
        batches (its first release of the pass): a record is in one batch, so the releases of the pass's other
        rounds are on other records, and what one record's owner pays is the ``ceil(T / b)`` releases of its
        batch at most (``CyclicSampler``)."""
        events = self._event_ids(mechanism, rows)
        asking = rows > 0
        covered = self._covered(asking)
        if receivers is None:
            return self.ledger.charge(self.round_index, events, agents=asking & ~covered) | covered
        senders, observers = owners.numpy(), receivers.cpu().numpy()  # (receivers: pass them on the host)
        observed_by = getattr(mechanism, "observed_by", None)
        if observed_by is not None:  # the mechanism says who observes what (not one receiver per row)
            senders, observers, observed = observed_by(senders, observers, self._rates)
        else:
            observed = [mechanism.receiver_event(o, float(self._rates[o])) for o in owners.tolist()]
        receiver_events = np.array([self.ledger.intern(event) for event in observed], dtype=np.int64)
        return self.ledger.charge(self.round_index, events, agents=asking & ~covered, senders=senders,
                                  receivers=observers, receiver_events=receiver_events) | covered

    def _covered(self, asking: np.ndarray) -> np.ndarray:
        """Under cyclic sampling, the asking agents already charged in this pass over their batches (read from
        the ledger, so a resumed run knows it too); no one under Poisson sampling."""
        period = getattr(self.sampler, "period", None)
        if period is None or self.round_index < 0:
            return np.zeros(self.n_agents, dtype=bool)
        last = self.ledger.last_rounds()
        return asking & (last >= 0) & (last // period == self.round_index // period)

    def prepay(self) -> np.ndarray:
        """Charge every agent, once and before its first release, the whole-run event of the run's mechanism when
        that mechanism prices its releases together (``prepaid``: a matrix-factorization mechanism, whose rounds
        share noise); the authorised mask.  Its releases are then charged nothing more, and those of an agent
        whose whole-run event did not fit its budget are refused."""
        mechanism = self.mechanism
        if mechanism is None or not getattr(mechanism, "prepaid", False):
            return np.ones(self.n_agents, dtype=bool)
        paid = self._paid_up(None)
        events = np.array([self.ledger.intern(mechanism.run_event(int(agent))) for agent in self._host_ids.tolist()],
                          dtype=np.int64)
        authorized = self.ledger.charge(self.round_index, events, agents=~paid)
        self._prepaid = None
        return authorized | paid

    def _paid_up(self, asking: np.ndarray | None) -> np.ndarray:
        """The agents (of ``asking``; all when ``None``) whose ledger holds the run mechanism's whole-run event; the
        other asking agents are refused (counted in the ledger's ``refused``)."""
        if self._prepaid is None:
            mechanism = self.mechanism
            self._prepaid = np.array([mechanism is not None and any(
                event == mechanism.run_event(int(agent)) for event, _ in self.ledger.history(row))
                for row, agent in enumerate(self._host_ids.tolist())], dtype=bool)
        if asking is None:
            return self._prepaid.copy()
        self.ledger.refused[asking & ~self._prepaid] += 1
        return asking & self._prepaid

    def _record_clipping(self, index: int, authorized: np.ndarray) -> None:
        """Count the released per-sample gradients that were clipped (an operator's diagnostic), on the device:
        nothing is read back until :attr:`last_clipped_fraction` is (only by ``--diagnostics``)."""
        counts = []
        for owners, norms, mask in self._norms.pop(index, []):
            allowed = torch.from_numpy(authorized).to(mask.device, non_blocking=True)
            real = mask.bool() & (allowed if owners is None else allowed[owners])[:, None]
            counts.append(torch.stack([((norms > self.clip_norm) & real).sum(), real.sum()]))
        self._clipping = torch.stack(counts).sum(dim=0) if counts else None

    @property
    def last_clipped_fraction(self) -> float:
        """The fraction of the last release's per-sample gradients that were clipped (read back here, once)."""
        if self._clipping is None:
            return 0.0
        if not isinstance(self._clipping, float):
            clipped, total = self._clipping.tolist()
            self._clipping = clipped / total if total else 0.0
        return self._clipping

    @last_clipped_fraction.setter
    def last_clipped_fraction(self, value: float) -> None:
        self._clipping = float(value)

    def _event_ids(self, mechanism: Mechanism, rows: np.ndarray) -> np.ndarray:
        """Each owner's joint event id for ``rows[o]`` sums (cached: steady rounds ask for the same)."""
        key = (id(mechanism), rows.tobytes())
        cached = self._event_cache.get(key)
        # The entry holds the mechanism itself, so that its id cannot be reused by another one while cached.
        if cached is None or cached[0] is not mechanism:
            ids = np.full(self.n_agents, -1, dtype=np.int64)
            for owner in np.flatnonzero(rows):
                ids[owner] = self.ledger.intern(
                    mechanism.agent_event(int(owner), float(self._rates[owner]), int(rows[owner])))
            if len(self._event_cache) > 64:
                self._event_cache.clear()
            cached = self._event_cache[key] = (mechanism, ids)
        return cached[1]

    def message_noise(self, index: int = 0) -> NoiseDraw:
        """Single-use keys for noise an algorithm adds to its messages that no agent's data term carries (e.g.
        Zip-DL's zero-sum noise): drawn from each agent's own stream under keys no release uses
        (``MESSAGE_NOISE + index``), priced by the algorithm's own observer view, never by the ledger (it
        protects nobody from every neighbour together, whose pooled messages cancel it)."""
        return NoiseDraw(self.rng, self._host_ids, self.round_index, MESSAGE_NOISE + index)

    def drop_spare(self) -> None:
        """Forget the block kept for the next round's sums (a caller measuring memory from a clean state)."""
        self._spare = None

    def _take_spare(self, params: torch.Tensor) -> torch.Tensor:
        """An ``(N, d)`` block for this round's sums: the previous call's ``params`` when nothing else holds
        them any more (the usual step ``theta <- f(theta, g)`` drops them), else a fresh one.

        Reusing that block keeps a round to the two ``(N, d)`` blocks the memory plan counts.  A fresh
        ``empty_like`` cannot be relied on to land in the hole they left: torch asks glibc for 64-byte
        aligned memory, and ``memalign`` requests the size plus the alignment plus a minimum chunk, more
        than the exactly-sized hole, so the block lands on fresh pages whenever a small allocation took
        the few bytes beside the hole (measured: up to one more ``(N, d)`` block at the peak, BENCHMARKS.md)."""
        spare, self._spare = self._spare, None
        if (spare is not None and spare.shape == params.shape and spare.dtype == params.dtype
                and spare.device == params.device and spare.is_contiguous() and not spare.requires_grad
                and spare.data_ptr() != params.data_ptr() and _unshared(spare)):
            return spare
        del spare
        return torch.empty_like(params)

    # -- the common case -----------------------------------------------------------------------------------
    def gradient(self, params: torch.Tensor, mechanism: Mechanism | None = None) -> torch.Tensor:
        """Every active agent's private stochastic gradient at its own ``params`` row (one fresh batch,
        one release, by ``mechanism`` or the run's); the plain mean gradient of the batch in a non-private run."""
        out = self._take_spare(params)  # the round's largest block first, before the batch takes the memory
        self._spare = params
        key = self.batch()
        (released,) = self.release(self.clip(key, params, out=out), mechanism=mechanism)
        if self._active_rows is not None:  # inactive agents release nothing
            released = out.zero_().index_copy_(0, self._active_rows, released)
        if self.mechanism is not None:
            released.div_(self._expected_batch_here[:, None])
        return released
