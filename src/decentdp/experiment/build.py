"""From a validated config to the components of a run, built and checked before anything is written.

Data flow (see ``docs/architecture.md``)::

    config -> dataset + partition -> AgentData -> PoissonSampler ------------------------+
           -> topology (graph, W) -> SimulatedNetwork -> GraphSequence (fixed or redrawn) +
           -> model -> gradient engine (stacked or vmap) --------------------------------+--> Simulator
           -> algorithm (registry) + its settings -> planned releases                    |
           -> sigma_i calibrated for them -> GaussianMechanism -> DataOracle <- ledger  -+
           -> scheduler (synchronous, pairing, Poisson clocks, sampled)                 /

Everything that can fail because of user input (data files, graph, calibration, memory) fails here,
so a failing run leaves nothing half-written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decentdp.algorithms import algorithm_class
from decentdp.algorithms.base import Algorithm, NoisePlan, PublicRun, State
from decentdp.algorithms.components.schedules import Schedule
from decentdp.config import FLOAT32_MAX, EngineSection, ExperimentConfig, checked_config
from decentdp.data.augment import Augmentation
from decentdp.data.datasets import Dataset, load_dataset
from decentdp.data.partition import class_histograms, hold_out, partition
from decentdp.errors import ConfigError
from decentdp.gradients.flat_model import FlatModel
from decentdp.gradients.memory import MemoryPlan, available_memory, padded_batch, plan_memory, state_bytes
from decentdp.gradients.stacked_model import gradient_model
from decentdp.models import build_model, classification_loss, validate_for_dp
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import GaussianMechanism, calibrate_agents
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.report import CYCLIC_AGENT_VIEW, PRIVATE_EVALUATION_NOTICE
from decentdp.privacy.sampling import AgentData, CyclicSampler, PoissonSampler
from decentdp.rng import Stream, agent_random, round_stream_seed
from decentdp.runtime.averaging import IterateAverage
from decentdp.runtime.evaluation import Evaluator, evaluation_chunk
from decentdp.runtime.network import GraphSequence, SimulatedNetwork
from decentdp.runtime.scheduler import Scheduler
from decentdp.runtime.simulator import Simulator
from decentdp.topology import Topology, build_topology
from decentdp.util.device import resolve_device


@dataclass
class Experiment:
    """Every component of a run, built and validated, before anything is written."""

    config: ExperimentConfig
    dataset: Dataset
    data: AgentData
    topology: Topology
    model: FlatModel
    algorithm: Algorithm
    oracle: DataOracle        # owns the run's ledger (``ledger`` below reads it)
    simulator: Simulator      # the run loop; engine.backend = "ray" puts a RaySimulator with its interface here
    evaluator: Evaluator
    noise_multipliers: torch.Tensor
    sample_rates: torch.Tensor
    histograms: np.ndarray
    memory: MemoryPlan
    graphs: GraphSequence     # the network of each round (public), whichever engine runs the rounds
    schedule: Schedule        # the step size of each round
    setup: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # announced when the run starts
    period: int | None = None  # cyclic sampling: b, the batches each agent's records are split into (None: Poisson)

    @property
    def ledger(self) -> PrivacyLedger:
        """The run's privacy ledger: the data oracle's, the one owner every release is charged through (a
        backend or a resume that replaces it sets ``oracle.ledger``)."""
        return self.oracle.ledger

    @property
    def device(self) -> torch.device:
        """The device the run computes on (``engine.device``, resolved)."""
        return self.oracle.device

    def initial_state(self) -> State:
        params = self.model.initial_parameters()
        return self.algorithm.init_state(params.unsqueeze(0).repeat(self.data.n_agents, 1))

    @property
    def round_flops(self) -> float:
        """Floating-point operations of a round's gradients, estimated: forward and backward (about three
        forwards) of every agent's expected batch, augmented copies included.  What sizes the round's kernels
        when the run chooses its threads (:func:`decentdp.util.threads.apply_threads`)."""
        sizes = torch.tensor([len(owned) for owned in self.data.indices], dtype=torch.float64)
        rates = self.sample_rates.double().cpu() if self.period is None else torch.full_like(sizes, 1 / self.period)
        expected = float((rates * sizes).sum()) * self.config.augmentation.copies
        return 3.0 * self.model.forward_flops_per_sample(self.data.x[self.data.indices[0][0]]) * expected

    @property
    def planned_releases(self) -> int:
        """Noisy releases each agent's noise is calibrated for: the setup phase's and every round's (one for a
        mechanism priced once for the whole run)."""
        if getattr(self.oracle.mechanism, "prepaid", False):
            return 1
        return planned_releases(self.config, self.algorithm, self.period)


def planned_releases(config: ExperimentConfig, algorithm: Algorithm, period: int | None = None) -> int:
    """The setup phase's releases and every round's, per agent: what sigma is calibrated for.  Under cyclic sampling
    of period ``b`` a record takes part in ``ceil(T / b)`` rounds at most, and the ledger charges each agent that
    many (:meth:`~decentdp.privacy.oracle.DataOracle.release`)."""
    rounds = config.experiment.rounds if period is None else -(-config.experiment.rounds // period)
    return rounds * algorithm.releases_per_round + algorithm.setup_releases


def cyclic_period(config: ExperimentConfig, algorithm: Algorithm, sizes: list[int]) -> int | None:
    """``b`` of a cyclic run (``data.batches``, else the smallest agent's records over ``algorithm.batch_size``, at
    least 1 and at most the rounds), checked against the rounds and the agents' data (the config checks the
    algorithm: one release a round, none before round 0); ``None`` for Poisson sampling."""
    if config.sampling_kind != "cyclic":
        return None
    smallest, rounds = min(sizes), config.experiment.rounds
    period = config.data.batches or min(rounds, max(1, smallest // config.algorithm.batch_size))
    if period > rounds:
        raise ConfigError("data.batches", f"is {period}, more than the {rounds} rounds (experiment.rounds): the "
                                          f"records of {period - rounds} batch(es) would never be used")
    if period > smallest:
        raise ConfigError("data.batches", f"is {period}, but the smallest agent holds {smallest} records: each of its "
                                          f"batches would be empty or nearly so; use at most {smallest}")
    assert algorithm.releases_per_round == 1 and not algorithm.setup_releases, "refused by the config's checks"
    return period


def agent_budgets(config: ExperimentConfig, n_agents: int) -> list[float]:
    """Each agent's epsilon: its own, or the one every agent has; the pooled agent gets the smallest."""
    budgets = config.privacy.budgets
    if config.pools_data:
        return [min(budgets)]
    return budgets if config.privacy.agent_epsilons is not None else budgets * n_agents



