"""Under Poisson sampling, every algorithm's reported epsilons are at least its observers' exact privacy loss.

``test_privacy_harness.py`` checks every traced algorithm with full batches (q = 1); ``test_decor_sampled_exact.py``
checks DECOR with q < 1.  This file checks every other traced algorithm that samples by Poisson
(``samplings`` holds ``"poisson"``): four agents on a graph that is not complete (a triangle 0-1-3 and a leaf 2 on
agent 1), partitioned unequally so that the batch size B gives each agent its own rate ``q_u = B / |D_u|`` (all
below 1, all different), a budget per agent (``privacy.agent_epsilons``), a colluding set where the algorithm
reports one; its own round code, traced as in the harness (the harness's schedules and linear settings), for
:data:`ROUNDS` rounds; and what it reports, built as ``run_experiment`` writes ``summary.json`` and
``privacy.json``.

**What is proven.**  Each epsilon the run reports for a sender (the ledger's, by the run's accountant and by RDP,
per agent and as the summary's maximum, which names every other agent together; where an algorithm reports them,
the pairwise matrix and its maximum, one receiving agent each, and each colluding set's) is at least the exact
epsilon, at the run's delta, of what the observer it names learns of that sender: every message sent to its
members, its members' own noise (and edge secrets) held, every other agent's data known, the record's gradients
``+-C`` along one direction in each data term (the harness's supremum).  At least one of the run's values is
within :data:`FACTOR` of its exact loss, so the check is not vacuous.

**Why the comparison is exact.**  From the traced messages, the observer's information about the sender's data
terms is ``M = A^T (B B^T)^+ A`` (``B``: the noise it does not hold), grouped by the batch each term was computed
on; a record is in each of the sender's batches independently with the sender's rate (checked to be the
sampler's), and moves every term of a batch together, so the view is a mixture of Gaussians whose exact epsilon
:mod:`tests.privacy.sampled_exact` computes directly (closed-form Gaussian tails, one quadrature, root finding):
one Poisson-sampled Gaussian per batch when the batches are independent in the view (no information between two:
asserted, except for :data:`SHARES_NOISE_ACROSS_ROUNDS`), the joint two-batch mixture otherwise.  The direct
computation reaches two batches: :data:`ROUNDS` is chosen so that at most two of a sender's batches reach any
observer (asserted).  The ledger charges every release, the last round's too, which a model-sending algorithm's
messages never carry; that, the RDP conversion and the pessimistic PLD are the slack.

The planted bug at the end (the ledger pricing every agent's releases at the run's smallest sampling rate) is
caught here, while the full-batch harness, where every rate is 1, cannot see it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from scipy import integrate
from tests.privacy.sampled_exact import (
    Claim,
    SampledRun,
    decoded,
    exact_sampled_epsilon,
    sampled_gaussian_delta,
    sampled_run,
    sender_view,
    understated,
)
from tests.privacy.tracing import TRACED, traced_run, violations

from decentdp.algorithms import algorithm_class
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.report import AGENT_VIEW

AGENTS = 4
SEED = 0
#: With this seed and edge probability the random graph is the triangle 0-1-3 with the leaf 2 on agent 1, and
#: the unequal partition gives the agents 325, 251, 543 and 318 records.
EDGE_PROBABILITY = 0.5
BATCH = 16
BUDGETS = [1.0, 2.0, 3.0, 1.5]
COLLUDING = [[0, 3]]

#: The traced algorithms that sample by Poisson.
SAMPLED = sorted(name for name in TRACED if "poisson" in algorithm_class(name).samplings)
#: Sampled algorithms not checked here, and why (each reason is asserted where it can be).
SKIPPED = {
    "decor": "checked field by field in test_decor_sampled_exact.py (its observer sees every message)",
    "local": "never sends a message: every observer's exact loss is 0, so no comparison has content",
}
CHECKED = [name for name in SAMPLED if name not in SKIPPED]

#: Rounds each algorithm runs, so that at most two of a sender's batches reach any observer (the direct
#: computation's reach) and, where possible, two do.  An algorithm that sends its model shows a round's release in
#: the next round's messages only, so its last round's reaches no one (three rounds, two seen); Muffliato and
#: Zip-DL send the round's update within the round (two rounds); TOP-DP's setup release is seen with its first
#: round's (two rounds: setup and round 0); DP-NET-FLEET's setup release and its first local step's joint pair
#: are seen, its communication step's only in the next round (one round).
ROUNDS = {"dp-dinno": 3, "dp-dpsgd": 3, "dp-dsgd": 3, "dp-dsgt": 3, "dp-net-fleet": 1, "li18-ma": 3,
          "muffliato": 2, "optimal": 3, "top-dp": 2, "top-dp-async": 2, "udp": 3, "zip-dl": 2}
#: The most batches of one sender that reach an observer, where not two: at this seed TOP-DP-async forms no pair in
#: round 1 (offline agents, no partner twice in a row), so no round-0 release is sent and only the setup release
#: is seen.
MOST_SEEN = {"top-dp-async": 1}
#: Batch sizes other than :data:`BATCH`: UDP's paper sigma is proportional to the rate, and at B = 16 (rates 0.03
#: to 0.06) no budget covers one release, so the ledger refuses them all and nothing is sent; B = 240 gives the
#: rates 0.74, 0.96, 0.44 and 0.75.
BATCHES = {"udp": 240}
#: Algorithms whose messages carry a sender's earlier noise that the observer of all other agents cannot remove:
#: Zip-DL's zero-sum draws, held by the sender alone, hide part of a round's release and come back in its next
#: model (through its own copy).  Their two batches are priced jointly.
SHARES_NOISE_ACROSS_ROUNDS = {"zip-dl"}

#: DECOR's pairwise figures (its observer sees every message) and the observer-view accountant's, exact for
#: gradients fixed in advance (``nonadaptive_``): the exact losses here take the gradients the run drew as fixed,
#: so both are checked against them.
PAIRWISE_PREFIXES = ("", "nonadaptive_")
#: The fields of privacy.json and summary.json named for epsilons that are not an epsilon of some observer.
NOT_AN_EPSILON = {"epsilon_accountant", "epsilon_observer", "epsilon_pairwise_network_method",
                  "nonadaptive_epsilon_pairwise_network_method", "epsilon_target"}
#: Reported papers' figures, labelled as such and never enforced: not claims of this library about an observer.
PAPER_FIGURES = {
    "paper_epsilon_per_receiver": "TOP-DP's view (a): each receiver's messages composed alone; below one receiver's "
                                  "exact loss when messages share noise (test_privacy_harness.py shows it)",
    "paper_epsilon_pairwise_rdp": "the same per-receiver composition by RDP",
    "paper_epsilon_per_receiver_view": "the text saying so",
    "paper_epsilon_pairwise_network": "Muffliato's authors' bound, which composes messages sharing one noise "
                                      "vector as if independent",
}
#: Algorithms the planted bug is run on: one Gaussian release a round (the run's mechanism), and TOP-DP's joint
#: release of several noisy copies of one sum, sent to single receivers.
PLANTED = ["dp-dsgd", "top-dp"]
#: How far above its exact loss the tightest reported value of a run may lie; not a soundness tolerance.  Measured
#: (the ledger's epsilon by the run's accountant): 1.000001 for Muffliato, whose observers see every release; 1.06
#: to 1.12 where the last round's release (or, for DP-NET-FLEET, its communication step's) reaches no one (DP-DSGD,
#: DP-DPSGD, DP-DiNNO, DP-DSGT, Optimal, TOP-DP, Li18+MA, DP-NET-FLEET); 1.14 for Zip-DL, whose zero-sum noise hides
#: part of each release from the others together; 1.24 for UDP and 1.31 for TOP-DP-async, whose agents sit out
#: rounds (one of three releases seen).
FACTOR = 1.5


@pytest.fixture(scope="module", params=CHECKED)
def run(request: pytest.FixtureRequest) -> SampledRun:
    """Each checked algorithm's honest sampled run, built once for the module."""
    name = request.param
    return sampled_run(name, ROUNDS[name], BATCHES.get(name, BATCH), BUDGETS, COLLUDING, AGENTS, EDGE_PROBABILITY,
                       SEED)


