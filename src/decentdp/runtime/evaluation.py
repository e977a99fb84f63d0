"""Evaluation of every agent's model on the test set, and consensus distance.

All N models are evaluated in one batched pass per test chunk (``vmap`` over agents), so the
test set is read once per evaluation, not N times; models that repeat one another bit for bit are
evaluated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentdp.gradients.flat_model import FlatModel
from decentdp.util.rows import repeated_rows


@dataclass(frozen=True)
class Evaluation:
    """Per-agent test accuracy and loss, and how far the agents are from agreeing."""

    accuracy: torch.Tensor  # (N,)
    loss: torch.Tensor      # (N,)
    consensus_distance: float

    def summary(self) -> dict[str, float]:
        acc = self.accuracy.double()
        figures = torch.stack([acc.mean(), acc.std(unbiased=False), acc.min(), acc.max(), self.loss.double().mean()])
        mean, std, low, high, loss = figures.tolist()  # one read-back from the device
        return {
            "accuracy_mean": mean,
            "accuracy_std": std,
            "accuracy_min": low,
            "accuracy_max": high,
            "loss_mean": loss,
            "consensus_distance": self.consensus_distance,
        }


def consensus_distance(params: torch.Tensor) -> float:
    """``sqrt(mean_i ||theta_i - mean_j theta_j||^2)``: zero exactly when all agents agree."""
    return float((params - params.mean(dim=0, keepdim=True)).pow(2).sum(dim=1).mean().sqrt())


def evaluation_chunk(activation_budget: int, activation_bytes_per_sample: int, n_agents: int) -> int:
    """Test samples per pass such that all agents' forward activations stay within the training
    pass's activation budget (between 64 and 4096 samples)."""
    return int(min(4096, max(64, activation_budget // max(1, n_agents * activation_bytes_per_sample))))


class Evaluator:
    """Evaluates stacked parameters on a fixed test set in chunks of ``chunk`` samples."""

    def __init__(self, model: FlatModel, x: torch.Tensor, y: torch.Tensor, chunk: int = 2048) -> None:
        self.model = model
        self.x = x
        self.y = y
        self.chunk = chunk

    @torch.no_grad()
    def __call__(self, params: torch.Tensor) -> Evaluation:
        """Every agent's test accuracy and loss.  Agents holding the same model, bit for bit (the complete
        graph, where mixing leaves every agent the average), are scored once (:func:`repeated_rows`)."""
        one_group = torch.zeros(params.shape[0], dtype=torch.int64, device="cpu")  # group ids live on the host
        repeated = repeated_rows(params, one_group)
        if repeated is None:
            accuracy, loss = self._scores(params)
        else:
            distinct, inverse = repeated
            accuracy, loss = (values[inverse] for values in self._scores(params[distinct]))
        return Evaluation(accuracy, loss, consensus_distance(params))

    def _scores(self, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Test accuracy and mean loss of each row of ``params``, accumulated on the device (read back once, by
        :meth:`Evaluation.summary`)."""
        correct = torch.zeros(params.shape[0], dtype=torch.float64, device=params.device)
        loss = torch.zeros(params.shape[0], dtype=torch.float64, device=params.device)
        for start in range(0, len(self.y), self.chunk):
            x, y = self.x[start:start + self.chunk], self.y[start:start + self.chunk]
            outputs = self.model.predict(params, x)                      # (N, B, K)
            n_agents, batch = outputs.shape[:2]
            flat_targets = y.repeat(n_agents)
            losses = self.model.loss(outputs.reshape(n_agents * batch, -1), flat_targets).view(n_agents, batch)
            predicted = (outputs[..., 0] > 0).long() if outputs.shape[-1] == 1 else outputs.argmax(dim=-1)
            correct += (predicted == y).sum(dim=1).double()
            loss += losses.sum(dim=1).double()
        n = len(self.y)
        return correct / n, loss / n