def calibrate(budgets: list[float], rates: list[float], config: ExperimentConfig, releases: int,
              sums: np.ndarray | None = None, joint: bool = True) -> list[float]:
    """Each agent's sigma for the run's ``releases`` (:func:`~decentdp.privacy.mechanisms.calibrate_agents`
    with the config's delta, accountant and neighbouring relation)."""
    return calibrate_agents(budgets, rates, releases, config.privacy.delta, config.privacy.accountant,
                            config.privacy.neighbouring, None if sums is None else sums.tolist(), joint)


def sums_per_batch(config: ExperimentConfig, algorithm: Algorithm, topology: Topology) -> np.ndarray:
    """Each agent's sums per released batch; with redrawn graphs any agent may get N - 1 neighbours."""
    degrees = topology.adjacency().sum(axis=1).astype(np.int64)
    if config.topology.redraw_every:
        degrees = np.full_like(degrees, topology.n_agents - 1)
    return algorithm.sums_per_batch(degrees)


def _noise_plan(config: ExperimentConfig, budgets: list[float], rates: list[float], sizes: list[int], dim: int,
                topology: Topology, public: PublicRun | None = None, period: int | None = None) -> NoisePlan:
    """What an algorithm that calibrates its own noise (:meth:`Algorithm.calibrate`) is told of the run."""
    schedule = config.schedule
    adjacency = topology.adjacency()
    return NoisePlan(budgets, config.privacy.delta, rates, sizes, config.experiment.rounds, dim, config.privacy.clip,
                     config.privacy.accountant, config.privacy.neighbouring,
                     (1 - schedule.offline_probability) * schedule.participation,
                     [int(d) for d in adjacency.sum(axis=1)],
                     [np.flatnonzero(row).tolist() for row in adjacency], bool(config.topology.redraw_every), public,
                     config.privacy.colluding, period, config.privacy.noise)


