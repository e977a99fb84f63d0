"""Bellet et al. (2018) personalized P2P learning: objective and solver, private updates and their
accounting, schedules, data, bad input, and the CLI path (``decentdp.personalized``)."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from tests.conftest import SHARED_DATA

from decentdp.cli.main import main
from decentdp.config import load_config, validate_config
from decentdp.data.movielens import load_movielens
from decentdp.data.personal import PersonalData, bound_features, holdout_masks
from decentdp.data.synthetic_linear import synthetic_linear
from decentdp.errors import ConfigError, DataError
from decentdp.experiment.loop import run_experiment
from decentdp.personalized.admm import gossip_admm
from decentdp.personalized.local import (
    CERTIFIED_TOLERANCE,
    LABEL_SHARE,
    local_dp_release,
    local_models,
    output_perturbation,
)
from decentdp.personalized.objective import (
    build_problem,
    clip_rows,
    data_gradient_sums,
    local_losses,
    objective,
    objective_gradient,
)
from decentdp.personalized.privacy import calibrate_updates, kairouz_epsilon, ledger_admits
from decentdp.personalized.runner import build_run, evaluate, run_personalized
from decentdp.personalized.schedule import plan_wakeups, poisson_ticks
from decentdp.personalized.solver import PrivateUpdates, coordinate_descent, minimiser
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.rng import AgentRandom, agent_random

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "experiments" / "personalized" / "demo-synthetic.toml"
DELTA = math.exp(-5)


def _regression(n: int = 6, p: int = 3, seed: int = 0) -> PersonalData:
    """A small quadratic instance: ring-plus-chords graph, a few records per agent, one agent without data."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(2, 8, n)
    counts[-1] = 0
    owner = np.repeat(np.arange(n), counts)
    x = rng.normal(size=(len(owner), p))
    y = x @ rng.normal(size=p) + 0.1 * rng.normal(size=len(owner))
    weights = np.zeros((n, n))
    for i in range(n):
        weights[i, (i + 1) % n] = weights[(i + 1) % n, i] = 1.0 + i / n
    weights[0, 3] = weights[3, 0] = 0.5
    return PersonalData(x, y, owner, x[:4], y[:4], owner[:4], weights, "regression")


def _optimum(problem) -> torch.Tensor:
    """Q_L's minimiser for the squared loss: one dense linear system over all (agent, coordinate) pairs."""
    n, p = problem.n_agents, problem.dim
    laplacian = torch.diag(problem.degree) - problem.weights
    system = torch.kron(laplacian, torch.eye(p, dtype=torch.float64))
    rhs = torch.zeros(n, p, dtype=torch.float64)
    pull = problem.mu * problem.degree * problem.confidence
    for i in range(n):
        rows = slice(int(problem.offsets[i]), int(problem.offsets[i + 1]))
        x, y, m = problem.x[rows], problem.y[rows], max(int(problem.counts[i]), 1)
        block = pull[i] * (2 * x.T @ x / m + 2 * problem.reg[i] * torch.eye(p, dtype=torch.float64))
        system[i * p:(i + 1) * p, i * p:(i + 1) * p] += block
        rhs[i] = pull[i] * 2 * x.T @ y / m
    return torch.linalg.solve(system, rhs.flatten()).reshape(n, p)


def test_noiseless_cd_decreases_the_objective_at_every_level_and_reaches_the_optimum():
    data = _regression()
    problem = build_problem(data, mu=0.5)
    plan = plan_wakeups(poisson_ticks(1, problem.n_agents, 4000), data.weights, 4000)
    theta = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    values = [objective(problem, theta)]
    coordinate_descent(problem, theta, plan, stop=60, after_level=lambda _l, t: values.append(objective(problem, t)))
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:], strict=False))
    coordinate_descent(problem, theta, plan, start=60)
    torch.testing.assert_close(theta, _optimum(problem), atol=1e-8, rtol=1e-8)


def test_the_central_minimiser_finds_the_optimum_of_either_loss():
    """L-BFGS on Q_L: the exact quadratic optimum (a linear system), and a vanishing gradient for the logistic
    loss, where the gradient itself is checked against autograd of the objective."""
    problem = build_problem(_regression(), mu=0.5)
    start = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    torch.testing.assert_close(minimiser(problem, start), _optimum(problem), atol=1e-6, rtol=1e-6)
    logistic = build_problem(synthetic_linear(12, 6, min_points=10, max_points=30, seed=2), mu=1.0)
    theta = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    squared = (theta * theta).sum(dim=1)
    smooth = (logistic.degree * squared).sum() - (theta * (logistic.weights @ theta)).sum()
    value = 0.5 * smooth + logistic.mu * (logistic.degree * logistic.confidence * local_losses(logistic, theta)).sum()
    value.backward()
    torch.testing.assert_close(objective_gradient(logistic, theta.detach()), theta.grad, atol=1e-10, rtol=1e-10)
    best = minimiser(logistic, torch.zeros(12, 6, dtype=torch.float64))
    assert float(objective_gradient(logistic, best).abs().max()) < 1e-6
    assert objective(logistic, best) <= objective(logistic, best + 1e-3 * torch.randn_like(best))


def test_gossip_admm_converges_to_the_minimiser_of_q_l_at_mu_not_mu_over_2():
    """Each edge lies in two agents' local objectives Q_a, so Q_a weighs it by 1/4 W_aj for sum_a Q_a to be Q_L; with
    specs D.8's 1/2 ADMM converged to argmin Q_L(mu / 2), here 0.34 away from argmin Q_L(mu)."""
    rng = np.random.default_rng(0)
    n, p, m = 4, 2, 6
    owner = np.repeat(np.arange(n), m)
    x = rng.normal(size=(n * m, p))
    y = rng.normal(size=n * m) + 2 * owner                  # agents whose targets differ: mu moves the optimum
    data = PersonalData(x, y, owner, x[:1], y[:1], owner[:1], np.ones((n, n)) - np.eye(n), "regression")
    problem = build_problem(data, mu=1.0)
    local = local_models(problem)
    best = minimiser(problem, local)
    assert float((best - minimiser(build_problem(data, mu=0.5), local)).abs().max()) > 0.3
    admm = gossip_admm(problem, local.clone(), poisson_ticks(0, n, 300), 0)
    torch.testing.assert_close(admm, best, atol=1e-6, rtol=0)


def test_levels_reproduce_the_one_agent_at_a_time_run_exactly():
    data = _regression()
    problem = build_problem(data, mu=0.3)
    woken = poisson_ticks(2, problem.n_agents, 200)
    plan = plan_wakeups(woken, data.weights, 25)
    batched = coordinate_descent(problem, torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64), plan)
    sequential = torch.zeros_like(batched)
    alpha, done = problem.step, np.zeros(problem.n_agents, dtype=int)
    for agent in woken.tolist():  # the definition: one agent at a time, from its neighbours' latest models
        if done[agent] >= 25:
            continue
        done[agent] += 1
        m = max(int(problem.counts[agent]), 1)
        rows = slice(int(problem.offsets[agent]), int(problem.offsets[agent + 1]))
        grad = 2 * problem.x[rows].T @ (problem.x[rows] @ sequential[agent] - problem.y[rows]) / m \
            + 2 * problem.reg[agent] * sequential[agent]
        average = problem.weights[agent] @ sequential / problem.degree[agent]
        sequential[agent] = (1 - alpha[agent]) * sequential[agent] + alpha[agent] * (
            average - problem.mu * problem.confidence[agent] * grad)
    torch.testing.assert_close(batched, sequential, atol=1e-12, rtol=1e-10)
    assert plan.updates_per_agent().max() <= 25


