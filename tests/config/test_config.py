"""Tests of decentdp.config: the TOML schema, its error messages, overrides and round-tripping.

Also checks errors that only surface when a validated config is built into an experiment
(graphs, data files, model options), since the CLI reports both kinds the same way.
"""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from decentdp.config import (
    ExperimentConfig,
    apply_overrides,
    load_config,
    parse_override,
    validate_config,
)
from decentdp.errors import ConfigError, DataError, DecentDPError, GraphError
from decentdp.experiment.build import build_experiment

from conftest import tiny_config

ALGORITHMS = ("central-dpsgd", "local", "dp-dsgd", "dp-dsgt", "dp-dinno")
DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100")
PARTITIONS = ("iid", "overlap", "dirichlet", "unequal")
GRAPHS = ("complete", "ring", "star", "path", "grid", "torus", "erdos-renyi", "geometric", "fiedler",
          "complete-bipartite", "k-regular")
MIXINGS = ("metropolis-hastings", "average", "max-degree")
MODELS = ("convnet", "mlp", "lenet5", "cifar-cnn", "resnet9", "linear", "logistic")
SECTIONS = ("algorithm, augmentation, averaging, data, engine, experiment, model, personalized, privacy, schedule, "
            "topology")
PRIVACY_KEYS = "accountant, agent_epsilons, clip, colluding, delta, epsilon, key_dir, neighbouring, noise"
# The common keys and those of the default algorithm (dp-dsgt, whose only own setting is weight_decay).
ALGORITHM_KEYS = ("batch_size", "lr", "lr_final", "lr_schedule", "name", "weight_decay")


def _quoted(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"'{name}'" for name in names)