def name_of(run: SampledRun) -> str:
    return str(run.experiment.config.algorithm.name)


def reported_claims(run: SampledRun) -> list[Claim]:
    """Every epsilon the run reports for a sender and an observer: the ledger's (privacy.json's by the run's
    accountant and by RDP, summary.json's per agent and its maximum), which names every other agent together;
    where reported, the pairwise matrix (one receiving agent) and its maximum, and each colluding set's."""
    privacy, summary_json, n = run.privacy, run.summary, run.n_agents
    assert run.observer == AGENT_VIEW, "the ledger names another observer: extend this check"
    claims: list[Claim] = []
    for u in range(n):
        others = tuple(v for v in range(n) if v != u)
        claims += [Claim("privacy.json epsilon", u, others, decoded(privacy["epsilon"][u])),
                   Claim("privacy.json epsilon_rdp", u, others, decoded(privacy["epsilon_rdp"][u])),
                   Claim("summary.json epsilon_per_agent", u, others, decoded(summary_json["epsilon_per_agent"][u])),
                   Claim("summary.json epsilon_max", u, others, decoded(summary_json["epsilon_max"]))]
        for prefix in PAIRWISE_PREFIXES:
            if f"{prefix}epsilon_pairwise_network" in privacy:
                for v in others:
                    claims += [Claim(f"privacy.json {prefix}epsilon_pairwise_network", u, (v,),
                                     decoded(privacy[f"{prefix}epsilon_pairwise_network"][u][v])),
                               Claim(f"{prefix}epsilon_pairwise_max", u, (v,),
                                     decoded(privacy[f"{prefix}epsilon_pairwise_max"]))]
            for entry in privacy.get(f"{prefix}epsilon_colluding", []):
                members = tuple(entry["agents"])
                if u in members:
                    assert entry["epsilon"][u] is None, (members, u)
                    continue
                claims.append(Claim(f"privacy.json {prefix}epsilon_colluding", u, members,
                                    decoded(entry["epsilon"][u])))
    for key in {f"{prefix}epsilon_pairwise_max" for prefix in PAIRWISE_PREFIXES} & set(privacy):
        assert privacy[key] == summary_json[key], key   # the summary's headline figure is privacy.json's
    return claims


