"""Privacy as a deployment needs it: secret per-agent noise, the neighbouring relation, tight reported
epsilon that never exceeds a budget, and results folders that hold no raw statistics of private data."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant

from decentdp.config import validate_config
from decentdp.errors import ConfigError, PrivacyError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.privacy.accounting import (
    PLD_DISCRETIZATION,
    _pld_interval,
    calibrate_noise_multiplier,
    epsilon_of_history,
    epsilon_spent,
)
from decentdp.privacy.events import gaussian_event, laplace_event
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.rng import AgentKeys, AgentRandom, SecureRandom, Stream

from conftest import tiny_config

# ---------------------------------------------------------------------------------------------
# Reported epsilon: tight, sound, never above the budget


def _reference_pld(sigma: float, q: float, count: int, delta: float, relation: str, interval: float) -> float:
    native = (dp_accounting.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
              else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant = pld_privacy_accountant.PLDAccountant(native, value_discretization_interval=interval)
    accountant.compose(dp_accounting.SelfComposedDpEvent(gaussian_event(sigma, q), count))
    return float(accountant.get_epsilon(delta))


def _random_settings(count: int, seed: int = 8) -> list[tuple[float, float, float, int, int]]:
    """Settings drawn log-uniformly (fixed seed): epsilon in [0.1, 10], q in [1e-3, 0.2], 50-5000 steps."""
    generator = np.random.default_rng(seed)
    return [(round(float(10 ** generator.uniform(-1, 1)), 3), 1e-5, round(float(10 ** generator.uniform(-3, -0.7)), 5),
             int(10 ** generator.uniform(1.7, 3.7)), int(generator.integers(1, 3))) for _ in range(count)]


#: (epsilon, delta, q, steps, releases per step): the review's failing case, small epsilon with many
#: releases, large q, the demo's setting, and a random sweep.
SWEEP = [(0.16, 1e-5, 0.0025, 3200, 2), (0.3, 1e-5, 0.01, 5000, 1), (1.0, 1e-5, 0.0417, 2000, 1),
         (4.0, 1e-6, 0.2, 300, 1), (10.0, 1e-5, 0.004, 2000, 3), *_random_settings(4)]


@pytest.mark.parametrize(("epsilon", "delta", "q", "steps", "per_step"), SWEEP)
def test_calibrated_sigma_reports_at_most_the_target_and_agrees_with_dp_accounting_pld(
        epsilon: float, delta: float, q: float, steps: int, per_step: int) -> None:
    sigma = calibrate_noise_multiplier(epsilon, delta, q, steps, per_step)
    reported = epsilon_spent(sigma, delta, q, steps, per_step)
    assert reported <= epsilon  # never above the budget the run was calibrated to
    assert reported >= 0.99 * epsilon  # and the noise is not wasted: calibrated with the tight accountant
    reference = _reference_pld(sigma, q, steps * per_step, delta, "add-remove", 1e-4)
    assert abs(reported - reference) <= 0.01 * reference
    assert reported <= epsilon_spent(sigma, delta, q, steps, per_step, accountant="rdp")  # the better of the two


@pytest.mark.parametrize(("epsilon", "delta", "q", "steps", "per_step"), SWEEP[:3])
def test_reported_epsilon_agrees_with_opacus_prv(epsilon: float, delta: float, q: float, steps: int,
                                                 per_step: int) -> None:
    prv = pytest.importorskip("opacus.accountants").PRVAccountant()
    sigma = calibrate_noise_multiplier(epsilon, delta, q, steps, per_step)
    prv.history = [(sigma, q, steps * per_step)]
    # Opacus reports only the upper end of its interval; the estimate is what a tight epsilon should match.
    lower, estimate, upper = prv._get_dprv(eps_error=0.002, delta_error=delta / 1000).compute_epsilon(
        delta, delta / 1000, 0.002)
    ours = epsilon_spent(sigma, delta, q, steps, per_step)
    assert ours == pytest.approx(estimate, rel=0.01) and lower * 0.99 <= ours <= upper * 1.01


def test_replace_one_costs_about_twice_add_remove_and_matches_dp_accounting() -> None:
    sigma, q, steps, delta = 7.62, 0.0417, 2000, 1e-5  # the review's demo figures: 0.917 vs 1.947
    add_remove = epsilon_spent(sigma, delta, q, steps)
    replace_one = epsilon_spent(sigma, delta, q, steps, relation="replace-one")
    interval = _pld_interval(((gaussian_event(sigma, q), steps),), delta, "replace-one")
    assert replace_one == pytest.approx(_reference_pld(sigma, q, steps, delta, "replace-one", interval), rel=1e-9)
    assert replace_one == pytest.approx(_reference_pld(sigma, q, steps, delta, "replace-one", 1e-4), rel=0.0025)
    assert 1.8 < replace_one / add_remove < 2.3
    # Calibration under replace-one meets its target under replace-one.
    calibrated = calibrate_noise_multiplier(1.0, delta, q, steps, relation="replace-one")
    assert epsilon_spent(calibrated, delta, q, steps, relation="replace-one") <= 1.0
    assert calibrated > calibrate_noise_multiplier(1.0, delta, q, steps)


@pytest.mark.parametrize(("sigma", "q", "count"), [(2.0, 0.02, 6908), (7.0, 0.04, 2000)])
def test_replace_one_with_sampling_gets_a_grid_from_the_scale_of_its_epsilon(sigma: float, q: float,
                                                                            count: int) -> None:
    """RDP cannot price replace-one with Poisson sampling, which left the PLD at its finest grid (1e-4: tens of
    times slower).  The grid needs only the scale of epsilon, which twice the add-remove RDP epsilon gives: the
    grid is coarser, and the epsilon stays within the 0.25 % discretisation target of the finest grid's."""
    history = ((gaussian_event(sigma, q), count),)
    assert _pld_interval(history, 1e-5, "replace-one") > PLD_DISCRETIZATION
    finest = _reference_pld(sigma, q, count, 1e-5, "replace-one", PLD_DISCRETIZATION)
    assert epsilon_of_history(history, 1e-5, "pld", "replace-one") == pytest.approx(finest, rel=0.0025)


