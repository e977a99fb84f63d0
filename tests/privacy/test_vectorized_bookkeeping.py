"""The per-round bookkeeping that runs over all agents at once: Poisson sampling, noise streams, ledger.

Each vectorised piece is checked against a straightforward per-agent reference written here, so
that the tests say what the vectorisation must preserve, not how it is done.
"""

from __future__ import annotations

import functools
import hashlib
import math

import dp_accounting
import dp_accounting.rdp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decentdp.privacy import accounting
from decentdp.privacy import ledger as ledger_module
from decentdp.privacy.accounting import calibrate_noise_multiplier, epsilon_of_history
from decentdp.privacy.events import gaussian_event, laplace_event
from decentdp.privacy.ledger import UNLIMITED, PrivacyLedger, _largest_within
from decentdp.privacy.sampling import AgentData, Batch, PoissonSampler
from decentdp.rng import AgentRandom, Stream, round_stream_seed, stream_seed

# ---------------------------------------------------------------------------------------------
# Poisson sampling


def _labelled_data(sizes: list[int], seed: int = 0) -> AgentData:
    """Records whose features and labels are their own ids, split in shuffled (unsorted) index lists."""
    total = sum(sizes)
    ids = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    bounds = np.cumsum([0, *sizes])
    x = torch.arange(total, dtype=torch.float32)[:, None, None] * torch.ones(1, 2, 3)
    return AgentData(x, torch.arange(total), tuple(ids[bounds[i]:bounds[i + 1]] for i in range(len(sizes))))


def _reference_selection(data: AgentData, rates: torch.Tensor, rng: AgentRandom, round_index: int,
                         step: int) -> list[torch.Tensor]:
    """What a shard holding any agent computes: the round-wide draw, sliced at the agent's global slots."""
    total = sum(len(idx) for idx in data.indices)
    draws = torch.rand(total, generator=rng.round_generator(round_index, Stream.SAMPLING, step), dtype=torch.float64)
    chosen, start = [], 0
    for agent, owned in enumerate(data.indices):
        mine = draws[start:start + len(owned)]
        chosen.append(owned[mine < float(rates[agent])])
        start += len(owned)
    return chosen


def _check_batch(batch: Batch, data: AgentData, chosen: list[torch.Tensor]) -> None:
    width = max(1, max(len(c) for c in chosen))
    assert batch.mask.shape == (data.n_agents, width) and batch.y.shape == (data.n_agents, width)
    assert batch.x.shape == (data.n_agents, width, *data.x.shape[1:])
    for agent, selected in enumerate(chosen):
        k = len(selected)
        assert batch.mask[agent, :k].eq(1.0).all() and batch.mask[agent, k:].eq(0.0).all()
        assert torch.equal(batch.y[agent, :k], data.y[selected])  # selected records, in the agent's order
        assert torch.equal(batch.x[agent, :k], data.x[selected])
        padding = data.indices[agent][0]  # padding reads the agent's own first record
        assert batch.y[agent, k:].eq(data.y[padding]).all()
        assert torch.equal(batch.x[agent, k:], data.x[padding].expand(width - k, *data.x.shape[1:]))
    torch.testing.assert_close(batch.sizes, torch.tensor([float(len(c)) for c in chosen]), rtol=0, atol=0)


@pytest.mark.parametrize("round_index,step", [(0, 0), (7, 0), (7, 2)])
def test_batches_are_the_owned_records_below_their_rate_with_exact_mask_and_padding(round_index: int,
                                                                                   step: int) -> None:
    sizes = [5, 1, 17, 9, 30, 2]
    data = _labelled_data(sizes)
    rates = torch.tensor([0.5, 0.9, 0.1, 1.0, 0.3, 0.7], dtype=torch.float64)
    rng = AgentRandom(3)
    batch = PoissonSampler(data, rates, rng).sample(round_index, step)
    chosen = _reference_selection(data, rates, rng, round_index, step)
    _check_batch(batch, data, chosen)
    assert batch.sizes[3] == 9  # q = 1 takes every record


def test_a_round_where_nobody_is_sampled_has_width_one_and_an_all_zero_mask() -> None:
    data = _labelled_data([4, 6, 3])
    batch = PoissonSampler(data, torch.full((3,), 1e-12, dtype=torch.float64), AgentRandom(0)).sample(2)
    assert batch.mask.shape == (3, 1) and not batch.mask.any()
    assert batch.y[:, 0].tolist() == [int(idx[0]) for idx in data.indices]


