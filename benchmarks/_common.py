"""Pieces shared by the benchmark scripts: machine facts, timing, the settings' experiments, and the
reference implementation they are compared with (a per-agent loop of Opacus ``GradSampleModule``s)."""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _machine import cpu_model
from decentdp.algorithms.base import State
from decentdp.config import validate_config
from decentdp.errors import DataError
from decentdp.experiment.build import Experiment, build_experiment
from decentdp.models import classification_loss
from decentdp.util.allocator import retain_freed_memory

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
CLIP = 10.0
EPSILON = 1.0
DELTA = 1e-5
LR = 0.01
PLANNED_ROUNDS = 1000  # horizon the noise is calibrated for; only sigma's value depends on it
MNIST_SHAPE = {"train": 60_000, "test": 10_000}


def experiment_config(model: str, agents: int, batch: int, epsilon: float, graph: str = "complete",
                      partition: str = "overlap", image_size: int | None = 32,
                      gradients: str = "auto") -> dict[str, Any]:
    """The raw config of a benchmarked DP-DSGD setting (``epsilon = inf`` for the non-private run)."""
    data: dict[str, Any] = {"dataset": "mnist", "partition": partition}
    if partition == "overlap":
        data["overlap_t"] = 1.0
    if image_size is not None:
        data["image_size"] = image_size
    return {
        "experiment": {"name": "benchmark", "rounds": PLANNED_ROUNDS, "seed": 0},
        "data": data,
        "topology": {"graph": graph, "agents": agents},
        "model": {"name": model},
        "algorithm": {"name": "dp-dsgd", "lr": LR, "batch_size": batch, "optimizer": "sgd"},
        "privacy": {"epsilon": epsilon, "delta": DELTA, "clip": CLIP},
        "engine": {"gradients": gradients},
    }


def write_synthetic_mnist(directory: Path) -> None:
    """Random uint8 28x28 images and labels with MNIST's split sizes, as ``mnist.npz``."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, size in MNIST_SHAPE.items():
        arrays[f"x_{split}"] = rng.integers(0, 256, size=(size, 28, 28), dtype=np.uint8)
        arrays[f"y_{split}"] = rng.integers(0, 10, size=size, dtype=np.uint8)
    np.savez(directory / "mnist.npz", **arrays)


class ExperimentFactory:
    """Builds experiments on MNIST from ``data_dir``, or on synthetic data of MNIST's size if it is missing."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.synthetic = False
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    def build(self, raw: dict[str, Any]) -> Experiment:
        config = validate_config(raw)
        if not self.synthetic:
            try:
                return build_experiment(config, self.data_dir)
            except DataError as exc:
                print(f"MNIST not usable ({exc}); using synthetic random 28x28 data of MNIST's size instead")
                self._scratch = tempfile.TemporaryDirectory()
                write_synthetic_mnist(Path(self._scratch.name))
                self.synthetic = True
        assert self._scratch is not None
        return build_experiment(config, Path(self._scratch.name))


class EngineRunner:
    """Rounds of decentdp's DP-DSGD, exactly as the simulator runs them."""

    def __init__(self, experiment: Experiment, first_round: int = 0) -> None:
        self.experiment = experiment
        self.state: State = experiment.initial_state()
        self.round_index = first_round  # an oracle opens each round once: runners sharing one continue

    def round(self) -> None:
        ctx = self.experiment.simulator.context(self.round_index)  # the benchmarked configs keep lr = LR
        with torch.no_grad():
            self.state = self.experiment.algorithm.round(self.state, ctx)
        self.round_index += 1

    def evaluate(self) -> None:
        """One evaluation of the agents' current models on the test set, as the run loop makes it."""
        self.experiment.evaluator(self.state["params"]).summary()


