"""Many independent trainings in one simulation: M copies of a small graph as one block-diagonal network.

An audit needs thousands of trainings of the same small problem (Bayrooti et al., App. D: 5,000
models on each of two datasets).  Instead of one process per model, :func:`block_simulation`
stacks M blocks of the config's n agents into one run of M * n agents: the mixing matrix is
``I_M (x) W`` (:class:`BlockNetwork` applies ``W`` to each block in one batched product, never
forming the Mn x Mn matrix), every agent's batches and noise come from its own keyed streams, so
blocks are independent trainings, and the stacked gradient engine computes all of them per round
in a few kernels.  Each block is a world: its target agent owns the audited record or not.

The run is the library's: the algorithm from the registry, the run's Poisson sampler,
:class:`~decentdp.privacy.oracle.DataOracle`, a Gaussian mechanism calibrated for the planned
releases (or the algorithm's own calibration, :meth:`Algorithm.calibrate`), the scheduler and the
simulator.  Two things differ from ``decentdp run``, both public
and the same in both worlds: sampling rates and noise are those of the larger world (the record
present), as add/remove DP requires; and the ledger records every event without enforcing
budgets (the calibration already fits exactly the planned releases; checking 10^5 identical
budgets would cost more than the training).  The target agent's epsilon is recomputed from its
ledger history and reported beside the nominal one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from decentdp.algorithms.base import Network, NoisePlan, PublicGraph, PublicRun, State
from decentdp.algorithms.components.schedules import Schedule
from decentdp.audit.bounds import audit_bound, split_sizes
from decentdp.config import ExperimentConfig
from decentdp.errors import ConfigError
from decentdp.experiment.build import Experiment, agent_budgets, build_experiment, calibrate, planned_releases
from decentdp.gradients.flat_model import FlatModel
from decentdp.models import validate_for_dp
from decentdp.privacy.accounting import epsilon_of_history
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import GaussianMechanism, Mechanism
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.sampling import AgentData, CyclicSampler, PoissonSampler
from decentdp.results.files import write_atomic
from decentdp.rng import AgentRandom, Stream, round_stream_seed
from decentdp.runtime.network import GraphSequence, SimulatedNetwork, topology_graph
from decentdp.runtime.scheduler import Scheduler
from decentdp.runtime.simulator import Simulator
from decentdp.topology import Topology

if TYPE_CHECKING:
    from decentdp.audit.settings import AuditSection


class BlockNetwork(SimulatedNetwork):
    """The :class:`~decentdp.algorithms.base.Network` of ``blocks`` disjoint copies of one topology.

    Agent ``b * n + a`` is agent ``a`` of block ``b``; ``(M n, d)`` tensors are viewed as
    ``(M, n, d)`` and mixed by one batched product with the block's ``(n, n)`` matrix.  Messages,
    aggregation and pairing are the simulated network's, over the block-diagonal edge list.
    """

    def __init__(self, topology: Topology, blocks: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.topology = topology
        self.device = torch.device(device)
        self.block_size = topology.n_agents
        self.blocks = blocks
        self.n_agents = self.n_total = blocks * self.block_size
        self.agent_ids = torch.arange(self.n_agents, device=self.device)
        local = torch.tensor(topology.edges(), dtype=torch.long, device=self.device).reshape(-1, 2)
        offsets = (torch.arange(blocks, device=self.device) * self.block_size).repeat_interleave(len(local))
        self.out_edges = self.in_edges = local.repeat(blocks, 1) + offsets[:, None]
        adjacency = topology.adjacency()
        self._mixing = torch.tensor(topology.mixing, dtype=dtype, device=self.device)
        self._adjacency = torch.tensor(adjacency, dtype=dtype, device=self.device)
        self.degrees = torch.tensor(adjacency.sum(axis=1), dtype=dtype, device=self.device).repeat(blocks)
        weights = topology.mixing[local[:, 1].cpu().numpy(), local[:, 0].cpu().numpy()]
        self.in_weights = torch.tensor(weights, dtype=dtype, device=self.device).repeat(blocks)
        self._neighbours = {(int(s), int(d)) for s, d in self.out_edges.tolist()}

    def _apply(self, operator: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``(I_M (x) operator) @ x``: one batched product over the blocks."""
        return torch.matmul(operator, x.reshape(self.blocks, self.block_size, -1)).reshape(x.shape)

    #: The simulator's fused ``mix_add`` multiplies by the whole ``Mn x Mn`` matrix: the blocks take the helper
    #: built on ``mix`` instead (one batched product, then the sum in ``into``).
    mix_add = Network.mix_add

    def _build_public_graph(self) -> PublicGraph:
        """Every block's graph: the block's edges and weights tiled with offsets ``b * n`` (no ``Mn x Mn`` matrix)."""
        block = topology_graph(self.topology)
        offsets = np.repeat(np.arange(self.blocks, dtype=np.int64) * self.block_size, len(block.edges))
        return PublicGraph(self.n_total, np.tile(block.edges, (self.blocks, 1)) + offsets[:, None],
                           np.tile(block.weights, self.blocks), np.tile(block.self_weights, self.blocks))