def test_mean_batch_size_matches_q_times_dataset_size() -> None:
    """Over R rounds agent i selects Binomial(R |D_i|, q_i) records; 5 standard deviations (fixed seed)."""
    sizes = [60, 60, 13, 200, 1, 45]
    rates = torch.tensor([0.5, 0.05, 0.3, 0.01, 0.5, 0.99], dtype=torch.float64)
    sampler = PoissonSampler(_labelled_data(sizes), rates, AgentRandom(123))
    rounds = 400
    totals = torch.zeros(len(sizes), dtype=torch.float64)
    for k in range(rounds):
        totals += sampler.sample(k).sizes.double()
    n = torch.tensor(sizes, dtype=torch.float64)
    mean, expected = totals / rounds, rates * n
    std_of_mean = torch.sqrt(rates * (1 - rates) * n / rounds)
    assert ((mean - expected).abs() <= 5 * std_of_mean).all(), (mean, expected, std_of_mean)


def test_batches_are_a_deterministic_function_of_seed_round_and_step() -> None:
    data = _labelled_data([20, 20, 20, 20])
    rates = torch.full((4,), 0.5, dtype=torch.float64)

    def sample(seed: int, round_index: int, step: int = 0) -> Batch:
        return PoissonSampler(data, rates, AgentRandom(seed)).sample(round_index, step)

    first, again = sample(5, 3), sample(5, 3)  # a fresh sampler and a fresh AgentRandom
    assert torch.equal(first.mask, again.mask) and torch.equal(first.y, again.y) and torch.equal(first.x, again.x)
    for other in (sample(6, 3), sample(5, 4), sample(5, 3, step=1)):
        assert not torch.equal(first.y * first.mask, other.y * other.mask) or first.mask.shape != other.mask.shape
    # Calling other rounds in between (as a resumed run does not) changes nothing.
    sampler = PoissonSampler(data, rates, AgentRandom(5))
    sampler.sample(0)
    sampler.sample(9, 1)
    assert torch.equal(sampler.sample(3).y, first.y)


def test_an_agents_batch_ignores_the_other_agents_rates_and_records() -> None:
    data = _labelled_data([10, 25, 8])
    rates = torch.tensor([0.4, 0.4, 0.4], dtype=torch.float64)
    base = PoissonSampler(data, rates, AgentRandom(1)).sample(4)
    changed_rates = PoissonSampler(data, torch.tensor([0.9, 0.4, 0.05], dtype=torch.float64), AgentRandom(1)).sample(4)
    k = int(base.sizes[1])
    assert torch.equal(changed_rates.y[1, :k], base.y[1, :k]) and changed_rates.sizes[1] == k
    # Same global layout (sizes), other agents' records relabelled: agent 1 still picks the same records.
    relabelled = AgentData(data.x, data.y, (data.indices[2][:1].repeat(10), data.indices[1], data.indices[0][:8]))
    moved = PoissonSampler(relabelled, rates, AgentRandom(1)).sample(4)
    assert torch.equal(moved.y[1, :k], base.y[1, :k])


def test_sampler_rejects_agents_without_records() -> None:
    data = AgentData(torch.zeros(3, 1), torch.zeros(3), (torch.arange(3), torch.zeros(0, dtype=torch.long)))
    with pytest.raises(ValueError, match="agent 1 owns no records"):
        PoissonSampler(data, torch.full((2,), 0.5, dtype=torch.float64), AgentRandom(0))


# ---------------------------------------------------------------------------------------------
# Keyed streams


def test_stream_keys_keep_their_documented_format() -> None:
    """Changing the key format would silently change the noise of runs resumed from old checkpoints."""
    expected = int.from_bytes(hashlib.sha256(b"7/3/11/2/1").digest()[:8], "little") >> 1
    assert stream_seed(7, 3, 11, Stream.NOISE, 1) == expected
    round_wide = int.from_bytes(hashlib.sha256(b"7/*/11/1/1").digest()[:8], "little") >> 1
    assert round_stream_seed(7, 11, Stream.SAMPLING, 1) == round_wide


