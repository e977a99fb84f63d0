"""What every decentralized learning algorithm provides to the engine.

An algorithm is a pure round function over stacked agent state: it receives the state of all the
agents an engine holds (``(N, d)`` tensors), a :class:`RoundContext` with the only two ways to
reach the outside world (the :class:`~decentdp.runtime.network.Network` for messages and the
gradient oracle for data), and returns the next state.  It never indexes other agents' rows,
never touches data directly and never draws random numbers: the oracle does sampling, clipping,
noise and privacy accounting, the network does communication.  So the same code runs in the
simulator and in a sharded multi-machine engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from decentdp.runtime.network import Network
from decentdp.algorithms.optim import Optimizer

State = dict[str, torch.Tensor]
GradientFn = Callable[[torch.Tensor, int, int], torch.Tensor]
"""``gradient(params (N, d), round_index, step) -> (N, d)``: one (private) release per agent."""


@dataclass(frozen=True)
class RoundContext:
    """Everything a round may use besides the algorithm's own state."""

    round_index: int
    lr: float
    network: Network
    gradient: GradientFn


class Algorithm(ABC):
    """A decentralized learning algorithm as a round function over stacked agent state."""

    name: ClassVar[str]
    #: True when all agents' data are pooled into one agent (central training baselines).
    pools_data: ClassVar[bool] = False

    @property
    def releases_per_round(self) -> int:
        """Noisy gradient releases each agent makes per round; noise calibration plans for these."""
        return 1

    @property
    def round_temporaries(self) -> int:
        """``(N, d)`` matrices a round allocates besides its state at its peak (gradient sums, mixing
        outputs, updates), with some slack for the allocator; the memory plan budgets them."""
        return 3

    @abstractmethod
    def init_state(self, params: torch.Tensor) -> State:
        """Initial state from the agents' initial parameters ``(N, d)`` (key ``params`` holds them)."""

    @abstractmethod
    def round(self, state: State, ctx: RoundContext) -> State:
        """One synchronous round: every agent computes from the previous round's values (Jacobi)."""


class OptimizerAlgorithm(Algorithm):
    """An algorithm whose only state besides the parameters is its optimizer's (under ``opt.``)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params, **prefixed("opt", self.optimizer.init(params))}


def prefixed(prefix: str, state: State) -> State:
    """Namespace a sub-state (e.g. an optimizer's) inside an algorithm's flat state dict."""
    return {f"{prefix}.{key}": value for key, value in state.items()}


def unprefixed(prefix: str, state: State) -> State:
    """The sub-state stored under ``prefix`` by :func:`prefixed`."""
    start = len(prefix) + 1
    return {key[start:]: value for key, value in state.items() if key.startswith(prefix + ".")}
