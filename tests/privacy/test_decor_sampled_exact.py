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
divergence is computed directly, with no privacy accountant, by :mod:`tests.privacy.sampled_exact` (shared with
``test_sampled_exact_every_algorithm.py``, which checks it against dp_accounting's PLD): one round's in closed form
(Gaussian tails), the other's by adaptive quadrature, epsilon by root finding, the larger of the two directions
(for one or two rounds, hence ``ROUNDS = 2``).

The reported epsilons are pessimistic PLD (or RDP) values: in this run the tightest lie 5e-7 to 2e-6 above the
exact ones (asserted below 1e-4, so that an exact value computed too low could not make the check vacuous).
The comparison allows ``sampled_exact.TOLERANCE`` (relative) for the computation's own error, nothing more.
The planted bugs at the end show that it fails when the ledger prices a sender at another agent's sampling
rate, or when the mechanism adds less noise than the run publishes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from tests.privacy.sampled_exact import (
    Claim,
    Observer,
    SampledRun,
    decoded,
    exact_sampled_epsilon,
    sampled_run,
    sender_view,
    understated,
)

from decentdp.privacy.correlated import CorrelatedGaussianMechanism

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
#: The fields of privacy.json and summary.json named for epsilons that are not an epsilon of some observer.
NOT_AN_EPSILON = {"epsilon_accountant", "epsilon_observer", "epsilon_pairwise_network_method", "epsilon_target",
                  "paper_accounting"}
#: Where the ledger's epsilon is reported (by the run's accountant and by RDP).
LEDGER_FIELDS = {"privacy.json epsilon", "privacy.json epsilon_rdp", "summary.json epsilon_per_agent",
                 "summary.json epsilon_max"}

RoundMultipliers = Callable[[Observer, int], tuple[float, ...]]


# -- the traced run and what it reports ---------------------------------------------------------------------------

def sampled_decor_run() -> SampledRun:
    """Run DECOR (the module docstring's setting) traced, and build what the run reports as ``run_experiment``
    writes it."""
    return sampled_run("decor", ROUNDS, BATCH, BUDGETS, COLLUDING, AGENTS, EDGE_PROBABILITY, SEED,
                       settings={"correlation": CORRELATION})


@pytest.fixture(scope="module")
def honest_run() -> SampledRun:
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


def published_round_system(run: SampledRun) -> RoundSystem:
    """The one-round system from what the run publishes: setup.json's noise multipliers and DECOR's calibration
    details (``sigma_cor = tau mean(L)``), the expected batches ``L_u = q_u |D_u|`` (float32, as divided by),
    and the graph's edges."""
    setup = run.experiment.setup
    batches = (run.sampling_rates * run.record_counts).astype(np.float32).astype(np.float64)
    adjacency = np.asarray(run.experiment.topology.adjacency())
    edges = np.argwhere(np.triu(adjacency, k=1) > 0)
    edge_scale = setup["calibration_details"]["sigma_cor"] / float(batches.mean())
    return RoundSystem(np.array(setup["noise_multipliers"], dtype=np.float64), batches, edge_scale, edges)


def traced_round_multipliers(run: SampledRun, observer: Observer, sender: int) -> tuple[float, ...]:
    """Each round's Gaussian-DP parameter of ``sender`` in the traced run's every-message view of ``observer``:
    the square roots of the diagonal of ``A^T (B B^T)^+ A`` over the sender's data terms, one per round
    (:func:`~tests.privacy.sampled_exact.sender_view`), whose off-diagonal entries vanish (the rounds are
    independent releases; asserted)."""
    view = sender_view(run, observer, sender, every_message=True)
    assert len(view.batches) == ROUNDS and len(view.visible) == ROUNDS
    assert view.independent, view.information
    return view.multipliers()


def reported_claims(run: SampledRun) -> list[Claim]:
    """Every epsilon the run reports for a sender and an observer: privacy.json's (the ledger's epsilon by the
    run's accountant and by RDP, for the worst single agent or colluding set; the pairwise matrix; each
    colluding set's; the local epsilon, all the others together; the eavesdropper's and the paper's SecLDP bound,
    nobody's) and summary.json's (the ledger's per agent, and the maxima)."""
    privacy, summary_json = run.privacy, run.summary
    sets = [tuple(members) for members in run.experiment.config.privacy.colluding]
    named = [(v,) for v in range(AGENTS)] + sets       # the ledger's observers: each single agent and each set
    eavesdropper: Observer = ()
    paper = decoded(privacy["paper_accounting"]["paper_epsilon_secldp"])
    claims: list[Claim] = []
    for u in range(AGENTS):
        others = tuple(v for v in range(AGENTS) if v != u)
        for observer in (o for o in named if u not in o):
            claims += [Claim("privacy.json epsilon", u, observer, decoded(privacy["epsilon"][u])),
                       Claim("privacy.json epsilon_rdp", u, observer, decoded(privacy["epsilon_rdp"][u])),
                       Claim("summary.json epsilon_per_agent", u, observer,
                             decoded(summary_json["epsilon_per_agent"][u])),
                       Claim("summary.json epsilon_max", u, observer, decoded(summary_json["epsilon_max"]))]
        for v in others:
            claims += [Claim("privacy.json epsilon_pairwise_network", u, (v,),
                             decoded(privacy["epsilon_pairwise_network"][u][v])),
                       Claim("epsilon_pairwise_max", u, (v,), decoded(summary_json["epsilon_pairwise_max"]))]
        for entry in privacy["epsilon_colluding"]:
            members = tuple(entry["agents"])
            if u in members:
                assert entry["epsilon"][u] is None, (members, u)
                continue
            claims += [Claim("privacy.json epsilon_colluding", u, members, decoded(entry["epsilon"][u])),
                       Claim("epsilon_colluding_max", u, members, decoded(summary_json["epsilon_colluding_max"]))]
        claims += [Claim("privacy.json epsilon_local", u, others, decoded(privacy["epsilon_local"][u])),
                   Claim("epsilon_local_max", u, others, decoded(summary_json["epsilon_local_max"])),
                   Claim("epsilon_eavesdropper_max", u, eavesdropper,
                         decoded(summary_json["epsilon_eavesdropper_max"])),
                   Claim("paper_epsilon_secldp", u, eavesdropper, paper)]
    for key in ("epsilon_pairwise_max", "epsilon_colluding_max", "epsilon_local_max", "epsilon_eavesdropper_max"):
        assert privacy[key] == summary_json[key], key   # the summary's maxima are privacy.json's
    return claims


def priced_claims(run: SampledRun, multipliers: RoundMultipliers) -> list[tuple[Claim, float]]:
    """Each reported claim with the exact epsilon of its observer's view of its sender: the rounds' Gaussian-DP
    parameters from ``multipliers``, each round sampled at the sender's own rate."""
    rates = run.sampling_rates
    return [(claim, exact_sampled_epsilon(multipliers(claim.observer, claim.sender), float(rates[claim.sender]),
                                          run.delta)) for claim in reported_claims(run)]


def published_multipliers(run: SampledRun) -> RoundMultipliers:
    """Every round's parameter from the published one-round system (the same each round: one graph, one sigma)."""
    system = published_round_system(run)
    return lambda observer, sender: (system.multiplier(observer, sender),) * ROUNDS


# -- the tests ----------------------------------------------------------------------------------------------------

def test_the_run_samples_each_agent_at_its_own_rate_below_one(honest_run: SampledRun) -> None:
    """The setting has what the check needs: a non-complete graph with a leaf, different rates below 1 that the
    sampler draws with and the run publishes, different budgets, every round released by every agent."""
    honest_run.check_setting(BUDGETS)
    assert honest_run.privacy["releases"] == [ROUNDS] * AGENTS


def test_the_published_one_round_system_is_what_the_run_sends_every_round(honest_run: SampledRun) -> None:
    """For every observer and sender, the traced run's view over all rounds is the published one-round system's
    Gaussian mechanism, once per round and independently (the information matrix is ``mu^2 I``); tau is the
    DECOR formula's ``rho mean(sigma / L)``."""
    run = honest_run
    system = published_round_system(run)
    assert system.edge_scale == pytest.approx(CORRELATION * float(np.mean(system.own / system.batches)), rel=1e-12)
    for observer, sender in {(claim.observer, claim.sender) for claim in reported_claims(run)}:
        traced = traced_round_multipliers(run, observer, sender)
        np.testing.assert_allclose(traced, system.multiplier(observer, sender), rtol=1e-9,
                                   err_msg=f"observer {observer}, sender {sender}")


def test_every_reported_epsilon_is_at_least_its_observers_exact_loss_under_poisson_sampling(
        honest_run: SampledRun) -> None:
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
def test_a_planted_bug_is_caught(bug: str, honest_run: SampledRun, monkeypatch: pytest.MonkeyPatch) -> None:
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
