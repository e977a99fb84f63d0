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

import copy
import hashlib
import json
import math
import os
import re
import socket
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

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
from decentdp.results.files import write_atomic, write_durably
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


@dataclass(frozen=True)
class Chunk:
    """One chunk of an audit's trainings, as :class:`ChunkStore` keeps it: every block's score and world, the
    target agent's ledger epsilon and noise multiplier, and the seconds the chunk took to build, train and score
    (None for chunks written before chunks recorded their time)."""

    scores: np.ndarray
    member: np.ndarray
    epsilon: float
    noise_multiplier: float
    seconds: float | None


#: A chunk's file while it is written: the chunk's index, the writing host and process (``.chunk-00042.HOST.PID.npz``;
#: files of processes before the host was named lack it).  Processes on one machine tell whose file is stale by its
#: PID, and never touch another host's.
_TEMPORARY = re.compile(r"^\.chunk-\d{5}\.(?:(?P<host>.+)\.)?(?P<pid>\d+)\.npz$")


def _host() -> str:
    """This machine's name as a temporary file's name holds it (letters, digits, ``-`` and ``_``)."""
    return re.sub(r"[^\w-]", "-", socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_ABSENT = object()


def spec_differences(held: Any, current: Any, defaults: Any = _ABSENT, where: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys in which a chunk folder's ``held`` spec and this audit's ``current`` one differ, each with its
    two values.  A key the held spec lacks matches a current value equal to the field's default (``defaults``, nested
    as the specs are, :func:`audit_spec_defaults`): a field added since the folder was written keeps, at its default,
    the behaviour the folder's chunks were trained with (the project's convention for new fields)."""
    if isinstance(current, dict) and (isinstance(held, dict) or (held is _ABSENT and isinstance(defaults, dict))):
        held = {} if held is _ABSENT else held
        sub = defaults if isinstance(defaults, dict) else {}
        return [difference for key in sorted({*held, *current}, key=str)
                for difference in spec_differences(held.get(key, _ABSENT), current.get(key, _ABSENT),
                                                   sub.get(key, _ABSENT), (*where, str(key)))]
    name = ".".join(where)
    if held is _ABSENT:
        return [] if defaults is not _ABSENT and current == defaults else [
            f"{name} (absent from the folder's spec, {json.dumps(current)} here)"]
    if current is _ABSENT:
        return [f"{name} ({json.dumps(held)} in the folder, not a setting here)"]
    return [] if held == current else [f"{name} ({json.dumps(held)} in the folder, {json.dumps(current)} here)"]


@dataclass
class ChunkStore:
    """Where an audit keeps each chunk's scores as the chunk finishes (``chunk-00042.npz``), so that a killed
    audit resumes where it stopped and separate processes can train separate chunks of one audit: a chunk's
    batches and noise depend on its index alone (:func:`chunk_seed`).  ``only`` names the chunks this process
    trains; the others are read where a process has written them and left out where none has yet, so the
    bound comes from whatever chunks exist.  ``spec.json`` holds the audit's settings: a folder written by
    another audit is refused, not mixed in.  Each chunk file also holds the spec's digest, its index and its seed,
    so that a chunk copied in from another audit's folder, or renamed to another index, is refused too.  A
    process that trains no chunk only reads: it creates neither the folder nor its ``spec.json``."""

    folder: Path
    only: range | None = None
    digest: str = field(default="", init=False)  # the digest chunks are stamped with, set by :meth:`open`
    _spec_text: str = field(default="", init=False, repr=False)  # spec.json's text, for a folder that has none yet

    def open(self, spec: dict[str, Any], chunks: int, defaults: dict[str, Any] | None = None) -> None:
        """Check that the folder belongs to the audit described by ``spec`` (``chunks`` chunks in all), or create it
        with its ``spec.json`` if this process trains any of them.

        A folder's spec that lacks a key matches this one where the key's value is its default (``defaults``, see
        :func:`spec_differences`); a folder whose spec differs is refused, naming the keys.  Chunks written into
        a folder are stamped with the digest of the folder's own ``spec.json``.  Temporary files that killed
        processes of this machine left behind are removed."""
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError("--chunk-dir", f"{self.folder} is a file, not a folder")
        path = self.folder / "spec.json"
        self._spec_text = json.dumps(spec, sort_keys=True, indent=1)
        self.digest = hashlib.sha256(self._spec_text.encode()).hexdigest()
        if path.exists():
            try:
                held = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ConfigError("--chunk-dir", f"cannot read {path} ({exc}); restore it, or choose another "
                                                 "folder") from None
            if not isinstance(held, dict):
                raise ConfigError("--chunk-dir", f"{path} is not an audit's spec (a JSON object); restore it, or "
                                                 "choose another folder")
            differences = spec_differences(without_operational(held), json.loads(self._spec_text),
                                           defaults or {})
            if differences:
                raise ConfigError("--chunk-dir", f"{self.folder} holds the chunks of another audit: its spec.json "
                                                 f"differs from this one's settings in {'; '.join(differences)}; "
                                                 "choose another folder, or audit with the folder's settings")
            self.digest = hashlib.sha256(json.dumps(held, sort_keys=True, indent=1).encode()).hexdigest()
        if self.only is None or any(index in self.only for index in range(chunks)):
            self._create()  # now, so that a folder that cannot be made is found before the first chunk trains
        if self.folder.is_dir():
            self._remove_stale_temporaries()

    def _create(self) -> None:
        """The folder and, unless it holds one, its ``spec.json``."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not (self.folder / "spec.json").exists():
                write_atomic(self.folder / "spec.json", self._spec_text)
        except OSError as exc:
            raise ConfigError("--chunk-dir", f"cannot create {self.folder}: {exc.strerror or exc}") from None

    def _remove_stale_temporaries(self) -> None:
        """Remove the chunk files that processes of this machine were writing when they were killed (their PID no
        longer runs); another machine's, and a running process's, are left alone."""
        for path in self.folder.glob(".chunk-*.npz"):
            match = _TEMPORARY.match(path.name)
            if match is None or match["host"] not in (None, _host()):
                continue
            pid = int(match["pid"])
            if pid == os.getpid() or not _running(pid):  # (this process has written nothing yet: a reused PID's)
                path.unlink(missing_ok=True)

    def _path(self, index: int) -> Path:
        return self.folder / f"chunk-{index:05d}.npz"

    def load(self, index: int, seed: int) -> Chunk | None:
        """Chunk ``index``, if written; a file stamped for another audit, index or seed is refused (files written
        before the stamps are read on spec.json's word, and those written before chunks recorded their time have
        ``seconds`` None)."""
        path = self._path(index)
        if not path.exists():
            return None
        try:
            with np.load(path) as saved:
                stamp = {key: saved[key].item() for key in ("spec_digest", "index", "seed") if key in saved.files}
                seconds = float(saved["seconds"]) if "seconds" in saved.files else math.nan
                chunk = Chunk(saved["scores"], saved["member"], float(saved["epsilon"]),
                              float(saved["noise_multiplier"]), None if math.isnan(seconds) else seconds)
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

    def save(self, index: int, seed: int, chunk: Chunk) -> None:
        """Write chunk ``index`` durably (a temporary file of this process, flushed to the disk and renamed into
        place), stamped with the spec's digest, its index and its seed."""
        self._create()
        temporary = self.folder / f".chunk-{index:05d}.{_host()}.{os.getpid()}.npz"
        seconds = math.nan if chunk.seconds is None else chunk.seconds
        write_durably(self._path(index), lambda handle: np.savez(
            handle, scores=chunk.scores, member=chunk.member, epsilon=chunk.epsilon,
            noise_multiplier=chunk.noise_multiplier, seconds=seconds, spec_digest=self.digest, index=index,
            seed=seed), temporary)

    def trains(self, index: int) -> bool:
        return self.only is None or index in self.only