@dataclass
class BlockRun:
    """A built block simulation: run it with :meth:`train`; ``targets`` are the target agents' rows."""

    experiment: Experiment
    simulator: Simulator
    oracle: DataOracle
    network: BlockNetwork
    ledger: PrivacyLedger
    targets: torch.Tensor        # (M,) row of each block's target agent
    member: np.ndarray           # (M,) whether the block's target owns the record, or (M, R): each of R records
    noise_multipliers: list[float]

    def train(self, rounds: int | None = None) -> State:
        """Every block's training from the experiment's initial parameters (identical in every block)."""
        params = self.experiment.model.initial_parameters().to(self.oracle.device)
        state = self.experiment.algorithm.init_state(params.unsqueeze(0).repeat(self.network.n_agents, 1))
        state = self.simulator.setup(state)
        total = self.experiment.config.experiment.rounds if rounds is None else rounds
        return self.simulator.run(state, 0, total, lambda _k, _state: True)

    def target_epsilon(self) -> float:
        """The first target agent's epsilon, recomputed from the events its ledger recorded."""
        config = self.experiment.config
        history = self.ledger.history(int(self.targets[0]))
        return float(epsilon_of_history(history, config.privacy.delta, config.privacy.accountant,
                                        relation=config.privacy.neighbouring))


def refuse_what_blocks_do_not_run(config: ExperimentConfig) -> None:
    """Settings of a run that an audit's blocks do not reproduce are refused rather than silently dropped: the
    audit would measure another training than the config's."""
    if config.personalized is not None:
        raise ConfigError("personalized", "audits train the round-based algorithms of [algorithm] as blocks; a "
                                          "personalized run (coordinate descent over wake-ups) is not one, and its "
                                          "[algorithm] defaults would be audited instead: remove [personalized]")
    if config.privacy.noise == "secure":
        raise ConfigError("privacy.noise", "an audit draws its noise from each chunk's seed, so that chunks resume "
                                           "and can be scored again (secure mode's noise has the same distribution):"
                                           " set privacy.noise = 'simulation'")
    if config.privacy.colluding:
        raise ConfigError("privacy.colluding", "an audit's blocks calibrate their agents' noise for single "
                                               "observers (a colluding set would need one set per block): remove it "
                                               "to audit this training")
    if config.augmentation.kind != "none":
        raise ConfigError("augmentation.kind", "an audit's blocks train on the records as they are (a canary is "
                                               "one record): set augmentation.kind = 'none'")
    if config.averaging.kind != "none":
        raise ConfigError("averaging.kind", "an audit scores the models the blocks train, their last iterates: "
                                            "set averaging.kind = 'none'")