def test_each_metrics_row_is_the_private_run_stopped_at_its_tick():
    """A level holds updates of many ticks, so the state after one is the state at no tick: rows were labelled with
    the level's last tick + 1 while missing earlier updates.  Each intermediate row must equal the run of the same
    schedule cut after its ``ticks`` (the same keyed noise, a fresh ledger), at every eval_every wake-ups."""
    n, wakeups = 20, 6
    raw = _config(agents=n, dim=4, wakeups=wakeups)
    raw["experiment"] = {"seed": 3, "eval_every": 1}
    config = validate_config(raw)
    _, metrics, _ = run_personalized(config, log=lambda _line: None)
    assert [row["ticks"] for row in metrics] == list(range(0, n * wakeups + 1, n))
    assert [row["wakeups_per_agent"] for row in metrics] == list(range(wakeups + 1))
    woken = poisson_ticks(3, n, n * wakeups)
    for row in metrics[1:-1]:
        cut = build_run(config)
        plan = plan_wakeups(woken[:row["ticks"]], cut.data.weights, wakeups)
        assert cut.noise is not None and plan.total_ticks == row["ticks"]
        private = PrivateUpdates(cut.noise, 1.0, cut.ledger, agent_random(3, False, "auto", n, torch.device("cpu")),
                                 cut.problem.counts > 0)
        theta = coordinate_descent(cut.problem, torch.zeros(n, 4, dtype=torch.float64), plan, private=private)
        assert row["objective"] == pytest.approx(objective(cut.problem, theta), rel=1e-12, abs=0)
        assert row["accuracy_mean"] == evaluate(cut.data, theta)["accuracy_mean"]


def test_after_level_sees_a_level_whose_agents_have_all_stopped():
    """The runner counts levels to know when a metrics tick is reached: a skipped callback would record a later
    state under an earlier tick."""
    data = _regression()
    problem = build_problem(data, mu=0.5)
    plan = plan_wakeups(poisson_ticks(0, problem.n_agents, 60), data.weights, 10)
    seen: list[int] = []
    coordinate_descent(problem, torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64), plan,
                       stopped=torch.ones(problem.n_agents, dtype=torch.bool),
                       after_level=lambda level, _theta: seen.append(level))
    assert seen == list(range(plan.n_levels))


def _private(data: PersonalData, budget: float, planned: int, ledger_budget: float | None = None,
             mechanism: str = "laplace", seed: int = 0):
    problem = build_problem(data, mu=0.5)
    shape = np.ones((problem.n_agents, planned))
    shape[(problem.counts == 0).numpy()] = 0
    noise = calibrate_updates(mechanism, "tight", budget, DELTA, shape, "pld", "replace-one")
    ledger = PrivacyLedger(problem.n_agents, budget if ledger_budget is None else ledger_budget, DELTA,
                           budget_accountant="pld", relation="replace-one")
    return problem, PrivateUpdates(noise, 1.0, ledger, AgentRandom(seed), problem.counts > 0), noise


def test_laplace_noise_has_the_calibrated_scale():
    data = _regression()
    problem, private, noise = _private(data, math.inf, 1)
    private.noise = calibrate_updates("laplace", "paper", 2.0, DELTA, np.ones((problem.n_agents, 4000)), "pld",
                                      "replace-one")
    private.__post_init__()
    agent = torch.tensor([0])
    samples = []
    for k in range(4000):  # agent 0's updates 0..3999, each with fresh noise keyed by its number
        sums = torch.zeros(1, problem.dim, dtype=torch.float64)
        private.release(k, agent, torch.tensor([k]), sums)
        samples.append(sums)
    values = torch.cat(samples).flatten()
    scale = float(private.noise.multipliers[0, 0]) * 1.0  # z * C, C = 1
    # Laplace(b): E|X| = b, Var X = 2 b^2; 12,000 draws give ~1% standard errors
    assert abs(float(values.abs().mean()) / scale - 1) < 0.04
    assert abs(float(values.var()) / (2 * scale**2) - 1) < 0.08
    # the paper's per-update epsilon: s = 2C / (eps m) on the mean, i.e. z = 2 / eps on the sum
    assert private.noise.paper_epsilons[0, 0] == pytest.approx(2 / scale)


def test_l1_clipping_bounds_the_sensitivity_of_the_sum_by_2c():
    gradients = torch.randn(50, 7, dtype=torch.float64) * 10
    clipped = clip_rows(gradients, 1.5, 1)
    assert float(clipped.abs().sum(dim=1).max()) <= 1.5 + 1e-12
    data = _regression()
    problem = build_problem(data, mu=0.5)
    theta = torch.randn(problem.n_agents, problem.dim, dtype=torch.float64) * 5
    agents = torch.arange(problem.n_agents)
    before = data_gradient_sums(problem, theta, agents, clip=1.5, norm=1)
    x, y = data.x_train.copy(), data.y_train.copy()
    x[0], y[0] = 100.0, -50.0  # replace agent 0's first record
    changed = build_problem(PersonalData(x, y, data.owner_train, x, y, data.owner_train, data.weights,
                                         "regression"), mu=0.5)
    after = data_gradient_sums(changed, theta, agents, clip=1.5, norm=1)
    assert float((after - before).abs().sum(dim=1).max()) <= 2 * 1.5 + 1e-9


def test_kairouz_composition_matches_a_hand_computed_value():
    # ten updates of eps = 0.1 at delta = e^-5, by hand: sum = 1; drift = 10 * 0.1 (e^0.1 - 1) / (e^0.1 + 1)
    # = 0.0499584; second = drift + sqrt(0.2 * log(e + sqrt(0.1) e^5)) = 0.0499584 + 0.883741 = 0.933700;
    # third = drift + sqrt(0.2 * 5) = 1.049958; the minimum is the second term.
    assert float(kairouz_epsilon(np.full(10, 0.1), DELTA)) == pytest.approx(0.933700, abs=2e-6)
    assert float(kairouz_epsilon(np.array([0.3]), DELTA)) == pytest.approx(0.3)  # one update: its own epsilon
    assert math.isinf(float(kairouz_epsilon(np.array([0.1, math.inf]), DELTA)))


def test_pld_epsilon_of_laplace_updates_matches_dp_accounting_directly():
    data = _regression()
    problem, private, noise = _private(data, 1.0, 6)
    agents = torch.arange(problem.n_agents)
    for k in range(6):
        private.release(k, agents, torch.full((problem.n_agents,), k), torch.zeros(problem.n_agents, 3,
                                                                                 dtype=torch.float64))
    z = float(noise.multipliers[0, 0])
    # replace-one Laplace of noise z C on a sum of l1 sensitivity 2C: the Laplace mechanism of multiplier z / 2
    direct = pld_privacy_accountant.PLDAccountant()
    direct.compose(dp_accounting.LaplaceDpEvent(z / 2), 6)
    assert private.ledger.epsilon("pld")[0] == pytest.approx(direct.get_epsilon(DELTA), rel=2e-3)
    assert private.ledger.epsilon("pld")[0] <= 1.0 + 1e-9
    assert private.ledger.epsilon("pld")[-1] == 0.0  # the agent without data released nothing


def test_the_neighbouring_relation_reaches_calibration_and_ledger():
    # replace-one doubles the sum's sensitivity: the same budget needs twice the Laplace multiplier, and the
    # ledger prices the released event under the run's relation (so both runs spend the same epsilon)
    shape = np.ones((2, 5))
    spent = {}
    for relation in ("replace-one", "add-remove"):
        noise = calibrate_updates("laplace", "tight", 1.0, DELTA, shape, "tight", relation)
        ledger = PrivacyLedger(2, 1.0, DELTA, budget_accountant="tight", relation=relation)
        event = ledger.intern(noise.event(float(noise.multipliers[0, 0])))
        ledger.charge(0, np.full(2, event), count=5)
        spent[relation] = (float(noise.multipliers[0, 0]), float(ledger.epsilon("tight")[0]))
    assert spent["replace-one"][0] == pytest.approx(2 * spent["add-remove"][0], rel=1e-3)
    assert spent["replace-one"][1] == pytest.approx(spent["add-remove"][1], rel=1e-3)
    assert spent["replace-one"][1] <= 1.0 + 1e-9


def test_a_zero_model_predicts_the_positive_class():
    data = synthetic_linear(4, 5, min_points=10, max_points=20, test_points=50, label_noise=0.0, gamma=0.1, seed=1)
    accuracy = evaluate(data, torch.zeros(data.n_agents, data.dim, dtype=torch.float64))["accuracy_mean"]
    owner, y = data.owner_test, data.y_test
    expected = np.mean([np.mean(y[owner == i] > 0) for i in range(data.n_agents)])
    assert accuracy == pytest.approx(expected)


