"""Experiment configuration: a TOML file validated by a pydantic schema.

Every field has a type, a range and a default; unknown keys are errors.  Validation failures are
turned into one :class:`~decentdp.errors.ConfigError` whose message names every field whose own type, range
or section check fails (``section.key``) with the allowed values, so the CLI can print it without a traceback.
The checks across sections (:meth:`ExperimentConfig._cross_field`) run once every section is valid, and
report the first field they refuse: fixing it may make the next one's message moot.
"""

from __future__ import annotations

import copy
import math
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from decentdp.algorithms import algorithm_class, algorithm_names
from decentdp.algorithms.base import Algorithm, AlgorithmSettings, Float32
from decentdp.config.personalized import PersonalizedSection, warm_start_overspend
from decentdp.data.partition import DIRICHLET_ALPHA_MAX, SIZE_SKEW_MAX
from decentdp.errors import ConfigError
from decentdp.models import check_model_options
from decentdp.topology import PARAM_USERS, check_graph_params

DatasetName = Literal["digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "a9a"]
PartitionName = Literal["iid", "overlap", "dirichlet", "unequal", "pathological"]
GraphName = Literal["complete", "ring", "star", "path", "grid", "torus", "erdos-renyi", "geometric", "fiedler",
                    "complete-bipartite", "k-regular", "two-star", "tree", "partial-mesh"]
MixingName = Literal["metropolis-hastings", "average", "max-degree"]
ModelName = Literal["convnet", "mlp", "lenet5", "cifar-cnn", "cga-cnn", "resnet9", "linear", "logistic"]


class _Section(BaseModel):
    # strict: no silent coercion ("3" -> 3, true -> 1 round); integers are still accepted for floats
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class ExperimentSection(_Section):
    name: str = Field("experiment", pattern=r"^\w[\w.-]*$",
                      description="letters, digits, '.', '_', '-' (it names the results folder, so no '/')")
    seed: int = Field(0, ge=0, lt=2**63, description="the run's seed (below 2**63: torch's generators take a "
                                                    "signed 64-bit seed)")
    rounds: int = Field(100, ge=1)
    eval_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="rounds between checkpoints; 0 = at evaluations only")

    @property
    def checkpoint_interval(self) -> int:
        """Rounds between checkpoints: ``checkpoint_every``, else ``eval_every``."""
        return self.checkpoint_every or self.eval_every


class DataSection(_Section):
    dataset: DatasetName = "digits"
    data_dir: str | None = None
    partition: PartitionName = "iid"
    overlap_t: float = Field(1.0, ge=0.0, le=1.0, description="A(t) of equation (8)")
    dirichlet_alpha: float = Field(0.5, gt=0.0, le=DIRICHLET_ALPHA_MAX, description=(
        "concentration of each class's Dirichlet proportions over the agents: small is strongly non-IID; at most "
        f"{DIRICHLET_ALPHA_MAX:g}, where every class is already cut into equal chunks to about 0.1 % (larger values "
        "change nothing, and near 1e308 numpy's sampler returns no proportions)"))
    size_skew: float = Field(1.0, gt=0.0, le=SIZE_SKEW_MAX, description=(
        "sigma of the lognormal agent sizes: near 0 equal sizes; at most "
        f"{SIZE_SKEW_MAX:g}, where the largest agent already holds 99 % of the records in a typical draw (larger "
        "values change little, and the weights e^(sigma z) overflow past sigma |z| = 709)"))
    image_size: int | None = Field(None, ge=4, description="resize images to this side once at load")
    validation_fraction: float = Field(0.0, ge=0.0, le=0.5, description="hold out this fraction of each agent's "
                                       "training records and evaluate on them instead of the test set (for "
                                       "tuning, e.g. decentdp sweep); 0 = evaluate on the test set")
    validation_split: Literal["exact-count", "per-record"] = Field(
        "exact-count", description="how the validation records are drawn: 'exact-count' (each agent holds out "
                                   "exactly floor(fraction * |D_i|) records, by a permutation that one added "
                                   "record redraws) or 'per-record' (each record held out with probability "
                                   "fraction by a keyed hash of its index, so no record's side depends on "
                                   "another's: what a private selection's epsilon assumes)")
    sampling: Literal["poisson", "cyclic"] | None = Field(
        None, description="how agents draw batches: 'poisson' (each record independently in each round, with "
                          "probability q = batch_size / |D_i|: amplified by sampling) or 'cyclic' (each agent's "
                          "records split once into b fixed batches, each record to one batch by a keyed hash of "
                          "its index; round t uses batch t mod b, every release unsampled); default: the "
                          "algorithm's own (poisson, except mafalda-sgd)")
    batches: int | None = Field(None, ge=1, description="cyclic sampling: b, the batches each agent's records are "
                                                        "split into (default: the smallest agent's records over "
                                                        "algorithm.batch_size, at least 1 and at most "
                                                        "experiment.rounds)")


class TopologySection(_Section):
    graph: GraphName = "complete"
    agents: int = Field(10, ge=1)
    mixing: MixingName = "metropolis-hastings"
    p: float | None = Field(None, gt=0.0, le=1.0)
    radius: float | None = Field(None, gt=0.0)
    k: int | None = Field(None, ge=1)
    fiedler: float | None = Field(None, gt=0.0, le=1.0, description="target normalized Fiedler value")
    fiedler_tol: float = Field(0.01, gt=0.0)
    rows: int | None = Field(None, ge=1)
    redraw_every: int = Field(0, ge=0, description="redraw a random graph every this many rounds (0: a fixed "
                                                  "graph); each draw depends only on the seed and the epoch")

    @property
    def graph_params(self) -> dict[str, float | int]:
        """The graph parameters set (``p``, ``radius``, ``k``, ``fiedler``, ``rows``) with ``fiedler_tol``, as
        :func:`decentdp.topology.make_graph` takes them."""
        given = {key: getattr(self, key) for key in PARAM_USERS if getattr(self, key) is not None}
        return {**given, "fiedler_tol": self.fiedler_tol}