def audit_experiment(config: ExperimentConfig, data_dir: str | Path | None = None) -> Experiment:
    """The config's data, model, algorithm and graph, built without calibrating noise for the config's own
    partition (the blocks calibrate for their datasets); the model is checked for DP as a run checks it.  Settings
    the blocks do not run are refused (:func:`refuse_what_blocks_do_not_run`)."""
    refuse_what_blocks_do_not_run(config)
    public = config.model_copy(update={"privacy": config.privacy.model_copy(
        update={"epsilon": math.inf, "agent_epsilons": None})})
    experiment = build_experiment(public, data_dir=data_dir)
    experiment.config = config
    if config.privacy.private:
        validate_for_dp(experiment.model.module)
    return experiment


_CALIBRATED: dict[tuple[int, str, tuple[float, ...], int, tuple[int, ...]], list[float]] = {}


def _sigmas(experiment: Experiment, budgets: list[float], rates: list[float], planned: int,
            sums: np.ndarray) -> list[float]:
    """Each block agent's calibrated multiplier, computed once per audit (every chunk asks for the same)."""
    key = (id(experiment), experiment.config.model_dump_json(), tuple(rates), planned, tuple(sums.tolist()))
    if key not in _CALIBRATED:
        _CALIBRATED.clear()
        _CALIBRATED[key] = calibrate(budgets, rates, experiment.config, planned, sums,
                                      experiment.algorithm.joint_accounting)
    return _CALIBRATED[key]