# (id, TOML text, expected ConfigError.field, fragments that must all appear in ConfigError.message)
INVALID_TOML: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("epsilon-negative", "[privacy]\nepsilon = -1.0", "privacy.epsilon",
     ("must be a positive number or 'inf'", "got -1.0")),
    ("epsilon-zero", "[privacy]\nepsilon = 0", "privacy.epsilon", ("must be a positive number or 'inf'", "got 0")),
    ("epsilon-nan", "[privacy]\nepsilon = nan", "privacy.epsilon", ("must be a positive number or 'inf'", "nan")),
    ("epsilon-minus-inf", "[privacy]\nepsilon = -inf", "privacy.epsilon", ("must be a positive number",)),
    ("epsilon-word", '[privacy]\nepsilon = "infinite"', "privacy.epsilon", ("valid number", "'infinite'")),
    ("delta-zero", "[privacy]\ndelta = 0.0", "privacy.delta", ("greater than 0", "got 0.0")),
    ("delta-one", "[privacy]\ndelta = 1.0", "privacy.delta", ("less than 1", "got 1.0")),
    ("delta-above-one", "[privacy]\ndelta = 1.5", "privacy.delta", ("less than 1", "got 1.5")),
    ("clip-zero", "[privacy]\nclip = 0.0", "privacy.clip", ("greater than 0",)),
    ("clip-negative", "[privacy]\nclip = -2.0", "privacy.clip", ("greater than 0", "got -2.0")),
    ("accountant-unknown", '[privacy]\naccountant = "moments"', "privacy.accountant",
     ("'moments' is not one of the allowed values", "'rdp'", "'pld'")),
    ("algorithm-unknown", '[algorithm]\nname = "fedavg"', "algorithm.name",
     ("'fedavg' is not one of the allowed values", *_quoted(ALGORITHMS))),
    ("dataset-unknown", '[data]\ndataset = "imagenet"', "data.dataset",
     ("'imagenet' is not one of the allowed values", *_quoted(DATASETS))),
    ("partition-unknown", '[data]\npartition = "by-colour"', "data.partition",
     ("'by-colour' is not one of the allowed values", *_quoted(PARTITIONS))),
    ("graph-unknown", '[topology]\ngraph = "hypercube"', "topology.graph",
     ("'hypercube' is not one of the allowed values", *_quoted(GRAPHS))),
    ("mixing-unknown", '[topology]\nmixing = "laplacian"', "topology.mixing",
     ("'laplacian' is not one of the allowed values", *_quoted(MIXINGS))),
    ("model-unknown", '[model]\nname = "vgg16"', "model.name",
     ("'vgg16' is not one of the allowed values", *_quoted(MODELS))),
    ("optimizer-unknown", '[algorithm]\nname = "dp-dsgd"\noptimizer = "adamw"', "algorithm.optimizer",
     ("'adamw' is not one of the allowed values", "'sgd'", "'adam'")),
    ("momentum-with-adam", '[algorithm]\nname = "dp-dsgd"\noptimizer = "adam"\nmomentum = 0.9', "algorithm.momentum",
     ("is not used by optimizer 'adam'",)),
    ("nesterov-without-momentum", '[algorithm]\nname = "dp-dsgd"\nnesterov = true', "algorithm.nesterov",
     ("needs momentum > 0",)),
    ("lr-schedule-unknown", '[algorithm]\nlr_schedule = "step"', "algorithm.lr_schedule",
     ("'step' is not one of the allowed values", "'constant'", "'logspace'", "'cosine'")),
    ("section-unknown", "[training]\nrounds = 3", "training", ("unknown key", f"allowed keys: {SECTIONS}")),
    ("key-unknown", "[privacy]\nepsilom = 1.0", "privacy.epsilom", ("unknown key", f"allowed keys: {PRIVACY_KEYS}")),
    ("key-unknown-algorithm", "[algorithm]\nlearning_rate = 0.1", "algorithm.learning_rate",
     ("unknown key", "allowed keys for algorithm 'dp-dsgt': " + ", ".join(ALGORITHM_KEYS))),
    ("key-of-another-algorithm", "[algorithm]\nrho = 0.9", "algorithm.rho",
     ("is not used by algorithm 'dp-dsgt'", "allowed keys: " + ", ".join(ALGORITHM_KEYS))),
    ("schedule-unsupported", '[schedule]\nkind = "pairing"', "schedule.kind",
     ("'pairing' is not supported by algorithm 'dp-dsgt'", "synchronous")),
    ("schedule-unknown", '[schedule]\nkind = "gossip"', "schedule.kind",
     ("'gossip' is not one of the allowed values",)),
    ("offline-probability-one", "[schedule]\noffline_probability = 1.0", "schedule.offline_probability",
     ("less than 1",)),
    ("offline-agents-unsupported", "[schedule]\noffline_probability = 0.3", "schedule.offline_probability",
     ("algorithm 'dp-dsgt' does not let agents go offline",)),
    ("participation-zero", "[schedule]\nparticipation = 0.0", "schedule.participation", ("greater than 0",)),
    ("participation-without-sampling", "[schedule]\nparticipation = 0.5", "schedule.participation",
     ("is used with schedule.kind = 'sampled' only", "--set ~schedule.participation")),
    ("dirichlet-alpha-without-dirichlet", "[data]\ndirichlet_alpha = 0.1", "data.dirichlet_alpha",
     ("is used with data.partition = 'dirichlet' only",)),
    ("overlap-without-overlap", '[data]\npartition = "dirichlet"\noverlap_t = 0.5', "data.overlap_t",
     ("is used with data.partition = 'overlap' only",)),
    ("image-size-of-feature-rows", '[data]\ndataset = "a9a"\nimage_size = 8', "data.image_size",
     ("is used with image datasets only",)),
    ("fiedler-tol-without-fiedler", "[topology]\nfiedler_tol = 0.05", "topology.fiedler_tol",
     ("is used with topology.graph = 'fiedler' only",)),
    ("key-dir-without-secure-noise", '[privacy]\nepsilon = 1.0\nkey_dir = "keys"', "privacy.key_dir",
     ("is used with privacy.noise = 'secure' only",)),
    ("colluding-without-observer-view", "[privacy]\nepsilon = 1.0\ncolluding = [[0, 1]]", "privacy.colluding",
     ("algorithm 'dp-dsgt' reports one epsilon per agent", "muffliato")),
    ("graph-parameter-of-another-family", '[topology]\ngraph = "ring"\np = 0.5', "topology.p",
     ("is not used by graph = 'ring' (only by erdos-renyi", "--set ~topology.p")),
    ("redraw-fixed-graph", "[topology]\nredraw_every = 5", "topology.redraw_every",
     ("redraws a random graph; graph = 'complete' is fixed",)),
    ("section-not-a-table", "privacy = 3", "privacy", ("valid dictionary",)),
    ("privacy-missing", "[experiment]\nrounds = 3", "privacy.epsilon",
     ("[privacy] is required", "epsilon = 'inf' for a deliberately non-private run")),
    ("epsilon-missing", "[privacy]\ndelta = 1e-6", "privacy.epsilon",
     ("is required", "epsilon = 'inf' for a deliberately non-private run")),
    ("rounds-zero", "[experiment]\nrounds = 0", "experiment.rounds", ("greater than or equal to 1", "got 0")),
    ("rounds-string", '[experiment]\nrounds = "ten"', "experiment.rounds", ("valid integer", "'ten'")),
    ("rounds-fraction", "[experiment]\nrounds = 10.5", "experiment.rounds", ("valid integer", "valid integer")),
    ("eval-every-zero", "[experiment]\neval_every = 0", "experiment.eval_every", ("greater than or equal to 1",)),
    ("seed-negative", "[experiment]\nseed = -1", "experiment.seed", ("greater than or equal to 0",)),
    ("agents-zero", "[topology]\nagents = 0", "topology.agents", ("greater than or equal to 1", "got 0")),
    ("p-above-one", '[topology]\ngraph = "erdos-renyi"\np = 1.5', "topology.p", ("less than or equal to 1",)),
    ("batch-size-zero", "[algorithm]\nbatch_size = 0", "algorithm.batch_size", ("greater than or equal to 1",)),
    ("lr-zero", "[algorithm]\nlr = 0.0", "algorithm.lr", ("greater than 0",)),
    ("lr-negative", "[algorithm]\nlr = -0.1", "algorithm.lr", ("greater than 0", "got -0.1")),
    ("momentum-one", '[algorithm]\nname = "dp-dsgd"\nmomentum = 1.0', "algorithm.momentum", ("less than 1",)),
    ("primal-steps-zero", '[algorithm]\nname = "dp-dinno"\nprimal_steps = 0', "algorithm.primal_steps",
     ("greater than or equal to 1",)),
    ("rho-growth-below-one", '[algorithm]\nname = "dp-dinno"\nrho_growth = 0.5', "algorithm.rho_growth",
     ("greater than or equal to 1", "got 0.5")),
    ("overlap-t-above-one", "[data]\noverlap_t = 1.5", "data.overlap_t", ("less than or equal to 1", "got 1.5")),
    ("dirichlet-alpha-zero", "[data]\ndirichlet_alpha = 0.0", "data.dirichlet_alpha", ("greater than 0",)),
    ("dirichlet-alpha-huge", '[data]\npartition = "dirichlet"\ndirichlet_alpha = 1e308', "data.dirichlet_alpha",
     ("less than or equal to 1000000",)),
    ("size-skew-huge", '[data]\npartition = "unequal"\nsize_skew = 1000.0', "data.size_skew",
     ("less than or equal to 20",)),
    ("image-size-tiny", "[data]\nimage_size = 2", "data.image_size", ("greater than or equal to 4",)),
    ("logspace-without-lr-final", '[algorithm]\nlr_schedule = "logspace"', "algorithm.lr_final",
     ("is required by lr_schedule = 'logspace'",)),
    ("cosine-without-lr-final", '[algorithm]\nlr_schedule = "cosine"', "algorithm.lr_final",
     ("is required by lr_schedule = 'cosine'",)),
    ("erdos-renyi-without-p", '[topology]\ngraph = "erdos-renyi"', "topology.p",
     ("is required by graph = 'erdos-renyi'",)),
    ("geometric-without-radius", '[topology]\ngraph = "geometric"', "topology.radius",
     ("is required by graph = 'geometric'",)),
    ("fiedler-without-target", '[topology]\ngraph = "fiedler"', "topology.fiedler",
     ("is required by graph = 'fiedler'",)),
    ("k-regular-without-k", '[topology]\ngraph = "k-regular"', "topology.k", ("is required by graph = 'k-regular'",)),
    ("agent-epsilons-wrong-length", "[topology]\nagents = 4\n[privacy]\nagent_epsilons = [1.0, 2.0, 3.0]",
     "privacy.agent_epsilons", ("has 3 entries but topology.agents = 4",)),
    ("agent-epsilons-negative", "[topology]\nagents = 3\n[privacy]\nagent_epsilons = [1.0, -2.0, 3.0]",
     "privacy.agent_epsilons", ("every per-agent epsilon must be a positive number",)),
    ("agent-epsilons-nan", "[topology]\nagents = 2\n[privacy]\nagent_epsilons = [1.0, nan]",
     "privacy.agent_epsilons", ("every per-agent epsilon must be a positive number",)),
]