def chunk_seed(seed: int, chunk: int) -> int:
    """The key of an audit chunk's batches and noise: distinct chunks are independent trainings."""
    return round_stream_seed(seed, chunk, Stream.SCHEDULE, step=7) % 2**63


def audit_blocks(models: int, chunk: int) -> list[np.ndarray]:
    """Membership of each block, chunk by chunk: worlds alternate, so each chunk holds both equally."""
    member = np.arange(2 * models) % 2 == 0
    return [member[start:start + 2 * chunk] for start in range(0, 2 * models, 2 * chunk)]


#: Settings that say how or where an audit process runs, not what it trains, and settings no audit reads (its blocks
#: neither evaluate nor checkpoint, and the experiment's name only labels a run): chunk folders may differ in them.
_OPERATIONAL = {"engine": ("threads", "memory_limit_gb", "agents_per_pass"), "data": ("data_dir",),
                "experiment": ("name", "eval_every", "checkpoint_every")}


def without_operational(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` less the settings chunk folders may differ in (:data:`_OPERATIONAL`, tracking): applied to this
    audit's spec and to a folder's, which may hold keys that were made operational after it was written."""
    spec = copy.deepcopy(spec)
    settings = spec.get("config")
    if isinstance(settings, dict):
        settings.pop("tracking", None)
        for section, keys in _OPERATIONAL.items():
            for key in keys:
                if isinstance(settings.get(section), dict):
                    settings[section].pop(key, None)
    return spec


def audit_spec(config: ExperimentConfig, audit: AuditSection, kind: str, chunks: int) -> dict[str, Any]:
    """What makes two processes' chunks parts of one audit: the config and audit settings, less how and where each
    process runs (threads, memory, the data folder's path, tracking) and what no audit reads (the experiment's
    name, evaluation and checkpoint intervals)."""
    return without_operational({"audit": kind, "config": config.model_dump(mode="json"),
                                "audit_settings": audit.model_dump(mode="json"), "chunks": chunks})


def _field_defaults(model: BaseModel) -> dict[str, Any]:
    """Each field's default in the JSON form ``model_dump(mode="json")`` gives, nested as the dump is (sections
    recursively); fields without a default are left out."""
    defaults: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            defaults[name] = _field_defaults(value)
        elif not info.is_required():
            defaults[name] = to_jsonable_python(info.get_default(call_default_factory=True))
    return defaults


def audit_spec_defaults(config: ExperimentConfig, audit: AuditSection) -> dict[str, Any]:
    """The defaults of :func:`audit_spec`'s settings, nested as the spec is (the algorithm's own settings within
    ``config.algorithm``): a key a chunk folder's older spec lacks matches this audit's value when that value is
    the field's default (:func:`spec_differences`)."""
    settings = _field_defaults(config)
    settings["algorithm"].update(_field_defaults(config.algorithm.settings))
    return {"config": settings, "audit_settings": _field_defaults(audit)}


def run_audit(experiment: Experiment, audit: AuditSection, kind: str,
              build: Callable[[np.ndarray, int], BlockRun], score: Callable[[BlockRun], np.ndarray],
              store: ChunkStore | None = None) -> AuditOutcome:
    """``audit.models`` trainings per world, ``audit.chunk`` per world at a time (``2 * audit.chunk`` blocks
    in one simulation): ``build(member, seed)`` makes a chunk's simulation, ``score(run)`` trains it and scores
    each block; then the bound on the scores.  With a ``store``, chunks it holds are read instead of trained, each
    trained chunk is written as it finishes, and the bound covers the chunks there are (``summary["chunks"]``).
    ``wall_seconds`` is the chunks' own time, summed over every chunk the bound covers, those read from the store
    included (None where a chunk written before chunks recorded their time is among them); reading the store and
    computing the bound are not in it."""
    config = experiment.config
    if config.algorithm.name == "muffliato":
        raise ConfigError("algorithm.name", "muffliato sizes its gossip from the graph's spectral gap, and the graph "
                                            "of many blocks (separate copies of the config's) has none: it does not "
                                            "run as many blocks (audit one-run trains one block, and does run it)")
    split_sizes(audit.models, audit.selection_fraction)
    blocks = audit_blocks(audit.models, audit.chunk)
    if store is not None:
        store.open(audit_spec(config, audit, kind, len(blocks)), len(blocks), audit_spec_defaults(config, audit))
    chunks: list[Chunk] = []
    for index, member in enumerate(blocks):
        seed = chunk_seed(config.experiment.seed, index)
        chunk = store.load(index, seed) if store is not None else None
        if chunk is None:
            if store is not None and not store.trains(index):
                continue
            start = time.perf_counter()
            run = build(member, seed)
            scores = score(run)
            chunk = Chunk(scores, run.member, run.target_epsilon(), float(run.noise_multipliers[audit.target]),
                          time.perf_counter() - start)
            if store is not None:
                store.save(index, seed, chunk)
        chunks.append(chunk)
    if not chunks:
        raise ConfigError("--chunks", f"no chunk of this audit is in {store.folder if store else 'memory'} yet, "
                                      "and this process was given none to train")
    all_scores, member = np.concatenate([c.scores for c in chunks]), np.concatenate([c.member for c in chunks])
    undefined = np.isnan(all_scores)  # (an infinite score is a sure guess: a noiseless release)
    if undefined.mean() > 0.5:
        raise ConfigError("audit", f"{int(undefined.sum())} of {undefined.size} models' scores are NaN (the training "
                                   "diverged): no bound can be read from them; lower algorithm.lr or check the "
                                   "config with decentdp run")
    times = [c.seconds for c in chunks]
    wall = None if None in times else float(sum(times))
    models = int(member.sum())
    bound = audit_bound(all_scores[member], all_scores[~member], config.privacy.delta, audit.selection_fraction,
                        audit.confidence, audit.threshold_rule)
    summary = {"audit": kind, "algorithm": config.algorithm.name, "models": models,
               "chunks": f"{len(chunks)} of {len(blocks)}", "complete": len(chunks) == len(blocks),
               "epsilon_nominal": agent_budgets(config, experiment.topology.n_agents)[audit.target],
               "epsilon_ledger": chunks[0].epsilon, "delta": config.privacy.delta, "rounds": config.experiment.rounds,
               "wall_seconds": wall, "seconds_per_model": None if wall is None else wall / len(member),
               **bound.as_dict()}
    return AuditOutcome(summary, all_scores, member, chunks[0].noise_multiplier)