def block_simulation(experiment: Experiment, x: torch.Tensor, y: torch.Tensor, parts: Sequence[np.ndarray],
                     target: int, record: int | Sequence[int] | np.ndarray, member: np.ndarray, seed: int,
                     model: FlatModel | None = None,
                     wrap_mechanism: Callable[[Mechanism], Mechanism] | None = None) -> BlockRun:
    """M = ``len(member)`` trainings of ``experiment``'s algorithm on the records ``x``, ``y``.

    ``parts[a]`` are the rows agent ``a`` of every block owns; agent ``target`` of block ``b`` also
    owns row ``record`` when ``member[b]``.  With several audited rows (``record`` a sequence of R
    rows), ``member`` is ``(M,)`` (all or none) or ``(M, R)``: block ``b``'s target owns ``record[r]``
    when ``member[b, r]`` (the one-run audit's independent canaries); rates and noise are those of a
    target owning every audited row.  ``seed`` keys the batches and noise (give each chunk of an
    audit its own).  ``model`` replaces the gradient engine (e.g. one that plants a canary
    gradient), ``wrap_mechanism`` the calibrated mechanism (fault injection in tests).
    """
    config = experiment.config
    if config.topology.redraw_every:
        raise ConfigError("topology.redraw_every", "audits run one fixed graph per block; set it to 0")
    block = len(parts)
    if block != experiment.topology.n_agents:
        raise ValueError(f"{block} parts for a block of {experiment.topology.n_agents} agents")
    blocks = len(member)
    device = experiment.device
    audited = np.atleast_1d(np.asarray(record, dtype=np.int64))
    owns = np.broadcast_to(np.asarray(member, dtype=bool).reshape(blocks, -1), (blocks, len(audited)))
    indices = []
    for b in range(blocks):
        for a, rows in enumerate(parts):
            owned = np.append(rows, audited[owns[b]]) if a == target else rows
            indices.append(torch.as_tensor(owned, dtype=torch.long, device=device))
    data = AgentData(x.to(device), y.to(device), tuple(indices))
    # rates and noise of the world with every audited record, in all worlds (add/remove DP: the mechanism is fixed)
    sizes = [len(rows) + (len(audited) if a == target else 0) for a, rows in enumerate(parts)]
    period = experiment.period  # cyclic sampling: every release unsampled, a record in the rounds of its batch
    rates = [min(1.0, config.algorithm.batch_size / size) for size in sizes] if period is None else [1.0] * block
    budgets = agent_budgets(config, block)
    planned = planned_releases(config, experiment.algorithm, period)
    sums = experiment.algorithm.sums_per_batch(experiment.topology.adjacency().sum(axis=1).astype(np.int64))
    private = config.privacy.private
    adjacency = experiment.topology.adjacency()
    degrees = [int(d) for d in adjacency.sum(axis=1)]
    neighbours = [[int(j) + b * block for j in np.flatnonzero(row)] for b in range(blocks) for row in adjacency]
    schedule_cfg = config.schedule
    rng = AgentRandom(seed, device=device)
    network = BlockNetwork(experiment.topology, blocks, device=device)
    # a cyclic run's algorithm may price the graph itself (mafalda-sgd's factorization): the blocks' graph is public
    public = None if period is None else PublicRun(
        lambda _: network, lambda k: rng.round_generator(k, Stream.PUBLIC),
        (torch.tensor(sizes * blocks, dtype=torch.float64) / period).float().double().numpy())
    own = experiment.algorithm.calibrate(NoisePlan(
        budgets * blocks, config.privacy.delta, rates * blocks, sizes * blocks, config.experiment.rounds,
        experiment.model.dim, config.privacy.clip, config.privacy.accountant, config.privacy.neighbouring,
        (1 - schedule_cfg.offline_probability) * schedule_cfg.participation, degrees * blocks, neighbours,
        bool(config.topology.redraw_every), public, period=period, noise=config.privacy.noise)) if private else None
    if own is not None:  # the algorithm's own mechanism (TOP-DP, Li18, ...), calibrated for every block agent
        sigmas, mechanism = list(own.noise_multipliers[:block]), own.mechanism
    else:
        sigmas = _sigmas(experiment, budgets, rates, planned, sums) if private else [0.0] * block
        mechanism = GaussianMechanism(torch.tensor(sigmas * blocks, dtype=torch.float32),
                                      config.privacy.clip) if private else None
    sample_rates = torch.tensor(rates * blocks, dtype=torch.float64)
    if mechanism is not None and wrap_mechanism is not None:
        mechanism = wrap_mechanism(mechanism)
    ledger = PrivacyLedger(blocks * block, float("inf"), config.privacy.delta,
                           budget_accountant=config.privacy.accountant, relation=config.privacy.neighbouring)
    sampler = PoissonSampler(data, sample_rates, rng) if period is None else CyclicSampler(data, period, seed)
    oracle = DataOracle(model or experiment.model, sampler, ledger, rng, mechanism,
                        config.privacy.clip, agents_per_pass=config.engine.agents_per_pass)
    scheduler = Scheduler(config.schedule_kind, rng, network.n_total, config.schedule.offline_probability,
                          config.schedule.participation, device=device)
    algo = config.algorithm
    schedule = Schedule(algo.lr_schedule, algo.lr, algo.lr_final or algo.lr, config.experiment.rounds)
    simulator = Simulator(experiment.algorithm, GraphSequence(network), oracle, scheduler, schedule, rng)
    targets = torch.arange(blocks, device=device) * block + target
    return BlockRun(experiment, simulator, oracle, network, ledger, targets, np.asarray(member, dtype=bool),
                    sigmas)


@dataclass(frozen=True)
class AuditOutcome:
    """An audit's summary (the bound, its test, the nominal epsilon, timing) and every run's score."""

    summary: dict[str, Any]
    scores: np.ndarray      # (2 M,) in the order the runs were made
    member: np.ndarray      # (2 M,) whether each run's target held the record
    target_noise_multiplier: float  # the target agent's calibrated noise multiplier in the trainings