def priced_claims(run: SampledRun) -> list[tuple[Claim, float]]:
    """Each reported claim with the exact epsilon of its observer's view of its sender, sampled at the sender's
    own rate."""
    rates = run.sampling_rates
    return [(claim, sender_view(run, claim.observer, claim.sender).epsilon(float(rates[claim.sender]), run.delta))
            for claim in reported_claims(run)]


# -- the tests ----------------------------------------------------------------------------------------------------

def test_every_sampled_traced_algorithm_is_checked_here_or_says_why_not() -> None:
    """A newly registered Poisson-sampling algorithm that the harness traces needs its rounds here or a reason in
    :data:`SKIPPED`.  Those the harness does not trace (its ``NOT_TRACED``) are checked under sampling in
    ``test_sampled_exact_untraced.py`` (DPDL, DP-CGA, central DP-SGD) or have no exact check (Li18: Laplace)."""
    assert set(CHECKED) | set(SKIPPED) == set(SAMPLED) and set(SKIPPED) <= set(SAMPLED)
    assert set(ROUNDS) == set(CHECKED)


def test_local_training_sends_nothing() -> None:
    """:data:`SKIPPED`'s reason for ``local``: no message leaves an agent, so no observer learns anything."""
    _, _, log = traced_run("local", AGENTS, EDGE_PROBABILITY, SEED, 2, settings={"batch_size": BATCH},
                           data={"partition": "unequal", "size_skew": 1.0}, agent_epsilons=BUDGETS)
    assert log == []


