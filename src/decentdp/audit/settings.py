"""An audit's config: an experiment config (every section of ``decentdp run``) plus an ``[audit]`` table.

The experiment sections describe the training being audited, validated exactly as for a run; the
``[audit]`` table says how many trainings, which record, which attack.  ``--set audit.key=value``
overrides work on both.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decentdp.config import ExperimentConfig, apply_overrides, overridden_algorithm_keys, validate_config
from decentdp.errors import ConfigError

#: The largest batch an inversion attack reconstructs: the attack optimises every image of the batch at once.
MAX_ATTACKED_BATCH = 1024


class AuditSection(BaseModel):
    """How an audit or attack runs (fields unused by a command are ignored by it)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # -- membership and message audits ------------------------------------------------------------------
    models: int = Field(1000, ge=1, description="trainings per world (with and without the record)")
    selection_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of each world's runs that "
                                                                       "chooses the threshold (the paper: 1,000 "
                                                                       "of 5,000)")
    confidence: float = Field(0.95, gt=0.0, lt=1.0, description="Clopper-Pearson confidence of the bound")
    threshold_rule: Literal["empirical", "gaussian"] = Field(
        "empirical", description="how the selection runs choose the threshold: observed rates, or the tails of "
                                 "normals fitted to each world's scores (Gaussian scores: the message audit at q = 1)")
    chunk: int = Field(2000, ge=1, description="trainings of each world per chunk: 2 x chunk blocks (trainings) "
                                               "are simulated at once, half with the record and half without; "
                                               "bounds memory")
    # -- membership inference (Bayrooti et al., App. D) -------------------------------------------------
    digits: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                              description="classes of D, one per agent (the target holds the first)")
    per_digit: int = Field(100, ge=1, description="records of each class in D (the paper: 300 in all)")
    # -- message audit ----------------------------------------------------------------------------------
    target: int = Field(0, ge=0, description="the audited agent of each block (membership: it holds the canary, "
                                             "labelled with its digit; one-run: it holds the canaries)")
    records: int = Field(8, ge=1, description="records each agent holds besides the canary")
    canary_parameter: str | None = Field(None, description="parameter (as named by the model) holding the "
                                                           "canary's coordinate; default: the flat vector")
    canary_index: int = Field(0, ge=0, description="coordinate of the canary within that parameter (one-run: of "
                                                   "the first canary; canary k takes the k-th one after it)")
    # -- one-run audit (Steinke, Nasr & Jagielski 2023) -------------------------------------------------
    canaries: int = Field(1000, ge=1, description="Dirac canaries of the one training, each on its own coordinate "
                                                  "and held by the target with probability 1/2")
    guesses_per_side: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [10, 20, 50, 100, 200, 500, 1000, 2000, 5000], min_length=1,
        description="numbers k tried of canaries guessed in (the k highest scores) and out (the k lowest); those "
                    "with 2 k <= canaries are tried, the best bound is reported, each at confidence "
                    "1 - (1 - confidence) / (entries tried): a union bound over the choice")
    # -- gradient inversion ---------------------------------------------------------------------------------
    attack: Literal["dlg", "idlg", "geiping"] = "geiping"
    release: Literal["gradient", "cross-gradient", "momentum-difference"] = Field(
        "gradient", description="what is attacked: the agent's gradient, a cross-gradient (a neighbour's "
                                "model on its data), or the difference of its momenta in rounds t and t + 1 "
                                "(DPDL's ND-MM / DPDL-MM)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="momentum coefficient beta of the "
                                                             "momentum-difference release (DPDL eq. 19)")
    momentum_round: int = Field(1, ge=1, description="t of the momentum-difference release v^{t+1} - v^t "
                                                     "(momentum steps of algorithm.lr before it)")
    trained_rounds: int = Field(0, ge=0, description="0: attack at the model's initial parameters, noise calibrated "
                                                     "for the attacked batch; T > 0: attack a message of round T + 1 "
                                                     "of the config's own run (its algorithm, graph and agents, "
                                                     "trained T rounds at each batch size and epsilon), at the "
                                                     "receiver's model, with the noise the run's messages carry")
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_ATTACKED_BATCH)]] = Field(
        default_factory=lambda: [1], min_length=1, description="records per attacked batch (each reconstructed)")
    epsilons: list[Annotated[float, Field(gt=0.0)]] = Field(default_factory=lambda: [1.0], min_length=1,
                                                            description="private releases attacked besides the "
                                                                        "non-private one")
    images: int = Field(4, ge=1, description="batches attacked per (batch size, epsilon)")
    iterations: int = Field(300, ge=1)
    attack_lr: float = Field(0.1, gt=0.0)
    tv_weight: float = Field(1e-4, ge=0.0, description="total-variation prior weight (Geiping et al.)")
    restarts: int = Field(1, ge=1, description="random restarts; the best gradient match is kept")


def load_audit_config(path: str | Path, overrides: list[str] | None = None) -> tuple[ExperimentConfig, AuditSection]:
    """Read ``path``, apply ``section.key=value`` overrides, validate the experiment and the ``[audit]`` table."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError("CONFIG", f"{file} is a directory, not a TOML audit config file")
    if not file.is_file():
        raise ConfigError("CONFIG", f"no such config file: {file}")
    try:
        raw: dict[str, Any] = tomllib.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("CONFIG", f"cannot read {file} as TOML: {exc}") from None
    explicit = overridden_algorithm_keys(overrides or [])
    raw = apply_overrides(raw, overrides or [])
    if "audit" not in raw:
        raise ConfigError("audit", f"{file} has no [audit] table: an audit config is an experiment config plus its "
                                   "[audit] settings (see experiments/audits/)")
    section = raw.pop("audit")
    if not isinstance(section, dict):
        raise ConfigError("audit", "must be a table ([audit])")
    try:
        audit = AuditSection.model_validate(section)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ConfigError(f"audit.{where}", error["msg"]) from None
    return validate_config(raw, explicit), audit