@dataclass
class ChunkStore:
    """Where an audit keeps each chunk's scores as the chunk finishes (``chunk-00042.npz``), so that a killed
    audit resumes where it stopped and separate processes can train separate chunks of one audit: a chunk's
    batches and noise depend on its index alone (:func:`chunk_seed`).  ``only`` names the chunks this process
    trains; the others are read where a process has written them and left out where none has yet, so the
    bound comes from whatever chunks exist.  ``spec.json`` holds the audit's settings: a folder written by
    another audit is refused, not mixed in.  Each chunk file also holds the spec's digest, its index and its seed,
    so that a chunk copied in from another audit's folder, or renamed to another index, is refused too."""

    folder: Path
    only: range | None = None
    digest: str = field(default="", init=False)  # the spec's SHA-256, set by :meth:`open`

    def open(self, spec: dict[str, Any]) -> None:
        """Create the folder, or check that it belongs to the audit described by ``spec``."""
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError("--chunk-dir", f"{self.folder} is a file, not a folder")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--chunk-dir", f"cannot create {self.folder}: {exc.strerror or exc}") from None
        path = self.folder / "spec.json"
        text = json.dumps(spec, sort_keys=True, indent=1)
        self.digest = hashlib.sha256(text.encode()).hexdigest()
        if path.exists():
            try:
                held = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ConfigError("--chunk-dir", f"cannot read {path} ({exc}); restore it, or choose another "
                                                 "folder") from None
            if held != json.loads(text):
                raise ConfigError("--chunk-dir", f"{self.folder} holds the chunks of another audit (its spec.json "
                                                 "differs from this one's settings); choose another folder")
        else:
            write_atomic(path, text)

    def _path(self, index: int) -> Path:
        return self.folder / f"chunk-{index:05d}.npz"

    def load(self, index: int, seed: int) -> tuple[np.ndarray, np.ndarray, float, float] | None:
        """Chunk ``index``'s (scores, member, target epsilon, target noise multiplier), if written; a file stamped
        for another audit, index or seed is refused (files written before the stamps are read on spec.json's
        word)."""
        path = self._path(index)
        if not path.exists():
            return None
        try:
            with np.load(path) as saved:
                stamp = {key: saved[key].item() for key in ("spec_digest", "index", "seed") if key in saved.files}
                chunk = (saved["scores"], saved["member"], float(saved["epsilon"]), float(saved["noise_multiplier"]))
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise ConfigError("--chunk-dir", f"{path} is damaged ({exc}); delete it to train that chunk "
                                             "again") from None
        expected = {"spec_digest": self.digest, "index": index, "seed": seed}
        wrong = [key for key, value in stamp.items() if value != expected[key]]
        if wrong:
            raise ConfigError("--chunk-dir", f"{path} was written as another chunk ({', '.join(wrong)} differ: "
                                             f"{', '.join(f'{k} {stamp[k]!r}' for k in wrong)}), copied or renamed "
                                             "from another audit or index; remove it to train this chunk")
        return chunk

    def save(self, index: int, seed: int, scores: np.ndarray, member: np.ndarray, epsilon: float,
             noise: float) -> None:
        """Write chunk ``index`` atomically (a temporary file renamed into place), stamped with the spec's digest,
        its index and its seed."""
        temporary = self.folder / f".chunk-{index:05d}.{os.getpid()}.npz"
        np.savez(temporary, scores=scores, member=member, epsilon=epsilon, noise_multiplier=noise,
                 spec_digest=self.digest, index=index, seed=seed)
        os.replace(temporary, self._path(index))

    def trains(self, index: int) -> bool:
        return self.only is None or index in self.only


def chunk_seed(seed: int, chunk: int) -> int:
    """The key of an audit chunk's batches and noise: distinct chunks are independent trainings."""
    return round_stream_seed(seed, chunk, Stream.SCHEDULE, step=7) % 2**63


def audit_blocks(models: int, chunk: int) -> list[np.ndarray]:
    """Membership of each block, chunk by chunk: worlds alternate, so each chunk holds both equally."""
    member = np.arange(2 * models) % 2 == 0
    return [member[start:start + 2 * chunk] for start in range(0, 2 * models, 2 * chunk)]


