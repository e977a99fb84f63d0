"""The exact epsilon of a traced run's view under Poisson sampling (q < 1), shared by the sampled exact checks.

``test_privacy_harness.py`` traces an algorithm's own round code (each clipped sum and each noise draw a
coordinate) and prices each observer's view with full batches.  Under Poisson sampling a record is in each of its
owner's batches independently, with the owner's rate ``q`` (:class:`~decentdp.privacy.sampling.PoissonSampler`
draws every ``oracle.batch()`` afresh), and a release is divided by the public expected batch, so the view stays
linear in the sender's clipped sums: a record in batch ``b`` moves every data term computed on ``b`` (several
when an algorithm releases several sums on one batch), a record out of it none.  This module gives:

* :func:`exact_sampled_epsilon`: the exact epsilon, under add/remove, of one or two Poisson-sampled Gaussian
  batches of one sender, independent or sharing noise in the observer's view, computed directly (Gaussian
  tails in closed form, one adaptive quadrature, root finding), with no privacy accountant;
* :func:`sampled_run`: an algorithm's traced run whose agents sample at unequal rates below one, each data
  term labelled with the batch (round, batch index) it was computed on, with the ``privacy.json`` and
  ``summary.json`` it would write;
* :func:`sender_view`: what an observer learns of a sender's data terms from the traced messages (the
  information matrix ``M = A^T (B B^T)^+ A`` over them, grouped by batch), and :meth:`SenderView.epsilon`, its
  exact sampled epsilon.

**The exact per-batch mechanism.**  For a record whose gradient in the data terms ``j`` of batch ``b`` is
``s_j C e_b`` (``s_j = +-1``, ``e_b`` a unit vector; the harness's sign patterns), the whitened view is
``N(sum_b I_b a_b, I)`` with ``I_b ~ Bernoulli(q)`` independent across batches (the record is in batch ``b`` or
not: every term of ``b`` moves together) and ``|a_b|^2 = s_b^T M_bb s_b``, ``<a_b, a_c> = s_b^T M_bc s_c``
(with ``e_b = e_c``); without the record it is ``N(0, I)``.  The likelihood ratio depends on the view through
its projection on the ``a_b`` alone, so the pair is exactly that of :func:`sampled_gaussian_delta` with
``mus_b = |a_b|`` and ``cross = <a_0, a_1>``.  When the observer's information matrix has no entry between two
batches (``M_bc = 0``: the rounds are independent releases), the pair is the product of one Poisson-sampled
Gaussian per batch, whatever the directions ``e_b``, with ``mu_b^2 = max_s s^T M_bb s``: the largest over sign
patterns, which is the supremum over all records for batches of one or two terms (``M_11 + M_22 + 2 |M_12|``),
and larger ``mu`` only increases the loss (a Gaussian with more noise is post-processing of one with less).
When the batches share noise in the view, the joint sign patterns of both are enumerated: the supremum over
records aligned or opposed across batches, the harness's own supremum (a lower bound on the one over all
records, which is what a comparison ``reported >= exact`` may rely on).  As in the harness, later data terms are
computed at models that earlier messages built, but ``M`` is fixed by public quantities (graph, noise multipliers,
expected batches), so a record whose gradients are fixed in advance attains the value computed here: a lower bound
on the adaptive view's loss, and equal to it where the batches are independent (each is the same sampled Gaussian
whatever came before, and composing such pairs adaptively is no worse than their product).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cache
from typing import Any
from unittest import mock

import numpy as np
import torch
from scipy import integrate, optimize, special
from tests.privacy.tracing import Sources, TracingOracle, traced_run

from decentdp.experiment.loop import run_facts
from decentdp.experiment.record import run_privacy_statement, summary
from decentdp.privacy.report import AGENT_VIEW, privacy_report

#: Relative error allowed to the exact epsilon: its computation agrees with dp_accounting's pessimistic PLD at
#: 1e-4 to 1e-8 from below and 2e-11 from above (quadrature at 1e-12), and with itself, batches swapped, to
#: 1e-11; reported values exceed it by 5e-7 or more where they are tight.
TOLERANCE = 1e-9
#: Half-width, in standard deviations, of the quadrature's range around the Gaussians' means.
SPAN = 14.0
#: Relative size below which a singular value of the unknown noise's covariance counts as zero, and the part of
#: a data term outside its range above which the observer sees data without noise (the harness's).
RANK_TOLERANCE = 1e-10
LEAK_TOLERANCE = 1e-7
#: Relative size below which an entry of the information matrix counts as zero (rounding of the traced view).
ZERO_INFORMATION = 1e-9

Observer = tuple[int, ...]
Batch = tuple[int, int]   # (round, batch index within the round); round -1 is the setup phase


# -- the exact epsilon of one or two Poisson-sampled Gaussian batches, computed directly ---------------------------

def _density(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _positive_part(alpha: float, beta: float, nu: float) -> float:
    """``integral (alpha phi(x) + beta phi(x - nu))_+ dx`` over the line (``phi`` the standard normal density,
    ``nu >= 0``): the two terms cross once, at ``t`` where ``beta e^(nu t - nu^2 / 2) = -alpha``, so the positive
    part is two Gaussian tails."""
    if alpha >= 0 and beta >= 0:
        return alpha + beta
    if alpha <= 0 and beta <= 0:
        return 0.0
    if nu == 0:
        return max(alpha + beta, 0.0)
    t = (math.log(-alpha / beta) + nu * nu / 2) / nu
    if beta > 0:                      # positive where x > t
        return float(beta * special.ndtr(nu - t) + alpha * special.ndtr(-t))
    return float(alpha * special.ndtr(t) + beta * special.ndtr(t - nu))   # positive where x < t


def sampled_gaussian_delta(epsilon: float, mus: tuple[float, ...], q: float, removed: bool,
                           cross: float = 0.0) -> float:
    """The hockey-stick divergence ``E_P[(1 - e^(epsilon - L))_+]`` of one or two Poisson-sampled Gaussian
    batches of rate ``q``: the view ``N(I_0 a_0 + I_1 a_1, I)`` (``I_b ~ Bernoulli(q)`` independent, ``|a_b| =
    mus[b]``, ``<a_0, a_1> = cross``) against ``N(0, I)``; ``P`` is the view with the record when ``removed`` (the
    neighbour is the dataset without it), without it otherwise, and ``L`` the privacy loss ``log P/Q``.

    In the plane of ``a_0`` and ``a_1`` (``x`` along ``a_0``, ``y`` orthogonal), ``a_0 = (mu_0, 0)`` and ``a_1 =
    (kappa, nu)``; the mixture's density is ``A(x) phi(y) + B(x) phi(y - nu)`` (``A``: the terms without batch 1,
    ``B``: with it), so for each ``x`` the integral over ``y`` is :func:`_positive_part`'s closed form, and the
    one over ``x`` is an adaptive quadrature split where its branch changes.  Independent batches are
    ``cross = 0``; one batch is ``mus = (mu,)``."""
    growth = math.exp(epsilon)
    if len(mus) == 1 or mus[0] == 0.0 or mus[1] == 0.0:
        if cross != 0.0:
            raise ValueError("a batch without information shares none")
        mu = max(mus)
        if removed:
            return _positive_part(1 - q - growth, q, mu)
        return _positive_part(1 - growth * (1 - q), -growth * q, mu)
    if len(mus) != 2:
        raise ValueError("the direct computation covers one or two batches")
    first, second = mus
    kappa = cross / first
    nu = math.sqrt(max(second * second - kappa * kappa, 0.0))

    def absent(x: float) -> float:        # A(x): batch 1 not in, batch 0 in or not
        return (1 - q) * ((1 - q) * _density(x) + q * _density(x - first))

    def present(x: float) -> float:       # B(x): batch 1 in, batch 0 in or not
        return q * ((1 - q) * _density(x - kappa) + q * _density(x - first - kappa))

    # A(x) / phi(x) grows from (1 - q)^2 with x: the branch of the integrand changes once, at A = e^epsilon phi
    # (removed) or phi = e^epsilon A (added); beyond it (removed) or before it (added) the positive part is
    # whole or empty.
    level = growth - (1 - q) ** 2 if removed else 1 / growth - (1 - q) ** 2
    branch = (math.log(level / (q * (1 - q))) + first * first / 2) / first if level > 0 else -math.inf
    low, high = min(0.0, kappa) - SPAN, max(first, first + kappa) + SPAN
    if removed:
        def integrand(x: float) -> float:
            return _positive_part(absent(x) - growth * _density(x), present(x), nu)
    else:
        if branch == -math.inf:           # e^epsilon A >= phi everywhere: the record can never be ruled in
            return 0.0

        def integrand(x: float) -> float:
            return _positive_part(_density(x) - growth * absent(x), -growth * present(x), nu)
        high = min(high, branch)
        if high <= low:
            return 0.0
    points = sorted(p for p in {branch, 0.0, first, kappa, first + kappa} if low < p < high)
    value, _ = integrate.quad(integrand, low, high, points=points, epsabs=0.0, epsrel=1e-12, limit=400)
    return value


@cache
def exact_sampled_epsilon(mus: tuple[float, ...], q: float, delta: float, cross: float = 0.0) -> float:
    """The exact epsilon at ``delta`` of one or two Poisson-sampled Gaussian batches (see
    :func:`sampled_gaussian_delta`) under add/remove: the larger of the two directions."""
    if any(math.isinf(mu) for mu in mus):
        return math.inf
    if not any(mus):
        return 0.0
    epsilon = 0.0
    for removed in (True, False):
        def excess(value: float, removed: bool = removed) -> float:
            return math.log(max(sampled_gaussian_delta(value, mus, q, removed, cross), 1e-300) / delta)

        if excess(0.0) <= 0:
            continue
        high = 1.0
        while excess(high) > 0:
            high *= 2
        epsilon = max(epsilon, optimize.brentq(excess, high / 2 if high > 1 else 0.0, high, xtol=1e-14, rtol=1e-15))
    return epsilon


# -- a traced run that samples ------------------------------------------------------------------------------------

@dataclass
class SampledRun:
    """A traced run under Poisson sampling: the experiment, its traced messages, the batch each data coordinate
    was computed on, and the summary.json and privacy.json it would write."""

    experiment: Any
    sources: Sources
    log: list[tuple[np.ndarray, torch.Tensor]]
    batches: dict[int, Batch]
    summary: dict[str, Any]
    privacy: dict[str, Any]

    @property
    def delta(self) -> float:
        return float(self.experiment.config.privacy.delta)

    @property
    def n_agents(self) -> int:
        return int(self.experiment.data.n_agents)

    @property
    def record_counts(self) -> np.ndarray:
        return np.array([len(records) for records in self.experiment.data.indices])

    @property
    def sampling_rates(self) -> np.ndarray:
        """Each agent's Poisson rate from the config's batch size and its record count: ``q_u = B / |D_u|``."""
        return np.minimum(1.0, self.experiment.config.algorithm.batch_size / self.record_counts)

    @property
    def observer(self) -> str:
        """Who the ledger's epsilon (the budgets') names: everyone together unless the run says otherwise."""
        return str(self.experiment.setup.get("epsilon_observer", AGENT_VIEW))

    def check_setting(self, budgets: list[float]) -> None:
        """What the exact checks need of the setting: different Poisson rates below 1, which the sampler draws with
        and the run publishes; a graph that is not complete, with a leaf; the budgets given; no release refused."""
        rates = self.sampling_rates
        assert (rates < 1).all() and len(set(rates.tolist())) == self.n_agents
        assert self.experiment.setup["sample_rates"] == rates.tolist()
        np.testing.assert_array_equal(self.experiment.oracle.sampler.sample_rates.numpy(), rates)
        degrees = np.asarray(self.experiment.topology.adjacency()).sum(axis=1)
        assert degrees.min() == 1 and degrees.sum() < self.n_agents * (self.n_agents - 1)
        assert self.experiment.config.privacy.agent_epsilons == budgets
        assert self.privacy["refused_releases"] == [0] * self.n_agents


def sampled_run(name: str, rounds: int, batch_size: int, budgets: list[float], colluding: list[list[int]],
                agents: int = 4, edge_probability: float = 0.5, seed: int = 0,
                settings: dict[str, Any] | None = None) -> SampledRun:
    """Run algorithm ``name`` traced (:func:`~tests.privacy.tracing.traced_run`) on an unequal
    partition with batch size ``batch_size`` (so each agent samples at its own rate ``B / |D_u|``), a budget per
    agent, and build what the run reports as ``run_experiment`` writes it.  Each data coordinate is labelled with
    the batch (round, index) the oracle computed it on."""
    batches: dict[int, Batch] = {}
    compute = TracingOracle._compute

    def labelled(self: TracingOracle, models: torch.Tensor, batch: Any, owners: Any, host: torch.Tensor,
                 out: torch.Tensor, index: int) -> None:
        start = len(self.sources.kind)
        compute(self, models, batch, owners, host, out, index)
        batches.update({column: (self.round_index, index) for column in range(start, len(self.sources.kind))})

    with mock.patch.object(TracingOracle, "_compute", labelled):
        experiment, sources, log = traced_run(
            name, agents, edge_probability, seed, rounds, settings={"batch_size": batch_size, **(settings or {})},
            data={"partition": "unequal", "size_skew": 1.0}, agent_epsilons=budgets, colluding=colluding)
    extras = experiment.algorithm.privacy_results(experiment.final_state, run_facts(experiment, rounds))
    config = experiment.config
    privacy = privacy_report(experiment.ledger, config.privacy.delta, run_privacy_statement(config),
                             experiment.setup.get("paper_accounting"), extras,
                             experiment.setup.get("epsilon_observer", AGENT_VIEW))
    return SampledRun(experiment, sources, log, batches, summary(experiment, [], 0.0, True, rounds) | extras.summary(),
                      privacy)


# -- what an observer learns of a sender ------------------------------------------------------------------------

@dataclass(frozen=True)
class SenderView:
    """An observer's information about one sender's data terms in a traced run: ``information = A^T (B B^T)^+ A``
    over them (``inf`` everywhere when some data reaches the observer without noise) and the batch of each."""

    information: np.ndarray
    batches: tuple[Batch, ...]

    def members(self, batch: Batch) -> np.ndarray:
        return np.flatnonzero([label == batch for label in self.batches])

    def block(self, first: Batch, second: Batch) -> np.ndarray:
        return self.information[np.ix_(self.members(first), self.members(second))]

    @property
    def scale(self) -> float:
        return float(np.abs(self.information).max()) if self.information.size else 0.0

    @property
    def visible(self) -> tuple[Batch, ...]:
        """The batches the observer learns anything about (the others never reach it, e.g. a last round's)."""
        if math.isinf(self.scale):
            return tuple(dict.fromkeys(self.batches))
        return tuple(batch for batch in dict.fromkeys(self.batches)
                     if np.abs(self.block(batch, batch)).max() > ZERO_INFORMATION * self.scale)

    @property
    def independent(self) -> bool:
        """Whether the visible batches are independent releases in the view: no information between two."""
        return math.isinf(self.scale) or all(np.abs(self.block(b, c)).max() <= ZERO_INFORMATION * self.scale
                                             for b, c in itertools.permutations(self.visible, 2))

    def multipliers(self) -> tuple[float, ...]:
        """Each visible batch's Gaussian-DP parameter, the square root of its block's largest ``s^T M_bb s`` over
        sign patterns (``inf`` for every batch when data reaches the observer without noise)."""
        if math.isinf(self.scale):
            return (math.inf,) * len(self.visible)
        return tuple(math.sqrt(max(_largest_form(self.block(batch, batch)), 0.0)) for batch in self.visible)

    def epsilon(self, q: float, delta: float) -> float:
        """The exact epsilon at ``delta`` of the view under Poisson sampling at the sender's rate ``q`` (the module
        docstring): independent batches at their multipliers; batches that share noise by their joint sign
        patterns, the largest.  One or two visible batches (the direct computation's reach)."""
        if math.isinf(self.scale):
            return math.inf
        visible = self.visible
        if len(visible) > 2:
            raise ValueError(f"{len(visible)} batches reach the observer: the direct computation covers two")
        if self.independent:
            return exact_sampled_epsilon(self.multipliers(), q, delta)
        first, second = (self.members(batch) for batch in visible)
        best = 0.0
        for signs in itertools.product([-1.0, 1.0], repeat=len(first) + len(second) - 1):
            s, t = np.array([1.0, *signs[:len(first) - 1]]), np.array(signs[len(first) - 1:])
            norms = (max(float(s @ self.information[np.ix_(first, first)] @ s), 0.0),
                     max(float(t @ self.information[np.ix_(second, second)] @ t), 0.0))
            if min(norms) <= ZERO_INFORMATION * self.scale:   # one batch moves nothing under these signs
                best = max(best, exact_sampled_epsilon((math.sqrt(max(norms)),), q, delta))
                continue
            bound = math.sqrt(norms[0] * norms[1])               # Cauchy-Schwarz, against rounding
            cross = min(max(float(s @ self.information[np.ix_(first, second)] @ t), -bound), bound)
            best = max(best, exact_sampled_epsilon((math.sqrt(norms[0]), math.sqrt(norms[1])), q, delta, cross))
        return best


def _largest_form(matrix: np.ndarray) -> float:
    """``max_s s^T matrix s`` over sign vectors ``s`` (the harness's supremum over one batch's data terms)."""
    return max(float(np.array(s) @ matrix @ np.array(s)) for s in itertools.product([-1.0, 1.0], repeat=len(matrix)))


def sender_view(run: SampledRun, observer: Observer, sender: int, every_message: bool = False) -> SenderView:
    """What ``observer`` learns of ``sender``'s data terms: it sees the messages sent to its members (every
    message of the run with ``every_message``, DECOR's pairwise view), holds its members' own noise and the edge
    secrets touching them, and knows every other agent's data (the harness's observer)."""
    sources = run.sources
    rows = [x.numpy() if every_message else x.numpy()[np.isin(receivers, observer)] for receivers, x in run.log
            if x.shape[-1] == sources.capacity]   # (narrower messages carry public values, e.g. batch sizes)
    seen = np.concatenate([*rows, np.zeros((0, sources.capacity))])
    padding = sources.capacity - len(sources.kind)
    kind = np.array(sources.kind + [""] * padding)
    agent, partner = np.array(sources.agent + [-1] * padding), np.array(sources.partner + [-1] * padding)
    unknown = (kind == "noise") & ~np.isin(agent, observer) & ~np.isin(partner, observer)
    columns = np.flatnonzero((kind == "data") & (agent == sender))
    labels = tuple(run.batches[int(column)] for column in columns)
    data = seen[:, columns]
    if not data.any():
        return SenderView(np.zeros((len(columns), len(columns))), labels)
    covariance = seen[:, unknown] @ seen[:, unknown].T
    inverse = np.linalg.pinv(covariance, rcond=RANK_TOLERANCE, hermitian=True)
    if not np.allclose(covariance @ inverse @ data, data, rtol=0.0, atol=LEAK_TOLERANCE * np.abs(data).max()):
        return SenderView(np.full((len(columns), len(columns)), math.inf), labels)
    return SenderView(data.T @ inverse @ data, labels)


# -- reported epsilons --------------------------------------------------------------------------------------------

def decoded(value: float | None) -> float:
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


def understated(priced: list[tuple[Claim, float]]) -> list[tuple[Claim, float]]:
    """The claims reported below the exact loss of their observer (beyond :data:`TOLERANCE`)."""
    return [(claim, exact) for claim, exact in priced if not claim.reported >= exact * (1 - TOLERANCE)]
