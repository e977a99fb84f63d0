"""MAFALDA-SGD (algorithms/mafalda_sgd.py): its noise keys, its whole-run ledger event, exact resume and its refusals.
Its privacy against every observer is checked by tests/privacy/test_privacy_harness.py (exact losses), its
factorization by tests/privacy/test_factorization.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decentdp.cli.main import main
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import NoiseDraw
from decentdp.privacy.oracle import DataOracle
from decentdp.rng import AgentRandom

from conftest import tiny_config


def _config(rounds: int = 6, **sections: dict[str, Any]) -> dict[str, Any]:
    return tiny_config(experiment={"rounds": rounds, "eval_every": 2, "checkpoint_every": 1,
                                   **sections.pop("experiment", {})},
                       algorithm={"name": "mafalda-sgd", **sections.pop("algorithm", {})},
                       data={"sampling": "cyclic", "batches": 2, **sections.pop("data", {})}, **sections)


@pytest.mark.parametrize("bands", [None, 2])
def test_each_rounds_noise_is_drawn_once_under_its_own_key_and_kept(monkeypatch: pytest.MonkeyPatch,
                                                                    bands: int | None) -> None:
    """Round t draws z_t under round t's release key (as DP-D-SGD's noise), once per agent, so no past key is drawn
    again; the history keeps the outputs y_t = (C^{-1} Z)_t the release adds (sigma C_clip y_t), in row t mod
    bands: all T of them for a dense C, the last two for a C of two bands, found by forward substitution."""
    experiment = build_experiment(validate_config(_config(rounds=5, algorithm={"bands": bands})))
    drawn: list[tuple[int, int, int]] = []
    original = NoiseDraw.normal

    def spy(self: NoiseDraw, rows: Any, out: torch.Tensor, slots: Any = None, workers: int = 1) -> torch.Tensor:
        drawn.extend((self.agent_ids[row], self.round_index, self.release) for row in rows)
        return original(self, rows, out, slots, workers)

    monkeypatch.setattr(NoiseDraw, "normal", spy)
    state = experiment.simulator.setup(experiment.initial_state())
    state = experiment.simulator.run(state, 0, 5, lambda k, s: True)
    assert sorted(drawn) == [(agent, t, 0) for agent in range(4) for t in range(5)]
    history = state["noise_history"]
    factorization = experiment.algorithm.factorization
    rows = 5 if bands is None else bands
    assert history.shape[1] == rows == factorization.bands
    assert np.count_nonzero(np.tril(factorization.c, -rows)) == 0 and np.count_nonzero(np.diag(factorization.c, -1))
    fresh = AgentRandom(experiment.config.experiment.seed)
    draws = []
    for t in range(5):
        expected = torch.empty(4, history.shape[2])
        NoiseDraw(fresh, range(4), t, 0).normal(list(range(4)), expected)
        draws.append(expected.double())
    outputs = torch.einsum("ts,sad->tad", torch.from_numpy(factorization.c_inverse), torch.stack(draws))
    for t in range(5 - rows, 5):
        torch.testing.assert_close(history[:, t % rows].double(), outputs[t], rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="drawn twice"):
        draw = NoiseDraw(fresh, range(4), 0, 0)
        draw.normal([0], torch.empty(1, 3))
        draw.normal([0], torch.empty(1, 3))


def test_the_ledger_holds_one_whole_run_event_charged_before_round_zero(tmp_path: Path) -> None:
    result = run_experiment(validate_config(_config()), tmp_path / "run", progress=False)
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    setup = json.loads((tmp_path / "run" / "setup.json").read_text())
    assert privacy["releases"] == [1] * 4 and privacy["refused_releases"] == [0] * 4
    assert [run[2:] for runs in privacy["ledger"]["agent_runs"] for run in runs] == [[-1, -1]] * 4
    details = setup["calibration_details"]
    assert details["sensitivity"] == pytest.approx(1.0, abs=1e-12) and details["noise_loss_ratio"] < 1
    sigma = setup["noise_multipliers"][0]
    assert privacy["ledger"]["events"][0]["noise_multiplier"] == pytest.approx(sigma / details["sensitivity"])
    assert 4.99 < result.summary["epsilon_max"] <= 5.0
    assert result.summary["nonadaptive_epsilon_pairwise_max"] <= result.summary["epsilon_local_max"]
    assert np.allclose(setup["paper_accounting"]["paper_epsilon_local"], privacy["epsilon"], rtol=1e-4)


def test_an_agent_whose_whole_run_does_not_fit_its_budget_releases_nothing() -> None:
    experiment = build_experiment(validate_config(_config()))
    oracle = experiment.oracle
    ledger = PrivacyLedger(4, [5.0, 5.0, 0.5, 5.0], 1e-5)  # agent 2's budget is below its whole-run event
    oracle = DataOracle(oracle.model, oracle.sampler, ledger, oracle.rng, oracle.mechanism, oracle.clip_norm)
    experiment.simulator.oracle = oracle
    state = experiment.simulator.setup(experiment.initial_state())
    before = state["params"].clone()
    state = experiment.simulator.run(state, 0, 2, lambda k, s: True)
    assert ledger.releases().tolist() == [1, 1, 0, 1]
    assert ledger.refused.tolist() == [0, 0, 3, 0]  # the whole-run event, then both rounds' releases
    assert not torch.equal(state["params"][0], before[0])


@pytest.mark.parametrize("bands", [None, 2])
def test_a_run_resumes_exactly_with_its_noise_history(tmp_path: Path, bands: int | None) -> None:
    """A run stopped after round 3 and resumed ends exactly as one run: the history (all T outputs, or a ring of
    two that has wrapped by then) travels in the checkpoint."""
    config = validate_config(_config(algorithm={"bands": bands}))
    whole = run_experiment(config, tmp_path / "whole", progress=False)
    run_experiment(config, tmp_path / "split", progress=False, stop_after=3)
    resumed = run_experiment(config, tmp_path / "split", progress=False, resume=True)
    for key, value in whole.state.items():
        assert torch.equal(value, resumed.state[key]), key
    privacy = [json.loads((tmp_path / run / "privacy.json").read_text()) for run in ("whole", "split")]
    assert privacy[0] == privacy[1]


def test_independent_noise_is_the_diagonal_factorization() -> None:
    experiment = build_experiment(validate_config(_config(algorithm={"factorization": "independent"})))
    c = experiment.algorithm.factorization.c
    assert np.array_equal(c, np.diag(np.diag(c)))
    assert experiment.setup["calibration_details"]["noise_loss_ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize(("sections", "field"), [
    ({"data": {"sampling": "poisson", "batches": None}}, "data.sampling"),
    ({"privacy": {"epsilon": 5.0, "noise": "secure"}}, "privacy.noise"),
    ({"topology": {"graph": "complete", "agents": 1}}, "topology.graph"),
    ({"topology": {"graph": "erdos-renyi", "p": 0.9, "redraw_every": 2}}, "topology.redraw_every"),
    ({"engine": {"memory_limit_gb": 0.0005}, "experiment": {"rounds": 100}}, "experiment.rounds"),
    ({"engine": {"memory_limit_gb": 0.0005}, "experiment": {"rounds": 100}, "algorithm": {"bands": 60}},
     "algorithm.bands"),
    ({"algorithm": {"bands": 0}}, "algorithm.bands"),
    ({"data": {"batches": 7}}, "data.batches"),
])
def test_bad_input_is_one_error_naming_the_field(sections: dict[str, Any], field: str, tmp_path: Path) -> None:
    raw = _config(**sections)
    raw["data"] = {key: value for key, value in raw["data"].items() if value is not None}
    with pytest.raises(ConfigError) as error:
        build_experiment(validate_config(raw))
    assert error.value.field == field, str(error.value)


def test_the_command_line_names_the_field_without_a_traceback(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "poisson.toml"
    config.write_text('[algorithm]\nname = "mafalda-sgd"\n[data]\nsampling = "poisson"\n[privacy]\nepsilon = 1.0\n')
    assert main(["run", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "data.sampling" in err and "Poisson" in err and "Traceback" not in err