def _write(tmp_path: Path, text: str, name: str = "experiment.toml") -> Path:
    path = tmp_path / name
    path.write_text(text + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(("text", "field", "fragments"), [case[1:] for case in INVALID_TOML],
                         ids=[case[0] for case in INVALID_TOML])
def test_invalid_toml_names_field_and_allowed_values(tmp_path: Path, text: str, field: str,
                                                     fragments: tuple[str, ...]) -> None:
    if "[privacy]" not in text and not text.startswith("privacy") and field != "privacy.epsilon":
        text = f"{text}\n[privacy]\nepsilon = 1.0"  # every config states its budget; each row breaks one thing
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    error = info.value
    assert error.field == field
    for fragment in fragments:
        assert fragment in error.message, f"{fragment!r} not in {error.message!r}"
    # The printed form names the field and carries no pydantic boilerplate.
    assert f"{field}: " in str(error)
    assert str(error).startswith("invalid configuration:")
    assert "errors.pydantic.dev" not in str(error)
    assert "Value error," not in str(error)


def test_invalid_case_table_is_large() -> None:
    assert len(INVALID_TOML) >= 25
    assert len({case[0] for case in INVALID_TOML}) == len(INVALID_TOML)


BUDGET = {"privacy": {"epsilon": 1.0}}


@pytest.mark.parametrize(("raw", "field", "fragment"), [
    ({"privacy": {"epsilon": float("nan")}}, "privacy.epsilon", "must be a positive number"),
    ({"privacy": {"epsilon": -3}}, "privacy.epsilon", "got -3"),
    ({"privacy": {"delta": 0}}, "privacy.delta", "greater than 0"),
    ({"topology": {"agents": 3}, "privacy": {"agent_epsilons": [1.0, 0.0, 2.0]}}, "privacy.agent_epsilons",
     "positive"),
    ({"experiment": {"rounds": "ten"}}, "experiment.rounds", "valid integer"),
    ({"experiment": {"seed": 2**64}, "privacy": {"epsilon": 1.0}}, "experiment.seed", "less than 9223372036854775808"),
    ({"engine": {"threads": 100_000}, "privacy": {"epsilon": 1.0}}, "engine.threads", "less than or equal to 1024"),
    ({"model": {"name": "mlp", "hidden": 3}}, "model.hidden", "allowed keys: name, options"),
    # model options are checked when the config is read (the builder runs on the meta device), not at build time
    # an algorithm's noise scales multiply float32 tensors
    ({**BUDGET, "algorithm": {"name": "decor", "correlation": 1e39}}, "algorithm.correlation", "largest float32"),
    ({**BUDGET, "algorithm": {"name": "zip-dl", "zero_sum_noise": 1e300}}, "algorithm.zero_sum_noise",
     "largest float32"),
    ({**BUDGET, "algorithm": {"name": "dp-dinno", "rho": 1e39}}, "algorithm.rho", "largest float32"),
    ({**BUDGET, "model": {"options": {"nonsense": 1}}}, "model.options.nonsense", "has no option 'nonsense'"),
    ({**BUDGET, "model": {"options": {"hidden": -3}}}, "model.options.hidden", "positive integer"),
    ({**BUDGET, "model": {"options": {"hidden": [8, 0]}}}, "model.options.hidden", "positive integer"),
    ({**BUDGET, "model": {"name": "convnet", "options": {"norm": "batch"}}}, "model.options.norm", "'none' or 'group'"),
    ({**BUDGET, "model": {"name": "lenet5", "options": {"activation": "mish"}}}, "model.options.activation", "tanh"),
])
def test_invalid_raw_dicts(raw: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert info.value.field == field
    assert fragment in info.value.message


_REDRAWN = {"graph": "erdos-renyi", "p": 0.9, "redraw_every": 2}


@pytest.mark.parametrize(("raw", "field", "fragment"), [
    (tiny_config(algorithm={"name": "no-noise"}), "privacy.epsilon", "adds no noise"),
    (tiny_config(algorithm={"name": "decor"}, topology=_REDRAWN), "topology.redraw_every", "one fixed graph"),
    (tiny_config(algorithm={"name": "mafalda-sgd"}, topology=_REDRAWN), "topology.redraw_every", "one fixed graph"),
    (tiny_config(algorithm={"name": "decor"}, privacy={"agent_epsilons": [1.0, 1.0, 1.0, "inf"]}),
     "privacy.agent_epsilons", "finite budget for every agent"),
    (tiny_config(algorithm={"name": "top-dp"}, privacy={"agent_epsilons": [1.0, 1.0, 1.0, "inf"]}),
     "privacy.agent_epsilons", "finite budget for every agent"),
    (tiny_config(algorithm={"name": "mafalda-sgd"}, privacy={"noise": "secure"}), "privacy.noise",
     "simulation mode only"),
    (tiny_config(algorithm={"name": "dp-dinno", "primal_steps": 2}, data={"sampling": "cyclic"}), "data.sampling",
     "makes 2 per round"),
])
def test_what_an_algorithm_cannot_price_is_refused_with_the_config(raw: dict[str, Any], field: str,
                                                                   fragment: str) -> None:
    """Refused when the config is read (so --dry-run says it too), not once the run's data has loaded; each refusal
    is the algorithm class's declaration, and the same settings without privacy are accepted."""
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert (info.value.field, fragment in info.value.message) == (field, True), info.value.message
    if field != "data.sampling":
        assert not validate_config({**raw, "privacy": {"epsilon": "inf"}}).privacy.private


def test_every_invalid_field_is_reported_first_one_as_field() -> None:
    raw = {"privacy": {"epsilon": -1, "delta": 2}, "algorithm": {"name": "fedavg"}, "topology": {"agents": 0}}
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    text = str(info.value)
    for field in ("privacy.epsilon", "privacy.delta", "algorithm.name", "topology.agents"):
        assert f"\n  {field}: " in text
    assert info.value.field in {"privacy.epsilon", "privacy.delta", "algorithm.name", "topology.agents"}


def test_config_error_is_a_decentdp_error() -> None:
    with pytest.raises(DecentDPError):
        validate_config({"privacy": {"delta": 0}})


def test_cross_field_checks_are_skipped_where_not_needed() -> None:
    # central-dpsgd pools the data: no per-agent length check, no graph parameters needed.
    config = validate_config({"algorithm": {"name": "central-dpsgd"}, "topology": {"graph": "erdos-renyi"},
                              "privacy": {"agent_epsilons": [2.0, 3.0]}})
    assert config.topology.p is None
    assert config.privacy.agent_epsilons == [2.0, 3.0]
    # A constant schedule does not need lr_final.
    assert validate_config({"algorithm": {"lr_schedule": "constant"}, "privacy": {"epsilon": 1.0}}).algorithm.lr_final \
        is None


# ----------------------------------------------------------------------------- load_config


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.field == "CONFIG"
    assert "no such config file" in info.value.message
    assert "nope.toml" in info.value.message


def test_config_path_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.field == "CONFIG"


def test_malformed_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "[privacy\nepsilon = 1"))
    assert info.value.field == "CONFIG"
    assert "is not valid TOML" in info.value.message