def _plan_memory(config: ExperimentConfig, model: FlatModel, algorithm: Algorithm, data: AgentData,
                 rates: list[float], device: torch.device) -> MemoryPlan:
    """Estimate the run's peak memory and how many agents' gradients fit in one pass (or refuse)."""
    n_agents = data.n_agents
    state = state_bytes(algorithm.init_state(torch.empty(n_agents, model.dim, device="meta")))  # (no memory)
    sizes = [len(owned) for owned in data.indices]
    copies = config.augmentation.copies  # a sampled record computes as this many rows
    width = copies * max(padded_batch(rate * size, size) for rate, size in zip(rates, sizes, strict=True))
    sample = data.x[data.indices[0][0]]
    per_sample = model.activation_bytes_per_sample(sample, data.y[data.indices[0][0]])
    batch = n_agents * width * (sample.numel() * sample.element_size() + 8 + 4)  # inputs, labels, mask
    limit = config.engine.memory_limit_gb
    return plan_memory(n_agents, model.dim, state, batch, per_sample, width,
                       int(limit * 2**30) if limit is not None else available_memory(device),
                       config.engine.agents_per_pass, algorithm.round_temporaries)


def _augmentation(config: ExperimentConfig, data: AgentData) -> Augmentation | None:
    """The run's augmentation multiplicity (``None`` without ``[augmentation]``); images only."""
    section = config.augmentation
    if section.kind == "none":
        return None
    shape = tuple(data.x.shape[1:])
    if len(shape) != 3:
        raise ConfigError("augmentation.kind", f"augments images (channels, height, width); data.dataset = "
                                               f"'{config.data.dataset}' has records of shape {shape}")
    if section.shift >= min(shape[1:]):
        raise ConfigError("augmentation.shift", f"is {section.shift} pixels, but the images are only "
                                                f"{shape[1]}x{shape[2]}: use less than {min(shape[1:])}")
    return Augmentation(section.copies, section.shift, flip=section.kind == "shift-flip")


def _graphs(config: ExperimentConfig, first: Topology, device: torch.device) -> GraphSequence:
    """The run's network, fixed or redrawn every ``topology.redraw_every`` rounds from a seed per epoch.  An
    algorithm that pools every agent's data into one (``pools_data``) keeps its one-agent network: ``[topology]``
    describes the agents it replaces, and a redrawn graph of theirs would not be its run's."""
    topo = config.topology
    network = SimulatedNetwork(first, device=device)
    if not topo.redraw_every or config.pools_data:
        return GraphSequence(network)

    def build(epoch: int) -> SimulatedNetwork:
        seed = round_stream_seed(config.experiment.seed, epoch, Stream.SCHEDULE, step=1) % 2**32 if epoch else \
            config.experiment.seed
        return SimulatedNetwork(config_topology(config, seed), device=device)

    return GraphSequence(network, build, topo.redraw_every)


def config_topology(config: ExperimentConfig, seed: int) -> Topology:
    """The graph ``[topology]`` describes, drawn from ``seed`` (a run's first graph)."""
    topo = config.topology
    return build_topology(topo.graph, topo.agents, mixing=topo.mixing, seed=seed, **topo.graph_params)


