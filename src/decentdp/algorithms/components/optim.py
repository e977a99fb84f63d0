"""Optimizers as pure functions over stacked ``(N, d)`` agent parameters.

Their state (momentum, Adam moments) is a dict of ``(N, d)`` tensors that the algorithm keeps in
its state between rounds, so momentum and Adam actually act across steps (the consensus paper's
code rebuilt its optimizer every step; see ``reset_each_round`` in DP-DiNNO for that behaviour).
Weight decay is added to the gradient (L2 regularisation), as in ``torch.optim.SGD``/``Adam``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from pydantic import Field, model_validator

from decentdp.algorithms.base import Algorithm, AlgorithmSettings, State, prefixed

OptimizerState = dict[str, torch.Tensor]


class Optimizer(Protocol):
    """A first-order update rule applied row-wise to stacked agent parameters."""

    def init(self, params: torch.Tensor) -> OptimizerState: ...

    def step(self, params: torch.Tensor, grad: torch.Tensor, state: OptimizerState, lr: float, *,
             inplace: bool = False) -> tuple[torch.Tensor, OptimizerState]:
        """The updated parameters and state.  With ``inplace`` the update is written into ``params``
        (a temporary the caller owns, such as a mixing output), saving one ``(N, d)`` matrix."""
        ...


@dataclass(frozen=True)
class SGD:
    """SGD with optional heavy-ball momentum, Nesterov and L2 weight decay (as ``torch.optim.SGD``)."""

    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    @property
    def plain(self) -> bool:
        """No momentum and no weight decay: the step is ``theta - lr * grad`` and nothing else."""
        return not self.momentum and not self.weight_decay

    def init(self, params: torch.Tensor) -> OptimizerState:
        return {"momentum": torch.zeros_like(params)} if self.momentum else {}

    def step(self, params: torch.Tensor, grad: torch.Tensor, state: OptimizerState, lr: float, *,
             inplace: bool = False) -> tuple[torch.Tensor, OptimizerState]:
        # torch.add(a, b, alpha=) is one fused kernel and one new (N, d) tensor, not two.
        if self.weight_decay:
            grad = torch.add(grad, params, alpha=self.weight_decay)
        direction, new_state = grad, state
        if self.momentum:
            buffer = torch.add(grad, state["momentum"], alpha=self.momentum)
            direction = torch.add(grad, buffer, alpha=self.momentum) if self.nesterov else buffer
            new_state = {"momentum": buffer}
        if inplace:
            return params.add_(direction, alpha=-lr), new_state
        return torch.add(params, direction, alpha=-lr), new_state


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba 2015) with bias correction and L2 weight decay (as ``torch.optim.Adam``)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def init(self, params: torch.Tensor) -> OptimizerState:
        return {"m": torch.zeros_like(params), "v": torch.zeros_like(params),
                "t": torch.zeros(params.shape[0], 1, dtype=params.dtype, device=params.device)}

    def step(self, params: torch.Tensor, grad: torch.Tensor, state: OptimizerState, lr: float, *,
             inplace: bool = False) -> tuple[torch.Tensor, OptimizerState]:
        if self.weight_decay:
            grad = grad + self.weight_decay * params
        t = state["t"] + 1
        m = self.beta1 * state["m"] + (1 - self.beta1) * grad
        v = self.beta2 * state["v"] + (1 - self.beta2) * grad * grad
        m_hat = m / (1 - self.beta1 ** t)
        v_hat = v / (1 - self.beta2 ** t)
        update = lr * m_hat / (v_hat.sqrt() + self.eps)
        return (params.sub_(update) if inplace else params - update), {"m": m, "v": v, "t": t}


OPTIMIZERS: tuple[str, ...] = ("sgd", "adam")


class OptimizerSettings(AlgorithmSettings):
    """The settings of an algorithm whose local step is taken by an optimizer."""

    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _settings_of_the_optimizer(self) -> OptimizerSettings:
        if self.optimizer == "adam":
            fields = type(self).model_fields
            unused = [key for key in ("momentum", "nesterov") if getattr(self, key) != fields[key].default]
            if unused:
                raise ValueError(f"{unused[0]}: is not used by optimizer 'adam'; remove {', '.join(unused)}")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov: Nesterov's look-ahead needs momentum > 0 (with momentum = 0 it is plain SGD)")
        return self

    def build(self) -> Optimizer:
        return make_optimizer(self.optimizer, momentum=self.momentum, weight_decay=self.weight_decay,
                              nesterov=self.nesterov)


class OptimizerAlgorithm(Algorithm):
    """An algorithm whose only state besides the parameters is its optimizer's (under ``opt.``)."""

    Settings = OptimizerSettings

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    @classmethod
    def from_settings(cls, settings: OptimizerSettings) -> Algorithm:
        return cls(settings.build())

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params, **prefixed("opt", self.optimizer.init(params))}


def make_optimizer(name: str, *, momentum: float = 0.0, weight_decay: float = 0.0,
                   nesterov: bool = False, betas: tuple[float, float] = (0.9, 0.999)) -> Optimizer:
    """Build an optimizer by name (names validated by the config schema)."""
    if name == "sgd":
        return SGD(momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    if name == "adam":
        return Adam(beta1=betas[0], beta2=betas[1], weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
