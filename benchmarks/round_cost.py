"""Seconds per round of DP-DSGD: decentdp's engine against a per-agent Opacus loop.

Setting: the consensus paper's MNIST ConvNet (Bayrooti et al.; 38,424 parameters at 32x32), MNIST
resized to 32x32, N agents (default 10) on a complete graph with the one-class-per-agent split
(``partition = "overlap"``, ``overlap_t = 1``), Poisson batches of expected size L (default 256)
per agent, clip C = 10, epsilon = 1, delta = 1e-5.

Three round costs are measured in the same process, interleaved round by round so that background
load on the machine hits all three alike:

``dp``
    one ``DPDSGD.round`` call through decentdp's engine: ledger spend, Poisson sampling of every
    agent's batch, per-sample gradients (``torch.func`` vmap over agents and samples), flat
    clipping, Gaussian noise, mixing ``W @ theta`` and the SGD step;
``nonprivate``
    the same call with ``epsilon = inf``: same sampling and mixing, but one batch gradient per
    agent instead of per-sample gradients, and no noise;
``opacus_loop``
    the reference implementation's approach, written here from its description: a Python loop
    over agents, each owning an ``opacus.GradSampleModule`` around its own copy of the ConvNet;
    per agent, Poisson-sample a batch (same rate), forward, backward (per-sample gradients in
    ``p.grad_sample``), clip per-sample gradients to C in flat l2 norm across all parameters,
    sum, add ``N(0, (sigma C)^2)`` noise, divide by L; then mix with a Python loop over agents and
    parameter tensors, ``theta_i <- sum_j w_ij theta_j - lr g_i``.  It uses decentdp's calibrated
    noise multipliers and sample rates, so both DP paths compute the same mechanism.

The figures are medians over the timed rounds (with min, max and interquartile range), after a
few warm-up rounds; warm-up absorbs one-off costs such as the ledger's first budget search.  The
ratios ``dp / nonprivate`` (the price of privacy in the engine) and ``opacus_loop / dp`` (the
engine's speed-up over the reference approach) are what later work is measured against.

Run from the repository root::

    .venv/bin/python benchmarks/round_cost.py            # full measurement
    .venv/bin/python benchmarks/round_cost.py --quick    # a smoke run, well under a minute's work
"""

from __future__ import annotations

import argparse
import copy
import json
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
import torch.nn.functional as F
from opacus import GradSampleModule

from decentdp.algorithms.base import RoundContext, State
from decentdp.config import validate_config
from decentdp.errors import DataError
from decentdp.experiment import Experiment, build_experiment

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
CLIP = 10.0
EPSILON = 1.0
DELTA = 1e-5
LR = 0.01
PLANNED_ROUNDS = 1000  # horizon the noise is calibrated for; only sigma's value depends on it
MNIST_SHAPE = {"train": 60_000, "test": 10_000}


def experiment_config(agents: int, batch: int, epsilon: float, planned_rounds: int) -> dict[str, Any]:
    """The raw config of the benchmarked setting (``epsilon = inf`` for the non-private run)."""
    return {
        "experiment": {"name": "round-cost", "rounds": planned_rounds, "seed": 0},
        "data": {"dataset": "mnist", "partition": "overlap", "overlap_t": 1.0, "image_size": 32},
        "topology": {"graph": "complete", "agents": agents},
        "model": {"name": "convnet"},
        "algorithm": {"name": "dp-dsgd", "lr": LR, "batch_size": batch, "optimizer": "sgd"},
        "privacy": {"epsilon": epsilon, "delta": DELTA, "clip": CLIP},
    }


def write_synthetic_mnist(directory: Path) -> None:
    """Random uint8 28x28 images and labels with MNIST's split sizes, as ``mnist.npz``."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, size in MNIST_SHAPE.items():
        arrays[f"x_{split}"] = rng.integers(0, 256, size=(size, 28, 28), dtype=np.uint8)
        arrays[f"y_{split}"] = rng.integers(0, 10, size=size, dtype=np.uint8)
    np.savez(directory / "mnist.npz", **arrays)


class EngineRunner:
    """Rounds of decentdp's DP-DSGD, exactly as the simulator runs them."""

    def __init__(self, experiment: Experiment) -> None:
        self.experiment = experiment
        self.state: State = experiment.initial_state()
        self.round_index = 0

    def round(self) -> None:
        simulator = self.experiment.simulator
        ctx = RoundContext(round_index=self.round_index, lr=LR, network=simulator.network,
                           gradient=simulator.gradient)
        with torch.no_grad():
            self.state = self.experiment.algorithm.round(self.state, ctx)
        self.round_index += 1


