"""DPDL's cosine calibration (eqs. 15-16) under the tuned Table I cell's sound noise: record every C_ij of a few rounds.
Runs experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir0.1-eps4.toml (LeNet-5, MNIST, N = 10 complete) for 3 rounds
(docs/reproduction.md, "Three more readings from a review")::

    python experiments/dpdl/diagnostics/cosine_calibration.py [CONFIG] [DATA_DIR]    # default ../shared/data
"""

import contextlib
import io
import sys
import tempfile

import decentdp
import decentdp.algorithms.dpdl as dpdl
from decentdp.experiment.loop import run_experiment

seen = []
original = dpdl.calibration


def recording(received, own):
    out = original(received, own)
    seen.append(out.detach().cpu().numpy().copy())
    return out


dpdl.calibration = recording
path = sys.argv[1] if len(sys.argv) > 1 else "experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir0.1-eps4.toml"
data_dir = sys.argv[2] if len(sys.argv) > 2 else "../shared/data"
cfg = decentdp.load_config(path, overrides=["experiment.rounds=3", "experiment.eval_every=3"])
with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
    run_experiment(cfg, out + "/r", data_dir=data_dir, progress=False)
for k, c in enumerate(seen):
    print(f"round {k}: C_ij over {c.size} edges: min {c.min():.5f} max {c.max():.5f} mean {c.mean():.5f} "
          f"(sigmoid(0) = 0.5; the range eq. 16 allows: 0.269-0.731)")
