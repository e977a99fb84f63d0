"""Privacy machinery: clipping, calibrated noise, calibration, ledgers and budget enforcement."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from scipy import stats

from decentdp.config import validate_config
from decentdp.errors import ConfigError, PrivacyError
from decentdp.experiment.build import build_experiment
from decentdp.gradients.clipping import clipped_sum
from decentdp.gradients.flat_model import FlatModel
from decentdp.models import build_model, classification_loss
from decentdp.privacy.accounting import calibrate_noise_multiplier, epsilon_spent
from decentdp.privacy.events import gaussian_event
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import GaussianMechanism, NoiseReuseError, round_up_to_float32
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.sampling import AgentData, PoissonSampler
from decentdp.rng import AgentRandom

from conftest import tiny_config


def _flat_model(name: str = "convnet", shape: tuple[int, int, int] = (1, 12, 12)) -> FlatModel:
    return FlatModel(build_model(name, shape, 10, seed=3), classification_loss)


@pytest.mark.parametrize("name,shape", [("convnet", (1, 12, 12)), ("mlp", (1, 8, 8)), ("cifar-cnn", (3, 8, 8))])
def test_per_sample_clipped_sums_match_one_sample_at_a_time(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = _flat_model(name, shape)
    n_agents, batch, clip = 3, 5, 0.05
    params = model.initial_parameters() + 0.01 * torch.randn(n_agents, model.dim)
    x = torch.randn(n_agents, batch, *shape)
    y = torch.randint(0, 10, (n_agents, batch))
    mask = torch.ones(n_agents, batch)
    mask[1, 3:] = 0.0  # padding must not contribute
    summed, norms = clipped_sum(model.per_sample_gradients(params, x, y), mask, clip)

    module = model.module
    for agent in range(n_agents):
        expected = torch.zeros(model.dim)
        for b in range(batch):
            torch.nn.utils.vector_to_parameters(params[agent].clone(), module.parameters())
            module.zero_grad()
            classification_loss(module(x[agent, b:b + 1]), y[agent, b:b + 1]).sum().backward()
            g = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
            assert norms[agent, b].item() == pytest.approx(g.norm().item(), rel=1e-4)
            expected += mask[agent, b] * g * min(1.0, clip / (g.norm().item() + 1e-6))
        torch.testing.assert_close(summed[agent], expected, rtol=1e-4, atol=1e-6)


def _oracle(sigma: float, clip: float, n_agents: int = 4, batch: int = 8) -> DataOracle:
    torch.manual_seed(1)
    model = _flat_model("mlp", (1, 8, 8))
    x = torch.randn(200, 1, 8, 8)
    y = torch.randint(0, 10, (200,))
    data = AgentData(x, y, tuple(torch.arange(i * 50, (i + 1) * 50) for i in range(n_agents)))
    rates = torch.full((n_agents,), batch / 50, dtype=torch.float64)
    rng = AgentRandom(7)
    ledger = PrivacyLedger(n_agents, math.inf, 1e-5)
    mechanism = GaussianMechanism(torch.full((n_agents,), sigma), clip)
    return DataOracle(model, PoissonSampler(data, rates, rng), ledger, rng, mechanism, clip)


def _released(oracle: DataOracle, params: torch.Tensor, round_index: int) -> torch.Tensor:
    oracle.begin(round_index)
    return oracle.gradient(params)


def test_added_noise_has_the_calibrated_standard_deviation() -> None:
    sigma, clip = 1.7, 0.5
    oracle = _oracle(sigma, clip)
    params = oracle.model.initial_parameters().repeat(4, 1)
    released = _released(oracle, params, 3)
    batch = oracle.sampler.sample(3)
    summed, _ = clipped_sum(oracle.model.per_sample_gradients(params, batch.x, batch.y), batch.mask, clip)
    noise = (released * oracle.expected_batch[:, None] - summed).flatten().double()
    expected_std = sigma * clip
    # Chi-square interval for the variance of n i.i.d. normal draws (fixed seed, alpha = 1e-4).
    n = noise.numel()
    var = float(noise.pow(2).mean())
    low, high = stats.chi2.ppf([5e-5, 1 - 5e-5], n) / n
    assert low * expected_std**2 < var < high * expected_std**2
    assert abs(float(noise.mean())) < 5 * expected_std / math.sqrt(n)
    # Noise differs across rounds, and a new oracle (a resumed run) draws the same for the same round.
    again = _released(_oracle(sigma, clip), params, 3)
    torch.testing.assert_close(again, released, rtol=0, atol=0)
    assert not torch.equal(_released(oracle, params, 4), released)
    with pytest.raises(NoiseReuseError, match="cannot be opened"):
        oracle.begin(3)  # one oracle never opens a round twice: it would replay its noise


def test_calibrated_sigma_agrees_with_opacus_within_one_percent() -> None:
    for epsilon, q, steps in [(1.0, 1 / 24, 2000), (10.0, 256 / 60000, 2000), (0.5, 0.01, 500)]:
        sigma = calibrate_noise_multiplier(epsilon, 1e-5, q, steps, accountant="rdp")
        opacus_sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=q, steps=steps,
                                            accountant="rdp", epsilon_tolerance=0.001)
        assert sigma == pytest.approx(opacus_sigma, rel=0.01)
        accountant = RDPAccountant()
        accountant.history = [(sigma, q, steps)]
        assert accountant.get_epsilon(1e-5) == pytest.approx(epsilon, rel=0.01)


def test_calibration_accounts_for_every_release_per_step() -> None:
    one = calibrate_noise_multiplier(1.0, 1e-5, 0.05, 200, releases_per_step=1, accountant="rdp")
    two = calibrate_noise_multiplier(1.0, 1e-5, 0.05, 200, releases_per_step=2, accountant="rdp")
    assert two > one
    assert two == pytest.approx(calibrate_noise_multiplier(1.0, 1e-5, 0.05, 400, accountant="rdp"), rel=1e-6)
    assert epsilon_spent(two, 1e-5, 0.05, 200, 2, accountant="rdp") <= 1.0


def test_pld_reports_a_tighter_epsilon_than_rdp() -> None:
    sigma = calibrate_noise_multiplier(1.0, 1e-5, 1 / 24, 2000, accountant="rdp")
    pld = epsilon_spent(sigma, 1e-5, 1 / 24, 2000, accountant="pld")
    assert 0.8 < pld < epsilon_spent(sigma, 1e-5, 1 / 24, 2000, accountant="rdp") <= 1.0


def test_unreachable_epsilon_raises_privacy_error() -> None:
    with pytest.raises(PrivacyError, match="raise epsilon or delta"):
        calibrate_noise_multiplier(1e-9, 1e-12, 1.0, 10**6)


@pytest.mark.parametrize("kwargs,field", [
    ({"target_epsilon": -1.0}, "privacy.epsilon"),
    ({"delta": 0.0}, "privacy.delta"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"steps": 0}, "steps"),
])
def test_calibration_rejects_invalid_requests(kwargs: dict[str, float], field: str) -> None:
    request = {"target_epsilon": 1.0, "delta": 1e-5, "sample_rate": 0.1, "steps": 10, **kwargs}
    with pytest.raises(ConfigError) as error:
        calibrate_noise_multiplier(**request)
    assert error.value.field == field


def test_ledger_enforces_the_budget_exactly_at_the_planned_releases() -> None:
    sigma = calibrate_noise_multiplier(1.0, 1e-5, 0.1, 50)
    ledger = PrivacyLedger(3, [1.0, 1.0, 0.5], 1e-5)
    events = np.full(3, ledger.intern(gaussian_event(sigma, 0.1)))
    for k in range(50):
        allowed = ledger.charge(k, events)
        assert allowed[:2].all()
    assert not ledger.charge(50, events)[:2].any()
    assert ledger.releases()[0] == 50
    assert ledger.refused[0] == 1
    # The agent with half the budget was stopped early, and never went past it.
    assert ledger.releases()[2] < 50
    assert ledger.epsilon()[2] <= 0.5
    assert (ledger.epsilon()[:2] <= 1.0).all()


def test_refused_agents_release_nothing() -> None:
    oracle = _oracle(sigma=0.8, clip=1.0)
    oracle.ledger = PrivacyLedger(4, [math.inf, 1e-3, math.inf, math.inf], 1e-5)
    params = oracle.model.initial_parameters().repeat(4, 1)
    grads = _released(oracle, params, 0)
    assert torch.count_nonzero(grads[1]) == 0
    assert torch.count_nonzero(grads[0]) > 0
    assert oracle.ledger.releases().tolist() == [1, 0, 1, 1]


def test_ledger_round_trips_through_its_state_dict() -> None:
    ledger = PrivacyLedger(2, 2.0, 1e-5)
    events = np.array([ledger.intern(gaussian_event(1.1, 0.1)), ledger.intern(gaussian_event(1.3, 0.2))])
    for k in range(5):
        ledger.charge(k, events, count=2)
    copy = PrivacyLedger.from_state_dict(ledger.state_dict())
    assert copy.state_dict() == ledger.state_dict()
    np.testing.assert_allclose(copy.epsilon(), ledger.epsilon())


def test_dinno_with_two_primal_steps_records_two_releases_per_round() -> None:
    raw = tiny_config(algorithm={"name": "dp-dinno", "optimizer": "adam", "lr": 0.01, "primal_steps": 2},
                      experiment={"rounds": 3, "eval_every": 3})
    experiment = build_experiment(validate_config(raw))
    one_step = build_experiment(validate_config(tiny_config(
        algorithm={"name": "dp-dinno", "optimizer": "adam", "lr": 0.01, "primal_steps": 1},
        experiment={"rounds": 3, "eval_every": 3})))
    assert experiment.algorithm.releases_per_round == 2
    assert (experiment.noise_multipliers > one_step.noise_multipliers).all()
    state = experiment.initial_state()
    experiment.simulator.run(state, 0, 3, lambda done, s: True)
    assert experiment.ledger.releases().tolist() == [6, 6, 6, 6]
    assert [count for _, count in experiment.ledger.history(0)] == [6]
    assert (experiment.ledger.epsilon() <= 5.0).all()


def test_non_private_runs_report_infinite_epsilon() -> None:
    experiment = build_experiment(validate_config(tiny_config(privacy={"epsilon": "inf"})))
    experiment.simulator.run(experiment.initial_state(), 0, 2, lambda done, s: True)
    assert np.isinf(experiment.ledger.epsilon()).all()
    assert experiment.ledger.releases().tolist() == [2, 2, 2, 2]


def test_padding_and_non_finite_gradients_contribute_nothing() -> None:
    per_sample = torch.ones(2, 3, 4)
    per_sample[0, 2] = float("nan")   # a padded slot holding garbage
    per_sample[1, 1] = float("inf")   # a real sample whose gradient overflowed
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    summed, _ = clipped_sum(per_sample, mask, clip=1.0)
    assert torch.isfinite(summed).all()
    # each kept gradient has norm 2: clipped to C (1 - 1e-5) by the factor C (1 - 1e-5) / (2 + 1e-6)
    expected = torch.tensor([[1.0] * 4, [1.0] * 4]) * 2 * (1 - 1e-5) / (2 + 1e-6)
    torch.testing.assert_close(summed, expected, rtol=1e-6, atol=0)


def test_noise_multipliers_are_never_below_plan_in_float32() -> None:
    planned = torch.tensor([7.613769531251, 1.1, 0.51234567891, 3.0, 1.1 * 10.0], dtype=torch.float64)
    rounded = round_up_to_float32(planned)
    assert rounded.dtype == torch.float32
    assert (rounded.double() >= planned).all()
    # The smallest such float32: one step down is below the plan wherever rounding was needed.
    below = torch.nextafter(rounded, torch.tensor(0.0)).double()
    assert ((below < planned) | (rounded.double() == planned)).all()


def test_noise_standard_deviation_is_never_below_sigma_times_clip() -> None:
    experiment = build_experiment(validate_config(tiny_config(privacy={"clip": 0.3})))
    planned = experiment.noise_multipliers.double() * 0.3
    assert (experiment.oracle.mechanism.scales.double() >= planned).all()


def test_pld_falls_back_to_rdp_where_it_is_impractical() -> None:
    ledger = PrivacyLedger(1, 1e9, 1e-5)
    ledger.charge(0, np.array([ledger.intern(gaussian_event(0.05, 0.5))]), count=3)
    with pytest.raises(PrivacyError, match="impractical"):
        ledger.epsilon("pld")
    epsilons, accountant = ledger.reported_epsilon()  # tight: the smaller sound bound, here RDP alone
    assert accountant == "tight" and epsilons[0] == ledger.epsilon("rdp")[0]


def test_a_history_too_long_for_a_pld_is_priced_by_rdp_at_once() -> None:
    """A reviewer's 10**12-round run hung in calibration (a PLD self-composed 10**12 times) and 10**30 steps
    overflowed numpy; past PLD_MAX_RELEASES the PLD declines and ``tight`` is RDP's value, in milliseconds."""
    from decentdp.privacy.accounting import PLD_MAX_RELEASES, epsilon_of_history

    event = gaussian_event(1.0, 0.01)
    for count in (PLD_MAX_RELEASES + 1, 10**12, 10**30):
        with pytest.raises(PrivacyError, match="impractical"):
            epsilon_of_history(((event, count),), 1e-5, "pld")
        assert epsilon_of_history(((event, count),), 1e-5) == epsilon_of_history(((event, count),), 1e-5, "rdp")





