"""Every ``[personalized]`` field changes what a run computes or reports, in the mode that reads it.

The personalized runner reads some fields for one method or one dataset only (cd's mechanism, ADMM's penalty,
MovieLens's k-NN graph); config validation refuses a dataset's fields on the other dataset and keeps a method's
knobs quietly.  This file moves each field in a run of the mode that reads it (a tiny synthetic problem, or a tiny
MovieLens file written here) and requires the final models, the summary's errors or the reported epsilons to
differ from the same run at the field's default.  A new field needs an entry in :data:`MOVED`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from decentdp.config import validate_config
from decentdp.config.personalized import DATASET_FIELDS, PersonalizedSection
from decentdp.personalized.runner import run_personalized

#: field -> (the mode's settings, shared by both runs; the moved settings).
MOVED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "method": ({}, {"method": "local"}),
    "dataset": ({}, {"dataset": "movielens-100k"}),
    "mu": ({}, {"mu": 0.5}),
    "wakeups": ({}, {"wakeups": 5}),
    "mechanism": ({}, {"mechanism": "gaussian"}),
    "allocation": ({"calibration": "paper"}, {"allocation": "optimal"}),
    "calibration": ({}, {"calibration": "paper"}),
    "warm_start": ({}, {"warm_start": True}),
    "warm_start_epsilon": ({"warm_start": True}, {"warm_start_epsilon": 0.2}),
    "admm_rho": ({"method": "admm"}, {"admm_rho": 5.0}),
    "admm_local_steps": ({"method": "admm"}, {"admm_local_steps": 2}),
    "feature_bound": ({}, {"feature_bound": 0.5}),
    "validation": ({"dataset": "movielens-100k"}, {"validation": True}),   # synthetic problems are drawn afresh
    "test_fraction": ({"dataset": "movielens-100k"}, {"test_fraction": 0.4}),
    "als_rank": ({"dataset": "movielens-100k"}, {"als_rank": 2}),
    "als_reg": ({"dataset": "movielens-100k"}, {"als_reg": 1.0}),
    "als_iterations": ({"dataset": "movielens-100k"}, {"als_iterations": 2}),
    "neighbours": ({"dataset": "movielens-100k"}, {"neighbours": 2}),
    "agents": ({}, {"agents": 10}),
    "dim": ({}, {"dim": 3}),
    "min_points": ({}, {"min_points": 30}),
    "max_points": ({}, {"max_points": 40}),
    "test_points": ({}, {"test_points": 20}),
    "label_noise": ({}, {"label_noise": 0.3}),
    "gamma": ({}, {"gamma": 0.5}),
}

#: The small problem every run starts from (synthetic fields dropped on MovieLens).
SMALL = {"agents": 12, "dim": 4, "wakeups": 3, "als_rank": 3, "neighbours": 3}


def _ratings(folder: Path) -> Path:
    """Six users' ratings of 29 movies: a MovieLens ``u.data`` small enough for a test."""
    rng = np.random.default_rng(0)
    lines = [f"{user}\t{item}\t{rng.integers(1, 6)}\t0" for user in range(1, 7)
             for item in rng.choice(np.arange(1, 30), 15, replace=False)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "u.data").write_text("\n".join(lines) + "\n")
    return folder


def _fingerprint(settings: dict[str, Any], data_dir: Path) -> tuple[np.ndarray, str]:
    personalized = {**SMALL, **settings}
    for dataset, fields in DATASET_FIELDS.items():
        if dataset != personalized.get("dataset", "synthetic"):
            personalized = {key: value for key, value in personalized.items() if key not in fields}
    raw = {"privacy": {"epsilon": 1.0, "delta": 1e-3, "clip": 1.0, "neighbouring": "replace-one"},
           "personalized": personalized}
    summary, _, theta = run_personalized(validate_config(raw), data_dir=data_dir, log=lambda _line: None)
    reported = {key: value for key, value in summary.items() if key.startswith(("epsilon", "rmse", "accuracy"))}
    return theta.double().cpu().numpy(), repr(sorted(reported.items()))


def test_every_field_has_a_moved_value() -> None:
    assert sorted(set(PersonalizedSection.model_fields) - set(MOVED)) == []


@pytest.mark.parametrize("field", sorted(MOVED))
def test_moving_a_field_changes_the_run(field: str, tmp_path: Path) -> None:
    mode, moved = MOVED[field]
    data_dir = _ratings(tmp_path / "movielens-100k")
    default = _fingerprint(mode, data_dir)
    changed = _fingerprint({**mode, **moved}, data_dir)
    same_models = default[0].shape == changed[0].shape and np.array_equal(default[0], changed[0])
    assert not (same_models and default[1] == changed[1]), \
        f"personalized.{field} changed neither the models nor the reported errors and epsilons"