class OpacusLoopRunner:
    """The reference approach: one ``GradSampleModule`` per agent and Python loops over agents."""

    def __init__(self, experiment: Experiment) -> None:
        self.x = experiment.data.x
        self.y = experiment.data.y
        self.indices = experiment.data.indices
        self.rates = experiment.sample_rates.tolist()
        self.sigmas = experiment.noise_multipliers.tolist()
        self.expected_batch = [rate * len(owned) for rate, owned in zip(self.rates, self.indices, strict=True)]
        self.mixing = experiment.topology.mixing.tolist()
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
            loss = F.cross_entropy(model(self.x[batch]), self.y[batch], reduction="sum")
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
                    for j, weight in enumerate(self.mixing[i]):
                        if weight != 0.0:
                            mixed += weight * old[j][k]
                    param.copy_(mixed - LR * grads[i][k])


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of per-round times."""
    ordered = sorted(seconds)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "q1": quartiles[0], "q3": quartiles[2]}


def time_interleaved(runners: dict[str, Callable[[], None]], warmup: int, rounds: int) -> dict[str, list[float]]:
    """Run ``warmup`` untimed then ``rounds`` timed rounds of each runner, alternating between them."""
    for _ in range(warmup):
        for run in runners.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Where the figures were measured."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def build_experiments(args: argparse.Namespace, data_dir: Path, planned: int) -> tuple[Experiment, Experiment]:
    """The private (epsilon = 1) and non-private experiments of the benchmarked setting."""
    def build(epsilon: float) -> Experiment:
        return build_experiment(validate_config(experiment_config(args.agents, args.batch, epsilon, planned)), data_dir)

    return build(EPSILON), build(float("inf"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="folder holding mnist.npz (default: ../shared/data from the repo root); "
                             "synthetic data of MNIST's size is used if it is missing")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per method (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per method first (default 3)")
    parser.add_argument("--agents", type=int, default=10, help="number of agents N (default 10)")
    parser.add_argument("--batch", type=int, default=256, help="expected Poisson batch per agent (default 256)")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed rounds (smoke run)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON holding every figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = 3, 1
    if args.rounds < 1 or args.warmup < 0 or args.agents < 1 or args.batch < 1:
        parser.error("--rounds, --agents and --batch must be positive and --warmup non-negative")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Opacus's hooks warn on every backward because the images do not require gradients; harmless.
    warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
    planned = max(PLANNED_ROUNDS, args.warmup + args.rounds)
    try:
        private, plain = build_experiments(args, args.data_dir, planned)
        synthetic = False
    except DataError as exc:
        print(f"MNIST not usable ({exc}); using synthetic random 28x28 data of MNIST's size instead")
        with tempfile.TemporaryDirectory() as scratch:
            write_synthetic_mnist(Path(scratch))
            private, plain = build_experiments(args, Path(scratch), planned)
        synthetic = True

    machine = machine_info()
    load_before = os.getloadavg()[0]
    times = time_interleaved({"dp": EngineRunner(private).round, "nonprivate": EngineRunner(plain).round,
                              "opacus_loop": OpacusLoopRunner(private).round}, args.warmup, args.rounds)
    load_after = os.getloadavg()[0]
    stats = {name: summarize(values) for name, values in times.items()}
    dp, nonprivate, loop = (stats[name]["median"] for name in ("dp", "nonprivate", "opacus_loop"))
    sigmas = private.noise_multipliers

    print(f"machine: {machine['platform']}, {machine['cpu_model']}, {machine['cpu_cores']} cores, "
          f"torch {machine['torch_version']} ({machine['torch_threads']} threads), python {machine['python']}")
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after the timed rounds")
    print(f"setting: convnet ({private.model.dim} parameters), {'synthetic' if synthetic else 'MNIST'} 32x32, "
          f"N = {args.agents} complete graph, overlap t = 1, expected batch {args.batch}, C = {CLIP}, "
          f"epsilon = {EPSILON}, delta = {DELTA}, sigma in [{float(sigmas.min()):.3f}, {float(sigmas.max()):.3f}] "
          f"(planned {planned} rounds)")
    print(f"{args.rounds} timed rounds per method after {args.warmup} warm-up rounds, interleaved")
    print(f"{'method':<14}{'median s':>10}{'min':>9}{'q1':>9}{'q3':>9}{'max':>9}")
    for name, s in stats.items():
        print(f"{name:<14}{s['median']:>10.3f}{s['min']:>9.3f}{s['q1']:>9.3f}{s['q3']:>9.3f}{s['max']:>9.3f}")
    print(f"dp / nonprivate:  {dp / nonprivate:.2f}x")
    print(f"opacus_loop / dp: {loop / dp:.2f}x (speed-up of decentdp's DP round over the per-agent Opacus loop)")

    if args.json:
        print(json.dumps({
            "dp_round_seconds": dp,
            "nonprivate_round_seconds": nonprivate,
            "opacus_loop_round_seconds": loop,
            "dp_over_nonprivate": dp / nonprivate,
            "speedup_vs_opacus_loop_convnet_n10": loop / dp,
            "round_seconds": stats,
            "agents": args.agents,
            "batch": args.batch,
            "timed_rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "synthetic_data": synthetic,
            "load_average_before": load_before,
            "load_average_after": load_after,
            **machine,
        }, sort_keys=True))


if __name__ == "__main__":
    main()