def _run_device(engine: EngineSection) -> torch.device:
    """``engine.device`` resolved on this machine; the CPU under ``engine.backend = "ray"``, whose workers are
    given no GPU and exchange rows as gloo messages of CPU tensors (the config refuses CUDA with it, so this is
    what ``auto`` means there)."""
    return torch.device("cpu") if engine.backend == "ray" else resolve_device(engine.device)


def build_experiment(config: ExperimentConfig | str | Path, data_dir: str | Path | None = None,
                     device: torch.device | str | None = None) -> Experiment:
    """Load data, build graph, model, privacy and algorithm; raises DecentDPError on bad input.

    ``config`` is validated again as a whole (:func:`~decentdp.config.checked_config`: a config changed after
    loading, or a path, which is loaded).  Everything is built on ``device`` (default: ``engine.device``, resolved
    on this machine); the data is moved there once, here.  A ``[personalized]`` config is refused: its runner
    (:func:`decentdp.run`) builds no network experiment."""
    config = checked_config(config)
    if config.personalized is not None:
        raise ConfigError("personalized", "a [personalized] run has its own runner (per-agent models, no network "
                                          "experiment to assemble): run it with decentdp.run (or `decentdp run`)")
    cfg_data, topo_cfg, algo_cfg = config.data, config.topology, config.algorithm
    seed = config.experiment.seed
    device = _run_device(config.engine) if device is None else torch.device(device)
    dataset = load_dataset(cfg_data.dataset, data_dir if data_dir is not None else cfg_data.data_dir,
                           image_size=cfg_data.image_size)
    labels = dataset.y_train.numpy()
    dataset = dataset.to(device)  # once: batches are then gathered where they are computed
    algorithm = algorithm_class(algo_cfg.name).from_settings(algo_cfg.settings)
    if algorithm.pools_data:
        parts = [np.arange(len(labels), dtype=np.int64)]
        topology = build_topology("complete", 1, mixing="metropolis-hastings", seed=seed)
    else:
        parts = partition(labels, topo_cfg.agents, cfg_data.partition, seed=seed, t=cfg_data.overlap_t,
                          alpha=cfg_data.dirichlet_alpha, size_skew=cfg_data.size_skew)
        topology = config_topology(config, seed)
    validation = None
    if cfg_data.validation_fraction > 0:  # tuning: evaluate on records held out of the agents' own data
        parts, validation = hold_out(parts, cfg_data.validation_fraction, seed, cfg_data.validation_split)
    data = AgentData(dataset.x_train, dataset.y_train, tuple(torch.from_numpy(p).to(device) for p in parts))

    module = build_model(config.model.name, dataset.input_shape, dataset.num_classes, seed=seed,
                         **config.model.options)
    private = config.privacy.private
    if private:
        validate_for_dp(module)
    model = gradient_model(module.to(device), classification_loss, config.engine.gradients)

    sizes = [len(p) for p in parts]
    mixing_notes = _mixing_notes(config, algorithm, topology)
    warnings = [*(topology.warnings if algorithm.reads_mixing else []), *config.notices,
                *(_privacy_warnings(config, sizes) if private else [])]
    if cfg_data.validation_fraction > 0 and private:
        warnings.append(PRIVATE_EVALUATION_NOTICE)
    if config.engine.backend == "ray" and config.engine.device == "auto" and torch.cuda.is_available():
        warnings.append("engine.device = 'auto' computes on the CPU with engine.backend = 'ray' (its workers are "
                        "given no GPU), although this machine has CUDA: engine.backend = 'simulator' would use it")
    if cfg_data.partition == "pathological" and sum(sizes) + len(validation if validation is not None else ()) \
            < len(labels):
        warnings.append(f"data.partition = 'pathological' trains on {sum(sizes)} of the {len(labels)} training "
                        "records: every class is trimmed to the smallest class's size, as CGA's code does")
    period = cyclic_period(config, algorithm, sizes)
    rates = [min(1.0, algo_cfg.batch_size / n) for n in sizes] if period is None else [1.0] * len(sizes)
    budgets = agent_budgets(config, len(parts))
    planned = planned_releases(config, algorithm, period)
    sums = sums_per_batch(config, algorithm, topology)
    rng = agent_random(config.experiment.seed, config.privacy.noise == "secure", config.engine.noise_streams,
                       len(parts), device)
    replay: list[GraphSequence] = []  # a sequence of its own (the run's keeps its first network), built if asked

    def replayed_network(round_index: int) -> SimulatedNetwork:
        if not replay:
            replay.append(_graphs(config, topology, device))
        return replay[0].at(round_index)

    public = PublicRun(replayed_network, lambda k: rng.round_generator(k, Stream.PUBLIC),
                       (torch.tensor(rates, dtype=torch.float64) * torch.tensor(sizes)).float().double().numpy())
    if private:  # what the algorithm keeps per agent, refused before its calibration's work
        limit = config.engine.memory_limit_gb
        refusal = algorithm.memory_refusal(len(parts), model.dim, config.experiment.rounds,
                                           int(limit * 2**30) if limit is not None else available_memory(device))
        if refusal is not None:
            raise refusal
    own = algorithm.calibrate(_noise_plan(config, budgets, rates, sizes, model.dim, topology, public, period)) \
        if private else None
    sigmas = own.noise_multipliers if own is not None else \
        calibrate(budgets, rates, config, planned, sums, algorithm.joint_accounting) if private else [0.0] * len(parts)
    if private and max(sigmas, default=0.0) * config.privacy.clip > FLOAT32_MAX:
        raise ConfigError("privacy.clip", f"the noise's standard deviation sigma * clip = {max(sigmas):.3g} * "
                                          f"{config.privacy.clip:g} exceeds the largest float32: lower the clip")
    if own is not None:
        warnings += own.notices
    if own is not None and getattr(own.mechanism, "prepaid", False):
        planned = 1  # one event for the whole run (matrix-factorization noise), charged before round 0
    ledger = PrivacyLedger(len(parts), budgets, config.privacy.delta, budget_accountant=config.privacy.accountant,
                          relation=config.privacy.neighbouring)
    # host values, known before any round: the ledger and the events read them without a device round trip
    sample_rates = torch.tensor(rates, dtype=torch.float64)
    noise_multipliers = torch.tensor(sigmas, dtype=torch.float32)
    sampler = PoissonSampler(data, sample_rates, rng) if period is None else CyclicSampler(data, period, seed)
    mechanism = own.mechanism if own is not None else \
        GaussianMechanism(noise_multipliers, config.privacy.clip) if private else None
    memory = _plan_memory(config, model, algorithm, data, rates, device)
    oracle = DataOracle(model, sampler, ledger, rng, mechanism, config.privacy.clip,
                        agents_per_pass=memory.agents_per_pass, augmentation=_augmentation(config, data))
    graphs = _graphs(config, topology, device)
    scheduler = Scheduler(config.schedule_kind, rng, len(parts), config.schedule.offline_probability,
                          config.schedule.participation, device=device)
    schedule = Schedule(algo_cfg.lr_schedule, algo_cfg.lr, algo_cfg.lr_final or algo_cfg.lr, config.experiment.rounds)
    warnings += algorithm.stability_warnings(topology, schedule)
    averaging = config.averaging
    simulator = Simulator(algorithm, graphs, oracle, scheduler, schedule, rng,
                          averaging=None if averaging.kind == "none" else
                          IterateAverage(averaging.kind, averaging.decay, averaging.start))
    held = None if validation is None else torch.from_numpy(validation).to(device)
    eval_x, eval_y = (dataset.x_test, dataset.y_test) if held is None else (dataset.x_train[held],
                                                                            dataset.y_train[held])
    evaluator = Evaluator(model, eval_x, eval_y,
                          chunk=evaluation_chunk(memory.agents_per_pass * memory.activation_bytes_per_agent,
                                                 memory.activation_bytes_per_sample, len(parts)))
    histograms = class_histograms(labels, parts, dataset.num_classes)
    setup = {
        **({"paper_accounting": own.paper_accounting} if own is not None else {}),
        **({"calibration_details": own.details} if own is not None and own.details else {}),
        **({"epsilon_observer": own.observer} if own is not None and own.observer else
           {"epsilon_observer": CYCLIC_AGENT_VIEW} if period is not None and private else {}),
        "n_agents": len(parts),
        "parameters": model.dim,
        "data_fingerprint": dataset.fingerprint(rng.fingerprint_key()),
        "agent_sizes": sizes,
        "sample_rates": rates,
        "noise_multipliers": sigmas,
        "epsilon_budgets": budgets,
        "releases_per_round": algorithm.releases_per_round,
        "setup_releases": algorithm.setup_releases,
        "sums_per_batch": sums.tolist(),
        "joint_accounting": algorithm.joint_accounting,
        "planned_releases": planned,
        "schedule": config.schedule_kind,
        "sampling": config.sampling_kind,
        **({} if period is None else {
            "batches": period, "expected_batches": oracle.expected_batch.double().tolist(),
            "batch_sizes": sampler.batch_sizes.tolist()}),
        "calibration_accountant": config.privacy.accountant,
        "neighbouring": config.privacy.neighbouring,
        "noise": config.privacy.noise,
        "topology": topology.report.as_dict(),
        "mixing_warnings": mixing_notes,
        "gradient_engine": model.backend,
        "gradient_engine_fallback_reason": model.fallback_reason,
        "memory_plan": memory.as_dict(),
        "evaluation_set": "test" if validation is None else f"validation: {len(validation)} records held out of "
                                                            "the agents' training data "
                                                            f"({cfg_data.validation_split})",
    }
    return Experiment(config, dataset, data, topology, model, algorithm, oracle, simulator, evaluator,
                      noise_multipliers, sample_rates, histograms, memory, graphs, schedule, setup, warnings, period)