class ModelSection(_Section):
    name: ModelName = "mlp"
    options: dict[str, Any] = Field(default_factory=dict)


class AlgorithmSection(_Section):
    """The algorithm, its learning rate and batch, and its own settings (validated by its registry entry)."""

    model_config = ConfigDict(_Section.model_config, extra="allow")

    name: str = "dp-dsgt"
    lr: Float32 = Field(0.1, gt=0.0)
    lr_final: Float32 | None = Field(None, gt=0.0)
    lr_schedule: Literal["constant", "logspace", "cosine"] = "constant"
    batch_size: int = Field(64, ge=1, description="expected Poisson batch size L; q_i = L / |D_i|")
    _settings: AlgorithmSettings | None = PrivateAttr(default=None)
    _ignored: dict[str, Any] = PrivateAttr(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in algorithm_names():
            allowed = ", ".join(repr(name) for name in algorithm_names())
            raise ValueError(f"{value!r} is not one of the allowed values: {allowed}")
        return value

    @model_validator(mode="after")
    def _own_settings(self, info: ValidationInfo) -> AlgorithmSection:
        settings_cls = algorithm_class(self.name).Settings
        own = settings_cls.model_fields
        if self.__pydantic_extra__ is None:
            self.__pydantic_extra__ = {}
        extras = self.__pydantic_extra__
        written = (info.context or {}).get(EXPLICIT_KEYS, frozenset())  # given with --set: never dropped
        for key in [key for key in extras if key not in own]:
            owners = _algorithms_with_setting(key)
            if key not in written and owners and any(_is_default(name, key, extras[key]) for name in owners):
                # resolved configs of other algorithms list it at its default: dropped, and said at run time
                self._ignored[key] = extras.pop(key)
                continue
            allowed = ", ".join(sorted([*type(self).model_fields, *own]))
            raise _FieldError(f"algorithm.{key}",
                              f"is not used by algorithm '{self.name}'; remove it (allowed keys: {allowed})" if owners
                              else f"unknown key; allowed keys for algorithm '{self.name}': {allowed}")
        try:
            self._settings = settings_cls.model_validate(dict(extras))
        except ValidationError as exc:
            field, message = _describe({**exc.errors()[0], "loc": ("algorithm", *exc.errors()[0]["loc"])})
            if field == "algorithm" and ": " in message:  # a settings-level check names its own field
                name, _, message = message.partition(": ")
                field = f"algorithm.{name}"
            raise _FieldError(field, message) from None
        extras.clear()
        extras.update(self._settings.model_dump())  # the resolved settings, defaults included
        return self

    @property
    def settings(self) -> AlgorithmSettings:
        """The algorithm's own validated settings."""
        assert self._settings is not None
        return self._settings

    @property
    def ignored_notices(self) -> list[str]:
        """One line per key dropped because it is another algorithm's setting at that algorithm's default (as a
        resolved config of that algorithm lists it): it changes nothing, but a user who wrote it meant something."""
        return [f"algorithm.{key} = {value!r} is not a setting of '{self.name}' and was ignored (it is the default "
                f"of {', '.join(repr(name) for name in _algorithms_with_setting(key) if _is_default(name, key, value))}"
                ", so a resolved config of that algorithm lists it)" for key, value in self._ignored.items()]


def _algorithms_with_setting(key: str) -> list[str]:
    """The registered algorithms that have a setting named ``key``."""
    return [name for name in algorithm_names() if key in algorithm_class(name).Settings.model_fields]


def _is_default(name: str, key: str, value: Any) -> bool:
    default = algorithm_class(name).Settings.model_fields[key].default
    return default == value and type(default) is type(value)


class ScheduleSection(_Section):
    """Which agents take part in each round (see :mod:`decentdp.runtime.scheduler`)."""

    kind: Literal["auto", "synchronous", "pairing", "poisson-clocks", "sampled"] = Field(
        "auto", description="auto: the algorithm's own protocol")
    offline_probability: float = Field(0.0, ge=0.0, lt=1.0, description="each agent is offline in a round with "
                                                                        "this probability")
    participation: float = Field(1.0, gt=0.0, le=1.0, description="sampled: probability that an online agent "
                                                                  "takes part")


class AveragingSection(_Section):
    """Each agent's average of its own iterates, evaluated and reported in place of its last iterate
    (post-processing: no release, no privacy cost; see :mod:`decentdp.runtime.averaging`)."""

    kind: Literal["none", "ema", "uniform"] = Field(
        "none", description="none: evaluate the last iterate; ema: exponential moving average; uniform: the "
                            "mean of every iterate from round `start` on (Polyak-Ruppert)")
    decay: float = Field(0.999, gt=0.0, lt=1.0, description="ema: the weight kept per round (a window of about "
                                                            "1/(1-decay) rounds)")
    start: int = Field(0, ge=0, description="the first round whose iterate is averaged; before it the average is "
                                            "the last iterate")


class AugmentationSection(_Section):
    """Augmentation multiplicity (De et al. 2022; :mod:`decentdp.data.augment`): each sampled image trains
    as the mean gradient of ``copies`` random augmentations, clipped once. The privacy cost is unchanged
    (a record still moves one clipped term); the gradient work grows ``copies`` times."""

    kind: Literal["none", "shift", "shift-flip"] = Field(
        "none", description="none; shift: random translations by up to `shift` pixels (reflection padding); "
                            "shift-flip: also a random horizontal flip (not for digits)")
    copies: int = Field(1, ge=1, le=64, description="augmented copies of each sampled record whose gradients are "
                                                    "averaged before clipping")
    shift: int = Field(2, ge=0, le=16, description="largest translation in pixels, in each direction")


class EngineSection(_Section):
    """How the simulator computes, not what: these settings change results only by floating-point rounding,
    except ``noise_streams``, which draws other noise of the same distribution."""

    gradients: Literal["auto", "stacked", "vmap"] = Field(
        "auto", description="per-sample gradient engine: stacked layer rules (fast), torch.func vmap (any "
                            "model), or auto (stacked when the model allows it)")
    memory_limit_gb: float | None = Field(None, gt=0.0, description="peak memory to plan for; default: "
                                                                     "what the OS reports available")
    agents_per_pass: int | None = Field(None, ge=1, description="agents whose gradients are computed at once; "
                                                                "default: as many as fit in memory")
    threads: int | None = Field(None, ge=1, le=1024, description="compute threads (at most 1024: far more start "
                                                                 "no library's thread pool); default: chosen at the "
                                                                 "start of a run (decentdp.util.threads): "
                                                                 "MKL_NUM_THREADS or OMP_NUM_THREADS if set, one "
                                                                 "thread for a round of small kernels, else the "
                                                                 "cores this process may use (affinity, CPU quota) "
                                                                 "less those other processes keep busy")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where the run computes: 'auto' (CUDA when present, else the CPU), 'cpu', "
                                    "'cuda' or 'cuda:K'")
    noise_streams: Literal["auto", "per-row", "batched"] = Field(
        "auto", description="how per-agent noise rows are drawn, with the same keys: 'per-row' (one re-seeded "
                            "generator per row, fastest on a CPU), 'batched' (all rows in one Philox4x32-10 "
                            "computation, fastest on a GPU, and the same numbers on a CPU), or 'auto' (batched "
                            "on CUDA, per-row otherwise); changes the noise drawn, not its distribution")
    backend: Literal["simulator", "ray"] = Field(
        "simulator", description="'simulator': every agent in this process; 'ray': agents sharded over Ray worker "
                                 "processes (pip install 'decentdp[ray]'), with the same results")
    workers: int = Field(1, ge=1, description="worker processes of the ray backend, each holding a contiguous "
                                              "shard of agents (at most the number of agents)")
    address: str = Field("", description="the ray backend's cluster: empty starts Ray on this machine (bound to "
                                         "127.0.0.1), 'auto' or 'host:port' attaches to a running cluster")