def test_replace_one_laplace_doubles_the_sensitivity() -> None:
    history = ((laplace_event(2.0), 3),)
    assert epsilon_of_history(history, 1e-5, "pld", "replace-one") == pytest.approx(
        epsilon_of_history(((laplace_event(1.0), 3),), 1e-5, "pld"), rel=1e-6)
    with pytest.raises(PrivacyError, match="no replace-one bound"):
        epsilon_of_history(((gaussian_event(2.0, 0.1), 3),), 1e-5, "rdp", "replace-one")


def test_budgets_stop_releases_past_the_planned_rounds_with_mixed_budgets() -> None:
    q, planned, delta = 0.05, 400, 1e-5
    budgets = [0.5, 2.0, math.inf]
    sigmas = [calibrate_noise_multiplier(b, delta, q, planned) if math.isfinite(b) else 0.0 for b in budgets]
    ledger = PrivacyLedger(3, budgets, delta)
    events = np.array([ledger.intern(gaussian_event(s, q)) for s in sigmas])
    allowed = np.array([ledger.charge(k, events).tolist() for k in range(planned + 50)])
    assert allowed[:planned].all()  # every planned release fits
    assert allowed[:, 2].all()  # no budget, never refused
    finite = ledger.releases()[:2]
    assert (finite >= planned).all() and (finite < planned * 1.02).all()  # a little slack from rounding, no more
    reported, _ = ledger.reported_epsilon()
    assert (reported[:2] <= np.array(budgets[:2])).all() and math.isinf(reported[2])


def test_every_agent_of_a_run_reports_at_most_its_budget(tmp_path: Path) -> None:
    for name, budgets in (("dp-dsgt", [0.5, 1.0, 3.0, 8.0]), ("dp-dsgd", [2.0, 2.0, 0.7, 5.0]),
                          ("dp-dinno", [1.0, 4.0, 1.0, 2.0])):
        raw = tiny_config(algorithm={"name": name}, privacy={"agent_epsilons": budgets},
                          experiment={"rounds": 6, "eval_every": 3})
        summary = run_experiment(validate_config(raw), tmp_path / name, progress=False).summary
        assert all(spent <= budget for spent, budget in zip(summary["epsilon_per_agent"], budgets, strict=True))


# ---------------------------------------------------------------------------------------------
# Noise secrecy