def test_non_utf8_config_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[experiment]\nname = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "CONFIG"
    assert "UTF-8" in info.value.message


def test_utf8_config_is_read_as_utf8(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, '[experiment]\nname = "caf\u00e9-\u03b5"\n[privacy]\nepsilon = 1.0'))
    assert config.experiment.name == "caf\u00e9-\u03b5"


# ----------------------------------------------------------------------------- valid configs


def test_defaults_validate() -> None:
    config = validate_config({"privacy": {"epsilon": 1.0}})
    assert config == ExperimentConfig(privacy={"epsilon": 1.0})
    assert config.experiment.rounds == 100
    assert config.data.dataset == "digits"
    assert config.topology.graph == "complete"
    assert config.algorithm.name == "dp-dsgt"
    assert config.privacy.delta == 1e-5
    assert config.privacy.private is True


def test_an_empty_config_is_refused_for_want_of_a_budget(tmp_path: Path) -> None:
    """A DP library never trains silently without privacy: the budget, or its absence, is stated."""
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, ""))
    assert info.value.field == "privacy.epsilon"
    assert load_config(_write(tmp_path, ""), ["privacy.epsilon=1"]) == ExperimentConfig(privacy={"epsilon": 1.0})
    assert not load_config(_write(tmp_path, '[privacy]\nepsilon = "inf"')).privacy.private