def test_the_sums_reuse_the_block_of_the_parameters_the_last_round_replaced() -> None:
    """A round holds the two (N, d) blocks the memory plan counts: its sums land in the block of the parameters
    the step theta <- f(theta, g) dropped, with the same release as in a fresh block."""
    reference, oracle = _oracle(sigma=0.5, clip=1.0), _oracle(sigma=0.5, clip=1.0)
    params = oracle.model.initial_parameters().repeat(4, 1)
    first = _released(oracle, params, 0)
    assert torch.equal(first, _released(reference, params.clone(), 0))
    old = params.data_ptr()
    params = params - 0.1 * first
    second = _released(oracle, params, 1)
    assert second.data_ptr() == old
    assert torch.equal(second, _released(reference, params.clone(), 1))


@pytest.mark.parametrize("hold", ["another name", "a view", "a detached alias"])
def test_a_parameters_block_still_held_is_never_reused(hold: str) -> None:
    oracle = _oracle(sigma=0.5, clip=1.0)
    params = oracle.model.initial_parameters().repeat(4, 1)
    gradient = _released(oracle, params, 0)
    held = {"another name": lambda t: t, "a view": lambda t: t[:2], "a detached alias": lambda t: t.detach()}[hold](
        params)
    before = held.clone()
    params = params - 0.1 * gradient
    released = _released(oracle, params, 1)
    assert released.data_ptr() != held.data_ptr() and torch.equal(held, before)