class OpacusLoopRunner:
    """The reference approach: one ``GradSampleModule`` per agent and Python loops over agents.

    Per agent: Poisson-sample a batch (same rate as the engine), forward, backward (per-sample
    gradients in ``p.grad_sample``), clip per-sample gradients to C in flat l2 norm across all
    parameters, sum, add ``N(0, (sigma C)^2)`` noise (the engine's calibrated sigma), divide by the
    expected batch; then mix, ``theta_i <- sum_j w_ij theta_j - lr g_i``, with a Python loop over
    agents, their neighbours (the non-zero weights only) and parameter tensors.
    """

    def __init__(self, experiment: Experiment) -> None:
        # Opacus's hooks warn on every backward because the images do not require gradients; harmless.
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        self.x = experiment.data.x
        self.y = experiment.data.y
        self.indices = experiment.data.indices
        self.rates = experiment.sample_rates.tolist()
        self.sigmas = experiment.noise_multipliers.tolist()
        self.expected_batch = [rate * len(owned) for rate, owned in zip(self.rates, self.indices, strict=True)]
        mixing = experiment.topology.mixing
        self.neighbours = [[(j, float(mixing[i, j])) for j in np.flatnonzero(mixing[i])] for i in range(len(mixing))]
        # Imported here: Opacus takes seconds to import, and only the reference loop needs it (not the child
        # processes of scaling.py and the other scripts, each of which would pay for it).
        from opacus import GradSampleModule

        self.models = [GradSampleModule(copy.deepcopy(experiment.model.module), loss_reduction="sum")
                       for _ in self.indices]

    def private_gradient(self, agent: int) -> list[torch.Tensor]:
        """Agent ``agent``'s noisy clipped mean gradient, one tensor per parameter."""
        model = self.models[agent]
        owned = self.indices[agent]
        batch = owned[torch.rand(len(owned)) < self.rates[agent]]
        params = list(model.parameters())
        model.zero_grad(set_to_none=True)
        if len(batch) > 0:
            loss = classification_loss(model(self.x[batch]), self.y[batch]).sum()
            loss.backward()
            per_sample = [p.grad_sample.reshape(len(batch), -1) for p in params]
            norms = torch.stack([g.norm(dim=1) for g in per_sample], dim=1).norm(dim=1)
            factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
            sums = [torch.einsum("b,b...->...", factors, p.grad_sample) for p in params]
        else:
            sums = [torch.zeros_like(p) for p in params]
        noise_std = self.sigmas[agent] * CLIP
        return [(s + noise_std * torch.randn_like(s)) / self.expected_batch[agent] for s in sums]

    def round(self) -> None:
        grads = [self.private_gradient(agent) for agent in range(len(self.models))]
        with torch.no_grad():
            old = [[p.detach().clone() for p in model.parameters()] for model in self.models]
            for i, model in enumerate(self.models):
                for k, param in enumerate(model.parameters()):
                    mixed = torch.zeros_like(param)
                    for j, weight in self.neighbours[i]:
                        mixed += weight * old[j][k]
                    param.copy_(mixed - LR * grads[i][k])


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of per-round times."""
    ordered = sorted(seconds)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "q1": quartiles[0], "q3": quartiles[2]}


def time_interleaved(runners: dict[str, Callable[[], None]], warmup: int, rounds: int) -> dict[str, list[float]]:
    """Run ``warmup`` untimed then ``rounds`` timed rounds of each runner, alternating between them and
    reversing their order every other round (A B, B A, ...), so that background load and whatever one
    runner leaves behind for the next (caches, the allocator) hit all of them alike."""
    for _ in range(warmup):
        for run in runners.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for index in range(rounds):
        for name in order if index % 2 == 0 else reversed(order):
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_stats(runners: dict[str, Callable[[], None]], warmup: int, rounds: int) -> dict[str, dict[str, float]]:
    """:func:`summarize` of each runner's rounds, timed by :func:`time_interleaved`."""
    return {name: summarize(seconds) for name, seconds in time_interleaved(runners, warmup, rounds).items()}


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """A ratio of two interleaved methods' round times: the ratio of their medians (the figure recorded) and the
    quartiles of the per-round ratios (round k of one over round k of the other: its spread across rounds)."""
    pairs = sorted(a / b for a, b in zip(numerator, denominator, strict=True))
    quartiles = statistics.quantiles(pairs, n=4, method="inclusive") if len(pairs) > 1 else [pairs[0]] * 3
    return {"ratio": statistics.median(numerator) / statistics.median(denominator), "q1": quartiles[0],
            "median_of_pairs": quartiles[1], "q3": quartiles[2], "rounds": len(pairs)}


#: Timed rounds per method under ``--quick`` at the least: two rounds moved a ratio by 30 % between quiet runs, five
#: by up to 19 % against the full run (BENCHMARKS.md, "Threads and waiting chosen from the work").
QUICK_MIN_ROUNDS = 8
SMOKE_HELP = "1 timed round, no warm-up: only checks that the script runs and prints its keys (figures meaningless)"


def interleaved_arguments(description: str, argv: list[str] | None, rounds: int, warmup: int,
                          quick: tuple[int, int]) -> argparse.Namespace:
    """The options of a benchmark that times methods round by round (:func:`time_interleaved`) on MNIST:
    ``--data-dir``, ``--rounds``, ``--warmup``, ``--quick`` (``quick`` = its rounds, at least
    :data:`QUICK_MIN_ROUNDS`, and warm-up), ``--smoke`` and ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder holding mnist.npz")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"timed rounds per method (default {rounds})")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help=f"untimed rounds per method first (default {warmup})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{quick[1]} warm-up and {quick[0]} timed rounds per method")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--json", action="store_true", help="end with one line of JSON holding every figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = quick
    if args.smoke:
        args.rounds, args.warmup = 1, 0
    return args


def start_interleaved(description: str, argv: list[str] | None, rounds: int, warmup: int, quick: tuple[int, int],
                      retain_memory: bool = True) -> tuple[argparse.Namespace, dict[str, Any]]:
    """What an interleaved benchmark does first: parse its options (:func:`interleaved_arguments`), keep freed
    memory as ``decentdp run`` does unless ``retain_memory`` is false, and print and return the machine's facts."""
    args = interleaved_arguments(description, argv, rounds, warmup, quick)
    if retain_memory:
        retain_freed_memory()
    machine = machine_info()
    print_machine(machine)
    return args, machine


def machine_info() -> dict[str, Any]:
    """Where the figures were measured."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "opacus_version": importlib.metadata.version("opacus"),
    }


def print_machine(machine: dict[str, Any]) -> None:
    print(f"machine: {machine['platform']}, {machine['cpu_model']}, {machine['cpu_cores']} cores, "
          f"torch {machine['torch_version']} ({machine['torch_threads']} threads), "
          f"opacus {machine['opacus_version']}, python {machine['python']}")


def print_table(stats: dict[str, dict[str, float]]) -> None:
    print(f"  {'method':<22}{'median s':>10}{'min':>9}{'q1':>9}{'q3':>9}{'max':>9}")
    for name, s in stats.items():
        print(f"  {name:<22}{s['median']:>10.4f}{s['min']:>9.4f}{s['q1']:>9.4f}{s['q3']:>9.4f}{s['max']:>9.4f}")