@pytest.mark.parametrize("text", ["inf", "INF", " Infinity ", "none", "non-private"])
def test_epsilon_inf_strings_mean_non_private(text: str) -> None:
    config = validate_config({"privacy": {"epsilon": text}})
    assert config.privacy.epsilon == math.inf
    assert config.privacy.private is False


def test_epsilon_inf_in_toml_file(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, '[privacy]\nepsilon = "inf"'))
    assert config.privacy.epsilon == math.inf
    assert config.privacy.private is False
    bare = load_config(_write(tmp_path, "[privacy]\nepsilon = inf", "bare.toml"))
    assert bare.privacy.epsilon == math.inf


def test_private_flag() -> None:
    assert validate_config({"privacy": {"epsilon": 1}}).privacy.private is True
    assert validate_config({"privacy": {"epsilon": 1}}).privacy.epsilon == 1.0
    all_inf = validate_config({"topology": {"agents": 2}, "privacy": {"agent_epsilons": ["inf", "inf"]}})
    assert all_inf.privacy.private is False
    mixed = validate_config({"topology": {"agents": 2}, "privacy": {"agent_epsilons": [2, "inf"]}})
    assert mixed.privacy.private is True
    assert mixed.privacy.agent_epsilons == [2.0, math.inf]


def test_validate_assignment_rejects_bad_values() -> None:
    config = validate_config({"privacy": {"epsilon": 1.0}})
    with pytest.raises(ValueError, match="delta"):
        config.privacy.delta = 0.0


# ----------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(("assignment", "path", "value", "kind"), [
    ("privacy.epsilon=1", ["privacy", "epsilon"], 1, int),
    ("privacy.epsilon=1.5", ["privacy", "epsilon"], 1.5, float),
    ("privacy.epsilon=inf", ["privacy", "epsilon"], math.inf, float),
    ("algorithm.name=dp-dsgd", ["algorithm", "name"], "dp-dsgd", str),
    ('algorithm.name="dp-dsgd"', ["algorithm", "name"], "dp-dsgd", str),
    ("topology.agents=5", ["topology", "agents"], 5, int),
    ("algorithm.nesterov=true", ["algorithm", "nesterov"], True, bool),
    ("experiment.name=my run", ["experiment", "name"], "my run", str),
    (" topology . graph = ring ", ["topology", "graph"], "ring", str),
    ("model.options.hidden=[32, 16]", ["model", "options", "hidden"], [32, 16], list),
])
def test_parse_override_reads_toml_values(assignment: str, path: list[str], value: Any, kind: type) -> None:
    parsed_path, parsed = parse_override(assignment)
    assert parsed_path == path
    assert parsed == value
    assert type(parsed) is kind


