"""``experiments/personalized/movielens_diagnosis.py``: the labelled not-DP ablation that centres each user's
targets by the user's own mean (what the paper's preprocessing gives away) keeps the RMSE's meaning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from decentdp.data.personal import PersonalData
from decentdp.personalized.objective import build_problem
from decentdp.personalized.runner import evaluate

from conftest import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "personalized" / "movielens_diagnosis.py"


def _ratings(seed: int = 0) -> PersonalData:
    """Four users, features ending with a constant 1 (each user's offset), targets rating - 3, users' test rows."""
    rng = np.random.default_rng(seed)
    owner = np.repeat(np.arange(4), [3, 5, 2, 6])
    x = np.hstack([rng.normal(size=(len(owner), 2)), np.ones((len(owner), 1))])
    y = rng.integers(1, 6, len(owner)).astype(np.float64) - 3.0
    test = np.repeat(np.arange(4), 2)
    x_test = np.hstack([rng.normal(size=(len(test), 2)), np.ones((len(test), 1))])
    y_test = rng.integers(1, 6, len(test)).astype(np.float64) - 3.0
    weights = np.ones((4, 4)) - np.eye(4)
    return PersonalData(x, y, owner, x_test, y_test, test, weights, "regression")


def test_centring_by_user_means_zeroes_each_users_mean_and_keeps_the_rmse_of_the_shifted_models() -> None:
    """Each user's centred training targets average 0, and a model theta on the centred data scores exactly what
    theta plus the user's mean on the offset feature scores on the original data (prediction + mean vs rating)."""
    module = load_script(SCRIPT, "movielens_diagnosis")
    data = _ratings()
    problem = build_problem(data, 0.5)
    centred, centred_problem = module.centred_by_user_mean(data, problem)
    sums = np.bincount(centred.owner_train, weights=centred.y_train)
    np.testing.assert_allclose(sums, 0.0, atol=1e-12)
    assert torch.equal(centred_problem.y, torch.as_tensor(centred.y_train))
    means = np.bincount(data.owner_train, weights=data.y_train) / np.bincount(data.owner_train)
    theta = torch.as_tensor(np.random.default_rng(1).normal(size=(4, 3)))
    shifted = theta.clone()
    shifted[:, -1] += torch.as_tensor(means)
    assert evaluate(centred, theta)["rmse_mean"] == pytest.approx(evaluate(data, shifted)["rmse_mean"], rel=1e-12)