class TrackingSection(_Section):
    """Where a run also logs, besides its results folder (:mod:`decentdp.experiment.tracking`; the ``tracking`` extra):
    its config as parameters, its metrics at every evaluation, each agent's epsilon spent, its files."""

    backend: Literal["none", "tensorboard", "mlflow"] = "none"
    log_dir: str | None = Field(None, min_length=1, description="TensorBoard: the log directory (default: "
                                                                "tensorboard/ in the results folder, else "
                                                                "runs/<experiment.name>)")
    uri: str | None = Field(None, min_length=1, description="MLflow: the tracking URI, e.g. a server's "
                                                            "http://127.0.0.1:5000 (default: the local store "
                                                            "sqlite:///mlflow.db in the current directory)")
    experiment: str = Field("decentdp", min_length=1, description="MLflow: the experiment runs are logged under")
    parent_run: str | None = Field(None, min_length=1, description="MLflow: the run this one nests under (set by "
                                                                   "decentdp sweep for its trials)")

    @model_validator(mode="after")
    def _fields_of_the_backend(self) -> TrackingSection:
        for field, backend in (("log_dir", "tensorboard"), ("uri", "mlflow"), ("parent_run", "mlflow")):
            if getattr(self, field) is not None and self.backend != backend:
                raise _FieldError(f"tracking.{field}", f"is a setting of backend = \"{backend}\", not of "
                                                       f"\"{self.backend}\"")
        return self


#: Fields that say where a run computes or logs, not what it computes: a run may resume with other values.
#: (``engine.threads`` changes only the last bits of float sums; a resume that leaves it unset takes the count the
#: run checkpointed with, and ends bit for bit as the uninterrupted run.)
PLACEMENT_FIELDS = ("engine.backend", "engine.workers", "engine.address", "engine.device", "engine.threads",
                    "tracking.backend", "tracking.log_dir", "tracking.uri", "tracking.experiment",
                    "tracking.parent_run")
#: Fields that say how often a run records itself (evaluations, checkpoints), not what it computes: evaluation
#: and checkpoints draw nothing from the run's streams, so a run may resume with other values and ends the same.
RECORDING_FIELDS = ("experiment.eval_every", "experiment.checkpoint_every")


