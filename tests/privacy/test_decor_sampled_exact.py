"""DECOR under Poisson sampling: every epsilon a run reports is at least its observer's exact privacy loss.

``test_privacy_harness.py`` checks DECOR with full batches only (q = 1).  Here a run samples: four agents on a
graph that is not complete (a triangle 0-1-3 and a leaf 2 on agent 1), partitioned unequally so that the
batch size B gives each agent its own Poisson rate ``q_u = B / |D_u|`` (all below 1, all different), with
a budget per agent (``privacy.agent_epsilons``) and a colluding set.  It runs its own round code for
``ROUNDS`` rounds, traced as in the harness (each clipped sum and each noise draw a coordinate), and reports
its epsilons through the functions ``run_experiment`` writes ``summary.json`` and ``privacy.json`` with.

**What is proven.**  Each epsilon the run reports (the ledger's per agent, by the run's accountant and by RDP;
the pairwise matrix; each colluding set's; each sender's local epsilon; the eavesdropper's; the paper's
SecLDP bound; the summary's maxima) is at least the exact epsilon, at the run's delta, of what the observer
it names learns of each sender: one agent or the colluding set (the ledger names the worst of them), nobody
(the eavesdropper), or all the other agents (the local epsilon), each seeing every message of every round,
holding its own noise and the keys of the edges that touch it, and knowing every other agent's data.

**Why the comparison is exact.** In one round that observer sees every agent's message::

    m_i = (x_i + sigma_i C xi_i) / L_i + sum_j s_ij v_ij

linear in the sender's clipped sum ``x_u`` and in Gaussian noise it does not hold, the same on every
coordinate of the model, so the round is a Gaussian mechanism on ``x_u`` whose Gaussian-DP
parameter for a record (a gradient of norm at most C) is ``mu^2 = a^T (B B^T)^+ a`` (``a = e_u / L_u``, ``B`` the
unknown noise's columns), built here from the DECOR formulas with the run's published sigma_i, tau and L_i, with
numpy's pseudo-inverse: not with the library's ``effective_multipliers``. The traced run shows that this is what
the code sends: over all the rounds, the sender's data terms in the observer's view have information ``mu^2 I``, so
the rounds are independent releases of that one mechanism. A record is in a round's batch with probability ``q_u``
(the sampler's rate, checked to be ``B / |D_u|``, the library's expected batch over the agent's record count),
independently from round to round, while the message is divided by the public expected batch ``L_u``: its round is
exactly the Poisson-sampled Gaussian, ``(1 - q) N(0, 1) + q N(mu, 1)`` against ``N(0, 1)`` (removing the record)
and the reverse (adding it), and the worst adversary's gradients (a fixed direction of norm C) make the run the
product of its rounds' pairs: the exact (tight) epsilon under add/remove, the run's relation. Its hockey-stick
divergence is computed directly, with no privacy accountant: the last round's in closed form (Gaussian tails), the
first's by adaptive quadrature, epsilon by root finding, the larger of the two directions (for one or two rounds,
hence ``ROUNDS = 2``). The computation is checked against dp_accounting's PLD, whose optimistic estimate bounds the
exact epsilon from below and whose pessimistic one from above.

The reported epsilons are pessimistic PLD (or RDP) values: in this run the tightest lie 5e-7 to 2e-6 above the
exact ones (asserted below 1e-4, so that an exact value computed too low could not make the check vacuous).
The comparison allows ``TOLERANCE`` (relative) for the computation's own error, nothing more.
The planted bugs at the end show that it fails when the ledger prices a sender at another agent's sampling
rate, or when the mechanism adds less noise than the run publishes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution
from scipy import integrate, optimize, special
from tests.privacy.test_privacy_harness import Sources, traced_run

from decentdp.experiment.loop import run_facts
from decentdp.experiment.record import run_privacy_statement, summary
from decentdp.privacy.correlated import CorrelatedGaussianMechanism
from decentdp.privacy.report import privacy_report

AGENTS = 4
ROUNDS = 2
BATCH = 16
BUDGETS = [1.0, 2.0, 3.0, 1.5]
COLLUDING = [[0, 3]]
CORRELATION = 2.0
#: With this seed and edge probability the random graph is the triangle 0-1-3 with the leaf 2 on agent 1, and
#: the unequal partition gives the agents 325, 251, 543 and 318 records.
SEED = 0
EDGE_PROBABILITY = 0.5
#: Relative error allowed to the exact epsilon: its computation agrees with dp_accounting's pessimistic PLD at
#: 1e-4 to 1e-8 from below and 2e-11 from above (quadrature at 1e-12), while the run's values exceed it by 5e-7 or
#: more.
TOLERANCE = 1e-9
#: Half-width, in standard deviations, of the quadrature's range around the Gaussians' means.
SPAN = 14.0

#: The fields of privacy.json and summary.json named for epsilons that are not an epsilon of some observer.
NOT_AN_EPSILON = {"epsilon_accountant", "epsilon_observer", "epsilon_pairwise_network_method", "epsilon_target",
                  "paper_accounting"}
#: Where the ledger's epsilon is reported (by the run's accountant and by RDP).
LEDGER_FIELDS = {"privacy.json epsilon", "privacy.json epsilon_rdp", "summary.json epsilon_per_agent",
                 "summary.json epsilon_max"}

Observer = tuple[int, ...]
RoundMultipliers = Callable[[Observer, int], tuple[float, ...]]


# -- the exact epsilon of Poisson-sampled Gaussian rounds, computed directly --------------------------------------

def _gaussian_density(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _log_mixture_ratio(x: float, mu: float, q: float) -> float:
    """``log [((1 - q) N(0, 1) + q N(mu, 1)) / N(0, 1)](x)``: one round's privacy loss when the record is removed."""
    return float(np.logaddexp(math.log1p(-q), math.log(q) + mu * x - mu * mu / 2))