def _mixing_notes(config: ExperimentConfig, algorithm: Algorithm, topology: Topology) -> list[str]:
    """What the run says about its mixing matrix: the topology's checks of it where the algorithm mixes with it,
    else that a mixing the config moved from its default changes nothing (with the other fields the algorithm does
    not read: :meth:`~decentdp.config.schema.ExperimentConfig.unread_by_the_algorithm`)."""
    return list(topology.warnings) if algorithm.reads_mixing else config.unread_by_the_algorithm()


def _privacy_warnings(config: ExperimentConfig, sizes: list[int]) -> list[str]:
    """Refuse a delta that voids the guarantee; warn about settings that weaken it without voiding it.

    (epsilon, delta)-DP with delta >= 1/n allows publishing a record outright, so such a delta is an
    error; the usual rule asks for delta well below 1/n.  A batch larger than an agent's data makes its
    sampling rate 1: nothing is amplified by subsampling, which is legal but rarely intended."""
    delta, smallest = config.privacy.delta, min(sizes)
    if delta >= 1 / smallest:
        raise ConfigError("privacy.delta", f"{delta:g} is not below 1/|D_i| = 1/{smallest}: such a guarantee "
                                           "allows an agent to publish one of its records in the clear")
    warnings = []
    if delta > 0.1 / smallest:
        warnings.append(f"privacy.delta = {delta:g} is not well below 1/|D_i| = 1/{smallest} (the usual rule "
                        f"is delta << 1/n, e.g. {10 ** math.floor(math.log10(0.01 / smallest)):g})")
    full = sum(config.algorithm.batch_size >= size for size in sizes) if config.sampling_kind == "poisson" else 0
    if full:
        warnings.append(f"algorithm.batch_size = {config.algorithm.batch_size} is at least the data of {full} "
                        f"agent(s) (smallest |D_i| = {smallest}): their sampling rate is q = 1, so Poisson "
                        "subsampling amplifies nothing for them")
    return warnings
