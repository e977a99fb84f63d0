"""Correlated noise from edge secrets (DECOR): keys, cancellation, the observer view it is priced on, the run.

The pairwise epsilon DECOR budgets is that of an observer who sees every message of every round; it is checked
here against the explicit linear-Gaussian view of that observer (``observer_view.observer_mu``, built
message by message), where it must be exact, and in ``test_privacy_harness.py`` against a neighbour's real
multi-round view, where it must be an upper bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.conftest import tiny_config

from decentdp.algorithms.base import NoisePlan
from decentdp.algorithms.decor import PAIRWISE_VIEW, SECURE_EDGE_NOTICE, Decor, DecorSettings
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.privacy.accounting import calibrate_noise_multiplier
from decentdp.privacy.correlated import CorrelatedGaussianMechanism, effective_multipliers, graph_edges
from decentdp.privacy.mechanisms import NoiseDraw, NoiseReuseError
from decentdp.privacy.observer_view import ViewBuilder, observer_mu
from decentdp.rng import AgentKeys, AgentRandom, SecureRandom, Stream

REPO = Path(__file__).resolve().parents[2]
QUICK_START = REPO / "experiments" / "correlated" / "decor-digits.toml"


def test_edge_keys_agree_at_both_ends_and_nowhere_else() -> None:
    keys = AgentKeys.generate(range(4))
    run = SecureRandom(0, keys)
    first, second = run.for_agents([0]), run.for_agents([1])     # two processes, one agent each
    assert first.edge_secret(0, 1) == second.edge_secret(1, 0)
    assert len({run.edge_secret(*pair) for pair in [(0, 1), (1, 2), (0, 2), (2, 3)]}) == 4
    assert torch.equal(first.edge_normal([(0, 1)], 20, 3), second.edge_normal([(1, 0)], 20, 3))
    assert not torch.equal(first.edge_normal([(0, 1)], 20, 3), first.edge_normal([(0, 1)], 20, 4))
    assert not torch.equal(run.edge_normal([(0, 1)], 20, 3)[0], run.normal([0], 20, 3, Stream.NOISE)[0])
    resumed = SecureRandom(0, AgentKeys.generate(range(4)))
    resumed.keys = keys                                           # a resumed run puts its saved keys back
    assert resumed.edge_secret(0, 1) == run.edge_secret(0, 1)
    lonely = SecureRandom(0, keys.subset([0]))                    # no neighbour's published key
    with pytest.raises(ConfigError, match="privacy.noise"):
        lonely.edge_secret(0, 1)


def test_simulated_edge_streams_are_keyed_by_the_unordered_pair() -> None:
    rng = AgentRandom(7)
    a, b = rng.edge_normal([(2, 5)], 30, 1), rng.edge_normal([(5, 2)], 30, 1)
    assert torch.equal(a, b) and not torch.equal(a, rng.edge_normal([(2, 6)], 30, 1))
    assert not torch.equal(a[0], rng.normal([2], 30, 1, Stream.NOISE)[0].float())


@pytest.mark.parametrize("secure", [False, True])
def test_edge_noise_cancels_in_the_sum_of_updates_and_is_drawn_once(secure: bool) -> None:
    n, dim = 5, 40
    edges = graph_edges(np.array([(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (0, 2)]))
    batches = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0])
    mechanism = CorrelatedGaussianMechanism(torch.zeros(n), 1.0, edges, 3.0, batches, torch.ones(n), PAIRWISE_VIEW)
    rng = SecureRandom(0, AgentKeys.generate(range(n))) if secure else AgentRandom(0)
    values = torch.zeros(n, dim, dtype=torch.float64)
    draw = NoiseDraw(rng, range(n), 0, 0)
    mechanism.perturb(values, torch.arange(n), draw)
    updates = values / batches.double()[:, None]
    assert (updates.norm(dim=1) > 1.0).all()                    # every message carries edge noise
    assert updates.sum(dim=0).abs().max() < 1e-9                 # which cancels in the network's sum
    with pytest.raises(NoiseReuseError):
        draw.edge_normal([(0, 1)], dim)


def _all_messages_view(n: int, edges: np.ndarray, own: np.ndarray, scale: np.ndarray, tau: float,
                       rounds: int) -> ViewBuilder:
    """Every update ``m_i`` of ``rounds`` rounds, message by message, sent to every agent and to an extra agent
    ``n`` that holds nothing (an external eavesdropper)."""
    builder = ViewBuilder(n + 1, capacity=rounds * (2 * n + len(edges)))
    everyone = np.arange(n + 1)
    for _ in range(rounds):
        data = builder.data(range(n))
        noise = builder.noise(own * scale, [{i} for i in range(n)])
        shared = builder.noise(np.full(len(edges), tau), [{int(i), int(j)} for i, j in edges])
        updates = scale[:, None] * data + noise
        for k, (i, j) in enumerate(edges.tolist()):
            updates[i] += shared[k]
            updates[j] -= shared[k]
        for agent in range(n):
            builder.send(everyone, np.repeat(updates[agent][None], n + 1, axis=0))
    return builder


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_effective_multiplier_is_exact_for_an_observer_of_every_message(relation: str) -> None:
    rng = np.random.default_rng(3)
    n, rounds = 6, 3
    edges = graph_edges(np.array([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0), (1, 4)]))
    own, scale, tau = rng.uniform(0.5, 2.0, n), 1.0 / rng.uniform(5, 20, n), 0.4
    observers = [[v] for v in range(n)] + [[1, 3], [n]]
    view = _all_messages_view(n, edges, own, scale, tau, rounds).view()
    exact = observer_mu(view, observers, relation).mu[:n]
    sigma_eff = effective_multipliers(scale, own, edges, tau, observers[:-1] + [[]])
    sensitivity = 2.0 if relation == "replace-one" else 1.0
    reported = sensitivity * math.sqrt(rounds) / sigma_eff              # rounds compose as independent Gaussians
    assert np.allclose(reported, exact, rtol=1e-6, equal_nan=True)
    assert (sigma_eff[:, :n][~np.eye(n, dtype=bool)] > own.repeat(n - 1)).all()  # edge noise always helps here


@pytest.mark.parametrize("tau", [0.4, 1e4, 1e5, 1e7])
def test_effective_multiplier_stays_exact_however_large_the_edge_noise(tau: float) -> None:
    """Against the covariance inverted in 60-digit arithmetic (mpmath): never above the truth, within 1e-8 of
    it.  The covariance's condition number grows as tau^2; inverted by eigh with a rank cut-off, multipliers
    came out 1e-6 above the truth at tau = 4e4 (epsilon understated) and 0 (every sender 'leaked') from 1e5,
    which crashed DECOR's calibration (a helper's review)."""
    import mpmath

    rng = np.random.default_rng(5)
    n = 6
    edges = graph_edges(np.array([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0), (1, 4)]))
    own, scale = rng.uniform(0.5, 2.0, n), 1.0 / rng.uniform(5, 20, n)
    observers = [[v] for v in range(n)] + [[1, 3], []]
    library = effective_multipliers(scale, own, edges, tau, observers)
    mpmath.mp.dps = 60
    for column, observer in enumerate(observers):
        outside = [u for u in range(n) if u not in observer]
        unknown = [k for k, (i, j) in enumerate(edges.tolist()) if i not in observer and j not in observer]
        covariance = mpmath.matrix(len(outside), len(outside))
        for row, u in enumerate(outside):
            covariance[row, row] = (mpmath.mpf(float(scale[u])) * mpmath.mpf(float(own[u]))) ** 2
        for k in unknown:
            i, j = edges[k]
            for a in (i, j):
                for b in (i, j):
                    if a in outside and b in outside:
                        sign = 1 if a == b else -1
                        covariance[outside.index(a), outside.index(b)] += sign * mpmath.mpf(tau) ** 2
        inverse = covariance ** -1
        for row, u in enumerate(outside):
            exact = 1 / (mpmath.mpf(float(scale[u])) * mpmath.sqrt(inverse[row, row]))
            ratio = float(library[u, column] / exact)
            assert 1 - 1e-8 <= ratio <= 1.0, (u, observer, ratio)


def test_large_correlation_calibrates() -> None:
    """DECOR at correlation 1e5 builds (it raised LinAlgError: every multiplier 0, so sigma = inf)."""
    sigmas = Decor(DecorSettings().build(), 1e5).calibrate(
        _plan([[1, 5], [0, 2], [1, 3], [2, 4], [3, 5], [4, 0]])).noise_multipliers
    assert np.all(np.isfinite(sigmas)) and np.all(np.asarray(sigmas) > 0)


def _plan(neighbours: list[list[int]], colluding: list[list[int]] | None = None, redrawn: bool = False) -> NoisePlan:
    n = len(neighbours)
    return NoisePlan([2.0] * n, 1e-5, [0.1] * n, [100] * n, 50, 10, 1.0, "tight", "add-remove", 1.0,
                     [len(x) for x in neighbours], neighbours, redrawn, None, colluding or [])


def test_a_leaf_gets_local_noise_while_well_hidden_agents_need_less() -> None:
    """A path 0 - 1 - 2 - 3: each end's one neighbour holds its only edge key, so the ends need the local
    sigma; the middle agents hide behind an edge their observer does not hold."""
    calibrated = Decor(DecorSettings().build(), 3.0).calibrate(_plan([[1], [0, 2], [1, 3], [2]]))
    sigmas = np.array(calibrated.noise_multipliers)
    assert sigmas[0] == pytest.approx(sigmas[3]) and sigmas[1] < 0.8 * sigmas[0]
    worst = np.array(calibrated.details["effective_multiplier_worst"])
    assert worst[0] == pytest.approx(sigmas[0], rel=1e-6)        # the leaf: its own noise alone
    assert calibrated.observer == PAIRWISE_VIEW


def test_colluding_sets_need_more_noise() -> None:
    ring = [[(i - 1) % 6, (i + 1) % 6] for i in range(6)]
    alone = Decor(DecorSettings().build(), 3.0).calibrate(_plan(ring))
    pooled = Decor(DecorSettings().build(), 3.0).calibrate(_plan(ring, colluding=[[1, 5]]))
    assert pooled.noise_multipliers[0] > alone.noise_multipliers[0]   # 1 and 5 hold both of 0's edge keys


def test_bad_inputs_name_their_field() -> None:
    with pytest.raises(ConfigError, match="privacy.colluding.1") as caught:
        validate_config(tiny_config(algorithm={"name": "decor"}, privacy={"colluding": [[0, 1], [2, 9]]}))
    assert "names agent(s) [9]" in str(caught.value)
    with pytest.raises(ConfigError, match="topology.graph"):
        Decor(DecorSettings().build(), 3.0).calibrate(_plan([[1], [0], []]))
    with pytest.raises(ConfigError, match="topology.redraw_every"):
        validate_config(tiny_config(algorithm={"name": "decor"}, topology={"graph": "erdos-renyi", "p": 0.9,
                                                                           "redraw_every": 2}))
    with pytest.raises(ConfigError, match="privacy.colluding"):
        validate_config(tiny_config(privacy={"colluding": [[]]}))


def test_a_correlation_past_what_a_run_can_price_is_refused_before_the_first_round() -> None:
    """It once trained every round, then failed in privacy_results naming the accountant's noise_multiplier, with
    no summary or privacy.json written."""
    with pytest.raises(ConfigError, match=r"algorithm\.correlation: 1e\+30 .* lower it"):
        build_experiment(validate_config(tiny_config(algorithm={"name": "decor", "correlation": 1e30})))


def test_secure_decor_run_spends_its_pairwise_budget_and_writes_no_edge_key(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DECENTDP_KEY_DIR", str(tmp_path / "keys"))
    raw = tiny_config(algorithm={"name": "decor", "correlation": 2.0}, privacy={"noise": "secure", "epsilon": 3.0},
                      experiment={"rounds": 3, "eval_every": 3})
    lines: list[str] = []
    result = run_experiment(validate_config(raw), tmp_path / "run", progress=False, log=lines.append)
    assert result.summary["epsilon_max"] <= 3.0 + 1e-9
    # the edge noise is a float Gaussian, not on the grid: said (a review found the notice defined, never shown)
    assert f"warning: {SECURE_EDGE_NOTICE}" in lines
    (key_file,) = (tmp_path / "keys").iterdir()
    keys = AgentKeys({int(a): bytes.fromhex(k) for a, k in json.loads(key_file.read_text()).items()})
    secrets = [SecureRandom(0, keys).edge_secret(i, (i + 1) % 4) for i in range(4)]
    for path in (tmp_path / "run").iterdir():
        content = path.read_bytes()
        assert not any(secret in content or secret.hex().encode() in content for secret in secrets), path


def test_quick_start_beats_dp_dsgd_at_the_same_budget(tmp_path: Path) -> None:
    """The digits quick start: within its pairwise budget, its summary names the pairwise epsilon, each agent's
    local epsilon is larger, and it is more accurate than DP-DSGD from the same config at the same epsilon."""
    from decentdp.config import load_config
    decor = run_experiment(load_config(QUICK_START), tmp_path / "decor", progress=False, log=lambda _: None)
    summary, privacy = decor.summary, json.loads((tmp_path / "decor" / "privacy.json").read_text())
    budget = load_config(QUICK_START).privacy.epsilon
    assert summary["epsilon_max"] <= budget + 1e-9 and summary["epsilon_pairwise_max"] <= budget + 1e-9
    assert privacy["epsilon_observer"] == PAIRWISE_VIEW
    assert summary["epsilon_local_max"] > 1.5 * budget
    assert np.nanmax(np.array(privacy["epsilon_pairwise_network"], dtype=float)) <= budget + 1e-9
    baseline = run_experiment(load_config(QUICK_START, ["algorithm.name=dp-dsgd", "~algorithm.correlation"]),
                              tmp_path / "dsgd", progress=False, log=lambda _: None)
    assert baseline.summary["epsilon_max"] <= budget + 1e-9
    assert summary["accuracy_mean"] > baseline.summary["accuracy_mean"] + 0.03


def test_a_local_epsilon_cap_raises_the_noise_of_well_hidden_agents_only() -> None:
    plan = _plan([[1], [0, 2], [1, 3], [2]])
    free = np.array(Decor(DecorSettings().build(), 3.0).calibrate(plan).noise_multipliers)
    capped = Decor(DecorSettings().build(), 3.0, local_epsilon=4.0).calibrate(plan)
    sigmas = np.array(capped.noise_multipliers)
    floor = calibrate_noise_multiplier(4.0, 1e-5, 0.1, 50, 1, "tight", relation="add-remove")
    assert (sigmas >= floor - 1e-6).all() and (sigmas >= free - 1e-6).all()
    assert sigmas[0] == pytest.approx(free[0]) and sigmas[1] > free[1]            # the leaf already had more
    assert (np.array(capped.details["effective_multiplier_worst"]) >= sigmas * (1 - 1e-9)).all()


def test_zero_sum_noise_sums_to_zero_in_what_the_receivers_weigh() -> None:
    from decentdp.algorithms.zip_dl import zero_sum

    rng = torch.Generator().manual_seed(0)
    sender = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    weights = torch.tensor([0.2, 0.3, 0.5, 0.6, 0.4, 0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    noise = zero_sum(torch.randn(9, 7, generator=rng, dtype=torch.float64), weights, sender, 3)
    totals = torch.zeros(3, 7, dtype=torch.float64).index_add_(0, sender, noise * weights[:, None])
    assert totals.abs().max() < 1e-12 and noise.abs().min() > 0


def test_zip_dl_noise_leaves_the_network_average_alone() -> None:
    """One round from the same state and batches with and without zero-sum noise: every model moves, the
    average over agents does not (Metropolis-Hastings weights are doubly stochastic)."""
    from decentdp.experiment.build import build_experiment

    def one_round(noise: float) -> torch.Tensor:
        raw = tiny_config(algorithm={"name": "zip-dl", "zero_sum_noise": noise}, privacy={"epsilon": "inf"},
                          topology={"graph": "erdos-renyi", "agents": 6, "p": 0.6, "mixing": "metropolis-hastings"})
        experiment = build_experiment(validate_config(raw))
        state = experiment.initial_state()
        return experiment.simulator.run(state, 0, 1, lambda done, current: True)["params"]

    plain, noisy = one_round(0.0), one_round(5.0)
    assert (noisy - plain).norm(dim=1).min() > 1e-3
    assert torch.allclose(noisy.mean(dim=0), plain.mean(dim=0), atol=1e-5)


def test_a_zip_dl_run_without_privacy_claims_no_finite_pairwise_epsilon(tmp_path: Path) -> None:
    """Without a budget the oracle releases unclipped means, which no unit sensitivity bounds: every pairwise
    epsilon is infinite (a reviewer's run wrote 23.2 as epsilon_pairwise_max with private: false)."""
    raw = tiny_config(algorithm={"name": "zip-dl"}, privacy={"epsilon": "inf"}, experiment={"rounds": 3})
    result = run_experiment(validate_config(raw), tmp_path / "zip", progress=False, log=lambda _: None)
    privacy = json.loads((tmp_path / "zip" / "privacy.json").read_text())
    headline = result.summary["nonadaptive_epsilon_pairwise_max"]
    assert headline is None or math.isinf(headline)
    assert all(value is None for row in privacy["nonadaptive_epsilon_pairwise_network"] for value in row
               if value not in (0, 0.0))
    assert "no noise" in privacy["nonadaptive_epsilon_pairwise_network_method"]


def test_zip_dl_quick_start_prices_each_neighbours_view_within_the_local_budget(tmp_path: Path) -> None:
    from decentdp.config import load_config
    config = REPO / "experiments" / "correlated" / "zip-dl-digits.toml"
    result = run_experiment(load_config(config), tmp_path / "zip", progress=False, log=lambda _: None)
    privacy = json.loads((tmp_path / "zip" / "privacy.json").read_text())
    pairwise = np.array(privacy["nonadaptive_epsilon_pairwise_network"], dtype=float)
    assert privacy["nonadaptive_epsilon_pairwise_network_method"] == \
        "the observer-view accountant over every message of the run"
    assert result.summary["epsilon_max"] <= 4.0 + 1e-9
    assert result.summary["nonadaptive_epsilon_pairwise_max"] <= 4.0 + 1e-9
    assert pairwise[0, 8] < 0.8 * pairwise[0, 1]        # the antipodal agent of the ring learns less


def test_a_multiplier_just_below_a_grid_point_is_priced_at_the_point_below_it() -> None:
    """On the geometric grid, a value a hair under a grid point takes the lower point's (larger) epsilon, never
    the point's own (a reviewer's value 4e-13 below a point was priced at it: below its exact epsilon)."""
    from decentdp.privacy.accounting import epsilon_spent
    from decentdp.privacy.correlated import PRICED_MULTIPLIERS, epsilon_upper_bounds

    grid = np.geomspace(2.0, 6.0, PRICED_MULTIPLIERS)
    values = np.concatenate([np.linspace(2.0, 6.0, PRICED_MULTIPLIERS + 12), [grid[10] * (1 - 4e-13)]])
    priced = epsilon_upper_bounds(values[None, :], np.array([0.05]), 50, 1e-5, "rdp", "add-remove")[0]
    assert priced[-1] >= epsilon_spent(float(values[-1]), 1e-5, 0.05, 50, 1, "rdp")


def test_many_distinct_multipliers_are_priced_on_a_grid_never_below_their_exact_epsilon() -> None:
    """``epsilon_upper_bounds`` prices up to PRICED_MULTIPLIERS distinct values exactly and more at the grid
    point below each: every entry at least its own accountant's epsilon, and close to it (the grid is fine)."""
    from decentdp.privacy.accounting import epsilon_spent
    from decentdp.privacy.correlated import PRICED_MULTIPLIERS, epsilon_upper_bounds

    rng = np.random.default_rng(4)
    multipliers = rng.uniform(2.0, 6.0, size=(12, 10))
    multipliers[0, 0], multipliers[1, 1], multipliers[2, 2] = np.nan, 0.0, np.inf
    rates = np.array([0.05] * 6 + [0.1] * 6)
    assert len(np.unique(multipliers[:6])) > PRICED_MULTIPLIERS
    priced = epsilon_upper_bounds(multipliers, rates, 20, 1e-5, "rdp", "add-remove")
    assert np.isnan(priced[0, 0]) and priced[1, 1] == np.inf and priced[2, 2] == 0.0
    for (row, column), sigma in np.ndenumerate(multipliers):
        if np.isfinite(sigma) and sigma > 0:
            exact = epsilon_spent(float(sigma), 1e-5, float(rates[row]), 20, 1, "rdp", "add-remove")
            assert exact - 1e-9 <= priced[row, column] <= 1.1 * exact


def test_a_decor_run_says_its_epsilon_is_pairwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DECOR's budgets name a narrower observer than every other run's: the run's last lines and summary.json
    say whom (the CLI used to print it as if it were the usual every-observer epsilon)."""
    import tomli_w

    from decentdp.cli.main import main

    config = tmp_path / "decor.toml"
    config.write_text(tomli_w.dumps(tiny_config(algorithm={"name": "decor"})))
    assert main(["run", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert f"epsilon spent per agent, towards {PAIRWISE_VIEW.split(':')[0]} (" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["epsilon_observer"] == PAIRWISE_VIEW
