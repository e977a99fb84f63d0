"""``experiments/consensus/gauss_seidel.py``: the paper code's in-place mixing sweep as one matrix."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from decentdp.algorithms.registry import algorithm_names
from decentdp.topology import build_topology

from conftest import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "consensus" / "gauss_seidel.py"


def test_the_sweep_matrix_is_the_in_place_loop_and_keeps_rows_stochastic() -> None:
    module = load_script(SCRIPT, "consensus_gauss_seidel")
    assert "dp-dsgd-gradient-at-mixed" not in algorithm_names()  # importing the script registers nothing
    w = build_topology("fiedler", 10, fiedler=0.06, fiedler_tol=0.01, seed=0).mixing
    values = np.random.default_rng(0).normal(size=(10, 3))
    swept = values.copy()
    for i in range(10):  # the code's loop: agent i reads the new values of agents 0 .. i-1
        swept[i] = w[i] @ swept
    m = module.gauss_seidel_step(w)
    np.testing.assert_allclose(m @ values, swept, atol=1e-12)
    np.testing.assert_allclose(m.sum(axis=1), 1.0, atol=1e-12)
    assert m.min() >= 0.0
    # On the complete graph with w = 1/10 its columns sum to 0.236 .. 1.594 (docs/reproduction.md, item 1).
    columns = module.gauss_seidel_step(np.full((10, 10), 0.1)).sum(axis=0)
    np.testing.assert_allclose(columns[[0, -1]], [0.236, 1.594], atol=1e-3)
