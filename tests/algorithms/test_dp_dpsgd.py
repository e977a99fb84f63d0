"""A(DP)^2SGD (``dp-dpsgd``) in the synchronous protocol is DP-DSGD with plain SGD, to the bit.

DPDL's Table I reports A(DP)^2SGD, not DP-DSGD; the job lists run it alone and take its learning rate from
DP-DSGD's study, which this equality makes the same study."""

from __future__ import annotations

import pytest
import torch

from decentdp.config import validate_config
from decentdp.experiment.loop import run_experiment

from conftest import tiny_config


@pytest.mark.parametrize("graph", ["ring", "complete-bipartite"])  # the graphs whose studies it shares
def test_synchronous_a_dp2_sgd_runs_exactly_as_dp_dsgd(graph: str) -> None:
    results = {name: run_experiment(validate_config(tiny_config(algorithm={"name": name, "lr": 0.5},
                                                                topology={"graph": graph}, engine={"threads": 1})),
                                    progress=False, log=lambda _line: None)
               for name in ("dp-dsgd", "dp-dpsgd")}
    dsgd, dpsgd = results["dp-dsgd"], results["dp-dpsgd"]
    assert torch.equal(dsgd.state["params"], dpsgd.state["params"])
    assert not torch.equal(dsgd.state["params"], torch.zeros_like(dsgd.state["params"]))

    def untimed(rows: list[dict]) -> list[dict]:  # type: ignore[type-arg]
        return [{key: value for key, value in row.items() if key != "wall_seconds"} for row in rows]

    assert untimed(dsgd.metrics) == untimed(dpsgd.metrics)
    assert dsgd.summary["epsilon_per_agent"] == dpsgd.summary["epsilon_per_agent"]