class PrivacySection(_Section):
    model_config = ConfigDict(_Section.model_config, allow_inf_nan=True)  # epsilon = inf: non-private

    epsilon: float | None = Field(None, description="target epsilon per agent (required unless agent_epsilons is "
                                                    "given); 'inf' = a deliberately non-private run")
    delta: float = Field(1e-5, gt=0.0, lt=1.0)
    clip: Float32 = Field(1.0, gt=0.0, allow_inf_nan=False)
    accountant: Literal["tight", "pld", "rdp"] = Field(
        "tight", description="accountant that calibrates sigma, enforces budgets and reports epsilon: tight (the "
                             "smaller of PLD and RDP, and of basic composition where every release is pure DP; all "
                             "sound), pld or rdp alone")
    neighbouring: Literal["add-remove", "replace-one"] = Field(
        "add-remove", description="neighbouring datasets differ by adding/removing one record (the DP-SGD "
                                  "papers' relation; assumes an agent's dataset size is not secret) or by "
                                  "replacing one (consistent with published sizes; about 2x the epsilon)")
    noise: Literal["simulation", "secure"] = Field(
        "simulation", description="simulation: noise and batches reproducible from experiment.seed (not private "
                                  "against anyone with the config); secure: per-agent secret keys from the OS, "
                                  "ChaCha20, hardened Gaussians (not reproducible)")
    key_dir: str | None = Field(None, description="secure mode: directory of the per-run key file (mode 0600; "
                                                  "default $DECENTDP_KEY_DIR, else ~/.local/state/decentdp/keys); "
                                                  "never inside the results folder")
    agent_epsilons: list[float] | None = Field(None, min_length=1,
                                               description="per-agent budgets (overrides epsilon)")
    colluding: list[list[int]] = Field(
        default_factory=list, description="sets of agents (ids) that pool what they see and know (messages, noise, "
                                          "edge keys): algorithms priced by the observer-view accountant report "
                                          "each sender's epsilon towards each set, and correlated-noise ones "
                                          "calibrate for them too")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "secure_noise" in data:
            raise _FieldError("privacy.secure_noise", "was replaced by privacy.noise = 'secure' (per-agent secret "
                                                      "keys) or 'simulation' (reproducible from the seed)")
        return data

    @field_validator("epsilon", mode="before")
    @classmethod
    def _parse_inf(cls, value: Any) -> Any:
        return _parse_infinity(value)

    @field_validator("agent_epsilons", mode="before")
    @classmethod
    def _parse_infs(cls, value: Any) -> Any:
        return [_parse_infinity(v) for v in value] if isinstance(value, list) else value

    @field_validator("epsilon")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        if value is not None and (math.isnan(value) or value <= 0):
            raise ValueError("must be a positive number or 'inf' (non-private)")
        return value

    @model_validator(mode="after")
    def _budget_stated(self) -> PrivacySection:
        if self.epsilon is None and self.agent_epsilons is None:
            raise _FieldError("privacy.epsilon", _NO_BUDGET)
        return self

    @field_validator("agent_epsilons")
    @classmethod
    def _all_positive(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and any(math.isnan(v) or v <= 0 for v in value):
            raise ValueError("every per-agent epsilon must be a positive number")
        return value

    @field_validator("colluding")
    @classmethod
    def _sets(cls, value: list[list[int]]) -> list[list[int]]:
        for index, members in enumerate(value):
            if not members:
                raise ValueError(f"set {index} is empty: name the agents that collude")
            if len(set(members)) != len(members):
                raise ValueError(f"set {index} names an agent twice: {members}")
        return value

    @property
    def budgets(self) -> list[float]:
        """The stated budgets: one per agent, or the one epsilon every agent has."""
        return list(self.agent_epsilons) if self.agent_epsilons is not None else [float(self.epsilon or math.inf)]

    @property
    def private(self) -> bool:
        return any(math.isfinite(b) for b in self.budgets)


_NO_BUDGET = ("is required: state each agent's privacy budget (e.g. epsilon = 1.0), or epsilon = 'inf' for a "
              "deliberately non-private run")


def _parse_infinity(value: Any) -> Any:
    """TOML has ``inf`` but users write ``"inf"``; both mean no budget (non-private)."""
    if isinstance(value, str) and value.strip().lower() in {"inf", "infinity", "none", "non-private"}:
        return math.inf
    return value


class ExperimentConfig(_Section):
    """A whole run: what data, which graph, which model, which algorithm, what privacy."""

    experiment: ExperimentSection = Field(default_factory=ExperimentSection)
    data: DataSection = Field(default_factory=DataSection)
    topology: TopologySection = Field(default_factory=TopologySection)
    model: ModelSection = Field(default_factory=ModelSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    privacy: PrivacySection  # required: a run without a stated budget must not train silently without privacy
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    averaging: AveragingSection = Field(default_factory=AveragingSection)
    augmentation: AugmentationSection = Field(default_factory=AugmentationSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    personalized: PersonalizedSection | None = Field(
        None, description="Bellet et al.'s personalized models (decentdp.personalized): when present, the run uses "
                          "this section, [privacy], [experiment] seed/eval_every and data.data_dir only")

    @property
    def pools_data(self) -> bool:
        """Whether the algorithm trains one model on all agents' data (central baselines)."""
        return algorithm_class(self.algorithm.name).pools_data

    @property
    def sampling_kind(self) -> str:
        """How agents draw batches: the configured ``data.sampling``, or the algorithm's own default."""
        return self.data.sampling or algorithm_class(self.algorithm.name).samplings[0]

    @property
    def schedule_kind(self) -> str:
        """The round schedule that runs: the configured one, or the algorithm's own protocol."""
        kind = self.schedule.kind
        return algorithm_class(self.algorithm.name).schedules[0] if kind == "auto" else kind

    @model_validator(mode="after")
    def _cross_field(self) -> ExperimentConfig:
        algo, topo, privacy = self.algorithm, self.topology, self.privacy
        if self.personalized is not None:  # its own runner: [algorithm], [model], [topology] are not read
            self._personalized_reads_every_field_set()
            if self.schedule.kind not in ("auto", "poisson-clocks"):
                raise _FieldError("schedule.kind", "personalized runs wake agents by Poisson clocks: use 'auto' or "
                                                   "'poisson-clocks'")
            if self.engine.device.startswith("cuda"):
                raise _FieldError("engine.device", "personalized runs compute on the CPU (small per-agent models, "
                                                   "seconds a run): use 'auto' or 'cpu'")
            overspend = warm_start_overspend(self.personalized, privacy.epsilon or math.inf) \
                if privacy.private else None
            if overspend is not None:
                raise _FieldError("personalized.warm_start_epsilon", overspend)
            if privacy.private and self.personalized.method == "cd" and privacy.neighbouring != "replace-one":
                raise _FieldError("privacy.neighbouring", "private personalized updates need 'replace-one': each "
                                  "agent's record count m_i sets its step, its confidence c_i, its lambda_i = 1/m_i "
                                  "and the 1/m_i of its released mean, and MovieLens' per-user 80/20 split redraws "
                                  "other records when one is added, so the epsilon cannot cover adding or removing "
                                  "a record")
            return self
        if algo.lr_schedule != "constant" and algo.lr_final is None:
            raise _FieldError("algorithm.lr_final", f"is required by lr_schedule = '{algo.lr_schedule}'")
        if self.engine.backend == "ray" and self.engine.device.startswith("cuda"):
            raise _FieldError("engine.device", f"'{self.engine.device}' cannot run with engine.backend = 'ray': its "
                                               "workers are given no GPU and exchange rows as gloo messages of CPU "
                                               "tensors; use engine.device = 'auto' or 'cpu' (the CPU), or "
                                               "engine.backend = 'simulator' for CUDA")
        try:
            check_model_options(self.model.name, self.model.options)
        except ConfigError as error:
            raise _FieldError(error.field, error.message) from None
        supported = algorithm_class(algo.name).schedules
        if self.schedule_kind not in supported:
            raise _FieldError("schedule.kind", f"'{self.schedule_kind}' is not supported by algorithm '{algo.name}' "
                                               f"(supported: {', '.join(supported)})")
        chosen = algorithm_class(algo.name)
        if self.sampling_kind not in chosen.samplings:
            note = f": {chosen.sampling_note}" if chosen.sampling_note else ""
            raise _FieldError("data.sampling", f"'{self.sampling_kind}' is not supported by algorithm '{algo.name}' "
                                               f"(supported: {', '.join(chosen.samplings)}){note}")
        if self.sampling_kind == "cyclic":
            built = chosen.from_settings(algo.settings)  # (its release counts may follow its settings)
            if built.releases_per_round != 1 or built.setup_releases:
                raise _FieldError("data.sampling", f"'cyclic' charges each agent once per pass over its batches, one "
                                                   f"release per round; algorithm '{algo.name}' makes "
                                                   f"{built.releases_per_round} per round and {built.setup_releases} "
                                                   "before round 0 with these settings: use 'poisson'")
        self._refuse_what_the_algorithm_cannot_price(chosen)
        if self.schedule.offline_probability and not algorithm_class(algo.name).follows_plan:
            raise _FieldError("schedule.offline_probability", f"algorithm '{algo.name}' does not let agents go "
                                                               "offline (its rounds involve every agent)")
        self._refuse_fields_outside_their_mode(MODE_ONLY)
        if topo.redraw_every and topo.graph not in _RANDOM_GRAPHS:
            raise _FieldError("topology.redraw_every", f"redraws a random graph; graph = '{topo.graph}' is fixed "
                                                       f"(random graphs: {', '.join(_RANDOM_GRAPHS)})")
        if privacy.agent_epsilons is not None and not self.pools_data \
                and len(privacy.agent_epsilons) != topo.agents:
            raise _FieldError("privacy.agent_epsilons",
                               f"has {len(privacy.agent_epsilons)} entries but topology.agents = {topo.agents}")
        if privacy.colluding and not algorithm_class(algo.name).reports_colluding:
            reporting = ", ".join(name for name in algorithm_names() if algorithm_class(name).reports_colluding)
            raise _FieldError("privacy.colluding", f"algorithm '{algo.name}' reports one epsilon per agent that "
                                                   f"bounds all other agents together, so it prices no colluding "
                                                   f"set apart (those that do: {reporting}); remove it")
        for index, members in enumerate(privacy.colluding):
            unknown = [agent for agent in members if not 0 <= agent < topo.agents]
            if unknown:
                raise _FieldError(f"privacy.colluding.{index}",
                                  f"names agent(s) {unknown}, but the run's agents are 0..{topo.agents - 1} "
                                  f"(topology.agents = {topo.agents})")
        for key, users in PARAM_USERS.items():
            if getattr(topo, key) is not None and topo.graph not in users and not self.pools_data:
                raise _FieldError(f"topology.{key}", f"is not used by graph = '{topo.graph}' (only by "
                                                     f"{', '.join(users)}); remove it, e.g. --set ~topology.{key}")
        if self.augmentation.kind == "none" and self.augmentation.copies > 1:
            raise _FieldError("augmentation.copies", f"is {self.augmentation.copies}, but augmentation.kind = 'none' "
                                                     "would make identical copies; choose a kind or copies = 1")
        if self.averaging.kind != "none" and self.averaging.start >= self.experiment.rounds:
            raise _FieldError("averaging.start", f"is {self.averaging.start}, but the run has only "
                                                 f"{self.experiment.rounds} rounds: nothing would be averaged")
        needed = GRAPH_REQUIRES.get(topo.graph)
        if needed is not None and getattr(topo, needed) is None and not self.pools_data:
            raise _FieldError(f"topology.{needed}", f"is required by graph = '{topo.graph}'")
        if not self.pools_data:  # the graph's shape, degree and Fiedler reach; not the random search (the dry-run's)
            try:
                check_graph_params(topo.graph, topo.agents, **topo.graph_params)
            except ConfigError as error:
                raise _FieldError(error.field, error.message) from None
        return self

    def _refuse_what_the_algorithm_cannot_price(self, chosen: type[Algorithm]) -> None:
        """The privacy settings the algorithm's class declares it cannot serve (:attr:`Algorithm.adds_noise`,
        ``fixed_graph_reason``, ``finite_budgets_reason``, ``noise_modes``), refused here rather than when the run
        calibrates, after its data loads (``--dry-run`` checks them too)."""
        privacy, name = self.privacy, self.algorithm.name
        if not privacy.private:
            return
        if not chosen.adds_noise:
            raise _FieldError("privacy.epsilon" if privacy.agent_epsilons is None else "privacy.agent_epsilons",
                              f"algorithm '{name}' adds no noise: set privacy.epsilon = 'inf' (a deliberately "
                              "non-private run)")
        if chosen.fixed_graph_reason is not None and self.topology.redraw_every:
            raise _FieldError("topology.redraw_every", f"algorithm '{name}' needs one fixed graph "
                                                       f"({chosen.fixed_graph_reason}): set it to 0")
        if chosen.finite_budgets_reason is not None and not all(math.isfinite(b) for b in privacy.budgets):
            raise _FieldError("privacy.agent_epsilons", f"algorithm '{name}' needs a finite budget for every agent "
                                                        f"({chosen.finite_budgets_reason}): give each agent one")
        if privacy.noise not in chosen.noise_modes:
            raise _FieldError("privacy.noise", f"'{privacy.noise}' is not supported by algorithm '{name}' (supported: "
                                               f"{', '.join(chosen.noise_modes)}): {chosen.noise_mode_note}")

    def _personalized_reads_every_field_set(self) -> None:
        """A personalized run refuses any field outside :data:`PERSONALIZED_READS` that differs from its default."""
        for section in type(self).model_fields:
            if section == "personalized":
                continue
            values = getattr(self, section)
            for key in type(values).model_fields:
                dotted = f"{section}.{key}"
                if key in PERSONALIZED_READS.get(section, ()) or not _differs_from_default(self, dotted):
                    continue
                why = _PERSONALIZED_WHY.get(dotted, _PERSONALIZED_READS_IN_WORDS)
                raise _FieldError(dotted, f"is not read by a [personalized] run ({why}); remove it, e.g. "
                                          f"--set ~{dotted}")
        settings = self.algorithm.settings  # the [algorithm] extras, resolved: defaults unless the user set them
        for key, field in type(settings).model_fields.items():
            if getattr(settings, key) != field.get_default(call_default_factory=True):
                raise _FieldError(f"algorithm.{key}", f"is not read by a [personalized] run "
                                                      f"({_PERSONALIZED_READS_IN_WORDS}); remove it")
        self._refuse_fields_outside_their_mode([row for row in MODE_ONLY if row[0].split(".")[1] in
                                                PERSONALIZED_READS.get(row[0].split(".")[0], ())])

    @property
    def notices(self) -> list[str]:
        """What a run says of this config when it starts, known from the config alone (``decentdp run --dry-run``
        prints them too): the ``[algorithm]`` keys dropped as another algorithm's defaults
        (:attr:`AlgorithmSection.ignored_notices`) and the fields set that the algorithm does not read
        (:meth:`unread_by_the_algorithm`)."""
        return [*self.algorithm.ignored_notices, *self.unread_by_the_algorithm()]

    def unread_by_the_algorithm(self) -> list[str]:
        """One line naming the fields set away from their defaults that the algorithm does not read, if any: every
        ``[topology]`` field and the partition where it pools all agents' data into one (``pools_data``), every
        ``[topology]`` field but ``agents`` where its agents never communicate (``communicates``), and
        ``topology.mixing`` where it weights its neighbours itself (``reads_mixing``).  They are accepted (a
        baseline shares its config with the runs it is compared with), and said."""
        unread, why = self._ignored_by_the_algorithm()
        set_here = [dotted for dotted in unread if _differs_from_default(self, dotted)]
        if not set_here:
            return []
        named = ", ".join(f"{dotted} = {getattr(getattr(self, dotted.split('.')[0]), dotted.split('.')[1])!r}"
                          for dotted in set_here)
        return [f"{named} {'changes' if len(set_here) == 1 else 'change'} nothing: {why}"]

    def _ignored_by_the_algorithm(self) -> tuple[list[str], str]:
        """The fields the algorithm never reads, whatever their values (:meth:`unread_by_the_algorithm` says which
        of them are set), and why."""
        chosen, name = algorithm_class(self.algorithm.name), self.algorithm.name
        topology = [f"topology.{key}" for key in TopologySection.model_fields]
        if chosen.pools_data:
            return ([*topology, "data.partition", "data.overlap_t", "data.dirichlet_alpha", "data.size_skew"],
                    f"'{name}' trains one model on all agents' data pooled (no graph, no partition)")
        if not chosen.communicates:
            return ([dotted for dotted in topology if dotted != "topology.agents"],
                    f"'{name}' trains each agent alone and sends no message (no graph)")
        if not chosen.reads_mixing:
            return ["topology.mixing"], f"'{name}' weights its neighbours in its own update rule, not with a mixing " \
                                        "matrix"
        return [], ""

    def unread_with_reasons(self) -> dict[str, str]:
        """Every field this run does not read, whatever its value, and why: those of a mode it does not have
        (:data:`MODE_ONLY`), the knobs whose switch is off (:data:`QUIET_KNOBS`), and those its algorithm ignores
        (:meth:`unread_by_the_algorithm`).  A sweep refuses to search one (every trial would be the same run)."""
        unread = {dotted: f"{dotted} is read with {switch} only" for dotted, reads, switch in (*MODE_ONLY, *QUIET_KNOBS)
                  if not reads(self)}
        ignored, why = self._ignored_by_the_algorithm()
        return unread | dict.fromkeys(ignored, why)

    def unread_fields(self) -> list[str]:
        """The fields this run does not read: those of a mode it does not have (:data:`MODE_ONLY`) and the knobs
        whose switch is off (:data:`QUIET_KNOBS`).  A report leaves them out, so that a knob left behind does not
        split one setting into two rows, and a default of another mode (``data.overlap_t`` in a Dirichlet run)
        matches no paper row."""
        return [dotted for dotted, reads, _ in (*MODE_ONLY, *QUIET_KNOBS) if not reads(self)]

    def _refuse_fields_outside_their_mode(self, rows: Sequence[tuple[str, Callable[[ExperimentConfig], bool],
                                                                     str]]) -> None:
        """The first of ``rows`` (:data:`MODE_ONLY`'s) whose field this run's mode does not read, yet is set."""
        for dotted, reads, mode in rows:
            if not reads(self) and _differs_from_default(self, dotted):
                raise _FieldError(dotted, f"is used with {mode} only, which this run does not have; remove it, "
                                          f"e.g. --set ~{dotted}")

    def to_toml_dict(self) -> dict[str, Any]:
        """The resolved config as TOML-writable data ('inf' for infinity, no None values), with the
        algorithm's own settings (defaults included) inside ``[algorithm]``."""
        return toml_ready(self.model_dump())


def _section_default(section: BaseModel, key: str) -> Any:
    return type(section).model_fields[key].get_default(call_default_factory=True)


def _differs_from_default(config: ExperimentConfig, dotted: str) -> bool:
    """Whether ``section.key`` holds anything but its default (a resolved config writes defaults back, so "set"
    has to mean "not the default")."""
    section, key = dotted.split(".")
    value = getattr(getattr(config, section), key)
    return value != _section_default(getattr(config, section), key)


#: Fields that one mode of a run reads and every other ignores: (field, whether this run reads it, the mode in
#: words).  These say what a run is (its data split, graph, participation, noise keys), so outside its mode such a
#: field must keep its default: a Dirichlet alpha without the Dirichlet partition is a mistake, not a preference.
#: The knobs of how a run trains or where it runs stay quiet when their switch is off (``algorithm.lr_final`` under
#: a constant schedule, ``averaging.decay`` with averaging off, ``engine.workers`` in the simulator): overrides and
#: sweeps turn those modes off and leave their knobs behind.
MODE_ONLY: tuple[tuple[str, Callable[[ExperimentConfig], bool], str], ...] = (
    ("data.overlap_t", lambda c: c.data.partition == "overlap", "data.partition = 'overlap'"),
    ("data.dirichlet_alpha", lambda c: c.data.partition == "dirichlet", "data.partition = 'dirichlet'"),
    ("data.size_skew", lambda c: c.data.partition == "unequal", "data.partition = 'unequal'"),
    ("data.image_size", lambda c: c.data.dataset not in _FEATURE_DATASETS, "image datasets"),
    ("augmentation.kind", lambda c: c.data.dataset not in _FEATURE_DATASETS, "image datasets"),
    ("data.batches", lambda c: c.sampling_kind == "cyclic", "data.sampling = 'cyclic'"),
    ("topology.fiedler_tol", lambda c: c.topology.graph == "fiedler", "topology.graph = 'fiedler'"),
    ("schedule.participation", lambda c: c.schedule_kind == "sampled", "schedule.kind = 'sampled'"),
    ("engine.noise_streams", lambda c: c.privacy.noise == "simulation",
     "privacy.noise = 'simulation' (secure mode draws from each agent's own key)"),
    ("privacy.key_dir", lambda c: c.privacy.noise == "secure", "privacy.noise = 'secure'"),
)

#: The knobs of one mode that a run accepts, and ignores, while their switch is off (:data:`MODE_ONLY`'s comment
#: says why): (field, whether this run reads it, the switch in words).
QUIET_KNOBS: tuple[tuple[str, Callable[[ExperimentConfig], bool], str], ...] = (
    ("algorithm.lr_final", lambda c: c.algorithm.lr_schedule != "constant", "algorithm.lr_schedule != 'constant'"),
    ("data.validation_split", lambda c: c.data.validation_fraction > 0, "data.validation_fraction > 0"),
    ("averaging.decay", lambda c: c.averaging.kind == "ema", "averaging.kind = 'ema'"),
    ("averaging.start", lambda c: c.averaging.kind != "none", "averaging.kind != 'none'"),
    ("augmentation.shift", lambda c: c.augmentation.kind != "none", "augmentation.kind != 'none'"),
)

#: What a ``[personalized]`` run reads besides its own section (:mod:`decentdp.personalized.runner`): every other
#: field must keep its default.
PERSONALIZED_READS: dict[str, tuple[str, ...]] = {
    "experiment": ("name", "seed", "eval_every"),
    "data": ("data_dir",),
    "privacy": ("epsilon", "delta", "clip", "accountant", "neighbouring", "noise"),
    "schedule": ("kind",),
    "engine": ("threads", "noise_streams", "device"),
}

#: Why a personalized run cannot take a field it does not read, where a reason helps.
_PERSONALIZED_WHY = {
    "experiment.rounds": "its length is set by personalized.wakeups, the wake-ups per agent",
    "privacy.agent_epsilons": "it takes one budget for every agent: privacy.epsilon",
    "privacy.colluding": "its reported epsilon already bounds all other agents together",
    "engine.backend": "it runs in one process (it takes seconds)",
}

_PERSONALIZED_READS_IN_WORDS = ("its runner reads [personalized], [privacy] (one budget), experiment.name, seed and "
                                "eval_every, data.data_dir, schedule.kind, and engine.threads, device and "
                                "noise_streams only")

_FEATURE_DATASETS = ("a9a",)
_RANDOM_GRAPHS = ("erdos-renyi", "geometric", "fiedler", "k-regular", "partial-mesh")
GRAPH_REQUIRES: dict[str, str] = {"erdos-renyi": "p", "geometric": "radius", "fiedler": "fiedler", "k-regular": "k",
                                  "partial-mesh": "p"}
"""The ``[topology]`` parameter each graph family requires (``decentdp list graphs`` shows it)."""


class _FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def toml_ready(value: Any) -> Any:
    """``value`` as TOML can write it: 'inf' for infinity, None values left out (what a resolved config.toml holds)."""
    if isinstance(value, dict):
        return {k: toml_ready(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [toml_ready(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys of the section that holds ``loc``'s last part (an optional section, ``X | None``, included)."""
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sections = [] if field is None else [kind for kind in (field.annotation, *get_args(field.annotation))
                                             if isinstance(kind, type) and issubclass(kind, BaseModel)]
        if not sections:
            return []
        model = sections[0]
    return sorted(model.model_fields)


def _describe(error: dict[str, Any]) -> tuple[str, str]:
    loc = tuple(error["loc"])
    field = ".".join(str(part) for part in loc)
    kind = error["type"]
    given = error.get("input")
    if kind == "missing" and loc == ("privacy",):
        return "privacy.epsilon", f"[privacy] {_NO_BUDGET}"
    if kind == "extra_forbidden":
        keys = _section_keys(loc)
        where = f"allowed keys: {', '.join(keys)}" if keys else "no such section"
        return field, f"unknown key; {where}"
    if kind == "literal_error":
        return field, f"{given!r} is not one of the allowed values: {error['ctx']['expected']}"
    if kind == "value_error" and isinstance(error.get("ctx", {}).get("error"), _FieldError):
        inner: _FieldError = error["ctx"]["error"]
        return inner.field, inner.message
    message = error["msg"].removeprefix("Value error, ")
    if kind == "value_error" and len(loc) == 1:  # a section-level check that names its own field ("key: ...")
        name, separator, rest = message.partition(": ")
        if separator and name in _section_keys((*loc, name)):
            return f"{field}.{name}", rest
    return field, f"{message} (got {given!r})" if given is not None and not isinstance(given, dict) else message


def flat_fields(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as dotted fields, e.g. ``{'experiment.rounds': 100, ...}`` (a model's ``options``
    table stays one value)."""
    def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, dict) and key != "options":
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    return flat(config.to_toml_dict())


def config_differences(old: ExperimentConfig, new: ExperimentConfig) -> list[str]:
    """The dotted fields whose resolved values differ between two configs, e.g. ``['experiment.rounds']``."""
    before, after = flat_fields(old), flat_fields(new)
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))


#: Validation context: the ``[algorithm]`` keys the user gave explicitly (``--set``), which are errors when
#: the algorithm does not use them, even at another algorithm's default (a file's are dropped then: resolved
#: configs of earlier versions listed every algorithm's settings).
EXPLICIT_KEYS = "explicit_algorithm_keys"


def validate_config(raw: dict[str, Any], explicit: frozenset[str] = frozenset()) -> ExperimentConfig:
    """Validate a raw mapping; raise one ConfigError naming every invalid field.  ``explicit``: the
    ``[algorithm]`` keys given with ``--set``."""
    try:
        return ExperimentConfig.model_validate(raw, context={EXPLICIT_KEYS: explicit})
    except ValidationError as exc:
        problems = [_describe(error) for error in exc.errors()]
        lines = [f"{field}: {message}" for field, message in problems]
        error = ConfigError(problems[0][0], problems[0][1])
        error.args = ("invalid configuration:\n  " + "\n  ".join(lines),)
        raise error from None


_REMOVE = object()
"""The value of a ``~section.key`` override: remove the key (and fall back to its default)."""


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value in TOML syntax, bare words taken as strings), or ``~section.key``
    (remove the key, as Hydra does: e.g. ``topology.p`` after switching to a graph that has no p)."""
    if assignment.startswith("~") and "=" not in assignment:
        path = [part.strip() for part in assignment[1:].strip().split(".")]
        if len(path) < 2 or not all(path):
            raise ConfigError("--set", f"key must look like ~section.key, got {assignment!r}")
        return path, _REMOVE
    if "=" not in assignment:
        raise ConfigError("--set", f"expected KEY=VALUE or ~KEY, got {assignment!r}")
    key, _, text = assignment.partition("=")
    path = [part.strip() for part in key.strip().split(".")]
    if len(path) < 2 or not all(path):
        raise ConfigError("--set", f"key must look like section.key, got {key!r}")
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return path, value


def apply_overrides(raw: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``section.key=value`` assignment applied."""
    merged: dict[str, Any] = copy.deepcopy(raw)
    for assignment in assignments:
        path, value = parse_override(assignment)
        target = merged
        for part in path[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError("--set", f"{'.'.join(path)}: {part} is not a section")
        if value is _REMOVE:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value
    return merged


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override and validate a TOML experiment file."""
    if isinstance(overrides, str) or not isinstance(overrides, list | tuple | None):
        raise TypeError(f"overrides must be a list of 'section.key=value' strings (--set syntax), e.g. "
                        f"overrides=['experiment.rounds=50'], got {overrides!r}")
    overrides = list(overrides or [])
    file = Path(path)
    if file.is_dir():
        raise ConfigError("CONFIG", f"{file} is a directory, not a TOML config file (a results folder holds its "
                                    "run's config as config.toml)")
    if not file.is_file():
        raise ConfigError("CONFIG", f"no such config file: {file}")
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("CONFIG", f"cannot read {file} as UTF-8 TOML: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("CONFIG", f"{file} is not valid TOML: {exc}") from None
    return validate_config(apply_overrides(raw, overrides), overridden_algorithm_keys(overrides))


def checked_config(config: ExperimentConfig | str | Path) -> ExperimentConfig:
    """The config a run or an assembly starts from, checked again as a whole: a path is loaded
    (:func:`load_config`), and a config object validated anew.

    A section re-checks an assigned field on its own (``validate_assignment``), but the checks across sections
    (:meth:`ExperimentConfig._cross_field`: a schedule the algorithm supports, ``lr_final`` under a decaying
    schedule, one budget per agent) run only when the whole config is validated, so a config changed after
    loading (``config.schedule.kind = "pairing"``) is validated again here from its dump.  Its ``[algorithm]``
    extras then hold the algorithm's own settings only, so the keys ``--set`` gave need no context; the keys a
    file gave that were dropped (:attr:`AlgorithmSection.ignored_notices`) are carried over, to be said."""
    if isinstance(config, str | Path):
        return load_config(config)
    if not isinstance(config, ExperimentConfig):
        raise TypeError(f"expected an ExperimentConfig (decentdp.load_config) or the path of a TOML config, got "
                        f"{type(config).__name__}")
    checked = validate_config(config.model_dump())
    checked.algorithm._ignored.update(config.algorithm._ignored)
    return checked


def overridden_algorithm_keys(assignments: list[str]) -> frozenset[str]:
    """The ``[algorithm]`` keys that ``section.key=value`` assignments set (for :data:`EXPLICIT_KEYS`)."""
    return frozenset(path[1] for path, value in map(parse_override, assignments)
                     if path[0] == "algorithm" and len(path) == 2 and value is not _REMOVE)