def _point_of_loss(loss: float, mu: float, q: float) -> float:
    """The ``x`` at which :func:`_log_mixture_ratio` equals ``loss`` (which must exceed ``log(1 - q)``)."""
    excess = loss - math.log1p(-q)
    log_expm1 = excess + math.log1p(-math.exp(-excess))          # log(e^excess - 1), stable
    return (log_expm1 + math.log1p(-q) - math.log(q) + mu * mu / 2) / mu


def _last_round_removed(c: float, mu: float, q: float) -> float:
    """``E_P[(1 - e^(c - loss))_+]`` with ``P = (1 - q) N(0, 1) + q N(mu, 1)``, ``Q = N(0, 1)``: the loss exceeds
    ``c`` on ``x > x*`` (everywhere when ``c <= log(1 - q)``), so it is ``P(x > x*) - e^c Q(x > x*)``."""
    if c <= math.log1p(-q):
        return -math.expm1(c)
    x = _point_of_loss(c, mu, q)
    return float((1 - q) * special.ndtr(-x) + q * special.ndtr(mu - x) - math.exp(c + special.log_ndtr(-x)))


def _last_round_added(c: float, mu: float, q: float) -> float:
    """The same with ``P = N(0, 1)``, ``Q`` the mixture: the loss ``-log(Q/P)`` exceeds ``c`` on ``x < x*``
    (nowhere when ``c >= -log(1 - q)``)."""
    if c >= -math.log1p(-q):
        return 0.0
    x = _point_of_loss(-c, mu, q)
    return float(special.ndtr(x) - math.exp(c) * ((1 - q) * special.ndtr(x) + q * special.ndtr(x - mu)))


def sampled_gaussian_delta(epsilon: float, mus: tuple[float, ...], q: float, removed: bool) -> float:
    """The hockey-stick divergence ``E_P[(1 - e^(epsilon - L))_+]`` of one or two Poisson-sampled Gaussian rounds
    (Gaussian-DP parameters ``mus``, sampling rate ``q``), ``P`` the view with the record when ``removed`` (the
    neighbour is the dataset without it), without it otherwise; ``L`` is the rounds' summed privacy loss.  The
    last round is integrated in closed form, the first by adaptive quadrature split where the last round's
    formula changes branch."""
    last = _last_round_removed if removed else _last_round_added
    if len(mus) == 1:
        return last(epsilon, mus[0], q)
    if len(mus) != 2:
        raise ValueError("the direct computation covers one or two rounds")
    first, final = mus
    low, high = -SPAN, first + SPAN
    if removed:
        def integrand(x: float) -> float:
            density = (1 - q) * _gaussian_density(x) + q * _gaussian_density(x - first)
            return density * last(epsilon - _log_mixture_ratio(x, first, q), final, q)
        branch = _point_of_loss(epsilon - math.log1p(-q), first, q)
    else:
        if epsilon >= -2 * math.log1p(-q):      # the summed loss never exceeds -2 log(1 - q)
            return 0.0

        def integrand(x: float) -> float:
            return _gaussian_density(x) * last(epsilon + _log_mixture_ratio(x, first, q), final, q)
        branch = _point_of_loss(-math.log1p(-q) - epsilon, first, q)
        high = min(high, branch)                 # beyond it the last round adds nothing
        if high <= low:
            return 0.0
    points = sorted(p for p in {branch, 0.0, first} if low < p < high)
    value, _ = integrate.quad(integrand, low, high, points=points, epsabs=0.0, epsrel=1e-12, limit=400)
    return value