def test_round_wide_streams_differ_from_every_agents_stream() -> None:
    per_agent = {stream_seed(0, agent, 5, stream) for agent in range(2000) for stream in Stream}
    assert all(round_stream_seed(0, 5, stream) not in per_agent for stream in Stream)
    rng = AgentRandom(0)
    assert not torch.equal(torch.rand(50, generator=rng.round_generator(5, Stream.SAMPLING)),
                           torch.rand(50, generator=rng.round_generator(5, Stream.NOISE)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_rows_are_each_agents_own_stream(dtype: torch.dtype) -> None:
    rng = AgentRandom(11)
    agents = [4, 0, 9, 4]
    block = rng.normal(agents, 37, round_index=2, stream=Stream.NOISE, step=1, dtype=dtype)
    for row, agent in enumerate(agents):
        alone = torch.empty(37, dtype=dtype).normal_(generator=rng.generator(agent, 2, Stream.NOISE, 1))
        assert torch.equal(block[row], alone)


def test_normal_draws_into_a_given_buffer() -> None:
    rng = AgentRandom(2)
    buffer = torch.full((3, 50), float("nan"), dtype=torch.float64)
    view = buffer[:, :20]  # a non-contiguous destination works too
    assert rng.normal([1, 2, 3], 20, 4, Stream.NOISE, out=view) is view
    assert torch.equal(view, rng.normal([1, 2, 3], 20, 4, Stream.NOISE, dtype=torch.float64))
    assert buffer[:, 20:].isnan().all()
    with pytest.raises(ValueError, match="expected"):
        rng.normal([1, 2], 20, 4, Stream.NOISE, out=buffer)


# ---------------------------------------------------------------------------------------------
# Privacy ledger


@functools.cache
def _reference_max_count(history: tuple, event, delta: float, budget: float) -> int:
    """Largest number of further ``event`` releases after ``history`` within budget, by plain search
    over dp_accounting's RDP accountant (no closed form, no caches inside the search).  The answer is a
    pure function of its arguments, so it is memoised: a run that grows asks again with the same
    prefix (a search costs up to about 80 compositions, and the property test asks thousands of times)."""

    def fits(count: int) -> bool:
        composed = [dp_accounting.SelfComposedDpEvent(e, c) for e, c in (*history, (event, count)) if c > 0]
        if not composed:
            return True
        accountant = dp_accounting.rdp.RdpAccountant()
        return accountant.compose(dp_accounting.ComposedDpEvent(composed)).get_epsilon(delta) <= budget

    if not fits(0):
        return -1
    high = 1
    while fits(high):
        if high >= UNLIMITED:
            return UNLIMITED
        high *= 2
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


class _ReferenceLedger:
    """The straightforward per-agent ledger: asks the accountant for every agent at every charge."""

    def __init__(self, budgets: list[float], delta: float) -> None:
        self.budgets, self.delta = budgets, delta
        self.runs: list[list[list]] = [[] for _ in budgets]  # [event, count]
        self.refused = [0] * len(budgets)

    def headroom(self, agent: int, event) -> int:
        if math.isinf(self.budgets[agent]):
            return UNLIMITED
        if isinstance(event, dp_accounting.NonPrivateDpEvent):
            return 0
        runs = self.runs[agent]
        if runs and runs[-1][0] == event:
            prefix, done = tuple(tuple(run) for run in runs[:-1]), runs[-1][1]
        else:
            prefix, done = tuple(tuple(run) for run in runs), 0
        return _reference_max_count(prefix, event, self.delta, self.budgets[agent]) - done

    def charge(self, events: list, releases: int, asking: np.ndarray) -> np.ndarray:
        allowed = np.zeros(len(self.budgets), dtype=bool)
        for agent in np.flatnonzero(asking):
            if self.headroom(agent, events[agent]) < releases:
                self.refused[agent] += 1
                continue
            allowed[agent] = True
            runs = self.runs[agent]
            if runs and runs[-1][0] == events[agent]:
                runs[-1][1] += releases
            else:
                runs.append([events[agent], releases])
        return allowed


# Mechanisms whose headroom ranges from none (sigma = 0, or q = 1 with little noise) to unlimited.
_SIGMAS = [0.0, 0.6, 1.0, 2.5, 8.0]
_RATES = [0.02, 0.3, 1.0]
_BUDGETS = [0.3, 1.0, 4.0, math.inf]
_mechanism = st.tuples(st.sampled_from(["gaussian", "laplace"]), st.sampled_from(_SIGMAS), st.sampled_from(_RATES))
_call = st.tuples(
    st.lists(st.integers(0, 5), min_size=3, max_size=3),  # each agent's mechanism: an index into the palette
    st.integers(0, 3),  # releases
    st.one_of(st.none(), st.lists(st.booleans(), min_size=3, max_size=3)),  # which agents ask
)


def _event(kind: str, sigma: float, rate: float):
    # Laplace on Poisson batches has no RDP bound in dp_accounting: the palette uses it unsampled.
    return gaussian_event(sigma, rate) if kind == "gaussian" else laplace_event(sigma)


@settings(max_examples=60, deadline=None)
@given(budgets=st.lists(st.sampled_from(_BUDGETS), min_size=3, max_size=3),
       palette=st.lists(_mechanism, min_size=1, max_size=3),
       calls=st.lists(_call, min_size=1, max_size=30), checkpoint_at=st.integers(0, 30))
def test_event_ledger_matches_the_per_agent_reference(budgets: list[float], palette: list[tuple[str, float, float]],
                                                      calls: list, checkpoint_at: int) -> None:
    """A small palette of mechanisms per example, so that runs repeat long enough to reach the budgets;
    the ledger's closed-form headroom must refuse exactly where a plain search over dp_accounting does."""
    ledger = PrivacyLedger(3, budgets, 1e-5, budget_accountant="rdp")  # the closed-form headroom
    reference = _ReferenceLedger(budgets, 1e-5)
    for round_index, (choice, releases, asking) in enumerate(calls):
        if round_index == checkpoint_at:  # a resumed run continues from the saved state
            ledger = PrivacyLedger.from_state_dict(ledger.state_dict())
        events = [_event(*palette[c % len(palette)]) for c in choice]
        mask = np.ones(3, dtype=bool) if asking is None else np.array(asking)
        allowed = ledger.charge(round_index, np.array([ledger.intern(e) for e in events]), count=releases,
                                agents=None if asking is None else mask)
        expected = reference.charge(events, releases, mask)
        np.testing.assert_array_equal(allowed, expected)
    np.testing.assert_array_equal(ledger.releases(), [sum(run[1] for run in runs) for runs in reference.runs])
    for agent in range(3):
        assert ledger.history(agent) == tuple(tuple(run) for run in reference.runs[agent])
    assert ledger.refused.tolist() == reference.refused


def test_a_refused_agent_records_nothing_and_can_still_afford_a_cheaper_mechanism() -> None:
    ledger = PrivacyLedger(2, [1.0, math.inf], 1e-5, budget_accountant="rdp")
    loud, quiet = ledger.intern(gaussian_event(8.0)), ledger.intern(gaussian_event(50.0, 0.01))
    room = _reference_max_count((), gaussian_event(8.0), 1e-5, 1.0)
    assert room >= 2
    for k in range(room):
        assert ledger.charge(k, np.array([loud, loud])).all()
    before = ledger.state_dict()
    assert ledger.charge(room, np.array([loud, loud])).tolist() == [False, True]
    assert ledger.refused.tolist() == [1, 0]
    assert ledger.state_dict()["agent_runs"][0] == before["agent_runs"][0]  # nothing recorded for the refused agent
    # A far noisier mechanism still fits the remaining budget, exactly `left` more times.
    left = _reference_max_count(((gaussian_event(8.0), room),), gaussian_event(50.0, 0.01), 1e-5, 1.0)
    assert left > 1
    assert ledger.charge(room + 1, np.array([quiet, loud]), count=left + 1).tolist() == [False, True]  # all or nothing
    assert ledger.refused.tolist() == [2, 0] and ledger.releases()[0] == room
    assert ledger.charge(room + 2, np.array([quiet, loud]), count=left - 1).all()  # opens a new run
    assert ledger.charge(room + 3, np.array([quiet, loud])).all()  # extends it up to the budget
    assert not ledger.charge(room + 4, np.array([quiet, loud]))[0]
    assert ledger.history(0) == ((gaussian_event(8.0), room), (gaussian_event(50.0, 0.01), left))
    assert ledger.epsilon("rdp")[0] <= 1.0
    assert ledger.releases().tolist() == [room + left, room + 3 + 2 * left]
    assert ledger.refused.tolist() == [3, 0]


def test_only_the_asking_agents_spend_or_are_refused() -> None:
    ledger = PrivacyLedger(3, [1e-3, 1e-3, 5.0], 1e-5)
    event = ledger.intern(gaussian_event(1.0, 0.1))
    allowed = ledger.charge(0, np.full(3, event), agents=np.array([True, False, True]))
    assert allowed.tolist() == [False, False, True]
    assert ledger.refused.tolist() == [1, 0, 0]
    assert ledger.releases().tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="non-negative"):
        ledger.charge(1, np.full(3, event), count=-1)


def test_checkpoints_of_the_previous_version_load_and_continue() -> None:
    saved = {"budgets": [10.0, float("inf")], "delta": 1e-5, "budget_accountant": "rdp", "refused": [0, 3],
             "runs": [[{"noise_multiplier": 1.1, "sample_rate": 0.1, "count": 4, "first_round": 0, "last_round": 1},
                       {"noise_multiplier": 1.3, "sample_rate": 0.2, "count": 6, "first_round": 2, "last_round": 4}],
                      []]}
    ledger = PrivacyLedger.from_state_dict(saved)
    assert ledger.releases().tolist() == [10, 0]
    assert ledger.refused.tolist() == [0, 3]
    assert ledger.history(0) == ((gaussian_event(1.1, 0.1), 4), (gaussian_event(1.3, 0.2), 6))
    assert ledger.charge(5, np.array([ledger.intern(gaussian_event(1.3, 0.2)),
                                      ledger.intern(gaussian_event(0.0))]), count=2).all()
    runs = ledger.state_dict()["agent_runs"]
    assert runs[0][-1][1:] == [8, 2, 5]  # the current run grew, keeping its first round
    assert ledger.epsilon("rdp")[1] == math.inf  # a non-private release
    restored = PrivacyLedger.from_state_dict(ledger.state_dict())
    assert restored.state_dict() == ledger.state_dict()


def test_a_rejected_per_receiver_release_records_nothing() -> None:
    ledger = PrivacyLedger(2, 5.0, 1e-5)
    event = ledger.intern(gaussian_event(2.0, 0.1))
    before = ledger.state_dict()
    with pytest.raises(ValueError, match="at most one message per"):
        ledger.charge(0, np.full(2, event), senders=np.array([0, 0]), receivers=np.array([1, 1]),
                      receiver_events=np.full(2, event))
    assert ledger.state_dict() == before and ledger.releases().tolist() == [0, 0]
    assert ledger.charge(0, np.full(2, event), senders=np.array([0, 1]), receivers=np.array([1, 0]),
                         receiver_events=np.full(2, event)).all()


# -- the aimed headroom search under the tight accountant ---------------------------------------------------------

_GROWTHS = {  # increasing epsilons of a release count: Gaussian-like, linear, steps, saturating, infinite past a point
    "sqrt": lambda c, s: s * math.sqrt(c),
    "linear": lambda c, s: s * c,
    "steps": lambda c, s: s * (c // 7),
    "saturating": lambda c, s: s * (1 - math.exp(-c / 50)) * 10,
    "infinite past 40": lambda c, s: s * c if c <= 40 else math.inf,
}


@settings(max_examples=200, deadline=None)
@given(growth=st.sampled_from(sorted(_GROWTHS)), scale=st.floats(1e-3, 3.0), budget=st.floats(0.0, 20.0),
       start=st.floats(0.0, 1.0))
def test_aimed_count_is_the_largest_that_fits(growth: str, scale: float, budget: float, start: float) -> None:
    """_largest_within, which aims at the budget instead of bisecting, returns what a plain scan finds, from any
    count known to fit (the RDP count it is given in a ledger is one such)."""
    def epsilon(count: int) -> float:
        return _GROWTHS[growth](count, scale)

    limit = 100_000
    expected = next((c - 1 for c in range(limit) if epsilon(c) > budget), None)
    if expected is None:  # nothing below the limit breaks the budget: only unlimited-or-more can be claimed
        assert _largest_within(epsilon, budget, 0) >= limit - 1
        return
    fits = int(start * max(0, expected))  # some count known to fit, or 0
    assert _largest_within(epsilon, budget, fits) == expected
    assert expected < UNLIMITED


def test_tight_headroom_takes_a_few_compositions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's budget check: from RDP's count, the exact (PLD) count in at most six compositions, where the
    doubling-and-bisecting search took eighteen; the count is the one a plain search finds."""
    sigma = calibrate_noise_multiplier(4.0, 1e-5, 0.03, 300)
    event = gaussian_event(sigma, 0.03)
    counted: list[int] = []

    def epsilon(history: tuple, delta: float, accountant: str, relation: str) -> float:
        counted.append(history[-1][1])
        return epsilon_of_history(history, delta, accountant, relation)

    ledger = PrivacyLedger(1, 4.0, 1e-5)
    event_id = ledger.intern(event)
    ledger_module._max_count.cache_clear()
    monkeypatch.setattr(ledger_module, "epsilon_of_history", epsilon)
    room, exact = ledger._headroom(0, event_id)
    monkeypatch.undo()
    assert exact and len(counted) <= 6
    assert epsilon_of_history(((event, room),), 1e-5, "tight", "add-remove") <= 4.0
    assert epsilon_of_history(((event, room + 1),), 1e-5, "tight", "add-remove") > 4.0


@pytest.mark.parametrize(("accountant", "relation"), [("tight", "replace-one"), ("pld", "add-remove")])
def test_headroom_from_no_known_count_takes_a_few_compositions(accountant: str, relation: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A replace-one ledger and the pld accountant have no RDP count to start the exact count from, so the search
    starts at zero: it predicts from the first count it measures and then interpolates, at most ten compositions,
    where predicting only at the first step (from 0, which predicts nothing) and then doubling took 23 (tight,
    replace-one) and 27 (pld) here; the count is the one a plain search finds (doubling and bisecting)."""
    budget, event = 3.0, gaussian_event(2.0, 0.02)
    counted: list[int] = []

    def epsilon(history: tuple, delta: float, accountant: str, relation: str) -> float:
        counted.append(history[-1][1])
        return epsilon_of_history(history, delta, accountant, relation)

    ledger = PrivacyLedger(1, budget, 1e-5, accountant, relation)
    event_id = ledger.intern(event)
    ledger_module._max_count.cache_clear()
    monkeypatch.setattr(ledger_module, "epsilon_of_history", epsilon)
    room, exact = ledger._headroom(0, event_id)
    monkeypatch.undo()
    assert exact and len(counted) <= 10
    if relation == "replace-one":  # (a plain search costs about 20 compositions: one relation is enough)
        assert room == ledger_module._search(
            lambda count: epsilon_of_history(((event, count),), 1e-5, accountant, relation) <= budget, 0)
    assert epsilon_of_history(((event, room),), 1e-5, accountant, relation) <= budget
    assert epsilon_of_history(((event, room + 1),), 1e-5, accountant, relation) > budget


def test_alternating_runs_are_priced_as_their_composition_in_any_order() -> None:
    """TOP-DP's joint releases alternate between a few events round by round. The history is priced with its runs
    merged (one distribution per distinct event): the same epsilon as dp_accounting composing every run in order, by
    PLD at the same discretisation and by RDP, and one value (one cache entry) for any order of the same runs."""
    events = [gaussian_event(sigma, 0.02) for sigma in (1.1, 1.6, 2.3)]
    pattern = [0, 1, 0, 2, 1, 0, 2, 1]
    history = tuple((events[e], count) for e, count in zip(pattern, [3, 5, 1, 4, 2, 7, 6, 1], strict=True))
    assert len(accounting.merged_history(history)) == 3
    composed = dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(e, c) for e, c in history])
    interval = accounting._pld_interval(history, 1e-5, "add-remove")
    pld = accounting.make_accountant("pld", "add-remove", interval).compose(composed).get_epsilon(1e-5)
    rdp = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS)).compose(composed).get_epsilon(1e-5)
    assert epsilon_of_history(history, 1e-5, "pld") == pytest.approx(pld, rel=1e-9)
    assert epsilon_of_history(history, 1e-5, "rdp") == pytest.approx(rdp, rel=1e-9)
    assert epsilon_of_history(history[::-1], 1e-5, "tight") == epsilon_of_history(history, 1e-5, "tight")