def test_the_run_samples_each_agent_at_its_own_rate_below_one(run: SampledRun) -> None:
    """The setting has what the check needs: a non-complete graph with a leaf, different rates below 1 that the
    sampler draws with and the run publishes, different budgets, releases made and charged."""
    run.check_setting(BUDGETS)
    assert sum(run.privacy["releases"]) > 0


def test_each_observer_sees_at_most_two_batches_independent_unless_noise_is_carried(run: SampledRun) -> None:
    """What the direct computation needs: at most two of a sender's batches reach each observer (as many as
    :data:`MOST_SEEN` says for some observer); they are independent releases in the view (no information between
    them) except for an algorithm of :data:`SHARES_NOISE_ACROSS_ROUNDS`, where some are not."""
    name = name_of(run)
    views = [sender_view(run, observer, sender) for observer, sender in
             {(claim.observer, claim.sender) for claim in reported_claims(run)}]
    assert max(len(view.visible) for view in views) == MOST_SEEN.get(name, 2)
    assert all(view.independent for view in views) == (name not in SHARES_NOISE_ACROSS_ROUNDS)


def test_every_reported_epsilon_is_at_least_its_observers_exact_loss_under_poisson_sampling(run: SampledRun) -> None:
    """The module docstring's claim, for every field the run reports that names an observer; the tightest is
    within :data:`FACTOR` of its exact loss."""
    priced = priced_claims(run)
    assert not understated(priced), understated(priced)
    reported = {key for key in (*run.privacy, *run.summary) if "epsilon" in key}
    assert reported - NOT_AN_EPSILON - set(PAPER_FIGURES) <= {claim.name for claim, _ in priced}, \
        "a reported epsilon left unchecked"
    ratios = [claim.reported / exact for claim, exact in priced if exact > 0]
    assert min(ratios) < FACTOR, min(ratios)


@pytest.mark.parametrize(("mu", "q", "rounds"), [(1.16, 0.03, 2), (0.3, 0.9, 2), (2.5, 0.2, 1)])
def test_the_direct_computation_lies_between_dp_accountings_optimistic_and_pessimistic_plds(
        mu: float, q: float, rounds: int) -> None:
    """The exact epsilon of :mod:`tests.privacy.sampled_exact` is bracketed by dp_accounting's PLD of the same
    Poisson-sampled Gaussian, composed ``rounds`` times: its optimistic estimate (a lower bound) and its pessimistic
    one (an upper bound); at a coarse discretisation, so the bracket is wide below (1e-3) and tight above (1e-6).
    At epsilon 0 both directions give the total variation distance, which is symmetric: the two branches agree
    there."""
    bounds = [privacy_loss_distribution.from_gaussian_mechanism(
        1 / mu, sampling_prob=q, pessimistic_estimate=pessimistic, use_connect_dots=pessimistic,
        value_discretization_interval=1e-3).self_compose(rounds).get_epsilon_for_delta(1e-5)
        for pessimistic in (False, True)]
    exact = exact_sampled_epsilon((mu,) * rounds, q, 1e-5)
    assert bounds[0] <= exact <= bounds[1] * (1 + 1e-10), (bounds, exact)
    total_variation = [sampled_gaussian_delta(0.0, (mu,) * rounds, q, removed) for removed in (True, False)]
    assert total_variation[0] == pytest.approx(total_variation[1], rel=1e-9)