def test_simulation_noise_is_bit_reproducible_and_says_so(tmp_path: Path) -> None:
    raw = tiny_config(experiment={"rounds": 2, "eval_every": 2})
    lines: list[str] = []
    first = run_experiment(validate_config(raw), tmp_path / "a", progress=False, log=lines.append)
    second = run_experiment(validate_config(raw), tmp_path / "b", progress=False, log=lambda _: None)
    assert torch.equal(first.state["params"], second.state["params"])
    assert sum("not private against anyone who reads its config" in line for line in lines) == 1
    privacy = json.loads((tmp_path / "a" / "privacy.json").read_text())
    assert privacy["noise"] == "simulation" and "recomputable from experiment.seed" in privacy["noise_notice"]
    assert privacy["neighbouring"] == "add-remove" and "sizes are not secret" in privacy["neighbouring_assumption"]


def test_secure_noise_is_fresh_and_its_keys_never_reach_the_results(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    monkeypatch.setenv("DECENTDP_KEY_DIR", str(keys))
    raw = tiny_config(privacy={"noise": "secure"}, experiment={"rounds": 2, "eval_every": 2})
    first = run_experiment(validate_config(raw), tmp_path / "a", progress=False, log=lambda _: None)
    second = run_experiment(validate_config(raw), tmp_path / "b", progress=False, log=lambda _: None)
    assert not torch.equal(first.state["params"], second.state["params"])
    key_files = sorted(keys.iterdir())
    assert len(key_files) == 2
    assert stat.S_IMODE(os.stat(key_files[0]).st_mode) == 0o600 and stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    secrets_hex = [key for path in key_files for key in json.loads(path.read_text()).values()]
    assert len(set(secrets_hex)) == 8  # one key per agent, per run
    for folder in (tmp_path / "a", tmp_path / "b"):
        for path in folder.iterdir():
            content = path.read_bytes()
            assert not any(key.encode() in content or bytes.fromhex(key) in content for key in secrets_hex), path
    assert json.loads((tmp_path / "a" / "privacy.json").read_text())["noise"] == "secure"


def test_secure_run_resumes_with_its_own_keys_and_refuses_without_them(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DECENTDP_KEY_DIR", str(tmp_path / "keys"))
    config = validate_config(tiny_config(privacy={"noise": "secure"}, experiment={"rounds": 4, "eval_every": 2}))
    run_experiment(config, tmp_path / "run", progress=False, stop_after=2, log=lambda _: None)
    resumed = run_experiment(config, tmp_path / "run", progress=False, resume=True, log=lambda _: None)
    assert resumed.summary["finished"]
    for path in (tmp_path / "keys").iterdir():
        path.unlink()
    with pytest.raises(ConfigError, match="key file of this secure run"):
        run_experiment(config, tmp_path / "run", progress=False, resume=True, log=lambda _: None)


def test_a_secure_runs_data_fingerprint_is_keyed_and_still_guards_its_resume(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """setup.json's fingerprint of the records is an HMAC under a key derived from the agents' secrets (a helper's
    review: a plain SHA-256 let whoever holds every record but one test candidates for it): two runs on the same
    records publish unrelated values, neither the plain hash; a resume restores the keys, recomputes the same
    value and goes on, and refuses other records."""
    import dataclasses

    from decentdp.data.datasets import load_dataset

    monkeypatch.setenv("DECENTDP_KEY_DIR", str(tmp_path / "keys"))
    config = validate_config(tiny_config(privacy={"noise": "secure"}, experiment={"rounds": 4, "eval_every": 2,
                                                                                  "checkpoint_every": 2}))
    run_experiment(config, tmp_path / "run", progress=False, stop_after=2, log=lambda _: None)
    run_experiment(config, tmp_path / "other", progress=False, stop_after=2, log=lambda _: None)
    published = [json.loads((tmp_path / name / "setup.json").read_text())["data_fingerprint"]
                 for name in ("run", "other")]
    plain = load_dataset("digits").fingerprint(None)  # the SHA-256 of the records
    assert plain not in published and published[0] != published[1]
    assert all(value.startswith("hmac-sha256:") and plain not in value for value in published)
    resumed = run_experiment(config, tmp_path / "run", progress=False, resume=True, log=lambda _: None)
    assert resumed.summary["finished"]
    assert json.loads((tmp_path / "run" / "setup.json").read_text())["data_fingerprint"] == published[0]
    run_experiment(config, tmp_path / "moved", progress=False, stop_after=2, log=lambda _: None)
    digits = load_dataset("digits")
    flipped = dataclasses.replace(digits, y_train=torch.cat([(digits.y_train[:1] + 1) % 10, digits.y_train[1:]]))
    monkeypatch.setattr("decentdp.experiment.build.load_dataset", lambda *args, **kwargs: flipped)
    with pytest.raises(ConfigError, match="the records loaded differ"):
        run_experiment(config, tmp_path / "moved", progress=False, resume=True, log=lambda _: None)


def test_key_directory_inside_the_results_folder_is_refused(tmp_path: Path) -> None:
    raw = tiny_config(privacy={"noise": "secure", "key_dir": str(tmp_path / "run" / "keys")})
    with pytest.raises(ConfigError, match="privacy.key_dir"):
        run_experiment(validate_config(raw), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_one_agents_state_holds_no_other_agents_key() -> None:
    keys = AgentKeys.generate(range(6))
    shard = keys.subset([2, 3])
    assert shard.agent_ids == [2, 3] and "AgentKeys(2 agents)" == repr(shard)
    with pytest.raises(KeyError, match="no key for agent 0"):
        shard.key(0)
    # The shard draws exactly the noise the full key set draws for its agents.
    full, part = SecureRandom(0, keys), SecureRandom(0, shard)
    assert torch.equal(full.normal([3], 50, 4, Stream.NOISE, 1), part.normal([3], 50, 4, Stream.NOISE, 1))


def test_secure_draws_are_standard_normal_in_float64_and_differ_per_agent_and_key() -> None:
    from scipy import stats

    rng = SecureRandom(0, AgentKeys.generate(range(3)))
    draws = rng.normal([0, 1, 2], 20000, 7, Stream.NOISE, 0)
    assert draws.dtype == torch.float64
    assert stats.kstest(draws.flatten().numpy(), "norm").pvalue > 1e-3
    assert not torch.equal(draws[0], draws[1])
    uniforms = rng.record_uniforms(7, 0, [1000, 1000, 1000])
    assert uniforms.dtype == torch.float64 and 0 <= float(uniforms.min()) and float(uniforms.max()) < 1
    assert stats.kstest(uniforms.numpy(), "uniform").pvalue > 1e-3
    other = SecureRandom(0, AgentKeys.generate(range(3)))
    assert not torch.equal(other.normal([0], 100, 7, Stream.NOISE, 0), draws[:1, :100])
    # Simulation draws are float32 and reproducible from the seed.
    assert torch.equal(AgentRandom(5).normal([1], 10, 2, Stream.NOISE), AgentRandom(5).normal([1], 10, 2, Stream.NOISE))


# ---------------------------------------------------------------------------------------------
# Nothing private in the outputs


def test_results_hold_no_raw_data_statistics_unless_asked(tmp_path: Path) -> None:
    raw = tiny_config(experiment={"rounds": 2, "eval_every": 1})
    run_experiment(validate_config(raw), tmp_path / "plain", progress=False, log=lambda _: None)
    histograms = build_experiment(validate_config(raw)).histograms
    rows = [json.dumps(row.tolist()) for row in histograms]
    for path in (tmp_path / "plain").iterdir():
        if path.suffix in {".json", ".jsonl", ".toml"}:
            text = path.read_text().replace(" ", "")
            assert "clipped_fraction" not in text and "histogram" not in text, path
            assert not any(row.replace(" ", "") in text for row in rows), path
    run_experiment(validate_config(raw), tmp_path / "diag", progress=False, diagnostics=True, log=lambda _: None)
    diagnostics = json.loads((tmp_path / "diag" / "diagnostics.json").read_text())
    assert "NOT differentially private" in diagnostics["warning"]
    assert diagnostics["class_histograms"] == histograms.tolist()
    first = json.loads((tmp_path / "diag" / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 <= first["diagnostics"]["clipped_fraction"] <= 1


def test_renamed_secure_noise_setting_names_its_replacement() -> None:
    with pytest.raises(ConfigError, match="privacy.secure_noise.*privacy.noise = 'secure'"):
        validate_config(tiny_config(privacy={"secure_noise": True}))


# ---------------------------------------------------------------------------------------------
# Sampling and clipping: what the accountant is told is what ran


@pytest.mark.parametrize("secure", [False, True])
def test_each_record_joins_with_probability_q_and_batch_sizes_have_binomial_variance(secure: bool) -> None:
    from decentdp.privacy.sampling import AgentData, PoissonSampler

    sizes, q, rounds = [40, 25], 0.3, 600
    x = torch.arange(sum(sizes), dtype=torch.float32)[:, None]
    data = AgentData(x, torch.arange(sum(sizes)), (torch.arange(40), torch.arange(40, 65)))
    rng = SecureRandom(0, AgentKeys.generate(range(2))) if secure else AgentRandom(11)
    sampler = PoissonSampler(data, torch.full((2,), q, dtype=torch.float64), rng)
    joins = torch.zeros(sum(sizes))
    batch_sizes = []
    for k in range(rounds):
        batch = sampler.sample(k)
        joins.index_add_(0, batch.y[batch.mask > 0].long(), torch.ones(int(batch.mask.sum())))
        batch_sizes.append(batch.sizes.double())
    # Per record: Binomial(rounds, q); 5 standard deviations, and the spread across records as expected.
    spread = math.sqrt(rounds * q * (1 - q))
    assert ((joins - rounds * q).abs() <= 5 * spread).all()
    sizes_seen = torch.stack(batch_sizes)
    for agent, n in enumerate(sizes):
        variance = float(sizes_seen[:, agent].var())
        expected = n * q * (1 - q)
        assert 0.75 * expected < variance < 1.3 * expected, (agent, variance, expected)


def test_every_clipped_contribution_is_at_most_c_up_to_float32_rounding() -> None:
    from decentdp.gradients.clipping import clipped_sum

    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 4, 64)
    per_sample = torch.randn(8, 64, 301, generator=generator) * scales[None, :, None]
    clip = 1.7
    for b in range(64):  # each record alone: its clipped contribution is the batch sum
        mask = torch.zeros(8, 64)
        mask[:, b] = 1
        sums, _ = clipped_sum(per_sample, mask, clip)
        assert float(sums.norm(dim=1).max()) <= clip * (1 + 8 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize(("algorithm", "secure"), [("dp-dsgd", False), ("central-dpsgd", False), ("dp-dsgd", True)])
def test_noise_in_the_broadcast_parameters_has_the_calibrated_scale_through_the_fast_engine(
        algorithm: str, secure: bool) -> None:
    """One round of a run, end to end, with its calibrated mechanism and with a vanishing one: the models
    differ by exactly the step times the released noise, ``lr sigma_i C / L_i`` per coordinate (Alg. 1
    line 10 moves each agent by its own noisy gradient)."""
    from decentdp.privacy.mechanisms import GaussianMechanism

    raw = tiny_config(algorithm={"name": algorithm, "lr": 0.5, "batch_size": 16},
                      model={"name": "mlp", "options": {"hidden": 64}}, engine={"gradients": "stacked"},
                      privacy={"epsilon": 2.0, "clip": 1.0, "noise": "secure" if secure else "simulation"})
    models, shared_keys = [], None
    for vanishing in (False, True):
        experiment = build_experiment(validate_config(raw))
        assert experiment.model.backend == "stacked"
        if vanishing:
            keep = experiment.oracle.mechanism
            experiment.oracle.mechanism = GaussianMechanism(keep.noise_multipliers * 1e-20, keep.sensitivity)
        if secure:  # the same keys in both builds, so that only the noise scale differs
            shared_keys = shared_keys or experiment.oracle.rng.keys
            experiment.oracle.rng.keys = shared_keys
        state = experiment.simulator.run(experiment.initial_state(), 0, 1, lambda done, current: False)
        models.append(state["params"].double())
    moved = models[0] - models[1]
    expected = 0.5 * experiment.noise_multipliers.double() * 1.0 / 16
    measured = moved.std(dim=1)
    assert torch.allclose(measured, expected, rtol=0.06), (measured, expected)
    assert moved.mean(dim=1).abs().max() < 4 * float(expected.max()) / math.sqrt(moved.shape[1])
