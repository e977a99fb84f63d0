"""The privacy boundary after the redesign: batch and noise keys are single-use, joint releases are
charged once, inactive agents pay nothing, per-edge messages reach only their receiver's pairwise
account, the event ledger agrees with dp_accounting, budgets are exact, and an algorithm defined
outside the package runs from a config.

Every value asserted here is computed independently (dp_accounting, numpy closed forms, or the
definition of the mechanism), never read back from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from pydantic import Field
from scipy import stats

from decentdp.algorithms.base import Algorithm, AlgorithmSettings, RoundContext, State
from decentdp.algorithms.registry import algorithm_class, register
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.loop import run_experiment
from decentdp.gradients.flat_model import FlatModel
from decentdp.models import build_model, classification_loss
from decentdp.privacy.accounting import calibrate_noise_multiplier
from decentdp.privacy.events import gaussian_event, joint_gaussian_event, laplace_event
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    NoiseDraw,
    NoiseReuseError,
    NoNoise,
    round_up_to_float32,
)
from decentdp.privacy.oracle import BatchKey, DataOracle
from decentdp.privacy.sampling import AgentData, PoissonSampler
from decentdp.rng import AgentRandom
from decentdp.runtime.network import SimulatedNetwork
from decentdp.runtime.scheduler import Scheduler
from decentdp.topology import build_topology

DELTA = 1e-5


# -- helpers --------------------------------------------------------------------------------------------------
def _oracle(sigma: float | list[float] = 1.5, clip: float = 1.0, n_agents: int = 4, per_agent: int = 50,
            batch: int = 8, budget: float | list[float] = math.inf, mechanism: str | None = "gaussian",
            model: str = "mlp", shape: tuple[int, int, int] = (1, 8, 8), budget_accountant: str = "rdp",
            ) -> DataOracle:
    """A small oracle over random data: ``n_agents`` agents of ``per_agent`` records, rate ``batch / per_agent``."""
    torch.manual_seed(1)
    flat = FlatModel(build_model(model, shape, 10, seed=3), classification_loss)
    x = torch.randn(n_agents * per_agent, *shape)
    y = torch.randint(0, 10, (n_agents * per_agent,))
    data = AgentData(x, y, tuple(torch.arange(i * per_agent, (i + 1) * per_agent) for i in range(n_agents)))
    rates = torch.full((n_agents,), batch / per_agent, dtype=torch.float64)
    rng = AgentRandom(7)
    ledger = PrivacyLedger(n_agents, budget, DELTA, budget_accountant=budget_accountant)
    sigmas = torch.as_tensor(sigma, dtype=torch.float32).expand(n_agents).clone()
    mech = {"gaussian": GaussianMechanism, "laplace": LaplaceMechanism}
    built = None if mechanism is None else mech[mechanism](sigmas, clip)
    return DataOracle(flat, PoissonSampler(data, rates, rng), ledger, rng, built, clip)


def _params(oracle: DataOracle, scale: float = 0.0, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    base = oracle.model.initial_parameters().repeat(oracle.n_agents, 1)
    return base + scale * torch.randn_like(base)


def _rdp_epsilon_of(event: dp_accounting.DpEvent, delta: float = DELTA) -> float:
    return rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(delta)


def _pld_epsilon_of(event: dp_accounting.DpEvent, delta: float = DELTA) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(delta)


def _exact_sums(oracle: DataOracle, params: torch.Tensor, key: BatchKey) -> torch.Tensor:
    """The clipped sums of ``params`` on the batch behind ``key``, recomputed outside the oracle."""
    batch = oracle.sampler.sample(key.round_index, key.index)
    sums, _ = oracle.model.clipped_gradient_sums(params, batch.x, batch.y, batch.mask, oracle.clip_norm)
    return sums


# -- 1. batch keys are single-use --------------------------------------------------------------------------
def test_a_released_batch_key_cannot_be_clipped_or_released_again() -> None:
    oracle = _oracle()
    params = _params(oracle)
    oracle.begin(0)
    key = oracle.batch()
    clipped = oracle.clip(key, params)
    (released,) = oracle.release(clipped)
    assert released.shape == params.shape and bool(torch.isfinite(released).all())
    with pytest.raises(NoiseReuseError):
        oracle.clip(key, params)
    with pytest.raises(NoiseReuseError):
        oracle.release(clipped)
    # The failed attempts charged nothing: one release per agent.
    assert oracle.ledger.releases().tolist() == [1, 1, 1, 1]


def test_a_key_not_issued_in_this_round_is_refused() -> None:
    oracle = _oracle()
    params = _params(oracle)
    oracle.begin(3)
    issued = oracle.batch()
    with pytest.raises(NoiseReuseError):
        oracle.clip(BatchKey(3, 7), params)  # never issued
    with pytest.raises(NoiseReuseError):
        oracle.clip(BatchKey(2, issued.index), params)  # right index, wrong round
    pending = oracle.clip(issued, params)
    oracle.begin(4)  # keys (and sealed sums) of round 3 become invalid
    with pytest.raises(NoiseReuseError):
        oracle.clip(issued, params)
    with pytest.raises(NoiseReuseError):
        oracle.release(pending)
    assert oracle.ledger.releases().tolist() == [0, 0, 0, 0]


def test_every_sum_computed_on_a_batch_must_be_released_together() -> None:
    oracle = _oracle()
    params = _params(oracle)
    oracle.begin(0)
    key = oracle.batch()
    first, second = oracle.clip(key, params), oracle.clip(key, _params(oracle, 0.01, seed=1))
    with pytest.raises(NoiseReuseError):
        oracle.release(first)
    with pytest.raises(NoiseReuseError):
        oracle.release(second)
    assert oracle.ledger.releases().tolist() == [0, 0, 0, 0]  # refused before anything was charged
    oracle.release(first, second)
    assert oracle.ledger.releases().tolist() == [1, 1, 1, 1]
    with pytest.raises(NoiseReuseError):
        oracle.release(first, second)
    # Sums of two different batches are never one event.
    other_a, other_b = oracle.batch(), oracle.batch()
    with pytest.raises(NoiseReuseError):
        oracle.release(oracle.clip(other_a, params), oracle.clip(other_b, params))


def test_the_same_sealed_sum_cannot_stand_in_for_another() -> None:
    oracle = _oracle()
    params = _params(oracle)
    oracle.begin(0)
    key = oracle.batch()
    first, second = oracle.clip(key, params), oracle.clip(key, params)
    with pytest.raises(NoiseReuseError):
        oracle.release(first, first)  # two sums were computed, but `second` is not among them
    assert oracle.ledger.releases().tolist() == [0, 0, 0, 0]
    oracle.release(first, second)  # the honest joint release still goes through
    assert oracle.ledger.releases().tolist() == [1, 1, 1, 1]


# -- 2. noise keys are single-use --------------------------------------------------------------------------
def test_a_noise_key_draws_once_per_row_and_slot() -> None:
    draw = NoiseDraw(AgentRandom(11), torch.tensor([5, 6, 7]), round_index=2, release=0)
    dim = 64
    base = draw.normal([0, 1], torch.empty(2, dim))
    with pytest.raises(NoiseReuseError):
        draw.normal([1], torch.empty(1, dim))  # row 1, no slot: drawn already
    with pytest.raises(NoiseReuseError):
        draw.laplace([0], torch.empty(1, dim))  # another distribution under the same key is still reuse
    with pytest.raises(NoiseReuseError):
        draw.normal([2, 2], torch.empty(2, dim))  # twice in one call
    slot3 = draw.normal([0], torch.empty(1, dim), slots=[3])  # a distinct slot is a distinct key
    slot4 = draw.normal([0], torch.empty(1, dim), slots=[4])
    with pytest.raises(NoiseReuseError):
        draw.normal([0], torch.empty(1, dim), slots=[3])
    with pytest.raises(NoiseReuseError):
        draw.normal([2, 2], torch.empty(2, dim), slots=[9, 9])
    pair = draw.normal([2, 2], torch.empty(2, dim), slots=[8, 9])  # one row, two slots: fine
    # Distinct keys give distinct noise (a repeated vector would be the reuse the keys prevent).
    rows = torch.cat([base, slot3, slot4, pair])
    assert torch.linalg.matrix_rank(rows.double()) == len(rows)
    # The same key under a fresh draw reproduces the stream (the run is reproducible).
    again = NoiseDraw(AgentRandom(11), torch.tensor([5, 6, 7]), round_index=2, release=0)
    assert torch.equal(again.normal([0, 1], torch.empty(2, dim)), base)
    other_release = NoiseDraw(AgentRandom(11), torch.tensor([5, 6, 7]), round_index=2, release=1)
    assert not torch.equal(other_release.normal([0, 1], torch.empty(2, dim)), base)


def test_two_releases_in_one_round_use_fresh_noise() -> None:
    oracle = _oracle(sigma=4.0)
    params = _params(oracle)
    oracle.begin(0)
    noises = []
    for _ in range(2):
        key = oracle.batch()
        exact = _exact_sums(oracle, params, key)
        (released,) = oracle.release(oracle.clip(key, params))
        noises.append(released - exact)
    correlation = float(torch.corrcoef(torch.stack([noises[0].flatten(), noises[1].flatten()]))[0, 1])
    assert abs(correlation) < 0.05


def test_reopening_a_round_does_not_replay_its_noise() -> None:
    oracle = _oracle(sigma=4.0)
    first_params, second_params = _params(oracle, 0.01, seed=1), _params(oracle, 0.05, seed=2)
    expected_batch = oracle.expected_batch[:, None]
    oracle.begin(0)
    first = oracle.gradient(first_params) * expected_batch
    try:
        oracle.begin(0)
        second = oracle.gradient(second_params) * expected_batch
    except NoiseReuseError:
        return  # refusing to reopen a round that released is a fix too
    batch = oracle.sampler.sample(0, 0)  # both releases drew batch 0 of round 0
    exact = [oracle.model.clipped_gradient_sums(p, batch.x, batch.y, batch.mask, oracle.clip_norm)[0]
             for p in (first_params, second_params)]
    noise = torch.stack([(first - exact[0]).flatten(), (second - exact[1]).flatten()])
    assert abs(float(torch.corrcoef(noise)[0, 1])) < 0.05


# -- 3. joint releases ---------------------------------------------------------------------------------------
def test_a_joint_release_is_charged_once_with_sensitivity_sqrt_k() -> None:
    sigma, clip, q = 1.5, 0.5, 8 / 50
    oracle = _oracle(sigma=sigma, clip=clip, model="linear", shape=(1, 32, 32))  # d = 10250
    params_a, params_b = _params(oracle), _params(oracle, 0.05, seed=2)
    oracle.begin(0)
    key = oracle.batch()
    exact_a, exact_b = _exact_sums(oracle, params_a, key), _exact_sums(oracle, params_b, key)
    released_a, released_b = oracle.release(oracle.clip(key, params_a), oracle.clip(key, params_b))

    expected = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / math.sqrt(2)))
    assert joint_gaussian_event(sigma, q, 2) == expected
    for agent in range(oracle.n_agents):
        assert oracle.ledger.history(agent) == ((expected, 1),)
    assert oracle.ledger.releases().tolist() == [1, 1, 1, 1]
    rdp = oracle.ledger.epsilon("rdp")
    np.testing.assert_allclose(rdp, _rdp_epsilon_of(expected), rtol=1e-12)
    # (the ledger discretises PLD per history: within 0.25 % of epsilon, see accounting.py)
    np.testing.assert_allclose(oracle.ledger.epsilon("pld"), _pld_epsilon_of(expected), rtol=5e-3)
    # Twice the sensitivity costs more than one sum would have.
    assert rdp[0] > _rdp_epsilon_of(gaussian_event(sigma, q)) * 1.2

    noise_a = (released_a - exact_a).double().flatten()
    noise_b = (released_b - exact_b).double().flatten()
    n = noise_a.numel()
    assert n > 40_000
    std = sigma * clip
    low, high = stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n  # each per-coordinate variance is (sigma C)^2
    for noise in (noise_a, noise_b):
        assert low * std**2 < float(noise.pow(2).mean()) < high * std**2
        assert abs(float(noise.mean())) < 5 * std / math.sqrt(n)
    correlation = float(torch.corrcoef(torch.stack([noise_a, noise_b]))[0, 1])
    assert abs(correlation) < 5 / math.sqrt(n)  # independent draws, not one vector twice


def test_one_model_on_one_batch_is_computed_once_and_each_message_gets_its_own_noise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cross-gradients where an owner is sent the same model several times (the complete graph after a round):
    the oracle computes that sum once, every row equals the sum recomputed outside it, and the release still
    draws independent noise for every row and charges the owner's joint event over all of them."""
    sigma, clip = 1.5, 1.0
    oracle = _oracle(sigma=sigma, clip=clip)
    params = _params(oracle, 0.1)
    models, owners = params[[1, 1, 1, 2, 0, 0]], torch.tensor([0, 0, 0, 1, 2, 2])
    oracle.begin(0)
    key = oracle.batch()
    rows_computed: list[int] = []
    compute = oracle.model.clipped_gradient_sums

    def counting(models: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rows_computed.append(len(models))
        return compute(models, *args, **kwargs)

    monkeypatch.setattr(oracle.model, "clipped_gradient_sums", counting)
    cross = oracle.clip(key, models, owners=owners, slots=[1, 2, 3, 0, 0, 1])  # slots: the receivers
    assert sum(rows_computed) == 3
    batch = oracle.sampler.sample(0, key.index)
    exact, _ = compute(models, batch.x[owners], batch.y[owners], batch.mask[owners], clip)
    torch.testing.assert_close(cross._sums, exact)
    (released,) = oracle.release(cross)
    noise = (released - exact).double()
    assert float((noise[0] - noise[1]).abs().min()) > 0  # same sum, independent draws
    assert abs(float(torch.corrcoef(noise[:2])[0, 1])) < 5 / math.sqrt(noise.shape[1])
    expected = joint_gaussian_event(sigma, 8 / 50, 3)
    assert oracle.ledger.history(0) == ((expected, 1),)



def test_one_stacked_call_releases_what_two_calls_on_the_batch_release() -> None:
    """Own models and cross models in one ``clip`` (what cross-gradients do, so that a repeated model is computed
    once) draw the same noise and charge the same joint event as the two calls: the noise is keyed by owner and
    slot, not by the call a row came in."""
    def released(merged: bool) -> tuple[torch.Tensor, tuple[Any, ...]]:
        oracle = _oracle(n_agents=3)
        params = _params(oracle, 0.1)
        cross_models, cross_owners, cross_slots = params[[1, 0, 2]], torch.tensor([0, 1, 1]), [1, 0, 2]
        oracle.begin(0)
        key = oracle.batch()
        if merged:
            (both,) = oracle.release(oracle.clip(key, torch.cat([params, cross_models]),
                                                 owners=torch.cat([torch.arange(3), cross_owners]),
                                                 slots=[0, 1, 2, *cross_slots]))
        else:
            own = oracle.clip(key, params, slots=[0, 1, 2])
            both = torch.cat(oracle.release(own, oracle.clip(key, cross_models, owners=cross_owners,
                                                             slots=cross_slots)))
        return both, oracle.ledger.history(0)

    (merged, merged_events), (separate, separate_events) = released(True), released(False)
    torch.testing.assert_close(merged, separate, rtol=1e-5, atol=1e-6)
    assert merged_events == separate_events

# -- 4. inactive agents and schedules ------------------------------------------------------------------------
def test_an_inactive_agent_releases_nothing_and_is_charged_nothing() -> None:
    oracle = _oracle(n_agents=5)
    params = _params(oracle, 0.01)
    active = torch.tensor([True, False, True, True, False])
    oracle.begin(0, active=active)
    released = oracle.gradient(params)
    assert released.shape == params.shape
    assert bool((released[~active] == 0).all())
    assert bool((released[active].abs().sum(dim=1) > 0).all())
    assert oracle.ledger.releases().tolist() == [1, 0, 1, 1, 0]
    assert oracle.ledger.refused.tolist() == [0, 0, 0, 0, 0]  # sitting out is not a refusal
    eps = oracle.ledger.epsilon("rdp")
    assert eps[1] == 0.0 and eps[4] == 0.0
    np.testing.assert_allclose(eps[[0, 2, 3]], _rdp_epsilon_of(gaussian_event(1.5, 8 / 50)), rtol=1e-12)
    # Their data cannot be reached by naming them either.
    key = oracle.batch()
    with pytest.raises(ValueError, match="inactive"):
        oracle.clip(key, params[:2], owners=torch.tensor([0, 1]))
    # A later round with everyone active charges everyone.
    oracle.begin(1)
    oracle.gradient(params)
    assert oracle.ledger.releases().tolist() == [2, 1, 2, 2, 1]


def _network(graph: str, n: int, **params: Any) -> SimulatedNetwork:
    return SimulatedNetwork(build_topology(graph, n, seed=0, **params))


def _plans(kind: str, network: SimulatedNetwork, rounds: int, seed: int = 5, **options: Any) -> list[Any]:
    scheduler = Scheduler(kind, AgentRandom(seed), network.n_total, **options)
    return [scheduler.plan(k, network) for k in range(rounds)]


def test_pairing_pairs_only_online_neighbours_and_never_repeats_a_pair() -> None:
    network = _network("erdos-renyi", 12, p=0.5)
    neighbours = {tuple(edge) for edge in network.out_edges.tolist()}
    rounds = 60
    plans = _plans("pairing", network, rounds, offline_probability=0.5)
    previous = list(range(12))
    paired = 0
    for plan in plans:
        partner = plan.partner.tolist()
        active = plan.active.tolist()
        for agent, other in enumerate(partner):
            if other == agent:
                continue
            paired += 1
            assert (agent, other) in neighbours
            assert partner[other] == agent
            assert active[agent] and active[other]  # offline agents are never paired ...
            assert previous[agent] != other  # ... and no pair repeats in consecutive rounds
        previous = partner
    online = sum(int(plan.active.sum()) for plan in plans)
    n = rounds * 12
    assert abs(online - n / 2) < 4 * math.sqrt(n / 4)  # each agent is offline with probability 1/2
    assert paired > n / 8  # pairing really happens
    # Reproducible from the seed; another seed plans otherwise.
    again = _plans("pairing", network, rounds, offline_probability=0.5)
    assert all(torch.equal(a.active, b.active) and torch.equal(a.partner, b.partner)
               for a, b in zip(plans, again, strict=True))
    other = _plans("pairing", network, rounds, seed=6, offline_probability=0.5)
    assert any(not torch.equal(a.partner, b.partner) for a, b in zip(plans, other, strict=True))


def test_offline_agents_are_never_active_and_poisson_clocks_wake_one_agent() -> None:
    network = _network("ring", 8)
    sync = _plans("synchronous", network, 200, offline_probability=0.25)
    counts = torch.stack([plan.active for plan in sync]).sum(dim=0).numpy()
    assert all(abs(c - 150) < 4 * math.sqrt(200 * 0.25 * 0.75) for c in counts)
    clocks = _plans("poisson-clocks", network, 400)
    assert all(int(plan.active.sum()) == 1 for plan in clocks)
    woken = np.bincount([int(torch.nonzero(plan.active)) for plan in clocks], minlength=8)
    assert stats.chisquare(woken).pvalue > 1e-4  # uniformly at random for equal rates
    again = _plans("poisson-clocks", network, 400)
    assert all(torch.equal(a.active, b.active) for a, b in zip(clocks, again, strict=True))
    sampled = _plans("sampled", network, 200, participation=0.3)
    taking_part = sum(int(plan.active.sum()) for plan in sampled)
    assert abs(taking_part - 480) < 4 * math.sqrt(1600 * 0.3 * 0.7)


@pytest.mark.parametrize(("kind", "options", "argument"), [
    ("poisson-clocks", {"offline_probability": 0.2}, "offline_probability"),
    ("synchronous", {"participation": 0.5}, "participation"),
    ("pairing", {"participation": 0.5}, "participation"),
    ("poisson-clocks", {"participation": 0.5}, "participation"),
])
def test_a_scheduler_refuses_what_its_schedule_does_not_read(kind: str, options: dict[str, float],
                                                             argument: str) -> None:
    """Poisson clocks wake one agent a tick whatever ``offline_probability`` says, and only ``sampled`` reads
    ``participation``: a value there would be ignored (a review: it was), so it is a ValueError naming it."""
    with pytest.raises(ValueError, match=argument):
        Scheduler(kind, AgentRandom(5), 8, **options)


def test_a_scheduled_round_charges_only_the_agents_it_activates() -> None:
    network = _network("complete", 6)
    oracle = _oracle(n_agents=6)
    params = _params(oracle, 0.01)
    scheduler = Scheduler("pairing", AgentRandom(3), 6, offline_probability=0.5)
    expected = np.zeros(6, dtype=np.int64)
    for k in range(6):
        plan = scheduler.plan(k, network)
        oracle.begin(k, plan.active)
        released = oracle.gradient(params)
        assert bool((released[~plan.active] == 0).all())
        expected += plan.active.numpy()
    assert oracle.ledger.releases().tolist() == expected.tolist()
    assert 0 < expected.sum() < 36


# -- 5. per-edge releases -------------------------------------------------------------------------------------
def test_a_per_edge_release_is_seen_only_by_its_receiver() -> None:
    sigma, q = 1.5, 8 / 50
    oracle = _oracle(n_agents=3)
    params = _params(oracle, 0.01)
    oracle.begin(0)
    key = oracle.batch()
    models = params[[1, 2, 0]]  # agent 0 evaluates the models of its receivers 1 and 2; agent 1 that of 0
    clipped = oracle.clip(key, models, owners=torch.tensor([0, 0, 1]))
    (messages,) = oracle.release(clipped, receivers=torch.tensor([1, 2, 0]))
    assert messages.shape == models.shape
    assert not torch.equal(messages[0], messages[1])

    ledger = oracle.ledger
    assert ledger.has_receiver_releases
    single, joint = gaussian_event(sigma, q), joint_gaussian_event(sigma, q, 2)
    pairwise = ledger.pairwise_epsilon("rdp", n_total=3)
    one = _rdp_epsilon_of(single)
    expected = np.array([[0.0, one, one],
                         [one, 0.0, 0.0],   # agent 1 sent nothing to agent 2
                         [0.0, 0.0, 0.0]])  # agent 2 sent nothing at all
    np.testing.assert_allclose(pairwise, expected, rtol=1e-12)
    # The agent view (all receivers together): agent 0's two rows are one joint event.
    assert ledger.history(0) == ((joint, 1),)
    assert ledger.history(1) == ((single, 1),)
    assert ledger.history(2) == ()
    np.testing.assert_allclose(ledger.epsilon("rdp"), [_rdp_epsilon_of(joint), one, 0.0], rtol=1e-12)
    assert ledger.epsilon("rdp")[0] > pairwise[0].max()


def test_broadcasts_before_and_after_a_per_edge_release_reach_every_pair() -> None:
    sigma, q = 1.5, 8 / 50
    oracle = _oracle(n_agents=3)
    params = _params(oracle, 0.01)
    oracle.begin(0)
    oracle.gradient(params)  # a broadcast, seen by everyone
    key = oracle.batch()
    oracle.release(oracle.clip(key, params[[1]], owners=torch.tensor([0])), receivers=torch.tensor([1]))
    oracle.begin(1)
    oracle.gradient(params)  # a second broadcast
    single = gaussian_event(sigma, q)
    broadcast = _rdp_epsilon_of(dp_accounting.SelfComposedDpEvent(single, 2))
    with_message = _rdp_epsilon_of(dp_accounting.SelfComposedDpEvent(single, 3))
    pairwise = oracle.ledger.pairwise_epsilon("rdp", n_total=3)
    expected = np.full((3, 3), broadcast)
    expected[0, 1] = with_message
    np.fill_diagonal(expected, 0.0)
    np.testing.assert_allclose(pairwise, expected, rtol=1e-9)
    np.testing.assert_allclose(oracle.ledger.epsilon("rdp"), [with_message, broadcast, broadcast], rtol=1e-9)


# -- 6. the ledger agrees with dp_accounting ---------------------------------------------------------------
def _random_history(rng: np.random.Generator) -> list[dp_accounting.DpEvent]:
    events = []
    for _ in range(int(rng.integers(1, 6))):
        kind = int(rng.integers(3))
        if kind == 0:
            event = gaussian_event(float(rng.uniform(0.6, 3.0)))
        elif kind == 1:
            event = gaussian_event(float(rng.uniform(0.6, 3.0)), float(rng.uniform(0.01, 0.3)))
        else:
            event = laplace_event(float(rng.uniform(1.0, 20.0)))
        events.extend([event] * int(rng.integers(1, 4)))  # runs of one event, then a change
    return events


@pytest.mark.parametrize("case", range(20))
def test_ledger_epsilon_equals_dp_accounting_on_the_composed_events(case: int) -> None:
    rng = np.random.default_rng(1000 + case)
    events = _random_history(rng)
    n = 2
    ledger = PrivacyLedger(n, math.inf, DELTA)
    for round_index, event in enumerate(events):
        ledger.charge(round_index, np.array([ledger.intern(event)] * n))
    composed = dp_accounting.ComposedDpEvent(events)
    np.testing.assert_allclose(ledger.epsilon("rdp"), _rdp_epsilon_of(composed), rtol=1e-9)
    # The ledger picks its PLD discretisation per history (error ~0.25 % of epsilon, see accounting.py).
    np.testing.assert_allclose(ledger.epsilon("pld"), _pld_epsilon_of(composed), rtol=5e-3)
    assert ledger.releases().tolist() == [len(events)] * n


# -- 7. a long ledger of distinct events composes exactly ---------------------------------------------------
def _laplace_rdp_curves(scales: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """RDP of Laplace(b) at each order (Mironov 2017, Prop. 6), ``(len(scales), len(orders))``:
    ``log(a/(2a-1) e^{(a-1)/b} + (a-1)/(2a-1) e^{-a/b}) / (a-1)``."""
    a = orders[None, :]
    b = scales[:, None]
    return np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) / b, np.log((a - 1) / (2 * a - 1)) - a / b) / (a - 1)