def test_two_correlated_batches_are_priced_the_same_either_way_round() -> None:
    """The joint two-batch computation does not depend on which batch is integrated numerically (the other is
    in closed form), for independent, aligned and opposed batches; at epsilon 0 both directions give the total
    variation distance.  Two batches along one direction are one Gaussian whose shift is 0, mu or 2 mu with the
    binomial weights, computed here by a plain quadrature of the densities."""
    for mus, cross, q in [((1.0, 0.8), 0.0, 0.05), ((1.0, 0.8), 0.5, 0.05), ((0.9, 1.3), -1.0, 0.3)]:
        for epsilon in (0.0, 0.4, 1.5):
            for removed in (True, False):
                forward = sampled_gaussian_delta(epsilon, mus, q, removed, cross)
                backward = sampled_gaussian_delta(epsilon, mus[::-1], q, removed, cross)
                assert forward == pytest.approx(backward, rel=1e-10, abs=1e-300), (mus, cross, epsilon, removed)
        total = [sampled_gaussian_delta(0.0, mus, q, removed, cross) for removed in (True, False)]
        assert total[0] == pytest.approx(total[1], rel=1e-9)
    mu, q = 0.6, 0.5

    def collinear(x: float) -> float:
        return sum(weight * math.exp(-(x - shift) ** 2 / 2) / math.sqrt(2 * math.pi)
                   for weight, shift in [((1 - q) ** 2, 0.0), (2 * q * (1 - q), mu), (q * q, 2 * mu)])

    for epsilon in (0.3, 1.0):
        for removed in (True, False):
            def excess(x: float, epsilon: float = epsilon, removed: bool = removed) -> float:
                neighbour = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
                first, second = (collinear(x), neighbour) if removed else (neighbour, collinear(x))
                return max(first - math.exp(epsilon) * second, 0.0)

            reference, _ = integrate.quad(excess, -20.0, 2 * mu + 20.0, points=[0.0, mu, 2 * mu], epsabs=0.0,
                                          epsrel=1e-12, limit=500)
            assert sampled_gaussian_delta(epsilon, (mu, mu), q, removed, mu * mu) == pytest.approx(reference, rel=1e-9)


def plant_the_smallest_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the oracle hands each owner's sampling rate to its mechanism's per-release event
    (``DataOracle._event_ids``, where every ledger charge of a release is built); here it hands the run's smallest
    rate instead, so the ledger prices every agent as if it sampled least."""
    original = DataOracle._event_ids

    def cheaper(self: DataOracle, mechanism: Any, rows: np.ndarray) -> np.ndarray:
        rates = self._rates
        self._rates = np.full_like(rates, rates.min())
        try:
            return original(self, mechanism, rows)
        finally:
            self._rates = rates

    monkeypatch.setattr(DataOracle, "_event_ids", cheaper)


@pytest.mark.parametrize("name", PLANTED)
def test_a_ledger_pricing_every_agent_at_the_smallest_rate_is_caught(name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has teeth: under :func:`plant_the_smallest_rate` the ledger reports every agent that samples
    more than the least, and whose releases some observer sees, below its exact loss (its own epsilon, and the
    pairwise and colluding ones it caps); nothing else changes."""
    plant_the_smallest_rate(monkeypatch)
    run = sampled_run(name, ROUNDS[name], BATCHES.get(name, BATCH), BUDGETS, COLLUDING, AGENTS, EDGE_PROBABILITY,
                      SEED)
    priced = priced_claims(run)
    found = understated(priced)
    rates = run.sampling_rates
    seen = {claim.sender for claim, exact in priced if exact > 0}
    assert {"privacy.json epsilon", "summary.json epsilon_per_agent"} <= {claim.field for claim, _ in found}
    assert {claim.sender for claim, _ in found} == seen & set(np.flatnonzero(rates > rates.min()).tolist())
    ledger = {u: {decoded(run.privacy[key][u]) for key in ("epsilon", "epsilon_rdp")} for u in range(AGENTS)}
    assert all(claim.reported in ledger[claim.sender] for claim, _ in found)   # the ledger's, or capped by it


def test_the_full_batch_harness_cannot_see_the_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """With full batches every rate is 1, the smallest too: the planted bug changes nothing, and the harness's
    check of every observer finds no violation in the same setting."""
    plant_the_smallest_rate(monkeypatch)
    name = PLANTED[0]
    experiment, sources, log = traced_run(name, AGENTS, EDGE_PROBABILITY, SEED, ROUNDS[name], agent_epsilons=BUDGETS)
    assert experiment.oracle.sampler.sample_rates.tolist() == [1.0] * AGENTS
    assert violations(experiment, sources, log, ROUNDS[name], None, "add-remove", COLLUDING[0])[0] == []