def test_agents_stop_at_their_budget_and_never_update_again():
    data = _regression()
    # noise for 6 updates at eps = 1, but a ledger that allows only eps = 0.4: about two updates each
    problem, private, _ = _private(data, 1.0, 6, ledger_budget=0.4)
    plan = plan_wakeups(poisson_ticks(3, problem.n_agents, 60), data.weights, 6)
    stopped = torch.zeros(problem.n_agents, dtype=torch.bool)
    snapshots = []
    theta = torch.zeros(problem.n_agents, problem.dim, dtype=torch.float64)
    coordinate_descent(problem, theta, plan, private=private, stopped=stopped,
                       after_level=lambda _l, t: snapshots.append((stopped.clone(), t.clone())))
    assert stopped[:-1].all() and not stopped[-1]  # every agent with data ran out; the one without never charges
    assert (private.ledger.epsilon("pld")[:-1] <= 0.4 + 1e-9).all()
    assert (private.ledger.releases()[:-1] < 6).all()
    for (was, before), (_, after) in zip(snapshots, snapshots[1:], strict=False):
        torch.testing.assert_close(after[was], before[was], rtol=0, atol=0)  # stopped agents never move


def test_schedule_is_reproducible_and_private_runs_resume_bit_for_bit():
    np.testing.assert_array_equal(poisson_ticks(7, 50, 500), poisson_ticks(7, 50, 500))
    assert not np.array_equal(poisson_ticks(7, 50, 500), poisson_ticks(8, 50, 500))
    data = _regression()
    problem, private, _ = _private(data, 1.0, 8)
    plan = plan_wakeups(poisson_ticks(4, problem.n_agents, 48), data.weights, 8)
    whole = coordinate_descent(problem, torch.zeros(problem.n_agents, 3, dtype=torch.float64), plan,
                               private=private)
    _, again, _ = _private(data, 1.0, 8)
    half = plan.n_levels // 2
    part = coordinate_descent(problem, torch.zeros(problem.n_agents, 3, dtype=torch.float64), plan, stop=half,
                              private=again)
    resumed = coordinate_descent(problem, part.clone(), plan, start=half, private=again)
    assert torch.equal(whole, resumed)
    assert np.array_equal(private.ledger.releases(), again.ledger.releases())


def test_synthetic_generator_matches_its_specification():
    data = synthetic_linear(40, 12, min_points=10, max_points=100, seed=5)
    assert data.n_agents == 40 and data.dim == 12 and data.task == "classification"
    assert data.train_counts.min() >= 10 and data.train_counts.max() <= 100
    assert np.allclose(data.weights, data.weights.T) and (data.weights.sum(axis=1) > 0).all()
    assert set(np.unique(data.y_train)) == {-1.0, 1.0}


def test_a_gamma_too_small_to_connect_the_synthetic_graph_names_the_field() -> None:
    """The similarity weights exp(-d / gamma) underflow to zero (a helper's review: a bare ValueError traceback)."""
    with pytest.raises(ConfigError) as error:
        synthetic_linear(20, 10, gamma=0.0005, seed=0)
    assert error.value.field == "personalized.gamma"


def test_synthetic_graph_keeps_the_weights_above_the_largest_connected_cut():
    """The authors' rule (Dada ``compute_adjacencies``): cuts max W / sqrt(10)^k, k = 1, 2, ...; the first
    that leaves a connected graph is kept, so the next larger one (if any was tried) disconnects it."""
    for seed, agents in ((0, 100), (3, 12)):
        data = synthetic_linear(agents, 4, seed=seed)
        weights, cut = data.weights, data.info["weight_cut"]
        assert np.allclose(weights, weights.T) and ((weights == 0) | (weights > cut)).all()
        adjacency = (weights > 0).astype(float)
        assert np.linalg.eigvalsh(np.diag(adjacency.sum(axis=1)) - adjacency)[1] > 1e-3
        kept = weights[weights > 0]
        larger = cut * np.sqrt(10)
        if larger < weights.max() / np.sqrt(10) * 1.0001:  # a larger cut was tried first: it disconnected
            coarse = (weights > larger).astype(float)
            assert np.linalg.eigvalsh(np.diag(coarse.sum(axis=1)) - coarse)[1] <= 1e-3
        assert kept.min() > cut
    fixed = synthetic_linear(100, 4, seed=0, threshold=1e-3)
    assert fixed.info["cut"] == "fixed" and (fixed.weights > 0).sum() > (synthetic_linear(100, 4, seed=0).weights
                                                                         > 0).sum()


def test_local_dp_release_perturbs_every_training_record_and_nothing_else():
    """Features: Laplace of scale 2 bound / ((1 - share) eps) per coordinate (for points already inside the
    l1 ball, which are not scaled); labels: flipped with probability 1 / (1 + e^(share eps))."""
    data = synthetic_linear(50, 3, min_points=100, max_points=100, seed=1)
    small = PersonalData(data.x_train / 100, data.y_train, data.owner_train, data.x_test, data.y_test,
                         data.owner_test, data.weights, data.task)  # every ||x||_1 < 0.1 <= bound
    epsilon, bound = 1.0, 0.5
    released = local_dp_release(small, epsilon, bound, np.random.default_rng(0))
    noise = released.x_train - small.x_train
    scale = 2 * bound / ((1 - LABEL_SHARE) * epsilon)
    assert abs(np.abs(noise).mean() / scale - 1) < 0.03  # 15,000 |Laplace| draws: ~0.8 % standard error
    flipped = np.mean(released.y_train != small.y_train)
    assert abs(flipped - 1 / (1 + math.exp(LABEL_SHARE * epsilon))) < 0.025  # 5,000 labels
    assert released.x_test is small.x_test and released.y_test is small.y_test
    big = local_dp_release(data, 1e9, 0.5, np.random.default_rng(0))  # almost no noise: only the scaling shows
    assert np.abs(big.x_train).sum(axis=1).max() <= 0.5 + 1e-6
    with pytest.raises(ValueError, match="classification only"):
        local_dp_release(_regression(), 1.0, 1.0, np.random.default_rng(0))


def test_warm_start_noise_dwarfs_the_local_models_whatever_lambda():
    """Output perturbation (Chaudhuri et al. 2011): the noise norm is Gamma(p, C / (m_i lambda_i eps)),
    while the clipped local model obeys 2 lambda_i theta = -(mean clipped gradient), so ||theta|| <=
    C / (2 lambda_i): noise / model >= 2 p / (m_i eps) for any lambda_i (docs/reproduction.md, Figure 2)."""
    dim, clip, epsilon = 5, 1.0, 0.5
    data = synthetic_linear(200, dim, min_points=10, max_points=100, seed=3)
    problem = build_problem(data, mu=0.04)
    local = local_models(problem, clip)
    assert bool((torch.linalg.vector_norm(local, dim=1) <= clip / (2 * problem.reg) + 1e-9).all())
    sensitivity = (1 + CERTIFIED_TOLERANCE) * clip / (problem.counts.double() * problem.reg)  # 2C / (m Lambda)
    scaled = torch.cat([torch.linalg.vector_norm(output_perturbation(problem, local, clip, epsilon, AgentRandom(seed))
                                                 - local, dim=1) * epsilon / sensitivity for seed in range(5)])
    # Gamma(p, 1): mean p, variance p; 1000 draws give a ~1.4% standard error on the mean
    assert abs(float(scaled.mean()) / dim - 1) < 0.06
    assert abs(float(scaled.var()) / dim - 1) < 0.2


