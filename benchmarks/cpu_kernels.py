"""What the CPU kernels for Mish and max-pooling buy (``decentdp/gradients/cpu_kernels.py``): each op against ATen's,
then the consensus paper's ConvNet run (Bayrooti et al.: MNIST 32x32, N = 10, B = 256, epsilon 1, the Fiedler-0.7
graph of ``experiments/consensus``) with and without them, round by round and evaluation by evaluation.

Everything is timed interleaved in one process (A B, B A, ...), so that background load hits both sides alike;
each figure is a ratio of medians, ``kernels / aten`` (below 1 is faster).  The ops run on the ConvNet's
activations: one training group (the stacked engine's 24 MiB, about 2,560 samples of ``3 x 28 x 28``) and one
evaluation chunk (4,096 test samples for each of the 10 agents).

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
    interleaved_arguments,
    machine_info,
    paired_ratio,
    print_machine,
    print_table,
    summarize,
    time_interleaved,
)
from decentdp.gradients.cpu_kernels import cpu_kernel

#: The ConvNet's first activation for one training group and for one evaluation chunk of 10 agents.
SHAPES = {"training group": (2560, 3, 28, 28), "evaluation chunk": (40960, 3, 28, 28)}
CONFIG = "experiments/consensus/table1-dsgd-eps1-fiedler0.7.toml"


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
    args = interleaved_arguments(__doc__.split("\n", 1)[0], argv, rounds=10, warmup=2, quick=(8, 1))
    machine = machine_info()
    print_machine(machine)
    results: dict[str, object] = {"machine": machine, "threads": torch.get_num_threads(), "smoke": args.smoke,
                                  "timed_rounds": args.rounds}
    generator = torch.Generator().manual_seed(0)
    for shape_name, shape in SHAPES.items():
        if args.smoke:
            shape = (64, *shape[1:])
        x = torch.randn(shape, generator=generator) * 2
        for op_name, module in (("mish", nn.Mish()), ("max_pool2d", nn.MaxPool2d(2))):
            for backward in (False, True):
                if backward and (shape_name == "evaluation chunk" or op_name == "max_pool2d"):
                    continue  # evaluation runs no backward pass; with one, max-pooling is ATen's own
                key = f"{op_name}{' forward+backward' if backward else ''}, {shape_name}"
                times = time_interleaved(op_runners(module, x, backward), args.warmup, args.rounds)
                ratio = paired_ratio(times["kernels"], times["aten"])
                print(f"{key}: kernels / aten = {ratio['ratio']:.3f}")
                print_table({name: summarize(value) for name, value in times.items()})
                results[key] = ratio
    factory = ExperimentFactory(args.data_dir or DEFAULT_DATA_DIR)
    raw = tomllib.loads(Path(CONFIG).read_text())
    if args.smoke:
        raw["algorithm"]["batch_size"] = 16
    with mock.patch("decentdp.gradients.stacked_model.cpu_kernel", lambda module: None):
        plain = EngineRunner(factory.build(raw))
    fast = EngineRunner(factory.build(raw))
    times = time_interleaved({"aten": plain.round, "kernels": fast.round}, args.warmup, args.rounds)
    rounds = paired_ratio(times["kernels"], times["aten"])
    print(f"ConvNet round (N = 10, B = 256): kernels / aten = {rounds['ratio']:.3f}")
    print_table({name: summarize(value) for name, value in times.items()})
    evaluations = time_interleaved({"aten": plain.evaluate, "kernels": fast.evaluate}, min(args.warmup, 1),
                                   max(1, args.rounds // 3))
    evaluation = paired_ratio(evaluations["kernels"], evaluations["aten"])
    print(f"ConvNet evaluation (10 agents x 10,000 test images): kernels / aten = {evaluation['ratio']:.3f}")
    print_table({name: summarize(value) for name, value in evaluations.items()})
    results |= {"round": rounds, "evaluation": evaluation, "round_ratio": rounds["ratio"],
                "evaluation_ratio": evaluation["ratio"],
                "round_seconds": {name: summarize(value)["median"] for name, value in times.items()},
                "evaluation_seconds": {name: summarize(value)["median"] for name, value in evaluations.items()}}
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
