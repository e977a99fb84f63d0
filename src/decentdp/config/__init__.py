"""Experiment configuration: TOML files validated by a pydantic schema (:mod:`decentdp.config.schema`), with
Bellet et al.'s ``[personalized]`` section beside it (:mod:`decentdp.config.personalized`)."""

from decentdp.algorithms.base import FLOAT32_MAX
from decentdp.config.personalized import PersonalizedSection
from decentdp.config.schema import (
    GRAPH_REQUIRES,
    PLACEMENT_FIELDS,
    RECORDING_FIELDS,
    EngineSection,
    ExperimentConfig,
    TrackingSection,
    apply_overrides,
    checked_config,
    config_differences,
    flat_fields,
    load_config,
    overridden_algorithm_keys,
    parse_override,
    validate_config,
)

__all__ = ["FLOAT32_MAX", "GRAPH_REQUIRES", "PLACEMENT_FIELDS", "RECORDING_FIELDS", "EngineSection", "ExperimentConfig",
           "PersonalizedSection", "TrackingSection", "apply_overrides", "checked_config",
           "config_differences", "flat_fields",
           "load_config", "overridden_algorithm_keys", "parse_override", "validate_config"]