def test_overrides_through_load_config_have_schema_types(tmp_path: Path) -> None:
    path = _write(tmp_path, '[privacy]\nepsilon = 8.0\n[algorithm]\nname = "dp-dinno"')
    config = load_config(path, ["privacy.epsilon=1", "algorithm.name=dp-dsgd", "topology.agents=5",
                                "model.options.hidden=[16]"])
    assert config.privacy.epsilon == 1.0
    assert isinstance(config.privacy.epsilon, float)
    assert config.algorithm.name == "dp-dsgd"
    assert config.topology.agents == 5
    assert isinstance(config.topology.agents, int)
    assert config.model.options == {"hidden": [16]}
    assert config.privacy.private is True


def test_later_override_wins(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, ""), ["privacy.epsilon=1", "privacy.epsilon=3"])
    assert config.privacy.epsilon == 3.0


def test_override_values_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, ""), ["privacy.delta=2"])
    assert info.value.field == "privacy.delta"
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, ""), ["privacy.epsilom=2"])
    assert info.value.field == "privacy.epsilom"
    assert "allowed keys" in info.value.message


@pytest.mark.parametrize(("assignment", "fragment"), [
    ("privacy.epsilon", "expected KEY=VALUE"),
    ("epsilon=1", "section.key"),
    (".epsilon=1", "section.key"),
    ("privacy.=1", "section.key"),
    ("privacy..epsilon=1", "section.key"),
])
def test_bad_override_syntax_names_set(assignment: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_override(assignment)
    assert info.value.field == "--set"
    assert fragment in info.value.message
    assert str(info.value).startswith("--set: ")


def test_override_into_a_value_that_is_not_a_section() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({"privacy": {"epsilon": 1.0}}, ["privacy.epsilon.x=1"])
    assert info.value.field == "--set"
    assert "epsilon is not a section" in info.value.message
    with pytest.raises(ConfigError) as info:
        apply_overrides({"privacy": 3}, ["privacy.epsilon=1"])
    assert info.value.field == "--set"


def test_apply_overrides_does_not_mutate_its_input() -> None:
    raw = {"privacy": {"epsilon": 2.0}, "model": {"name": "mlp", "options": {"hidden": [8]}}}
    before = copy.deepcopy(raw)
    merged = apply_overrides(raw, ["privacy.epsilon=1", "model.options.hidden=[4, 4]", "data.dataset=digits"])
    assert raw == before
    assert merged["privacy"]["epsilon"] == 1
    assert merged["model"]["options"]["hidden"] == [4, 4]
    assert merged["data"] == {"dataset": "digits"}


# ----------------------------------------------------------------------------- to_toml_dict round trip


def _round_trip(config: ExperimentConfig) -> ExperimentConfig:
    return validate_config(tomllib.loads(tomli_w.dumps(config.to_toml_dict())))


def test_defaults_round_trip_through_toml() -> None:
    config = validate_config({"privacy": {"epsilon": "inf"}})
    data = config.to_toml_dict()
    assert data["privacy"]["epsilon"] == "inf"
    assert "lr_final" not in data["algorithm"]  # None values are dropped
    assert _round_trip(config) == config


def test_non_default_config_round_trips_through_toml(tmp_path: Path) -> None:
    config = validate_config({
        "experiment": {"name": "rt", "seed": 7, "rounds": 12, "eval_every": 3},
        "data": {"dataset": "mnist", "data_dir": "/data", "partition": "dirichlet", "dirichlet_alpha": 0.3,
                 "image_size": 32},
        "topology": {"graph": "erdos-renyi", "agents": 4, "p": 0.5, "mixing": "max-degree"},
        "model": {"name": "mlp", "options": {"hidden": [32, 16]}},
        "algorithm": {"name": "dp-dinno", "lr": 0.05, "lr_schedule": "logspace", "lr_final": 0.001,
                      "optimizer": "adam", "primal_steps": 3, "rho_growth": 1.1},
        "privacy": {"epsilon": 2, "delta": 1e-6, "clip": 0.5, "accountant": "pld",
                    "agent_epsilons": [1.0, "inf", 2.5, 3.0]},
    })
    data = config.to_toml_dict()
    assert data["privacy"]["agent_epsilons"] == [1.0, "inf", 2.5, 3.0]
    again = _round_trip(config)
    assert again == config
    assert again.privacy.agent_epsilons[1] == math.inf
    # And through a file, as the results folder stores it.
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    assert load_config(path) == config


# ----------------------------------------------------------------------------- build-time errors

TINY = {
    "experiment": {"rounds": 2, "eval_every": 1},
    "data": {"dataset": "digits"},
    "topology": {"graph": "ring", "agents": 4},
    "model": {"name": "mlp"},
    "algorithm": {"name": "dp-dsgt", "batch_size": 16},
    "privacy": {"epsilon": "inf"},
}


def _tiny(**sections: dict[str, Any]) -> ExperimentConfig:
    raw = copy.deepcopy(TINY)
    for section, values in sections.items():
        raw[section].update(values)
    return validate_config(raw)


@pytest.mark.parametrize(("sections", "error_type", "field", "fragment"), [
    ({"topology": {"graph": "erdos-renyi", "agents": 20, "p": 0.01}}, GraphError, "topology.p",
     "p is too small for a connected draw"),
    ({"topology": {"graph": "complete", "agents": 2000}}, ConfigError, "topology.agents", "training set has"),
    ({"data": {"partition": "dirichlet", "dirichlet_alpha": 0.01}, "topology": {"graph": "complete", "agents": 50}},
     ConfigError, "data.dirichlet_alpha", "use a larger alpha"),
])
def test_build_time_errors(sections: dict[str, Any], error_type: type[DecentDPError], field: str | None,
                           fragment: str) -> None:
    config = _tiny(**sections)
    with pytest.raises(error_type) as info:
        build_experiment(config)
    if field is not None:
        assert info.value.field == field
    assert fragment in str(info.value)


@pytest.mark.parametrize(("topology", "field", "fragment"), [
    ({"graph": "torus", "agents": 10}, "topology.agents", "torus needs at least 3 rows"),
    ({"graph": "ring", "agents": 2}, "topology.agents", "'ring' needs at least 3 agents"),
    ({"graph": "grid", "agents": 7}, "topology.agents", "7 is prime"),
    ({"graph": "grid", "agents": 13}, "topology.agents", "13 is prime"),
    ({"graph": "grid", "agents": 12, "rows": 1}, "topology.rows", "1x12, a path"),
    ({"graph": "torus", "agents": 18, "rows": 2}, "topology.rows", "2x9 is too thin"),
    ({"graph": "fiedler", "fiedler": 0.9}, "topology.fiedler", "unreachable"),
    ({"graph": "fiedler", "agents": 10, "fiedler": 0.95}, "topology.fiedler", "at most (N-2)/N = 0.8"),
    ({"graph": "k-regular", "agents": 5, "k": 3}, "topology.k", "must be even"),
    ({"graph": "k-regular", "agents": 9, "k": 3}, "topology.k", "must be even"),
    ({"graph": "k-regular", "agents": 9, "k": 10}, "topology.k", "must be below n_agents"),
])
def test_graphs_no_draw_can_build_are_refused_by_validation(topology: dict[str, Any], field: str,
                                                           fragment: str) -> None:
    """Every check of the graph's parameters that draws nothing (:func:`check_graph_params`) runs when the config is
    validated, so ``--dry-run`` refuses what the run's start would (it was only met in ``build_experiment``)."""
    with pytest.raises(ConfigError) as info:
        _tiny(topology=topology)
    assert info.value.field == field
    assert fragment in info.value.message


def test_graph_checks_are_skipped_where_the_algorithm_pools_the_data() -> None:
    """An algorithm that pools every agent's data builds no graph, so a graph it could not build is no error (the
    fields are only said to be unread)."""
    config = _tiny(topology={"graph": "torus", "agents": 10}, algorithm={"name": "central-dpsgd", "batch_size": 16})
    assert config.pools_data


def test_mnist_without_files_names_the_files_looked_for(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    config = _tiny(data={"dataset": "mnist", "data_dir": str(empty)})
    with pytest.raises(DataError) as info:
        build_experiment(config)
    message = str(info.value)
    assert str(empty / "mnist.npz") in message
    assert "train-images-idx3-ubyte" in message
    # The data_dir argument (the CLI's --data-dir) takes precedence over data.data_dir.
    with pytest.raises(DataError, match="is not an existing directory"):
        build_experiment(config, data_dir=tmp_path / "missing")


def test_mnist_without_data_dir_explains_how_to_pass_one() -> None:
    with pytest.raises(DataError, match="--data-dir"):
        build_experiment(_tiny(data={"dataset": "mnist"}))


def test_tiny_valid_config_builds() -> None:
    experiment = build_experiment(_tiny())
    assert experiment.data.n_agents == 4
    assert experiment.setup["n_agents"] == 4
    assert experiment.setup["epsilon_budgets"] == [math.inf] * 4
    assert experiment.setup["noise_multipliers"] == [0.0] * 4
    assert sum(experiment.setup["agent_sizes"]) == len(experiment.dataset.y_train)


def test_resolved_configs_spell_out_the_algorithms_settings() -> None:
    """With or without the algorithm's settings written out, a config resolves to the same thing (so a
    resumed run recognises its own config), and an earlier version's resolved config, which listed
    every algorithm's settings at their defaults, resolves to it too."""
    budget = {"epsilon": 1.0}
    bare = validate_config({"algorithm": {"name": "dp-dsgt"}, "privacy": budget})
    spelled = validate_config({"algorithm": {"name": "dp-dsgt", "weight_decay": 0.0}, "privacy": budget})
    earlier = validate_config({"algorithm": {"name": "dp-dsgt", "weight_decay": 0.0, "optimizer": "sgd",
                                             "momentum": 0.0, "nesterov": False, "rho": 0.5, "rho_growth": 1.0,
                                             "primal_steps": 1, "reset_optimizer_each_round": False},
                               "privacy": budget})
    assert bare.to_toml_dict() == spelled.to_toml_dict() == earlier.to_toml_dict()
    assert bare.to_toml_dict()["algorithm"]["weight_decay"] == 0.0
    assert validate_config(bare.to_toml_dict()) == bare


def test_a_tilde_override_removes_a_key(tmp_path: Path) -> None:
    """Switching graph family leaves the old family's parameter behind; ``~section.key`` removes it."""
    path = _write(tmp_path, '[topology]\ngraph = "erdos-renyi"\np = 0.3\n[privacy]\nepsilon = 1.0')
    with pytest.raises(ConfigError) as info:
        load_config(path, ['topology.graph="geometric"', "topology.radius=0.5", "privacy.epsilon=2"])
    assert info.value.field == "topology.p"
    config = load_config(path, ['topology.graph="geometric"', "topology.radius=0.5", "~topology.p"])
    assert config.topology.p is None and config.topology.graph == "geometric"
    assert load_config(path, ["~topology.nothing_here"]).topology.p == 0.3  # removing an absent key is harmless
    with pytest.raises(ConfigError, match="~section.key"):
        load_config(path, ["~p"])


def test_a_directory_given_as_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory, not a TOML config file"):
        load_config(tmp_path)


@pytest.mark.parametrize(("assignment", "owner"), [("algorithm.momentum=0.9", "dpdl"),
                                                    ("algorithm.alpha=0.5", "top-dp"),
                                                    ("algorithm.local_steps=1", "dp-net-fleet")])
def test_a_setting_given_with_set_is_never_dropped(tmp_path: Path, assignment: str, owner: str) -> None:
    """Issue 37: ``--set algorithm.momentum=0.9`` on a DP-DSGT config was dropped without a word, 0.9 being
    dpdl's default.  A key the user gives with --set is an error when the algorithm does not use it; in a
    file it is still dropped at another algorithm's default (earlier resolved configs list them all)."""
    from decentdp.algorithms import algorithm_class

    key, _, _ = assignment.partition("=")
    assert key.split(".")[1] in algorithm_class(owner).Settings.model_fields
    path = tmp_path / "c.toml"
    path.write_text('[algorithm]\nname = "dp-dsgt"\n[privacy]\nepsilon = 1.0\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ": is not used by algorithm 'dp-dsgt'"):
        load_config(path, [assignment])
    value = assignment.partition("=")[2]
    path.write_text(f'[algorithm]\nname = "dp-dsgt"\n{key.split(".")[1]} = {value}\n[privacy]\nepsilon = 1.0\n',
                    encoding="utf-8")
    loaded = load_config(path)
    assert key.split(".")[1] not in loaded.to_toml_dict()["algorithm"]
    notice, = loaded.algorithm.ignored_notices  # said at run time (build_experiment's warnings)
    assert notice.startswith(f"{key} = {value} is not a setting of 'dp-dsgt' and was ignored") and repr(owner) in notice


def test_a_dropped_setting_is_among_the_runs_warnings() -> None:
    """A reviewer's DP-DSGT config with momentum = 0.9 (DPDL's default) ran without momentum and without a word."""
    config = validate_config(tiny_config(algorithm={"momentum": 0.9}, privacy={"epsilon": "inf"}))
    warnings = build_experiment(config).warnings
    assert any(w.startswith("algorithm.momentum = 0.9 is not a setting of 'dp-dsgt'") for w in warnings)
    assert not build_experiment(validate_config(tiny_config(privacy={"epsilon": "inf"}))).warnings


@pytest.mark.parametrize(("section", "values", "field"), [
    ("algorithm", {"lr": 1e300}, "algorithm.lr"), ("algorithm", {"lr_final": 1e39}, "algorithm.lr_final"),
    ("privacy", {"clip": 1e39}, "privacy.clip")])
def test_values_beyond_float32_are_refused_by_name(section: str, values: dict[str, Any], field: str) -> None:
    """lr = 1e300 crashed DP-DSGD in addmm_ with a traceback and let DP-DSGT run to garbage."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ": .* is above the largest float32 "):
        validate_config(tiny_config(**{section: values}))


def test_noise_whose_scale_leaves_float32_is_refused_by_name() -> None:
    """sigma * clip above the largest float32 made the noise infinite: a run of garbage parameters that still
    reported its epsilon."""
    with pytest.raises(ConfigError, match=r"privacy\.clip: the noise's standard deviation sigma \* clip"):
        build_experiment(validate_config(tiny_config(privacy={"clip": 1e38, "epsilon": 0.01})))