def test_secure_warm_start_is_an_exact_grid_laplace_release_of_the_l1_sensitivity():
    """Secure mode's output perturbation: every released coordinate is an integer number of grid steps (no
    float support gaps, Mironov 2012), the per-coordinate noise is Laplace of scale sqrt(p) Delta_i / eps
    (mean absolute value = scale, within sampling error), and agents without data are left alone."""
    from decentdp.privacy.discrete import laplace_grid_step
    from decentdp.rng import AgentKeys, SecureRandom

    dim, clip, epsilon = 5, 1.0, 0.5
    data = synthetic_linear(300, dim, min_points=10, max_points=100, seed=3)
    problem = build_problem(data, mu=0.04)
    local = local_models(problem, clip)
    keys = AgentKeys({agent: bytes([agent % 256, agent // 256]) * 16 for agent in range(300)})  # fixed: no flaky draw
    released = output_perturbation(problem, local, clip, epsilon, SecureRandom(0, keys))
    sensitivity = math.sqrt(dim) * (1 + CERTIFIED_TOLERANCE) * clip / (problem.counts.double() * problem.reg)
    steps = torch.tensor([laplace_grid_step(float(s), dim, 1 / epsilon) for s in sensitivity],
                         dtype=torch.float64)[:, None]
    assert torch.equal(torch.round(released / steps), released / steps)        # on each agent's grid, exactly
    scaled = ((released - local) * epsilon / sensitivity[:, None]).abs()
    assert abs(float(scaled.mean()) - 1) < 0.08                                # 1500 draws of |Laplace(1)|


def test_private_local_models_are_certified_and_move_at_most_the_certified_sensitivity():
    """The warm start's models are iterates, not exact minimisers: local_models certifies each one's clipped
    objective gradient (at most CERTIFIED_TOLERANCE C / m_i), and for datasets that differ in one record
    (replaced by a far point with the opposite label) the models move by at most the sensitivity that
    output_perturbation adds noise for, (1 + CERTIFIED_TOLERANCE) C / (m_i lambda_i)."""
    from dataclasses import replace

    from decentdp.personalized.objective import data_gradient_sums

    clip, rng = 1.0, np.random.default_rng(5)
    data = synthetic_linear(40, 8, min_points=5, max_points=30, seed=4)
    problem = build_problem(data, mu=0.04)
    local = local_models(problem, clip)
    counts = problem.counts.clamp(min=1).double()
    gradient = data_gradient_sums(problem, local, torch.arange(problem.n_agents), clip, 2) / counts[:, None] \
        + 2 * problem.reg[:, None] * local
    assert bool((torch.linalg.vector_norm(gradient, dim=1) <= CERTIFIED_TOLERANCE * clip / counts).all())
    bound = (1 + CERTIFIED_TOLERANCE) * clip / (counts * problem.reg)
    ratios = []
    for row in rng.choice(len(data.y_train), 12, replace=False):
        x, y = data.x_train.copy(), data.y_train.copy()
        x[row], y[row] = -50.0 * x[row], -y[row]
        moved = local_models(build_problem(replace(data, x_train=x, y_train=y), mu=0.04), clip)
        agent = int(data.owner_train[row])
        ratios.append(float(torch.linalg.vector_norm(moved[agent] - local[agent]) / bound[agent]))
    assert 0.1 < max(ratios) <= 1.0   # within the bound (0.22 here), and the bound is not vacuous


def test_an_uncertified_warm_start_is_refused(monkeypatch: pytest.MonkeyPatch):
    from decentdp.errors import PrivacyError
    from decentdp.personalized import local

    monkeypatch.setattr(local, "MAX_CLIPPED_STEPS", 0)
    problem = build_problem(synthetic_linear(10, 4, min_points=5, max_points=20, seed=1), mu=0.04)
    with pytest.raises(PrivacyError, match="personalized.warm_start"):
        local_models(problem, 1.0)


def test_the_secure_warm_starts_exact_loss_stays_within_its_epsilon():
    """Brute force over the discrete Laplace mass of the grid release: for two local models l2-apart by the
    output-perturbation sensitivity Delta (the minimisers of neighbouring datasets), the largest log-ratio of
    any output's probability is sum_j |q_j - q'_j| / t (q: the rounded inputs, t: the noise scale in grid
    steps); it must not exceed the warm start's epsilon, including for the l1-worst direction (all
    coordinates equal)."""
    from decentdp.privacy.discrete import grid_scale, laplace_grid_step

    rng = np.random.default_rng(2)
    for _ in range(300):
        dim, delta, epsilon = int(rng.integers(1, 40)), rng.uniform(1e-3, 10.0), rng.uniform(0.01, 2.0)
        l1 = math.sqrt(dim) * delta                         # the sensitivity the release is built for
        gamma, t = laplace_grid_step(l1, dim, 1.0 / epsilon), grid_scale(1.0 / epsilon, dim, l1)
        theta = rng.normal(scale=rng.choice([1e-2, 1.0, 1e2]) * delta, size=dim)
        direction = np.ones(dim) if rng.uniform() < 0.5 else rng.normal(size=dim)
        other = theta + delta * rng.uniform() * direction / np.linalg.norm(direction)
        exact = np.abs(np.rint(theta / gamma) - np.rint(other / gamma)).sum() / t
        assert exact <= epsilon * (1 + 1e-12)


def _config(**personalized) -> dict:
    return {"privacy": {"epsilon": 1.0, "delta": DELTA, "clip": 1.0, "accountant": "pld",
                        "neighbouring": "replace-one"},
            "personalized": {"dataset": "synthetic", "agents": 12, "dim": 4, "wakeups": 3, **personalized}}


@pytest.mark.parametrize(("personalized", "field"), [
    ({"mu": 0.0}, "personalized.mu"),
    ({"mu": -1.0}, "personalized.mu"),
    ({"wakeups": 0}, "personalized.wakeups"),
    ({"allocation": "optimal"}, "personalized.allocation"),
    ({"dataset": "movielens-100k"}, "personalized.agents"),     # the synthetic problem's size, left on MovieLens
    ({"neighbours": 5}, "personalized.neighbours"),             # MovieLens's k-NN graph, on the synthetic problem
    ({"min_points": 50, "max_points": 20}, "personalized.min_points"),
    ({"validation": True}, "personalized.validation"),          # checked when the config is read, not at the run
])
def test_bad_settings_name_their_field(personalized, field):
    with pytest.raises(ConfigError) as error:
        validate_config(_config(**personalized))
    assert error.value.field == field


def test_private_updates_refuse_add_remove_neighbours():
    """Under add-remove, m_i (in the step, c_i, lambda_i and the released mean) differs between neighbours, and
    MovieLens' split is not neighbour-preserving (below): a private cd run is refused, a non-private one is not."""
    raw = _config()
    raw["privacy"] = {**raw["privacy"], "neighbouring": "add-remove"}
    with pytest.raises(ConfigError) as error:
        validate_config(raw)
    assert error.value.field == "privacy.neighbouring" and "replace-one" in error.value.message
    validate_config({**raw, "privacy": {**raw["privacy"], "epsilon": "inf"}})
    validate_config({**raw, "personalized": {**raw["personalized"], "method": "local"}})


def test_the_per_user_split_is_neighbour_preserving_under_replace_one_only():
    """holdout_masks draws one key per row in row order: replacing a row keeps every row's key (the same split),
    removing one shifts the keys of every later row, so other users' ratings move between training and test."""
    owner = np.repeat(np.arange(4), 25)
    split = holdout_masks(owner, 0.2, np.random.default_rng(7))
    assert np.array_equal(split, holdout_masks(owner.copy(), 0.2, np.random.default_rng(7)))  # replace-one: same
    removed = holdout_masks(np.delete(owner, 3), 0.2, np.random.default_rng(7))  # user 0 loses a rating
    assert not np.array_equal(split[25:], removed[24:])  # users 1-3's splits change


@pytest.mark.parametrize(("section", "values", "field", "fragment"), [
    # per-agent budgets once left the runner's budget infinite: zero noise in a run marked private
    ("privacy", {"epsilon": None, "agent_epsilons": [1.0] * 12}, "privacy.agent_epsilons", "one budget"),
    ("privacy", {"colluding": [[0, 1]]}, "privacy.colluding", "all other agents together"),
    ("experiment", {"rounds": 50}, "experiment.rounds", "personalized.wakeups"),
    ("schedule", {"offline_probability": 0.2}, "schedule.offline_probability", "is not read"),
    ("topology", {"agents": 50}, "topology.agents", "is not read"),
    ("engine", {"backend": "ray"}, "engine.backend", "one process"),
    ("engine", {"device": "cuda"}, "engine.device", "on the CPU"),
    ("averaging", {"kind": "ema"}, "averaging.kind", "is not read"),
    ("algorithm", {"weight_decay": 0.5}, "algorithm.weight_decay", "is not read"),
    ("engine", {"noise_streams": "batched"}, "engine.noise_streams", "privacy.noise = 'simulation'"),
])
def test_a_setting_a_personalized_run_would_ignore_is_refused(section, values, field, fragment):
    raw = _config()
    raw[section] = {**raw.get(section, {}), **values}
    if section == "engine" and "noise_streams" in values:  # secure noise draws from each agent's own key
        raw["privacy"] = {**raw["privacy"], "noise": "secure"}
    with pytest.raises(ConfigError) as error:
        validate_config(raw)
    assert error.value.field == field and fragment in error.value.message


@pytest.mark.parametrize("option", ["profile", "diagnostics"])
def test_network_run_options_are_refused_by_a_personalized_run(option):
    with pytest.raises(ConfigError) as error:
        run_experiment(validate_config(_config()), None, progress=False, **{option: True})
    assert error.value.field == f"--{option}"


def test_a_budget_that_leaves_no_update_is_a_config_error():
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        validate_config({**_config(), "privacy": {**_config()["privacy"], "epsilon": 0.0}})
    # no Laplace noise up to the largest multiplier makes even the planned updates fit this budget
    config = validate_config({**_config(), "privacy": {**_config()["privacy"], "epsilon": 1e-7, "delta": 1e-10}})
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        run_personalized(config, log=lambda _line: None)


def _write_ratings(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "u.data").write_text("\n".join(lines) + "\n")
    return folder


def test_movielens_files_missing_or_malformed_are_named(tmp_path):
    with pytest.raises(DataError, match="u.data"):
        load_movielens(tmp_path, 0)
    _write_ratings(tmp_path / "bad", ["1\t2\t5\t881250949", "1\tx\t3\t1"])
    with pytest.raises(DataError, match=r"u\.data, line 2"):
        load_movielens(tmp_path / "bad", 0)
    _write_ratings(tmp_path / "range", ["1\t2\t9\t881250949"])
    with pytest.raises(DataError, match="ratings lie in 1..5"):
        load_movielens(tmp_path / "range", 0)
    _write_ratings(tmp_path / "twice", ["1\t2\t5\t1", "2\t2\t3\t1", "1\t3\t4\t1", "1\t2\t1\t1"])
    with pytest.raises(DataError, match=r"u\.data, lines 1 and 4: user 1 rates item 2 twice"):
        load_movielens(tmp_path / "twice", 0)


@pytest.mark.parametrize(("text", "message"), [
    ("1\t1\t5\t0\n\n2\t1\t3\t0\n1\t2\t9\t0\n", r"line 4: user and item ids start at 1"),
    ("\n\n1\t1\t5\t0\n\n\n1\t1\t4\t0\n", r"lines 3 and 6: user 1 rates item 1 twice"),
    ("\n" + "".join(f"{user}\t{user}\t3\t1\n" for user in range(1, 7)) + "\n1\t20000000\t3\t1\n",
     r"line 9: ids are used as indices"),
    ("# user item rating timestamp\n1\t1\t5\t0\n2\t1\t3\t0\n", r"line 1: expected 4 integers"),
    ("1\t1\t5\t0\n\n# a comment\n2\t1\t3\t0\n", r"line 3: expected 4 integers"),
])
def test_ratings_messages_name_the_true_line_past_blank_lines(tmp_path, text, message):
    """numpy's parser skips blank lines (and took '#' lines as comments, which the line-by-line check refused), so
    row indices were reported as line numbers (a reviewer: a bad rating on line 4 named line 3, a repeated pair
    on lines 3 and 6 named lines 1 and 2).  u.data has no comment syntax: a '#' line is malformed, named."""
    (tmp_path / "u.data").write_text(text)
    with pytest.raises(DataError, match=r"u\.data, " + message):
        load_movielens(tmp_path, 0, neighbours=1)


def test_ids_that_would_make_the_dense_matrices_too_large_are_refused(tmp_path):
    """Six users and an item id of 2e7: one 0.9 GiB matrix, under the 4 GiB limit when only one was counted, but the
    loader holds about five (a reviewer measured 2.45 GB resident for item ids up to 1e7); refused at once."""
    _write_ratings(tmp_path / "sparse", [f"{user}\t{user}\t3\t1" for user in range(1, 7)] + ["1\t20000000\t3\t1"])
    with pytest.raises(DataError, match=r"line 7: ids are used as indices.*GiB of dense matrices"):
        load_movielens(tmp_path / "sparse", 0)


@pytest.mark.parametrize(("line", "message"), [
    ("99999999999999999999\t1\t3\t1", r"line 2: 99999999999999999999 does not fit a 64-bit integer"),
    ("1\t3\t4\t99999999999999999999", r"line 2: 99999999999999999999 does not fit"),  # the timestamp too
    ("1\t--3\t3\t1", r"line 2: expected 4 integers"),        # passed '--3'.lstrip('-').isdigit()
    ("1\t\u00b2\t3\t1", r"line 2: expected 4 integers"),      # '²' (latin-1 0xB2) passed str.isdigit
])
def test_a_ratings_line_the_int64_parser_cannot_read_is_named(tmp_path, line, message):
    """The line-by-line check let these through to numpy's int64 conversion, which raised OverflowError or
    ValueError with no file or line."""
    folder = tmp_path / "ml"
    folder.mkdir()
    (folder / "u.data").write_text(f"1\t2\t5\t881250949\n{line}\n", encoding="latin-1")
    with pytest.raises(DataError, match=r"u\.data, " + message):
        load_movielens(folder, 0)


@pytest.mark.parametrize(("test_fraction", "validation"), [(0.95, True), (0.01, False)])
def test_a_split_that_holds_out_no_rating_names_test_fraction_before_writing(tmp_path, test_fraction, validation):
    """Users with 10 ratings: 0.95 leaves one training rating each, which a validation split cannot divide; 0.01
    rounds every user's test share to 0.  evaluate() then reduced an empty tensor after setup.json was written."""
    rng = np.random.default_rng(0)
    lines = [f"{user}\t{item}\t{rng.integers(1, 6)}\t1" for user in range(1, 7)
             for item in rng.choice(np.arange(1, 30), 10, replace=False)]
    raw = _config(dataset="movielens-100k", als_rank=2, neighbours=2, test_fraction=test_fraction,
                  validation=validation)
    for synthetic_only in ("agents", "dim"):
        del raw["personalized"][synthetic_only]
    raw["privacy"]["clip"] = 10.0
    folder = _write_ratings(tmp_path / "ml", lines)
    with pytest.raises(ConfigError, match="personalized.test_fraction"):
        run_personalized(validate_config(raw), out_dir=tmp_path / "out", data_dir=folder, log=lambda _line: None)
    assert not (tmp_path / "out").exists()


def test_a_user_without_ratings_gets_the_confidence_floor_and_spends_nothing(tmp_path):
    rng = np.random.default_rng(0)
    lines = [f"{user}\t{item}\t{rng.integers(1, 6)}\t0" for user in (1, 2, 4, 5, 6) for item in
             rng.choice(np.arange(1, 30), 12, replace=False)]  # user 3 has no ratings
    folder = _write_ratings(tmp_path / "ml", lines)
    raw = _config(dataset="movielens-100k", als_rank=3, neighbours=2, wakeups=4)
    for synthetic_only in ("agents", "dim"):   # MovieLens's users are its agents
        del raw["personalized"][synthetic_only]
    raw["privacy"]["clip"] = 10.0
    raw["privacy"]["delta"] = 1e-3
    summary, _, theta = run_personalized(validate_config(raw), data_dir=folder, log=lambda _line: None)
    assert torch.isfinite(theta).all() and math.isfinite(summary["rmse_mean"])
    assert summary["epsilon_per_agent"][2] == 0.0 and summary["epsilon_max"] <= 1.0 + 1e-9


def test_cli_demo_prints_the_summary_keys(capsys, tmp_path):
    assert main(["run", str(DEMO), "--json", "--out", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("accuracy_mean", "epsilon_max", "paper_epsilon_max", "epsilon_max_rdp", "wall_seconds"):
        assert key in summary
    assert summary["epsilon_max"] <= 1.0 + 1e-9 < summary["paper_epsilon_max"]
    assert (tmp_path / "out" / "summary.json").is_file() and (tmp_path / "out" / "schedule.npz").is_file()


@pytest.mark.slow
def test_movielens_cli_path(capsys, tmp_path):
    if not (SHARED_DATA / "movielens-100k" / "u.data").is_file():
        pytest.skip(f"MovieLens-100K not found in {SHARED_DATA}/movielens-100k")
    config = ROOT / "experiments" / "personalized" / "movielens-eps1.toml"
    assert load_config(config).personalized is not None
    assert main(["run", str(config), "--data-dir", str(SHARED_DATA), "--set", "personalized.wakeups=3",
                 "--json", "--out", str(tmp_path / "ml")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["n_agents"] == 943
    for key in ("rmse_mean", "epsilon_max", "paper_epsilon_max", "wall_seconds"):
        assert summary[key] is not None
    # three wake-ups from Theta = 0 (every rating predicted 3, RMSE about 1.25): barely started, but finite
    assert 0.9 < summary["rmse_mean"] < 1.3 and summary["epsilon_max"] <= 1.0 + 1e-9


def test_privacy_json_names_the_accountant_and_observer_of_its_epsilon(tmp_path):
    """A reviewer's run with privacy.accountant = 'rdp' wrote its RDP value under the key "tight" (the tight
    accountant's, the smaller of PLD and RDP, was 0.992 against 1.000): every field now says what it is."""
    raw = _config()
    raw["privacy"]["accountant"] = "rdp"
    summary, _, _ = run_personalized(validate_config(raw), out_dir=tmp_path / "run", log=lambda _line: None)
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert "tight" not in privacy and privacy["epsilon_accountant"] == summary["epsilon_accountant"] == "rdp"
    assert privacy["epsilon"] == privacy["epsilon_rdp"] and max(privacy["epsilon"]) == summary["epsilon_max"]
    assert privacy["epsilon_observer"].startswith("everyone together") and "paper_epsilon" in privacy
    assert {"paper_epsilon_max", "paper_delta"} <= set(summary) and "epsilon_max_paper" not in summary


def test_a_run_states_its_noise_mode_and_spends_the_warm_start_inside_the_budget(tmp_path):
    """Issue item 6: the noise mode and the simulation notice are stated (setup, privacy.json, summary, log),
    and the private warm start's epsilon is spent inside the budget, not added on top of it."""
    lines: list[str] = []
    raw = _config(warm_start=True, warm_start_epsilon=0.3)
    summary, _, _ = run_personalized(validate_config(raw), out_dir=tmp_path / "run", log=lines.append)
    assert summary["epsilon_max"] <= 1.0 + 1e-9 and summary["warm_start_epsilon"] == 0.3
    assert summary["private"] is True and summary["noise"] == "simulation"
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    setup = json.loads((tmp_path / "run" / "setup.json").read_text())
    for record in (privacy, setup):
        assert record["noise"] == "simulation" and "recomputable" in record["noise_notice"]
        assert record["neighbouring"] == "replace-one"
    assert any("recomputable" in line for line in lines)
    with pytest.raises(ConfigError, match="personalized.warm_start_epsilon"):
        run_personalized(validate_config(_config(warm_start=True, warm_start_epsilon=1.0)), log=lambda _line: None)


@pytest.mark.parametrize("method", ["admm", "propagation"])
def test_a_method_without_noise_says_it_is_not_private(method, tmp_path):
    lines: list[str] = []
    summary, _, _ = run_personalized(validate_config(_config(method=method)), out_dir=tmp_path / method,
                                     log=lines.append)
    assert summary["private"] is False and summary["epsilon_max"] is None
    assert any("NOT private" in line for line in lines)
    assert json.loads((tmp_path / method / "privacy.json").read_text())["private"] is False


@pytest.mark.parametrize("method", ["local", "propagation"])
def test_the_private_warm_start_alone_is_priced_at_its_pure_epsilon(method, tmp_path):
    """Model propagation of the warm start's output-perturbed local models is post-processing (eq. (16), public
    weights): private at warm_start_epsilon, not 'NOT private' and infinite as reported before (a reviewer's note);
    method = 'local' with the warm start keeps those DP models and reported epsilon 0 beside their noise."""
    lines: list[str] = []
    summary, _, _ = run_personalized(validate_config(_config(method=method, warm_start=True)),
                                     out_dir=tmp_path / method, log=lines.append)
    assert summary["private"] is True and summary["epsilon_max"] == summary["warm_start_epsilon"] == 0.05
    assert summary["paper_epsilon_max"] == 0.05
    assert not any("NOT private" in line for line in lines)
    assert json.loads((tmp_path / method / "privacy.json").read_text())["private"] is True


class _Recording:
    """A numpy generator that records the Laplace scales and uniform draws local_dp_release asks for."""

    def __init__(self) -> None:
        self.generator, self.scales = np.random.default_rng(0), []

    def laplace(self, loc: float, scale: float, size: tuple[int, ...]) -> np.ndarray:
        self.scales.append(scale)
        return self.generator.laplace(loc, scale, size)

    def random(self, size: int) -> np.ndarray:
        return self.generator.random(size)


def test_local_dp_release_loses_at_most_epsilon_for_any_two_records():
    """The exact privacy loss of one released record, computed here from the noise the release drew: for two
    records x, x' (features scaled into the l1 ball as the release does, labels y, y') the Laplace part
    loses ||c(x) - c(x')||_1 / b at worst and randomized response |log(p / (1 - p))| when the labels differ.
    Over every pair of the dataset's records (most outside the ball) and the ball's antipodes it stays <= eps,
    with equality at the antipodes with opposite labels."""
    data = synthetic_linear(20, 4, min_points=10, max_points=10, seed=2)
    epsilon, bound = 2.0, 1.0
    recording = _Recording()
    released = local_dp_release(data, epsilon, bound, recording)
    (scale,) = recording.scales
    keep = np.mean(released.y_train == data.y_train)                       # observed, for the label's share
    rr = math.log(1 / (1 + math.exp(-LABEL_SHARE * epsilon)) / (1 / (1 + math.exp(LABEL_SHARE * epsilon))))
    assert abs(keep - 1 / (1 + math.exp(-LABEL_SHARE * epsilon))) < 0.1
    size = np.abs(data.x_train).sum(axis=1, keepdims=True)
    clipped = data.x_train * np.minimum(1.0, bound / size)                  # this test's own scaling
    distances = np.abs(clipped[:, None, :] - clipped[None, :, :]).sum(axis=2) / scale
    differ = data.y_train[:, None] != data.y_train[None, :]
    assert (distances + rr * differ).max() <= epsilon + 1e-9
    antipodes = 2 * bound / scale + rr                                      # x = bound e_1, x' = -bound e_1
    assert antipodes == pytest.approx(epsilon, rel=1e-12)


def _replace_one_record(data: PersonalData, row: int, scale: float) -> PersonalData:
    """``data`` with training row ``row``'s features multiplied by ``scale`` (a neighbouring dataset)."""
    x = data.x_train.copy()
    x[row] *= scale
    return PersonalData(x, data.y_train, data.owner_train, data.x_test, data.y_test, data.owner_test, data.weights,
                        data.task, data.info, data.feature_bound)


@pytest.mark.parametrize("allocation", ["equal", "optimal"])
def test_a_private_runs_steps_and_noise_read_no_record(allocation):
    """The step alpha_i multiplies agent i's noisy gradient in its broadcast, so it must be public: with the
    records' own smoothness one replaced record changed alpha_i 15-fold on the demo (a reviewer's finding,
    reported epsilon 1 against an exact 16.9).  A private run's steps, block constants and (optimal allocation)
    noise multipliers are the same on neighbouring datasets."""
    raw = tomllib.loads(DEMO.read_text())
    raw["personalized"].update({"allocation": allocation, **({"calibration": "paper"} if allocation == "optimal"
                                                             else {})})
    config = validate_config(raw)
    data = synthetic_linear(30, 10, seed=0)
    for row in (0, 57, len(data.y_train) - 1):
        runs = []
        for candidate in (data, _replace_one_record(data, row, 10.0)):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("decentdp.personalized.runner.load_personal_data", lambda *_args, c=candidate: c)
                runs.append(build_run(config))
        first, second = runs
        assert torch.equal(first.problem.step, second.problem.step)
        assert torch.equal(first.problem.block_lipschitz, second.problem.block_lipschitz)
        assert np.array_equal(first.noise.multipliers, second.noise.multipliers)
        assert first.setup["training_rows_scaled_to_bound"] == 0 < second.setup["training_rows_scaled_to_bound"]
    exact = build_problem(data, 0.04)  # a non-private run keeps the records' own (larger) steps
    assert not torch.equal(exact.step, build_problem(_replace_one_record(data, 0, 10.0), 0.04).step)


def test_bound_features_scales_only_the_rows_above_the_bound():
    data = _regression()
    norms = np.linalg.norm(data.x_train, axis=1)
    bound = float(np.median(norms))
    bounded, rescaled = bound_features(data, bound)
    after = np.linalg.norm(bounded.x_train, axis=1)
    assert rescaled == int((norms > bound).sum()) > 0 and np.all(after <= bound * (1 + 1e-12))
    assert np.array_equal(bounded.x_train[norms <= bound], data.x_train[norms <= bound])
    assert np.allclose(bounded.x_train / after[:, None], data.x_train / norms[:, None])  # directions kept
    assert bounded.feature_bound == bound


def test_a_private_run_on_data_without_a_declared_bound_names_the_field(monkeypatch):
    data = _regression()
    raw = tomllib.loads(DEMO.read_text())
    monkeypatch.setattr("decentdp.personalized.runner.load_personal_data", lambda *_args: data)
    with pytest.raises(ConfigError, match="personalized.feature_bound"):
        build_run(validate_config(raw))
    raw["personalized"]["feature_bound"] = 2.0
    run = build_run(validate_config(raw))
    assert run.setup["feature_bound"] == 2.0 and run.setup["step_smoothness"].startswith("public")


def test_one_changed_rating_moves_no_other_target_and_the_run_says_what_it_treats_as_public(tmp_path):
    """The paper centres each user's ratings by the user's mean, so one changed rating moved every target of
    its user and the clipped sum by up to 1.6 times the 2C the accounting assumes (a reviewer's measurement on
    MovieLens-100K).  Targets are now ratings less a public constant."""
    rng = np.random.default_rng(1)
    rows = [(user, item, int(rng.integers(1, 6))) for user in range(1, 7)
            for item in rng.choice(np.arange(1, 30), 12, replace=False)]
    changed = [(user, item, 5 if rating < 5 else 1) if k == 3 else (user, item, rating)
               for k, (user, item, rating) in enumerate(rows)]
    targets = []
    for name, table in (("a", rows), ("b", changed)):
        folder = _write_ratings(tmp_path / name, [f"{u}\t{i}\t{r}\t0" for u, i, r in table])
        data = load_movielens(folder, 0, rank=3, neighbours=2)
        targets.append((data.x_train, data.y_train))
        assert data.public_inputs and np.allclose(data.x_train[:, -1], 1.0)
        assert data.feature_bound >= np.linalg.norm(data.x_train, axis=1).max()
    moved = np.flatnonzero(targets[0][1] != targets[1][1])
    assert len(moved) <= 1  # the changed rating's own target (if it is a training rating), no other
    raw = _config(dataset="movielens-100k", als_rank=3, neighbours=2, wakeups=2)
    for synthetic_only in ("agents", "dim"):
        del raw["personalized"][synthetic_only]
    raw["privacy"]["clip"] = 10.0
    run_personalized(validate_config(raw), tmp_path / "out", data_dir=tmp_path / "a", log=lambda _line: None)
    statement = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert "movie features" in statement["public_inputs"] and statement["step_smoothness"].startswith("public")


def _first_broadcast(data: PersonalData, feature_bound: float | None) -> tuple[float, float, float]:
    """Agent 0's first private update from Theta = 0 (2 agents, p = 1, Laplace, eps 1): the broadcast is
    -k (S + eta) with k = alpha mu c / m, eta ~ Laplace(z C); returns (k S, k z C, the ledger's epsilon)."""
    clip, delta = 1.0, math.exp(-5)
    problem = build_problem(data, 0.04, feature_bound=feature_bound)
    noise = calibrate_updates("laplace", "tight", 1.0, delta, np.ones((2, 1)), "pld", "replace-one")
    ledger = PrivacyLedger(2, 1.0, delta, budget_accountant="pld", relation="replace-one")
    private = PrivateUpdates(noise, clip, ledger, AgentRandom(7), problem.counts > 0)
    theta = torch.zeros(2, 1, dtype=torch.float64)
    total = float(data_gradient_sums(problem, theta, torch.tensor([0]), clip, 1)[0, 0])
    coordinate_descent(problem, theta, plan_wakeups(np.array([0]), data.weights, 1), private=private)
    k = float(problem.step[0]) * 0.04 * float(problem.confidence[0]) / float(problem.counts[0])
    return k * total, k * float(noise.multipliers[0, 0]) * clip, float(ledger.epsilon("pld")[0])


def _laplace_epsilon(first: tuple[float, float], second: tuple[float, float], delta: float) -> float:
    """The exact epsilon at ``delta`` between Laplace(first) and Laplace(second) (location, scale), both ways:
    the hockey-stick divergence integrated numerically (scipy quad), solved for epsilon by bisection."""
    from scipy import integrate, optimize

    def density(location: float, scale: float):
        return lambda r: math.exp(-abs(r - location) / scale) / (2 * scale)

    def divergence(p, q, epsilon: float) -> float:
        kinks = sorted({first[0], second[0]})
        edges = [-np.inf, kinks[0] - 50 * max(first[1], second[1]), *kinks,
                 kinks[-1] + 50 * max(first[1], second[1]), np.inf]
        return sum(integrate.quad(lambda r: max(0.0, p(r) - math.exp(epsilon) * q(r)), a, b, limit=400,
                                  epsabs=1e-15)[0] for a, b in zip(edges[:-1], edges[1:], strict=True) if a < b)

    def one_way(p, q) -> float:
        if divergence(p, q, 0.0) <= delta:
            return 0.0
        return optimize.brentq(lambda e: divergence(p, q, e) - delta, 0.0, 200.0, xtol=1e-7)

    p, q = density(*first), density(*second)
    return max(one_way(p, q), one_way(q, p))


@pytest.mark.parametrize("replacement", [10.0, -3.0, 0.2])
def test_a_private_updates_broadcast_loses_at_most_the_reported_epsilon(replacement):
    """Brute force, independent of the ledger: agent 0's broadcast after its one private update is Laplace with
    a location and scale read off the run on two replace-one neighbours (its second record's feature 1 or
    ``replacement``); the exact epsilon between the two at delta is at most the reported one.  With the
    records' own steps (the reviewer's case) the scales differ and the same check fails: 16.9 against 1."""
    def data(x_second: float) -> PersonalData:
        x = np.array([[1.0], [x_second], [1.0], [-1.0]])
        y, owner = np.array([1.0, 1.0, 0.5, 0.5]), np.array([0, 0, 1, 1])
        return PersonalData(x, y, owner, x, y, owner, np.array([[0.0, 1.0], [1.0, 0.0]]), "regression")

    delta, bound = math.exp(-5), 10.0
    *first, reported = _first_broadcast(bound_features(data(1.0), bound)[0], bound)
    *second, _ = _first_broadcast(bound_features(data(replacement), bound)[0], bound)
    assert first[1] == second[1]  # one public scale
    assert reported >= _laplace_epsilon(tuple(first), tuple(second), delta) - 1e-6
    if replacement == 10.0:  # the check has teeth: the old data-dependent step breaks it
        *leaky_first, _ = _first_broadcast(data(1.0), None)
        *leaky_second, _ = _first_broadcast(data(10.0), None)
        assert _laplace_epsilon(tuple(leaky_first), tuple(leaky_second), delta) > 10 * reported


def test_an_out_folder_that_cannot_be_created_is_one_message_before_the_build(tmp_path, capsys, monkeypatch):
    """A review: --out below a file gave NotADirectoryError's traceback, after the model was built."""
    import decentdp.personalized.runner as runner

    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(runner, "build_run", lambda *args: pytest.fail("built before the folder was checked"))
    assert main(["run", str(DEMO), "--out", str(tmp_path / "afile" / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--out: cannot create {tmp_path / 'afile' / 'run'}: {tmp_path / 'afile'} is a file" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("budget", "planned"), [(1.0, 800), (0.5, 800), (0.1, 400), (1.0, 200), (1.05, 8), (3.0, 1)])
def test_theorem_1s_calibration_spends_the_whole_budget_even_beside_an_agent_without_updates(budget, planned):
    """A review: the bracket only doubled while twice the scale still fit, so the bisection returned its top, a
    power-of-two multiple of the basic-composition split (eps-bar 1, T_i 800: per-update 0.01 with a Kairouz total
    of 0.8197, where Theorem 1 allows 0.011856); and an agent with no planned update (a zero row) started its
    bracket at budget / 1e-300 and stopped every agent's growth, leaving them all at eps-bar / T_i (or below)."""
    rows = np.ones((4, planned))
    rows[1, max(1, planned // 2):] = 0.0                      # an agent planned to wake half as often
    rows[2] = np.linspace(1.0, 0.5, planned)                  # a decaying allocation (Proposition 2's shape)
    rows[3] = 0.0                                             # an agent without data, or never woken
    noise = calibrate_updates("laplace", "paper", budget, DELTA, rows, "tight", "replace-one")
    spent = kairouz_epsilon(noise.paper_epsilons, DELTA)
    assert spent[:3] == pytest.approx(np.full(3, budget), rel=1e-9) and (spent[:3] <= budget).all()
    assert spent[3] == 0.0 and not noise.multipliers[3].any()
    alone = calibrate_updates("laplace", "paper", budget, DELTA, rows[:1], "tight", "replace-one")
    np.testing.assert_array_equal(alone.multipliers[0], noise.multipliers[0])  # no agent holds back another


def _paper_run(**privacy) -> dict:
    raw = _config(calibration="paper", wakeups=1)
    raw["privacy"] = {**raw["privacy"], "accountant": "tight", "delta": 1e-5, **privacy}
    return raw


@pytest.mark.parametrize(("mechanism", "epsilon", "fitted"),
                         [("laplace", 1.0, False), ("laplace", 5.0, False), ("gaussian", 20.0, True)])
def test_theorem_1s_calibration_is_fitted_so_that_the_ledger_admits_every_planned_update(mechanism, epsilon, fitted):
    """A review: the paper's bound for Laplace updates is the sum of their epsilons, but the ledger's accountant priced
    one Laplace release at pure epsilon 1 at 1.00016 (PLD rounds up), so the last planned release of every agent was
    refused, all of them at T_i = 1 (the models never left zero, and nothing said so); the Gaussian's classical scale
    at eps_t = 20 is far from enough.  Now the epsilons are scaled down just enough for the ledger to admit them where
    it prices them higher (the Gaussian); the Laplace sum is what ``tight`` charges (basic composition), as planned."""
    raw = _paper_run(epsilon=epsilon)
    raw["personalized"]["mechanism"] = mechanism
    summary, _, _ = run_personalized(validate_config(raw), log=lambda _line: None)
    run = build_run(validate_config(raw))
    assert summary["refused_releases"] == 0 and summary["warnings"] == []
    planned = float(run.plan.updates_per_agent().mean())
    assert planned > 0 and summary["updates_per_agent_mean"] == pytest.approx(planned)
    assert epsilon * (1 - 1e-4) <= summary["epsilon_max"] <= epsilon  # fitted to the budget, not far below it
    factors = np.array(run.setup["calibration"]["accountant_fit_factors"])
    if not fitted:
        assert (factors == 1).all() and "calibration_notice" not in run.setup
        return
    assert (factors < 1).all() and "scaled by" in run.setup["calibration_notice"]
    # the largest factor the ledger admits, to its tolerance: 0.001 % more epsilon is refused
    noise = run.noise
    assert ledger_admits(mechanism, noise.multipliers[0], epsilon, 1e-5, "tight", "replace-one")
    assert not ledger_admits(mechanism, noise.multipliers[0] * (1 - 1e-5), epsilon, 1e-5, "tight", "replace-one")


def test_a_calibration_that_fits_is_left_as_it_is():
    raw = _config()  # tight calibration: priced by the ledger's own accountant already
    run = build_run(validate_config(raw))
    assert run.setup["calibration"]["accountant_fit_factors"] == [1.0] * 12 and "calibration_notice" not in run.setup
    paper = build_run(validate_config({**raw, "personalized": {**raw["personalized"], "calibration": "paper",
                                                               "wakeups": 200}}))
    assert paper.setup["calibration"]["accountant_fit_factors"] == [1.0] * 12  # Kairouz is the looser bound there


def test_updates_the_ledger_refuses_are_a_warning_and_in_the_summary(monkeypatch):
    """Whatever still gets refused at run time (here: the calibration left unfitted) is said, not silent."""
    import decentdp.personalized.runner as runner

    monkeypatch.setattr(runner, "fit_to_accountant", lambda noise, *args: (noise, np.ones(len(noise.multipliers))))
    lines: list[str] = []
    raw = _paper_run(epsilon=20.0)
    raw["personalized"]["mechanism"] = "gaussian"  # the classical scale at eps_t = 20 is far from enough
    summary, _, _ = run_personalized(validate_config(raw), log=lines.append)
    assert summary["refused_releases"] > 0 and summary["updates_per_agent_mean"] == 0.0
    warning = next(line for line in lines if "ran out of privacy budget" in line)
    assert warning.startswith("warning: ") and warning.removeprefix("warning: ") in summary["warnings"]
    assert f"{summary['refused_releases']} agent(s)" in warning


@pytest.mark.parametrize(("method", "allowed"), [("local", 1.0), ("propagation", 1.0), ("admm", 1.0), ("cd", 0.9)])
def test_a_warm_start_beyond_the_budget_is_refused_whatever_the_method(method, allowed):
    """A review: update_budget() ran only for cd, so method = 'propagation' with warm_start_epsilon = 5 under
    privacy.epsilon = 1 reported epsilon_max 5 beside epsilon_budget 1, without an error.  The warm start is
    spent inside the budget: all of it where it is the whole spend, less than all of it for cd."""
    with pytest.raises(ConfigError) as error:
        validate_config(_config(method=method, warm_start=True, warm_start_epsilon=5.0))
    assert error.value.field == "personalized.warm_start_epsilon" and "privacy.epsilon = 1" in error.value.message
    validate_config(_config(method=method, warm_start=True, warm_start_epsilon=allowed))
    if method == "cd":
        with pytest.raises(ConfigError, match="leaves nothing"):
            validate_config(_config(method=method, warm_start=True, warm_start_epsilon=1.0))
    config = validate_config(_config(method=method, warm_start=True, warm_start_epsilon=allowed))
    config.personalized.warm_start_epsilon = 5.0  # changed after validation: the build refuses it too
    with pytest.raises(ConfigError) as error:
        build_run(config)
    assert error.value.field == "personalized.warm_start_epsilon"


def test_the_papers_gaussian_figure_is_absent_where_remark_4_is_no_bound(tmp_path):
    """A review: at eps-bar 20 and T_i 1 the per-update eps_t is 20, where the classical Gaussian mechanism's
    sigma >= 2C sqrt(2 ln(2/delta_t)) / eps_t does not hold; the CLI printed "paper's formula 17.035" while the exact
    Gaussian loss was 19.45.  Such a figure is now null with a note, in privacy.json, summary.json and the log."""
    raw = _config(mechanism="gaussian", wakeups=1)
    raw["privacy"] = {**raw["privacy"], "epsilon": 20.0, "delta": 1e-5, "accountant": "tight"}
    lines: list[str] = []
    summary, _, _ = run_personalized(validate_config(raw), out_dir=tmp_path / "big", log=lines.append)
    privacy = json.loads((tmp_path / "big" / "privacy.json").read_text())
    assert summary["paper_epsilon_max"] is None and "eps_t < 1" in summary["paper_epsilon_note"]
    assert privacy["paper_epsilon_note"] == summary["paper_epsilon_note"]
    # an agent that never woke made no update: its paper figure, 0, stands; every other one is absent
    assert all((paper is None) == (spent > 0) for paper, spent in zip(privacy["paper_epsilon"], privacy["epsilon"],
                                                                      strict=True))
    assert any(paper is None for paper in privacy["paper_epsilon"])
    assert "paper's formula absent" in lines[-1] and summary["epsilon_max"] <= 20.0
    raw["privacy"]["epsilon"], raw["personalized"]["wakeups"] = 1.0, 3  # eps_t < 1: the figure stands
    raw["personalized"]["calibration"] = "paper"
    summary, _, _ = run_personalized(validate_config(raw), out_dir=tmp_path / "small", log=lambda _line: None)
    assert 0.99 < summary["paper_epsilon_max"] <= 1.0 and "paper_epsilon_note" not in summary


def test_admm_and_private_updates_build_their_tensors_on_the_problems_device():
    """With the default device set elsewhere (meta: no data), tensors created without the problem's device fail
    to mix with it: ADMM's duals, edge tables and one-agent gradients, and the noise draws' agent ids, once did."""
    data = _regression()
    problem = build_problem(data, mu=0.5)
    local = local_models(problem, None)
    woken = poisson_ticks(0, problem.n_agents, 20)
    expected = gossip_admm(problem, local, woken, 0)
    _, private, _ = _private(data, 1.0, 3)
    _, again, _ = _private(data, 1.0, 3)
    agents, first = torch.arange(problem.n_agents), torch.zeros(problem.n_agents, dtype=torch.long)
    sums = torch.zeros(problem.n_agents, 3, dtype=torch.float64)
    again.release(0, agents, first, sums)
    with torch.device("meta"):
        assert torch.equal(gossip_admm(problem, local, woken, 0), expected)
        released = torch.zeros(problem.n_agents, 3, dtype=torch.float64, device="cpu")
        private.release(0, agents.cpu(), first.cpu(), released)
    assert torch.equal(released, sums)
