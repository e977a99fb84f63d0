"""What summing clipping norms in float64, and certified ghost norms, cost per gradient pass.

The median of 7 calls of ``clipped_gradient_sums`` (after one warm-up) for each model on random inputs,
one thread, printed as one JSON line.  Run it with two source trees to compare them, alternating::

    for i in 1 2 3; do for src in ../before/src src; do
        PYTHONPATH=$src .venv/bin/python benchmarks/clip_rounding.py; done; done
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from decentdp.gradients.stacked_model import gradient_model
from decentdp.models import build_model, classification_loss

#: (model, input shape, agents, batch): the consensus and DPDL models, and two with ghost-norm layers.
SETTINGS = (("convnet", (1, 32, 32), 10, 64), ("lenet5", (1, 28, 28), 10, 64), ("mlp", (1, 28, 28), 10, 64),
            ("cga-cnn", (1, 28, 28), 4, 32), ("resnet9", (3, 32, 32), 2, 16))


def main() -> None:
    torch.set_num_threads(1)
    medians = {}
    for name, shape, agents, batch in SETTINGS:
        model = gradient_model(build_model(name, input_shape=shape, num_classes=10, seed=0), classification_loss,
                               "stacked")
        params = model.initial_parameters().repeat(agents, 1)
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(agents, batch, *shape, generator=generator)
        y = torch.randint(0, 10, (agents, batch), generator=generator)
        mask = torch.ones(agents, batch)
        model.clipped_gradient_sums(params, x, y, mask, 1.0)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            model.clipped_gradient_sums(params, x, y, mask, 1.0)
            times.append(time.perf_counter() - start)
        medians[name] = round(statistics.median(times), 5)
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