def test_a_pld_whose_loss_overflows_reads_infinite_quietly_and_tight_is_rdp(recwarn: pytest.WarningsRecorder) -> None:
    """Past about 709 nats dp_accounting's PLD epsilon overflows (a personalized run at budget 1000 met it: 72
    replace-one Laplace releases) and answers inf, an upper bound; ``tight`` reports RDP's finite value, which
    lies below basic composition's 72 * 2 / b, and no overflow warning reaches the user."""
    from dp_accounting import LaplaceDpEvent

    from decentdp.privacy.accounting import epsilon_of_history

    history, delta, scale = ((LaplaceDpEvent(0.188467), 72),), math.exp(-5), 0.188467
    assert epsilon_of_history(history, delta, "pld", "replace-one") == math.inf
    tight = epsilon_of_history(history, delta, "tight", "replace-one")
    assert tight == epsilon_of_history(history, delta, "rdp", "replace-one") < 72 * 2 / scale
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _exact_sampled_laplace_epsilon(rate: float, multiplier: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of one Poisson-sampled Laplace release (add/remove, both directions):
    sensitivity 1, scale b = multiplier; with the record the output is the mixture (1 - q) Lap(0, b) + q Lap(1, b),
    without it Lap(0, b).  Outside [0, 1] the two densities are in a fixed ratio (closed form: the tails hold
    1/2 and e^(-1/b)/2 of Lap(0, b)); inside, quadrature."""
    from scipy import integrate, optimize

    b = multiplier
    without = stats.laplace(0.0, b).pdf
    with_record = lambda x: (1 - rate) * without(x) + rate * stats.laplace(1.0, b).pdf(x)  # noqa: E731
    tails = (((1 - rate) + rate * math.exp(-1 / b), 0.5), ((1 - rate) + rate * math.exp(1 / b), math.exp(-1 / b) / 2))

    def hockey(forward: bool, epsilon: float) -> float:
        first, second = (with_record, without) if forward else (without, with_record)
        middle = integrate.quad(lambda x: max(0.0, first(x) - math.exp(epsilon) * second(x)), 0.0, 1.0,
                                limit=200, epsabs=1e-13)[0]
        return middle + sum(max(0.0, (ratio if forward else 1.0) - math.exp(epsilon) * (1.0 if forward else ratio))
                            * mass for ratio, mass in tails)

    def excess(epsilon: float) -> float:
        return max(hockey(True, epsilon), hockey(False, epsilon)) - delta

    return 0.0 if excess(0.0) <= 0 else optimize.brentq(excess, 0.0, 1 / b + 1e-9, xtol=1e-12)


def test_a_sampled_laplace_ledger_charges_changing_events_and_bounds_the_exact_loss() -> None:
    """A review: a Poisson-sampled Laplace event (LaplaceMechanism at a rate below 1) crashed the ledger's RDP
    totals the first time an agent's event changed (dp_accounting has no RDP of sampled Laplace).  RDP now bounds
    it by the unsampled Laplace (sound: sampling only helps) and PLD prices the sampling; every accountant's
    epsilon for one release is at least the exact one, computed by quadrature."""
    from decentdp.privacy.accounting import rdp_curve
    from decentdp.privacy.events import laplace_event

    first, second = laplace_event(2.0, 0.1), laplace_event(3.0, 0.2)
    assert np.array_equal(rdp_curve(first), rdp_curve(laplace_event(2.0)))
    for accountant in ("rdp", "pld", "tight"):
        ledger = PrivacyLedger(2, math.inf, 1e-5, budget_accountant=accountant)
        ids = np.array([ledger.intern(first), ledger.intern(second)])
        for round_index in range(6):  # every round changes each agent's event
            ledger.charge(round_index, ids[[round_index % 2, (round_index + 1) % 2]])
        assert np.isfinite(ledger.epsilon(accountant)).all() and (ledger.releases() == 6).all()
    for rate, multiplier in ((0.1, 2.0), (0.5, 0.7)):
        exact = _exact_sampled_laplace_epsilon(rate, multiplier, 1e-5)
        for accountant in ("rdp", "pld", "tight"):
            ledger = PrivacyLedger(1, math.inf, 1e-5, budget_accountant=accountant)
            ledger.charge(0, np.array([ledger.intern(laplace_event(multiplier, rate))]))
            assert ledger.epsilon(accountant)[0] >= exact - 1e-9, (rate, multiplier, accountant)
        assert exact < 1 / multiplier   # the quadrature sees the sampling's credit: PLD may take it, RDP does not


def test_tight_prices_pure_releases_by_basic_composition_where_it_is_smaller() -> None:
    """One Laplace release of multiplier b is exactly 1/b-DP at every delta (2/b under replace-one), but PLD priced
    it 1.00016 / b (its discretisation rounds up) and RDP higher still, so a budget of exactly 1 refused the one
    release that spends 1.  ``tight`` now also takes basic composition where every release is pure DP; a sampled
    release's pure epsilon, log(1 + q (e^eps - 1)), is the largest log-likelihood ratio of its outputs (by brute
    force on a grid), the exact loss at delta = 0; a history with a Gaussian release gets no pure figure."""
    from dp_accounting import GaussianDpEvent, LaplaceDpEvent, PoissonSampledDpEvent

    from decentdp.privacy.accounting import epsilon_of_history, pure_epsilon
    from decentdp.privacy.events import laplace_event

    for relation, factor in (("add-remove", 1.0), ("replace-one", 2.0)):
        one = ((LaplaceDpEvent(0.8), 1),)
        assert epsilon_of_history(one, 1e-5, "tight", relation) == factor / 0.8
        assert epsilon_of_history(one, 1e-5, "pld", relation) > factor / 0.8
        three = ((LaplaceDpEvent(2.0), 2), (LaplaceDpEvent(4.0), 1))
        assert pure_epsilon(three, relation) == pytest.approx(factor * 1.25, rel=1e-15)
    many = ((LaplaceDpEvent(10.0), 400),)  # PLD's composition beats the sum (40) by far
    assert epsilon_of_history(many, 1e-5) == epsilon_of_history(many, 1e-5, "pld") < 10
    for rate, multiplier in ((0.1, 2.0), (0.5, 0.7)):
        pure = pure_epsilon(((PoissonSampledDpEvent(rate, LaplaceDpEvent(multiplier)), 1),))
        assert pure == pytest.approx(math.log1p(rate * math.expm1(1 / multiplier)), rel=1e-15)
        # brute force: the largest log-likelihood ratio either way between the outputs with and without the record
        x = np.linspace(-20.0, 21.0, 400_001)
        without = stats.laplace(0.0, multiplier).pdf(x)
        with_record = (1 - rate) * without + rate * stats.laplace(1.0, multiplier).pdf(x)
        assert pure == pytest.approx(np.abs(np.log(with_record / without)).max(), rel=1e-12)
    assert pure_epsilon(((LaplaceDpEvent(1.0), 1), (GaussianDpEvent(1.0), 1))) is None
    ledger = PrivacyLedger(1, 1.0, 1e-5, budget_accountant="tight")
    event = ledger.intern(laplace_event(1.0))
    assert ledger.charge(0, np.array([event]))[0] and not ledger.charge(1, np.array([event]))[0]
    assert ledger.epsilon("tight")[0] == 1.0


def test_poisson_inclusion_never_exceeds_the_priced_rate_on_the_uniforms_grid() -> None:
    """A uniform u on the 2^-53 grid is below a float64 rate q with probability ceil(q 2^53) 2^-53, up to 2^-53
    above q.  The sampler compares with the rate rounded down onto the grid: exactly that probability, at most q.
    Checked by counting grid points, exactly, for rates that are not on the grid and at the grid's edges."""
    from fractions import Fraction

    from decentdp.rng import below_on_grid

    for rate in (0.1, 1 / 3, 64 / 60000, 2.0**-53 * 0.5, 1.0 - 2.0**-54, 0.25, 1.0):
        threshold = float(below_on_grid(rate))
        grid_points_below = math.ceil(Fraction(threshold) * 2**53)   # k 2^-53 < threshold
        assert Fraction(grid_points_below, 2**53) <= Fraction(rate)
        assert Fraction(rate) - Fraction(grid_points_below, 2**53) < Fraction(1, 2**53)
    assert math.ceil(Fraction(0.1) * 2**53) > Fraction(0.1) * 2**53   # the plain comparison runs above 0.1
    data = AgentData(torch.zeros(6, 2), torch.zeros(6, dtype=torch.long), [torch.arange(0, 3), torch.arange(3, 6)])
    sampler = PoissonSampler(data, torch.tensor([0.1, 1 / 3], dtype=torch.float64), AgentRandom(0))
    assert sampler._slot_rates.tolist() == [float(below_on_grid(0.1))] * 3 + [float(below_on_grid(1 / 3))] * 3
