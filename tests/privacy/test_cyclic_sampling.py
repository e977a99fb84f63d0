"""Cyclic participation (``data.sampling = 'cyclic'``): b fixed batches per agent, batch t mod b in round t, and a
ledger that charges each agent ceil(T / b) unsampled releases, not T."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.sampling import AgentData, CyclicSampler, cyclic_batches

from conftest import tiny_config


def _cyclic(rounds: int = 10, batches: int = 4, **sections: dict) -> dict:
    return tiny_config(experiment={"rounds": rounds, "eval_every": rounds, "checkpoint_every": 1},
                       data={"sampling": "cyclic", "batches": batches}, **sections)


def test_each_record_is_in_one_fixed_batch_that_no_other_record_moves() -> None:
    x = torch.arange(40, dtype=torch.float32)[:, None]
    y = torch.zeros(40, dtype=torch.long)
    owned = (torch.arange(0, 20), torch.arange(20, 39))
    sampler = CyclicSampler(AgentData(x, y, owned), 3, seed=7)
    for agent, records in enumerate(owned):
        seen = []
        for t in range(3):
            batch = sampler.sample(t)
            seen.append(batch.x[agent][batch.mask[agent].bool()].view(-1).int().tolist())
            assert len(seen[-1]) == sampler.batch_sizes[agent, t]
        assert sorted(sum(seen, [])) == records.tolist()              # every record, in one batch only
    for t in range(7):  # round t reads batch t mod b, whatever the step
        assert torch.equal(sampler.sample(t).x, sampler.sample(t % 3, step=1).x)
    # one more record for agent 1: every other record keeps its batch
    bigger = CyclicSampler(AgentData(x, y, (owned[0], torch.arange(20, 40))), 3, seed=7)
    before = cyclic_batches(np.arange(20, 39), 3, 7)
    after = cyclic_batches(np.arange(20, 40), 3, 7)
    assert np.array_equal(before, after[:-1])
    assert bigger.batch_sizes[1].sum() == 20 and np.array_equal(bigger.batch_sizes[0], sampler.batch_sizes[0])
    np.testing.assert_allclose(sampler.expected_batches.numpy(), [20 / 3, 19 / 3], rtol=1e-6)


def test_the_ledger_charges_one_release_per_pass_over_the_batches(tmp_path: Path) -> None:
    """10 rounds over 4 batches: 3 charges per agent (rounds 0, 4, 8; privacy.json's ``releases`` counts charges),
    calibrated for and spent exactly."""
    result = run_experiment(validate_config(_cyclic(algorithm={"name": "dp-dsgd"})), tmp_path / "run",
                            progress=False)
    setup = json.loads((tmp_path / "run" / "setup.json").read_text())
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert setup["planned_releases"] == 3 and setup["sampling"] == "cyclic" and setup["batches"] == 4
    assert setup["sample_rates"] == [1.0] * 4
    assert privacy["releases"] == [3] * 4 and privacy["refused_releases"] == [0] * 4
    runs = privacy["ledger"]["agent_runs"][0]
    assert [(count, first, last) for _, count, first, last in runs] == [(3, 0, 8)]
    sigma = setup["noise_multipliers"][0]
    assert privacy["ledger"]["events"][0] == {"type": "GaussianDpEvent", "noise_multiplier": sigma}
    assert max(result.summary["epsilon_per_agent"]) <= 5.0 and min(result.summary["epsilon_per_agent"]) > 4.99
    assert "once per pass" in result.summary["epsilon_observer"]
    # The assumption names what the run publishes about sizes: agent_sizes (its sample rates here are 1, not L/|D_i|).
    assert "agent_sizes" in privacy["neighbouring_assumption"] and len(setup["agent_sizes"]) == 4


def test_an_agent_out_at_a_passes_first_round_is_charged_when_it_first_releases() -> None:
    experiment = build_experiment(validate_config(_cyclic(rounds=8, batches=4, algorithm={"name": "dp-dsgd"})))
    oracle, params = experiment.oracle, experiment.initial_state()["params"]
    active = {0: [True, False, True, True], 1: [True, True, True, True], 2: [True, True, False, True],
              4: [False, True, True, True], 5: [True, True, True, True]}
    for k, mask in active.items():
        oracle.begin(k, np.array(mask))
        oracle.gradient(params.clone())
    runs = [[(count, first, last) for _, count, first, last in experiment.ledger.state_dict()["agent_runs"][agent]]
            for agent in range(4)]
    assert runs == [[(2, 0, 5)], [(2, 1, 4)], [(2, 0, 4)], [(2, 0, 4)]]


def test_a_resumed_oracle_knows_what_this_pass_has_paid() -> None:
    """The pass's charges are read from the ledger: a new oracle with the saved ledger (a resume) in the middle of a
    pass charges no agent again."""
    experiment = build_experiment(validate_config(_cyclic(rounds=8, batches=4, algorithm={"name": "dp-dsgd"})))
    oracle, params = experiment.oracle, experiment.initial_state()["params"]
    for k in range(2):
        oracle.begin(k)
        oracle.gradient(params.clone())
    saved = PrivacyLedger.from_state_dict(json.loads(json.dumps(experiment.ledger.state_dict())))
    again = DataOracle(oracle.model, oracle.sampler, saved, oracle.rng, oracle.mechanism, oracle.clip_norm)
    for k in range(2, 6):
        again.begin(k)
        again.gradient(params.clone())
    assert saved.releases().tolist() == [2] * 4


def test_a_cyclic_run_resumes_exactly(tmp_path: Path) -> None:
    config = validate_config(_cyclic(rounds=6, batches=4, algorithm={"name": "dp-dsgd"}))
    whole = run_experiment(config, tmp_path / "whole", progress=False)
    run_experiment(config, tmp_path / "split", progress=False, stop_after=3)
    resumed = run_experiment(config, tmp_path / "split", progress=False, resume=True)
    assert torch.equal(whole.state["params"], resumed.state["params"])
    privacy = [json.loads((tmp_path / run / "privacy.json").read_text()) for run in ("whole", "split")]
    assert privacy[0] == privacy[1] and privacy[0]["releases"] == [2] * 4


@pytest.mark.parametrize(("sections", "field", "words"), [
    ({"data": {"batches": 3}}, "data.batches", "'cyclic' only"),
    ({"data": {"sampling": "cyclic"}, "algorithm": {"name": "decor"}}, "data.sampling", "not supported"),
    ({"data": {"sampling": "cyclic", "batches": 1000}, "experiment": {"rounds": 2000}}, "data.batches", "smallest"),
    ({"data": {"sampling": "cyclic", "batches": 5}}, "data.batches", "more than the 4 rounds"),
    ({"data": {"sampling": "cyclic"}, "algorithm": {"name": "dp-dinno", "primal_steps": 2}}, "data.sampling",
     "2 per round"),
])
def test_bad_cyclic_settings_are_one_error_naming_the_field(sections: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_experiment(validate_config(tiny_config(**sections)))
    assert error.value.field == field and words in str(error.value), str(error.value)
