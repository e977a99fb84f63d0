"""DPDL's Theorem 1 names "the global sampling rate q" (paper text, Sec. V-A).  If the paper's calibration used one
global rate (N B / |D|, equal to every q_i only for equal splits) where the library uses each agent's own q_i = B/|D_i|,
its small agents under Dirichlet 0.1 would carry far less noise.  Multipliers of the tuned Table I cell (complete
graph, N = 10, alpha = 0.1, eps = 4, 1000 rounds, k_i = 10 sums per batch) both ways, by the library's calibration
(docs/reproduction.md, "Three more readings from a review")::

    python experiments/dpdl/diagnostics/global_rate.py [DATA_DIR]      # default ../shared/data; a minute
"""

import sys

import numpy as np

import decentdp
from decentdp.experiment.build import build_experiment, calibrate, planned_releases, sums_per_batch

DATA_DIR = sys.argv[1] if len(sys.argv) > 1 else "../shared/data"
CELLS = ["experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir0.1-eps4.toml",
         "experiments/dpdl/tuned/dpdl-mnist-fc-n10-dir1-eps4.toml"]

for path in CELLS:
    cfg = decentdp.load_config(path)
    exp = build_experiment(cfg, DATA_DIR)
    sizes = np.array([len(p) for p in exp.data.indices])
    rates = exp.sample_rates.numpy()
    sig = np.asarray(exp.noise_multipliers, dtype=float)
    n, b = len(sizes), cfg.algorithm.batch_size
    q_global = n * b / sizes.sum()
    sums = sums_per_batch(cfg, exp.algorithm, exp.topology)
    sig_global = np.array(
        calibrate([cfg.privacy.epsilon] * n, [q_global] * n, cfg, planned_releases(cfg, exp.algorithm), sums))
    print(path.split("/")[-1])
    print("  |D_i|          ", sizes.tolist())
    print("  q_i (library)  ", np.round(rates, 4).tolist(), f"; global N B/|D| = {q_global:.4f}")
    print("  sigma_i (lib)  ", np.round(sig, 2).tolist())
    print("  sigma (global q)", np.round(sig_global, 2).tolist())
    print(f"  sum of sigma^2: {np.sum(sig ** 2):.0f} (library), {np.sum(sig_global ** 2):.0f} (global q)")