#: Settings that say how or where an audit process runs, not what it trains: chunk folders may differ in them.
_OPERATIONAL = {"engine": ("threads", "memory_limit_gb", "agents_per_pass"), "data": ("data_dir",)}


def audit_spec(config: ExperimentConfig, audit: AuditSection, kind: str, chunks: int) -> dict[str, Any]:
    """What makes two processes' chunks parts of one audit: the config and audit settings, less how and where each
    process runs (threads, memory, the data folder's path, tracking)."""
    settings = config.model_dump(mode="json")
    settings.pop("tracking", None)
    for section, keys in _OPERATIONAL.items():
        for key in keys:
            settings[section].pop(key, None)
    return {"audit": kind, "config": settings, "audit_settings": audit.model_dump(mode="json"), "chunks": chunks}


def run_audit(experiment: Experiment, audit: AuditSection, kind: str,
              build: Callable[[np.ndarray, int], BlockRun], score: Callable[[BlockRun], np.ndarray],
              store: ChunkStore | None = None) -> AuditOutcome:
    """``audit.models`` trainings per world, ``audit.chunk`` at a time: ``build(member, seed)`` makes a
    chunk's simulation, ``score(run)`` trains it and scores each block; then the bound on the scores.  With a
    ``store``, chunks it holds are read instead of trained, each trained chunk is written as it finishes, and
    the bound covers the chunks there are (``summary["chunks"]``)."""
    config = experiment.config
    if config.algorithm.name == "muffliato":
        raise ConfigError("algorithm.name", "muffliato sizes its gossip from the graph's spectral gap, and the graph "
                                            "of many blocks (separate copies of the config's) has none: it does not "
                                            "run as many blocks (audit one-run trains one block, and does run it)")
    split_sizes(audit.models, audit.selection_fraction)
    blocks = audit_blocks(audit.models, audit.chunk)
    if store is not None:
        store.open(audit_spec(config, audit, kind, len(blocks)))
    start = time.perf_counter()
    scores, members, epsilons, noises, trained = [], [], [], [], 0
    for index, member in enumerate(blocks):
        seed = chunk_seed(config.experiment.seed, index)
        saved = store.load(index, seed) if store is not None else None
        if saved is None:
            if store is not None and not store.trains(index):
                continue
            run = build(member, seed)
            saved = (score(run), run.member, run.target_epsilon(), float(run.noise_multipliers[audit.target]))
            trained += len(run.member)
            if store is not None:
                store.save(index, seed, *saved)
        for kept, value in zip((scores, members, epsilons, noises), saved, strict=True):
            kept.append(value)
    if not scores:
        raise ConfigError("--chunks", f"no chunk of this audit is in {store.folder if store else 'memory'} yet, "
                                      "and this process was given none to train")
    undefined = np.isnan(np.concatenate(scores))  # (an infinite score is a sure guess: a noiseless release)
    if undefined.mean() > 0.5:
        raise ConfigError("audit", f"{int(undefined.sum())} of {undefined.size} models' scores are NaN (the training "
                                   "diverged): no bound can be read from them; lower algorithm.lr or check the "
                                   "config with decentdp run")
    wall = time.perf_counter() - start
    all_scores, member = np.concatenate(scores), np.concatenate(members)
    models = int(member.sum())
    bound = audit_bound(all_scores[member], all_scores[~member], config.privacy.delta, audit.selection_fraction,
                        audit.confidence, audit.threshold_rule)
    summary = {"audit": kind, "algorithm": config.algorithm.name, "models": models,
               "chunks": f"{len(scores)} of {len(blocks)}", "complete": len(scores) == len(blocks),
               "epsilon_nominal": agent_budgets(config, experiment.topology.n_agents)[audit.target],
               "epsilon_ledger": epsilons[0], "delta": config.privacy.delta, "rounds": config.experiment.rounds,
               "wall_seconds": wall, "seconds_per_model": wall / trained if trained else None,
               **bound.as_dict()}
    return AuditOutcome(summary, all_scores, member, noises[0])