@cache
def exact_sampled_epsilon(mus: tuple[float, ...], q: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of Poisson-sampled Gaussian rounds under add/remove (both directions)."""
    if any(math.isinf(mu) for mu in mus):
        return math.inf
    epsilon = 0.0
    for removed in (True, False):
        def excess(value: float, removed: bool = removed) -> float:
            return math.log(max(sampled_gaussian_delta(value, mus, q, removed), 1e-300) / delta)

        if excess(0.0) <= 0:
            continue
        high = 1.0
        while excess(high) > 0:
            high *= 2
        epsilon = max(epsilon, optimize.brentq(excess, high / 2 if high > 1 else 0.0, high, xtol=1e-14, rtol=1e-15))
    return epsilon


@pytest.mark.parametrize(("mu", "q", "rounds"), [(1.16, 0.03, 2), (0.3, 0.9, 2), (2.5, 0.2, 1)])
def test_the_direct_computation_lies_between_dp_accountings_optimistic_and_pessimistic_plds(
        mu: float, q: float, rounds: int) -> None:
    """The exact epsilon computed here is bracketed by dp_accounting's PLD of the same Poisson-sampled Gaussian,
    composed ``rounds`` times: its optimistic estimate (a lower bound) and its pessimistic one (an upper bound);
    at a coarse discretisation, so the bracket is wide below (1e-3) and tight above (1e-6).  At epsilon 0 both
    directions give the total variation distance, which is symmetric: the two branches agree there."""
    bounds = [privacy_loss_distribution.from_gaussian_mechanism(
        1 / mu, sampling_prob=q, pessimistic_estimate=pessimistic, use_connect_dots=pessimistic,
        value_discretization_interval=1e-3).self_compose(rounds).get_epsilon_for_delta(1e-5)
        for pessimistic in (False, True)]
    exact = exact_sampled_epsilon((mu,) * rounds, q, 1e-5)
    assert bounds[0] <= exact <= bounds[1] * (1 + 1e-10), (bounds, exact)
    total_variation = [sampled_gaussian_delta(0.0, (mu,) * rounds, q, removed) for removed in (True, False)]
    assert total_variation[0] == pytest.approx(total_variation[1], rel=1e-9)


# -- the traced run and what it reports ---------------------------------------------------------------------------

@dataclass
class SampledDecorRun:
    """A traced sampled DECOR run: the experiment, its traced messages, and its summary.json and privacy.json."""

    experiment: Any
    sources: Sources
    log: list[tuple[np.ndarray, torch.Tensor]]
    summary: dict[str, Any]
    privacy: dict[str, Any]

    @property
    def delta(self) -> float:
        return float(self.experiment.config.privacy.delta)

    @property
    def record_counts(self) -> np.ndarray:
        return np.array([len(records) for records in self.experiment.data.indices])

    @property
    def sampling_rates(self) -> np.ndarray:
        """Each agent's Poisson rate from the config's batch size and its record count: ``q_u = B / |D_u|``."""
        return np.minimum(1.0, self.experiment.config.algorithm.batch_size / self.record_counts)


def sampled_decor_run() -> SampledDecorRun:
    """Run DECOR (the module docstring's setting) traced, and build what the run reports as ``run_experiment``
    writes it."""
    experiment, sources, log = traced_run(
        "decor", AGENTS, EDGE_PROBABILITY, SEED, ROUNDS, settings={"batch_size": BATCH, "correlation": CORRELATION},
        data={"partition": "unequal", "size_skew": 1.0}, agent_epsilons=BUDGETS, colluding=COLLUDING)
    extras = experiment.algorithm.privacy_results(experiment.final_state, run_facts(experiment, ROUNDS))
    config = experiment.config
    privacy = privacy_report(experiment.ledger, config.privacy.delta, run_privacy_statement(config),
                             experiment.setup.get("paper_accounting"), extras, experiment.setup["epsilon_observer"])
    return SampledDecorRun(experiment, sources, log, summary(experiment, [], 0.0, True) | extras.summary(), privacy)


@pytest.fixture(scope="module")
def honest_run() -> SampledDecorRun:
    return sampled_decor_run()


@dataclass(frozen=True)
class RoundSystem:
    """One round of DECOR's messages in units of C: ``m_i = (x_i + own_i xi_i) / batches_i + sum_e +-edge_scale v_e``
    (``+`` at the smaller end of edge ``e``), ``xi`` and ``v`` standard normal."""

    own: np.ndarray
    batches: np.ndarray
    edge_scale: float
    edges: np.ndarray

    def multiplier(self, observer: Observer, sender: int) -> float:
        """The round's Gaussian-DP parameter of ``sender`` towards an ``observer`` who sees every message, holds
        its members' own noise and the edges touching it: ``a^T (B B^T)^+ a`` (inf if ``a`` leaves the range)."""
        n, count = len(self.own), len(self.edges)
        noise = np.zeros((n, n + count))
        noise[np.arange(n), np.arange(n)] = self.own / self.batches
        noise[self.edges[:, 0], n + np.arange(count)] = self.edge_scale
        noise[self.edges[:, 1], n + np.arange(count)] = -self.edge_scale
        held = np.zeros(n + count, dtype=bool)
        held[list(observer)] = True
        held[n:] = np.isin(self.edges, observer).any(axis=1)
        unknown = noise[:, ~held]
        data = np.zeros(n)
        data[sender] = 1.0 / self.batches[sender]
        covariance = unknown @ unknown.T
        inverse = np.linalg.pinv(covariance, rcond=1e-12, hermitian=True)
        if not np.allclose(covariance @ inverse @ data, data, rtol=0.0, atol=1e-9 * np.abs(data).max()):
            return math.inf
        return math.sqrt(float(data @ inverse @ data))


def published_round_system(run: SampledDecorRun) -> RoundSystem:
    """The one-round system from what the run publishes: setup.json's noise multipliers and DECOR's calibration
    details (``sigma_cor = tau mean(L)``), the expected batches ``L_u = q_u |D_u|`` (float32, as divided by),
    and the graph's edges."""
    setup = run.experiment.setup
    batches = (run.sampling_rates * run.record_counts).astype(np.float32).astype(np.float64)
    adjacency = np.asarray(run.experiment.topology.adjacency())
    edges = np.argwhere(np.triu(adjacency, k=1) > 0)
    edge_scale = setup["calibration_details"]["sigma_cor"] / float(batches.mean())
    return RoundSystem(np.array(setup["noise_multipliers"], dtype=np.float64), batches, edge_scale, edges)


def traced_round_multipliers(run: SampledDecorRun, observer: Observer, sender: int) -> tuple[float, ...]:
    """Each round's Gaussian-DP parameter of ``sender`` in the traced run's every-message view of ``observer``:
    the square roots of the diagonal of ``A^T (B B^T)^+ A`` over the sender's data terms, one per round, whose
    off-diagonal entries vanish (the rounds are independent releases; asserted)."""
    sources = run.sources
    rows = [x.numpy() for _, x in run.log if x.shape[-1] == sources.capacity]
    seen = np.concatenate(rows)
    padding = sources.capacity - len(sources.kind)
    kind = np.array(sources.kind + [""] * padding)
    agent, partner = np.array(sources.agent + [-1] * padding), np.array(sources.partner + [-1] * padding)
    unknown = (kind == "noise") & ~np.isin(agent, observer) & ~np.isin(partner, observer)
    data = seen[:, (kind == "data") & (agent == sender)]
    assert data.shape[1] == ROUNDS
    covariance = seen[:, unknown] @ seen[:, unknown].T
    inverse = np.linalg.pinv(covariance, rcond=1e-12, hermitian=True)
    if not np.allclose(covariance @ inverse @ data, data, rtol=0.0, atol=1e-9 * np.abs(data).max()):
        return (math.inf,) * ROUNDS
    information = data.T @ inverse @ data
    scale = float(np.abs(information).max())
    assert np.abs(information - np.diag(np.diag(information))).max() <= 1e-9 * scale, information
    return tuple(math.sqrt(value) for value in np.diag(information))


def _decoded(value: float | None) -> float:
    """An epsilon as results files store it: ``null`` is infinite."""
    return math.inf if value is None else float(value)


@dataclass(frozen=True)
class Claim:
    """One reported epsilon: where it is reported, for which sender and towards which observer."""

    field: str
    sender: int
    observer: Observer
    reported: float

    @property
    def name(self) -> str:
        """The field's name without the file it is in."""
        return self.field.removeprefix("privacy.json ").removeprefix("summary.json ")


def reported_claims(run: SampledDecorRun) -> list[Claim]:
    """Every epsilon the run reports for a sender and an observer: privacy.json's (the ledger's epsilon by the
    run's accountant and by RDP, for the worst single agent or colluding set; the pairwise matrix; each
    colluding set's; the local epsilon, all the others together; the eavesdropper's and the paper's SecLDP bound,
    nobody's) and summary.json's (the ledger's per agent, and the maxima)."""
    privacy, summary_json = run.privacy, run.summary
    sets = [tuple(members) for members in run.experiment.config.privacy.colluding]
    named = [(v,) for v in range(AGENTS)] + sets       # the ledger's observers: each single agent and each set
    eavesdropper: Observer = ()
    paper = _decoded(privacy["paper_accounting"]["paper_epsilon_secldp"])
    claims: list[Claim] = []
    for u in range(AGENTS):
        others = tuple(v for v in range(AGENTS) if v != u)
        for observer in (o for o in named if u not in o):
            claims += [Claim("privacy.json epsilon", u, observer, _decoded(privacy["epsilon"][u])),
                       Claim("privacy.json epsilon_rdp", u, observer, _decoded(privacy["epsilon_rdp"][u])),
                       Claim("summary.json epsilon_per_agent", u, observer,
                             _decoded(summary_json["epsilon_per_agent"][u])),
                       Claim("summary.json epsilon_max", u, observer, _decoded(summary_json["epsilon_max"]))]
        for v in others:
            claims += [Claim("privacy.json epsilon_pairwise_network", u, (v,),
                             _decoded(privacy["epsilon_pairwise_network"][u][v])),
                       Claim("epsilon_pairwise_max", u, (v,), _decoded(summary_json["epsilon_pairwise_max"]))]
        for entry in privacy["epsilon_colluding"]:
            members = tuple(entry["agents"])
            if u in members:
                assert entry["epsilon"][u] is None, (members, u)
                continue
            claims += [Claim("privacy.json epsilon_colluding", u, members, _decoded(entry["epsilon"][u])),
                       Claim("epsilon_colluding_max", u, members, _decoded(summary_json["epsilon_colluding_max"]))]
        claims += [Claim("privacy.json epsilon_local", u, others, _decoded(privacy["epsilon_local"][u])),
                   Claim("epsilon_local_max", u, others, _decoded(summary_json["epsilon_local_max"])),
                   Claim("epsilon_eavesdropper_max", u, eavesdropper,
                         _decoded(summary_json["epsilon_eavesdropper_max"])),
                   Claim("paper_epsilon_secldp", u, eavesdropper, paper)]
    for key in ("epsilon_pairwise_max", "epsilon_colluding_max", "epsilon_local_max", "epsilon_eavesdropper_max"):
        assert privacy[key] == summary_json[key], key   # the summary's maxima are privacy.json's
    return claims


def priced_claims(run: SampledDecorRun, multipliers: RoundMultipliers) -> list[tuple[Claim, float]]:
    """Each reported claim with the exact epsilon of its observer's view of its sender: the rounds' Gaussian-DP
    parameters from ``multipliers``, each round sampled at the sender's own rate."""
    rates = run.sampling_rates
    return [(claim, exact_sampled_epsilon(multipliers(claim.observer, claim.sender), float(rates[claim.sender]),
                                          run.delta)) for claim in reported_claims(run)]


def understated(priced: list[tuple[Claim, float]]) -> list[tuple[Claim, float]]:
    """The claims reported below the exact loss of their observer (beyond :data:`TOLERANCE`)."""
    return [(claim, exact) for claim, exact in priced if not claim.reported >= exact * (1 - TOLERANCE)]


def published_multipliers(run: SampledDecorRun) -> RoundMultipliers:
    """Every round's parameter from the published one-round system (the same each round: one graph, one sigma)."""
    system = published_round_system(run)
    return lambda observer, sender: (system.multiplier(observer, sender),) * ROUNDS


# -- the tests ----------------------------------------------------------------------------------------------------

def test_the_run_samples_each_agent_at_its_own_rate_below_one(honest_run: SampledDecorRun) -> None:
    """The setting has what the check needs: a non-complete graph with a leaf, different rates below 1 that the
    sampler draws with and the run publishes, different budgets, every round released by every agent."""
    run = honest_run
    rates = run.sampling_rates
    assert (rates < 1).all() and len(set(rates.tolist())) == AGENTS
    assert run.experiment.setup["sample_rates"] == rates.tolist()
    np.testing.assert_array_equal(run.experiment.oracle.sampler.sample_rates.numpy(), rates)
    degrees = np.asarray(run.experiment.topology.adjacency()).sum(axis=1)
    assert degrees.min() == 1 and degrees.sum() < AGENTS * (AGENTS - 1)
    assert run.experiment.config.privacy.agent_epsilons == BUDGETS
    assert run.privacy["releases"] == [ROUNDS] * AGENTS and run.privacy["refused_releases"] == [0] * AGENTS


def test_the_published_one_round_system_is_what_the_run_sends_every_round(honest_run: SampledDecorRun) -> None:
    """For every observer and sender, the traced run's view over all rounds is the published one-round system's
    Gaussian mechanism, once per round and independently (the information matrix is ``mu^2 I``); tau is the
    DECOR formula's ``rho mean(sigma / L)``."""
    run = honest_run
    system = published_round_system(run)
    assert system.edge_scale == pytest.approx(CORRELATION * float(np.mean(system.own / system.batches)), rel=1e-12)
    for observer, sender in {(claim.observer, claim.sender) for claim in reported_claims(run)}:
        traced = traced_round_multipliers(run, observer, sender)
        np.testing.assert_allclose(traced, system.multiplier(observer, sender), rtol=1e-6,
                                   err_msg=f"observer {observer}, sender {sender}")


def test_every_reported_epsilon_is_at_least_its_observers_exact_loss_under_poisson_sampling(
        honest_run: SampledDecorRun) -> None:
    """The module docstring's claim; the reported values exceed the exact ones by little (pessimistic PLD), so
    this also shows they are tight."""
    run = honest_run
    priced = priced_claims(run, published_multipliers(run))
    assert not understated(priced), understated(priced)
    reported = {key for key in (*run.privacy, *run.summary, *run.privacy["paper_accounting"])
                if "epsilon" in key and not key.endswith("_view")}
    assert reported - NOT_AN_EPSILON <= {claim.name for claim, _ in priced}, "a reported epsilon left unchecked"
    tightest = [claim.reported / exact for claim, exact in priced if claim.name == "epsilon_pairwise_network"]
    assert max(tightest) < 1 + 1e-4


@pytest.mark.parametrize("bug", ["ledger-prices-the-smallest-rate", "mechanism-adds-less-own-noise"])
def test_a_planted_bug_is_caught(bug: str, honest_run: SampledDecorRun, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has teeth.  A ledger that prices every agent's rounds at the run's smallest sampling rate
    (another agent's) reports the ledger epsilon of the agents that sample more below their exact loss; a
    mechanism that adds 0.7 of the own noise it publishes sends a view whose exact loss is above what is
    reported (seen in the traced view, the published system no longer matching it)."""
    smallest = float(honest_run.sampling_rates.min())
    if bug == "ledger-prices-the-smallest-rate":
        event = CorrelatedGaussianMechanism.agent_event

        def cheaper_event(self: CorrelatedGaussianMechanism, owner: int, sample_rate: float, rows: int) -> Any:
            return event(self, owner, smallest, rows)

        monkeypatch.setattr(CorrelatedGaussianMechanism, "agent_event", cheaper_event)
    else:
        build = CorrelatedGaussianMechanism.__init__

        def weaker(self: CorrelatedGaussianMechanism, *args: Any, **kwargs: Any) -> None:
            build(self, *args, **kwargs)
            self.scales = self.scales * 0.7

        monkeypatch.setattr(CorrelatedGaussianMechanism, "__init__", weaker)
    run = sampled_decor_run()
    if bug == "ledger-prices-the-smallest-rate":
        found = understated(priced_claims(run, published_multipliers(run)))
        assert {"privacy.json epsilon", "summary.json epsilon_per_agent"} <= {claim.field for claim, _ in found}
        assert {claim.field for claim, _ in found} <= LEDGER_FIELDS   # what privacy_results prices stays sound
        assert {claim.sender for claim, _ in found} == set(np.flatnonzero(run.sampling_rates > smallest).tolist())
    else:
        found = understated(priced_claims(run, lambda observer, sender: traced_round_multipliers(run, observer,
                                                                                                    sender)))
        assert understated(priced_claims(run, published_multipliers(run))) == []   # the published system hides it
        assert any(claim.field == "privacy.json epsilon_pairwise_network" for claim, _ in found)
