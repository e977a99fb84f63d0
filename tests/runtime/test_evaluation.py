"""The evaluator: every agent's test accuracy and loss, one batched pass, repeated models scored once."""

from __future__ import annotations

import pytest
import torch

from decentdp.gradients.flat_model import FlatModel
from decentdp.models import build_model, classification_loss
from decentdp.runtime import evaluation
from decentdp.runtime.evaluation import Evaluator


def _evaluator() -> Evaluator:
    torch.manual_seed(0)
    model = FlatModel(build_model("mlp", (1, 8, 8), 10, seed=1, hidden=16), classification_loss)
    return Evaluator(model, torch.randn(300, 1, 8, 8), torch.randint(0, 10, (300,)), chunk=128)


@pytest.mark.parametrize(("layout", "rows_scored"), [([0, 0, 0, 0], 1), ([0, 0, 1, 0], 2), ([0, 1, 2, 3], 4)])
def test_repeated_models_are_scored_once_with_every_agents_figures(layout: list[int], rows_scored: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents holding one model bit for bit (the complete graph) are scored once, and every agent gets the figures
    that scoring each row gives."""
    evaluator = _evaluator()
    base = evaluator.model.initial_parameters()
    models = torch.stack([base + 0.3 * k * torch.randn_like(base) for k in range(4)])
    params = models[layout]
    scored: list[int] = []
    predict = evaluator.model.predict

    def counting(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scored.append(len(rows))
        return predict(rows, x)

    monkeypatch.setattr(evaluator.model, "predict", counting)
    once = evaluator(params)
    assert set(scored) == {rows_scored}  # each test chunk scores the distinct models only
    monkeypatch.setattr(evaluation, "repeated_rows", lambda rows, groups: None)
    every = evaluator(params)
    torch.testing.assert_close(once.accuracy, every.accuracy, rtol=0, atol=0)
    torch.testing.assert_close(once.loss, every.loss)
    assert once.consensus_distance == every.consensus_distance
    assert len(set(once.accuracy.tolist())) <= len(set(layout))
