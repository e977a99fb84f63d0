"""What the CPU kernels for Mish and pooling buy (``decentdp/gradients/cpu_kernels.py``): each op against ATen's,
then two paper runs with and without them, round by round and evaluation by evaluation: the consensus paper's
ConvNet (Bayrooti et al.: MNIST 32x32, N = 10, B = 256, epsilon 1, the Fiedler-0.7 graph of
``experiments/consensus``; Mish and max-pooling) and DPDL's LeNet-5 (the tuned complete-graph cell of
``experiments/dpdl/tuned``: tanh and average pooling, N = 10 models on every batch).

Everything is timed interleaved in one process (A B, B A, ...), so that background load hits both sides alike;
each figure is a ratio of medians, ``kernels / aten`` (below 1 is faster).  The ops run on the models'
first activations: a training group of the stacked engine (2,560 samples of ``3 x 28 x 28`` for the ConvNet,
of ``6 x 28 x 28`` for LeNet-5) and one evaluation chunk of the ConvNet (4,096 test samples for each of the 10 agents).

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_kernels.py [--quick] [--json]
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from _common import (
    DEFAULT_DATA_DIR,
    EngineRunner,
    ExperimentFactory,
    paired_ratio,
    print_table,
    start_interleaved,
    summarize,
    time_interleaved,
)
from decentdp.gradients.cpu_kernels import cpu_kernel

#: (op, module, activation shape, with a backward pass): the ConvNet's first activation in one training group and
#: one evaluation chunk of 10 agents, and LeNet-5's in one training group.
OPS = [
    ("mish, training group", nn.Mish(), (2560, 3, 28, 28), False),
    ("mish forward+backward, training group", nn.Mish(), (2560, 3, 28, 28), True),
    ("max_pool2d, training group (no gradient)", nn.MaxPool2d(2), (2560, 3, 28, 28), False),
    ("mish, evaluation chunk", nn.Mish(), (40960, 3, 28, 28), False),
    ("max_pool2d, evaluation chunk", nn.MaxPool2d(2), (40960, 3, 28, 28), False),
    ("avg_pool2d, LeNet-5 training group", nn.AvgPool2d(2), (2560, 6, 28, 28), False),
    ("avg_pool2d forward+backward, LeNet-5 training group", nn.AvgPool2d(2), (2560, 6, 28, 28), True),
]
#: The whole runs: name -> config.
RUNS = {"ConvNet": "experiments/consensus/table1-dsgd-eps1-fiedler0.7.toml",
        "LeNet-5 (DPDL)": "experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir0.1-eps4.toml"}


def op_runners(module: nn.Module, x: torch.Tensor, backward: bool) -> dict[str, Callable[[], None]]:
    """``module`` on ``x`` through ATen and through its CPU kernel, with a backward pass when ``backward``."""
    kernel = cpu_kernel(module)
    assert kernel is not None

    def run(apply: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def once() -> None:
            if backward:
                source = x.detach().requires_grad_()
                out = apply(source)
                out.backward(torch.ones_like(out))
            else:
                with torch.no_grad():
                    apply(x)
        return once

    return {"aten": run(module), "kernels": run(kernel)}


def main(argv: list[str] | None = None) -> None:
    args, machine = start_interleaved(__doc__.split("\n", 1)[0], argv, rounds=10, warmup=2, quick=(8, 1),
                                      retain_memory=False)
    results: dict[str, object] = {"machine": machine, "threads": torch.get_num_threads(), "smoke": args.smoke,
                                  "timed_rounds": args.rounds}
    generator = torch.Generator().manual_seed(0)
    for key, module, shape, backward in OPS:
        x = torch.randn((64, *shape[1:]) if args.smoke else shape, generator=generator) * 2
        times = time_interleaved(op_runners(module, x, backward), args.warmup, args.rounds)
        results[key] = paired_ratio(times["kernels"], times["aten"])
        print(f"{key}: kernels / aten = {results[key]['ratio']:.3f}")
        print_table({name: summarize(value) for name, value in times.items()})
    factory = ExperimentFactory(args.data_dir or DEFAULT_DATA_DIR)
    for run_name, path in RUNS.items():
        raw = tomllib.loads(Path(path).read_text())
        raw["privacy"]["accountant"] = "rdp"  # the calibration's accountant changes no round's cost
        if args.smoke:
            raw["algorithm"]["batch_size"] = 16
        with mock.patch("decentdp.gradients.stacked_model.cpu_kernel", lambda module: None):
            plain = EngineRunner(factory.build(raw))
        fast = EngineRunner(factory.build(raw))
        times = time_interleaved({"aten": plain.round, "kernels": fast.round}, args.warmup, args.rounds)
        rounds = paired_ratio(times["kernels"], times["aten"])
        print(f"{run_name} round: kernels / aten = {rounds['ratio']:.3f}")
        print_table({name: summarize(value) for name, value in times.items()})
        evaluations = time_interleaved({"aten": plain.evaluate, "kernels": fast.evaluate}, min(args.warmup, 1),
                                       max(1, args.rounds // 3))
        evaluation = paired_ratio(evaluations["kernels"], evaluations["aten"])
        print(f"{run_name} evaluation (10 agents x 10,000 test images): kernels / aten = {evaluation['ratio']:.3f}")
        print_table({name: summarize(value) for name, value in evaluations.items()})
        results[run_name] = {"round": rounds, "evaluation": evaluation,
                             "round_seconds": {name: summarize(value)["median"] for name, value in times.items()},
                             "evaluation_seconds": {name: summarize(value)["median"]
                                                    for name, value in evaluations.items()}}
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