#: A history long enough for the composed epsilon to be far from any single event's, every event distinct.
#: How long a ledger of 100,000 takes (linear in the releases: 36 s here) is measured in
#: benchmarks/calibration.py ("a long ledger"), not here; this one takes about a fifth of that.
LONG_RUN_RELEASES = 20_000


def test_a_ledger_of_twenty_thousand_distinct_releases_composes_exactly() -> None:
    ledger = PrivacyLedger(1, 1000.0, DELTA)
    scales = 50.0 + 1e-3 * np.arange(LONG_RUN_RELEASES)
    for k, scale in enumerate(scales.tolist()):
        event = gaussian_event(scale) if k % 2 == 0 else laplace_event(scale)
        assert ledger.charge(k, np.array([ledger.intern(event)]))[0]
    epsilon = ledger.epsilon("rdp")
    assert ledger.releases().tolist() == [LONG_RUN_RELEASES]

    orders = np.asarray(rdp_privacy_accountant.RdpAccountant().orders, dtype=np.float64)
    gaussian, laplace = scales[0::2], scales[1::2]
    curves = _laplace_rdp_curves(laplace, orders)
    for scale, curve in zip(laplace[:: len(laplace) // 4], curves[:: len(laplace) // 4], strict=True):
        reference = rdp_privacy_accountant.RdpAccountant().compose(dp_accounting.LaplaceDpEvent(float(scale)))
        np.testing.assert_allclose(curve, reference._rdp, rtol=1e-7)
    total = orders * np.sum(1 / (2 * gaussian**2)) + curves.sum(axis=0)
    expected, _ = rdp_privacy_accountant.compute_epsilon(orders, total, DELTA)
    np.testing.assert_allclose(epsilon, expected, rtol=1e-9)


# -- 8. budgets ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant,releases", [("rdp", 25), ("rdp", 400), ("pld", 12), ("tight", 40)])
def test_an_agent_calibrated_for_t_releases_makes_exactly_t(accountant: str, releases: int) -> None:
    epsilon, q = 1.0, 0.05
    sigma = calibrate_noise_multiplier(epsilon, DELTA, q, releases, accountant=accountant)
    event = gaussian_event(sigma, q)
    ledger = PrivacyLedger(2, [epsilon, math.inf], DELTA, budget_accountant=accountant)
    ids = np.array([ledger.intern(event)] * 2)
    for k in range(releases):
        assert ledger.charge(k, ids).tolist() == [True, True], k
    assert ledger.charge(releases, ids).tolist() == [False, True]
    assert ledger.charge(releases + 1, ids).tolist() == [False, True]
    assert ledger.releases().tolist() == [releases, releases + 2]
    assert ledger.refused.tolist() == [2, 0]
    spent = ledger.epsilon(accountant)[0]
    assert spent <= epsilon
    # The refusal was needed: one more release would have exceeded the budget.
    one_more = dp_accounting.SelfComposedDpEvent(event, releases + 1)
    over = {"rdp": _rdp_epsilon_of(one_more), "pld": _pld_epsilon_of(one_more),
            "tight": min(_rdp_epsilon_of(one_more), _pld_epsilon_of(one_more))}[accountant]
    assert over > epsilon


def test_an_exhausted_agent_releases_zeros_through_the_oracle() -> None:
    epsilon, q, planned = 2.0, 8 / 50, 3
    sigma = calibrate_noise_multiplier(epsilon, DELTA, q, planned, accountant="rdp")
    sigma32 = float(round_up_to_float32(torch.tensor(sigma, dtype=torch.float64)))
    oracle = _oracle(sigma=sigma32, n_agents=2, budget=[epsilon, math.inf])
    params = _params(oracle, 0.01)
    for k in range(planned):
        oracle.begin(k)
        released = oracle.gradient(params)
        assert bool((released.abs().sum(dim=1) > 0).all()), k
        assert oracle.last_authorized.tolist() == [True, True]
    oracle.begin(planned)
    released = oracle.gradient(params)
    assert bool((released[0] == 0).all()) and bool((released[1] != 0).any())
    assert oracle.last_authorized.tolist() == [False, True]
    assert oracle.ledger.refused.tolist() == [1, 0]
    assert oracle.ledger.releases().tolist() == [planned, planned + 1]
    assert oracle.ledger.epsilon("rdp")[0] <= epsilon


def test_a_budget_is_never_exceeded_by_any_mixture_of_events() -> None:
    rng = np.random.default_rng(42)
    budget = 3.0
    ledger = PrivacyLedger(1, budget, DELTA, budget_accountant="rdp")  # checked against RDP, release by release
    orders = np.asarray(rdp_privacy_accountant.RdpAccountant().orders, dtype=np.float64)
    spent = np.zeros(len(orders))  # dp_accounting's RDP of the accepted releases (RDP composes additively)
    accepted = refusals = 0
    for k in range(60):
        kind = int(rng.integers(3))
        scale = float(rng.uniform(0.8, 12.0))
        event = gaussian_event(scale, float(rng.choice([0.05, 0.2]))) if kind == 0 else \
            gaussian_event(scale) if kind == 1 else laplace_event(scale * 4)
        allowed = bool(ledger.charge(k, np.array([ledger.intern(event)]))[0])
        curve = rdp_privacy_accountant.RdpAccountant().compose(event)._rdp
        fits = rdp_privacy_accountant.compute_epsilon(orders, spent + curve, DELTA)[0] <= budget
        assert allowed == fits, (k, event)  # refused exactly when the release would not fit
        if allowed:
            spent = spent + curve
            accepted += 1
        else:
            refusals += 1
        assert ledger.epsilon("rdp")[0] <= budget
    assert refusals > 5 and accepted > 5
    assert ledger.refused.tolist() == [refusals]
    assert ledger.releases().tolist() == [accepted]
    np.testing.assert_allclose(ledger.epsilon("rdp"), rdp_privacy_accountant.compute_epsilon(orders, spent, DELTA)[0],
                               rtol=1e-9)


# -- 9. an algorithm registered outside the package ----------------------------------------------------------
class HalfwaySettings(AlgorithmSettings):
    shrink: float = Field(0.5, gt=0, le=1)


@register
class Halfway(Algorithm):
    """Gossip, then a shrunken private gradient step: ``theta <- W theta - lr * shrink * G``."""

    name: ClassVar[str] = "test-halfway"
    Settings = HalfwaySettings
    built: ClassVar[list[float]] = []

    def __init__(self, shrink: float) -> None:
        self.shrink = shrink

    @classmethod
    def from_settings(cls, settings: HalfwaySettings) -> Algorithm:
        cls.built.append(settings.shrink)
        return cls(settings.shrink)

    def init_state(self, params: torch.Tensor) -> State:
        return {"params": params}

    def round(self, state: State, ctx: RoundContext) -> State:
        params = state["params"]
        grad = ctx.oracle.gradient(params)
        return {"params": ctx.network.mix(params) - ctx.lr * self.shrink * grad}


def _halfway_config(**algorithm: Any) -> dict[str, Any]:
    return {
        "experiment": {"name": "halfway", "seed": 0, "rounds": 3, "eval_every": 3},
        "data": {"dataset": "digits"},
        "topology": {"graph": "ring", "agents": 4},
        "model": {"name": "linear"},
        "algorithm": {"name": "test-halfway", "lr": 0.1, "batch_size": 16, **algorithm},
        "privacy": {"epsilon": 2.0},
    }


def test_an_algorithm_registered_by_a_test_module_runs_from_a_config(tmp_path: Path) -> None:
    assert algorithm_class("test-halfway") is Halfway
    config = validate_config(_halfway_config(shrink=0.25))
    assert config.algorithm.settings == HalfwaySettings(shrink=0.25)
    Halfway.built.clear()
    result = run_experiment(config, tmp_path / "out", progress=False, log=lambda message: None)
    assert Halfway.built == [0.25]
    summary = result.summary
    assert summary["algorithm"] == "test-halfway" and summary["rounds"] == 3 and summary["finished"]
    assert math.isfinite(summary["accuracy_mean"]) and 0.0 <= summary["accuracy_mean"] <= 1.0
    assert 0.0 < summary["epsilon_max"] <= 2.0
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert privacy["releases"] == [3, 3, 3, 3]
    assert privacy["refused_releases"] == [0, 0, 0, 0]
    assert max(privacy["epsilon"]) <= 2.0 and privacy["epsilon_accountant"] == "tight"
    assert bool(torch.isfinite(result.state["params"]).all())


def test_an_invalid_setting_of_a_registered_algorithm_names_its_field() -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(_halfway_config(shrink=2))
    assert error.value.field == "algorithm.shrink"
    with pytest.raises(ConfigError) as error:
        validate_config(_halfway_config(shrink=0))
    assert error.value.field == "algorithm.shrink"
    with pytest.raises(ConfigError) as error:
        validate_config(_halfway_config(shrinkk=0.5))
    assert error.value.field == "algorithm.shrinkk"
    assert "shrink" in error.value.message  # the message lists the algorithm's own settings
    raw = _halfway_config()
    raw["privacy"]["epsilonn"] = 1.0
    with pytest.raises(ConfigError) as error:
        validate_config(raw)
    assert error.value.field == "privacy.epsilonn"


# -- 10. mechanisms ------------------------------------------------------------------------------------------
def test_laplace_noise_has_its_scale_and_names_its_event() -> None:
    multipliers = torch.tensor([0.5, 2.0, 8.0])
    sensitivity = 0.75
    mechanism = LaplaceMechanism(multipliers, sensitivity)
    dim = 100_000
    values = torch.zeros(3, dim)
    mechanism.perturb(values, torch.arange(3), NoiseDraw(AgentRandom(4), torch.arange(3), 0, 0))
    scales = (multipliers * sensitivity).double()
    mean_abs = values.double().abs().mean(dim=1)  # E|X| = b for Laplace(b)
    np.testing.assert_allclose(mean_abs.numpy(), scales.numpy(), rtol=0.02)
    np.testing.assert_allclose(values.double().std(dim=1).numpy(), (math.sqrt(2) * scales).numpy(), rtol=0.03)
    assert bool((values.double().mean(dim=1).abs() < 5 * math.sqrt(2) * scales / math.sqrt(dim)).all())
    # A Kolmogorov-Smirnov check of the shape, not only the scale.
    assert stats.kstest(values[1, :5000].double().numpy(), "laplace", args=(0, float(scales[1]))).pvalue > 1e-4

    assert mechanism.agent_event(1, 1.0, 1) == dp_accounting.LaplaceDpEvent(2.0)
    assert mechanism.agent_event(1, 1.0, 4) == dp_accounting.LaplaceDpEvent(0.5)
    assert mechanism.agent_event(2, 0.1, 2) == dp_accounting.PoissonSampledDpEvent(0.1,
                                                                                   dp_accounting.LaplaceDpEvent(4.0))
    assert mechanism.receiver_event(2, 1.0) == dp_accounting.LaplaceDpEvent(8.0)


def test_a_joint_laplace_release_through_the_oracle_is_charged_m_over_k() -> None:
    oracle = _oracle(n_agents=2, per_agent=20, batch=20, mechanism="laplace")  # q = 1: every record, every time
    params = _params(oracle, 0.01)
    mechanism = LaplaceMechanism(torch.tensor([6.0, 3.0]), 1.0)
    oracle.begin(0)
    key = oracle.batch()
    oracle.release(oracle.clip(key, params), oracle.clip(key, params), oracle.clip(key, params),
                   mechanism=mechanism)
    assert oracle.ledger.history(0) == ((dp_accounting.LaplaceDpEvent(2.0), 1),)
    assert oracle.ledger.history(1) == ((dp_accounting.LaplaceDpEvent(1.0), 1),)
    np.testing.assert_allclose(oracle.ledger.epsilon("rdp"),
                               [_rdp_epsilon_of(dp_accounting.LaplaceDpEvent(m)) for m in (2.0, 1.0)], rtol=1e-12)


def test_each_mechanism_is_charged_its_own_event() -> None:
    oracle = _oracle(n_agents=2, per_agent=4, batch=4, mechanism="laplace", model="linear", shape=(1, 2, 2))
    params = _params(oracle, 0.01)
    owner_of_address: dict[int, float] = {}
    collisions = 0
    for k in range(150):
        multiplier = (8.0, 0.5, 2.0)[k % 3]
        oracle.begin(k)
        key = oracle.batch()
        clipped = oracle.clip(key, params)
        mechanism = LaplaceMechanism(torch.full((2,), multiplier), 1.0)
        if owner_of_address.get(id(mechanism), multiplier) != multiplier:
            collisions += 1  # a new mechanism where an earlier, different one lived
        owner_of_address[id(mechanism)] = multiplier
        oracle.release(clipped, mechanism=mechanism)
        del mechanism
        charged = oracle.ledger.history(0)[-1][0]
        assert charged == dp_accounting.LaplaceDpEvent(multiplier), (k, charged)
        if collisions >= 5:
            break
    if collisions == 0:
        pytest.skip("the allocator never reused a mechanism's address: nothing was exercised")


def test_no_noise_is_non_private_and_reported_as_infinite() -> None:
    mechanism = NoNoise()
    assert mechanism.agent_event(0, 0.1, 3) == dp_accounting.NonPrivateDpEvent()
    assert mechanism.receiver_event(0, 0.1) == dp_accounting.NonPrivateDpEvent()
    values = torch.arange(6.0).reshape(2, 3)
    mechanism.perturb(values, torch.arange(2), NoiseDraw(AgentRandom(0), torch.arange(2), 0, 0))
    assert torch.equal(values, torch.arange(6.0).reshape(2, 3))

    oracle = _oracle(n_agents=3, mechanism=None)
    params = _params(oracle, 0.01)
    oracle.begin(0)
    key = oracle.batch()
    batch = oracle.sampler.sample(0, key.index)
    weights = batch.mask / batch.mask.sum(dim=1, keepdim=True).clamp(min=1)
    expected = oracle.model.batch_gradients(params, batch.x, batch.y, weights)  # the plain mean gradient
    (released,) = oracle.release(oracle.clip(key, params))
    torch.testing.assert_close(released, expected)
    assert all(history == ((dp_accounting.NonPrivateDpEvent(), 1),) for history in map(oracle.ledger.history,
                                                                                           range(3)))
    assert np.isinf(oracle.ledger.epsilon("rdp")).all()
    assert np.isinf(oracle.ledger.epsilon("pld")).all()
    assert oracle.ledger.reported_epsilon()[0].tolist() == [math.inf] * 3
    # A finite budget cannot pay for a non-private release.
    budgeted = PrivacyLedger(1, 10.0, DELTA)
    assert budgeted.charge(0, np.array([budgeted.intern(dp_accounting.NonPrivateDpEvent())])).tolist() == [False]
    assert budgeted.refused.tolist() == [1]


def test_a_non_private_run_refuses_noisy_mechanisms() -> None:
    """Its sums are unclipped batch means: no mechanism's event would describe their sensitivity."""
    oracle = _oracle(mechanism=None)
    oracle.begin(0)
    key = oracle.batch()
    with pytest.raises(ValueError, match="non-private"):
        oracle.release(oracle.clip(key, _params(oracle)), mechanism=LaplaceMechanism(torch.ones(4), 1.0))
