"""TOP-DP's two strategies (Guo et al., Section IV), shared by its synchronous and asynchronous protocols.

* **Topology-aware noise reduction** (eqs. 4-5).  A message from ``i`` that mixes in a neighbour
  ``k``'s estimate with weight ``1 - alpha`` already carries ``(1 - alpha)`` times ``k``'s noise; if the
  receiver ``j`` does not know that noise, ``i`` only adds the residual (eq. 5b)::

      sigma_i^j = sqrt(sigma_i^2 - c_ik^2),   c_ik = (1 - alpha) sigma_k L_i / L_k          (5a, 5b)

  (``L_i / L_k`` converts ``k``'s noise, added to its sum of ``L_k`` expected samples, into ``i``'s
  gradient units; it is 1 for equal batches, the paper's setting).  A ``k`` with ``c_ik >= sigma_i``
  (heterogeneous budgets) cannot cover anyone: such edges fall back to full noise and are counted.
* **Time-aware noise decay** (eq. 6b): ``sigma_t = sigma_0 gamma^floor(t / period)``.

**Accounting.**  Every noisy copy of agent ``i``'s round sum (its local estimate, line 19, and each
per-receiver message, eq. 5c) reaches its neighbours, now or inside later messages: the local estimate
is mixed into every later message, and a message to ``j'`` is mixed into ``j'``'s estimate, which ``j'``
sends on.  So one receiver, given enough rounds, sees every copy, and a receiver (or a set of them)
that knows the reused noise learns each copy up to its residual noise.  The ledger therefore charges,
per round, all of ``i``'s copies on one batch as one joint Gaussian with ``1 / sigma_eff^2 = sum_r
1 / sigma_r^2`` (:meth:`RowGaussian.agent_event`: every other noise known, the colluding view), and
budgets hold on it: it bounds every observer, a single curious neighbour and colluding ones alike.
:func:`calibrate_top_dp` sizes ``sigma_0`` so that these joint releases meet the budget over the
decayed rounds: those of the covers Algorithm 1 will draw (public randomness, replayed before the first
round: :func:`replayed_factors`), or the largest the graph allows (:func:`precision_factors`).  Several
vectors pass; Algorithm 1 keeps the one that leaves the least noise in the models (:func:`noise_left`, the
run's own noise path replayed), not the least noise on average: unequal sigmas stop the reuse of eq. 5.

Two views the paper argues with are reported beside it, labelled, never enforced: the per-receiver
composition (view (a), each receiver charged ``sigma_{t,i}`` per round, as if it knew no reused noise
and never saw the estimate's copy: below what one receiver of a 4-ring actually learns,
``tests/privacy/test_privacy_harness.py``; 1.20-1.25x it over 50 full-batch rounds, ``docs/reproduction.md``),
and Theorem 1 (eq. 7), which also leaves out the decay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from pydantic import Field
from scipy import sparse

from decentdp.algorithms.base import Calibrated, Network, NoisePlan
from decentdp.algorithms.components.select_mix import InEdges, SelectMixSettings
from decentdp.errors import ConfigError, PrivacyError
from decentdp.privacy.accounting import calibrate_scale, narrow_bracket
from decentdp.privacy.baselines.paper import theorem1_epsilon, theorem1_noise_multiplier
from decentdp.privacy.discrete import grid_gaussian_release
from decentdp.privacy.events import gaussian_event
from decentdp.privacy.mechanisms import GaussianMechanism, NoiseDraw, add_noise, round_up_to_float32


class TopDPSettings(SelectMixSettings):
    """TOP-DP's switches (Figs. 10-11: TOP alone is ``decay_gamma = 1``, ND alone ``topology_aware = false``)."""

    topology_aware: bool = Field(True, description="reuse a neighbour's noise (eqs. 4-5); false: full noise on "
                                                   "every message (time-aware decay alone)")
    decay_gamma: float = Field(0.9, gt=0.0, le=1.0, description="gamma of eq. 6b (1: no decay)")
    decay_period: int = Field(1000, ge=1, description="rounds between two decays (eq. 6b's period)")


def decayed_history_event(sigma0: float, sample_rate: float, rounds: int, gamma: float, period: int,
                          setup_releases: int) -> dp_accounting.DpEvent:
    """The releases one receiver observes over a run: the setup phase's at ``sigma_0``, then one per round
    at ``sigma_0 gamma^floor(t / period)``."""
    parts = [dp_accounting.SelfComposedDpEvent(gaussian_event(sigma0, sample_rate), setup_releases)] \
        if setup_releases else []
    epochs, counts = np.unique(np.arange(rounds) // period, return_counts=True)
    parts += [dp_accounting.SelfComposedDpEvent(gaussian_event(sigma0 * gamma ** int(e), sample_rate), int(c))
              for e, c in zip(epochs, counts, strict=True)]
    return dp_accounting.ComposedDpEvent(tuple(parts))  # a tuple: events are cached by hash


def precision_factors(plan: NoisePlan, alpha: float, sigmas: np.ndarray, per_cover: bool,
                      topology_aware: bool) -> np.ndarray:
    """``f_i``: the most one round's noisy copies of agent ``i``'s sum can tell colluding receivers, as a
    multiple of one copy at ``sigma_i`` (``1 / sigma_eff^2 = f_i / sigma_i^2``).  A copy whose noise reuses
    neighbour ``k``'s (``rho = c_ik / sigma_i``, eq. 5a) keeps the residual ``sigma_i sqrt(1 - rho^2)`` (eq.
    5b) and counts ``1 / (1 - rho^2)``.  Algorithm 1 (``per_cover``) sends the estimate plus at most one
    message per neighbour that can cover a receiver (``N_i \\ ({k} u N_k)`` not empty); Algorithm 2 one
    copy, to its partner (any neighbour) or alone.  On a redrawn graph any agent may be a neighbour that covers."""
    n = len(sigmas)
    factors = np.ones(n)
    if not topology_aware:
        return factors
    batch = np.asarray(plan.sample_rates) * np.asarray(plan.sizes)
    sets = [set(nb) for nb in plan.neighbours]
    for i in range(n):
        candidates = [k for k in range(n) if k != i] if plan.redrawn else \
            [k for k in plan.neighbours[i] if not per_cover or sets[i] - {k} - sets[k]]
        if not candidates:
            continue
        rho = reuse_coefficients(alpha, sigmas, batch, np.full(len(candidates), i), np.array(candidates)) / sigmas[i]
        usable = 1 - rho**2 > 1e-12   # as residual_multipliers: else the message falls back to full noise
        terms = 1 / (1 - rho[usable] ** 2)
        factors[i] = 1 + terms.sum() if per_cover else max(1.0, float(terms.max(initial=1.0)))
    return factors


def replayed_factors(plan: NoisePlan, alpha: float, sigmas: np.ndarray, gamma: float, period: int) -> np.ndarray:
    """``(rounds, N)``: each round's precision factor of each agent's joint release in Algorithm 1, from the
    covers the run will draw (public: each round's graph and generator, ``plan.public``), replayed with
    ``sigmas`` (the float32 values the run draws with) decayed as its rounds decay them.  A factor is
    ``sigma_t^2`` times the precision of the estimate and every group message of the round."""
    assert plan.public is not None
    public = plan.public
    factors = np.ones((plan.rounds, len(sigmas)))
    planners: dict[int, CoverPlanner] = {}
    for k in range(plan.rounds):
        network = public.network(k)
        if id(network.out_edges) not in planners:   # (not setdefault: that builds a planner every round)
            planners[id(network.out_edges)] = CoverPlanner(network)
        planner = planners[id(network.out_edges)]
        sigma = sigmas * gamma ** (k // period)
        cover = planner.plan(alpha, sigma, public.expected_batches, public.generator(k))   # lines 10-17
        first = cover_groups(cover.via).first
        senders = planner.edges[first, 0]
        np.add.at(factors[k], senders, (sigma[senders] / cover.multiplier[first]) ** 2)
    return factors


def _unreachable_budget(error: PrivacyError, rounds: int, gamma: float, period: int) -> ConfigError:
    """The field to change when no sigma_0 meets a budget: the decay, where it shrinks the late rounds' noise
    (each decay step divides the noise the budget can buy by gamma), else the budget itself."""
    if gamma < 1 and rounds > period:
        steps = (rounds - 1) // period
        reason = str(error).removesuffix("; raise epsilon or delta")
        return ConfigError("algorithm.decay_gamma", f"{reason}: the noise decays to {gamma:g}^{steps} = "
                                                    f"{gamma ** steps:.3g} of sigma_0 by round {rounds} "
                                                    f"(algorithm.decay_period = {period}); raise decay_gamma "
                                                    "or decay_period, or the budget")
    return ConfigError("privacy.epsilon", str(error))


#: Damped steps towards the worst-case calibration's fixed point (each step's vector is raised until it passes).
FIXED_POINT_STEPS = 12


def calibrate_top_dp(plan: NoisePlan, alpha: float, gamma: float, period: int, setup_releases: int,
                     topology_aware: bool, per_cover: bool) -> Calibrated:
    """sigma_0 per agent such that the joint release of every round (all noisy copies of its sum, the
    colluding view) meets (epsilon_i, delta) over the decayed rounds: ``sigma_0,i = base_i sqrt(f_i)``,
    where ``base_i`` meets the budget with one release per round (:func:`decayed_history_event`) and
    ``f_i`` is :func:`precision_factors`, which depends on the neighbours' sigmas.  Any sigma vector with no
    joint multiplier ``sigma_i / sqrt(f_i)`` below its base, checked on the float32 values the run draws with,
    is sound.  Such vectors are found by raising short agents from the base and from damped steps towards the
    fixed point ``sigma = base sqrt(f(sigma))``; Algorithm 1 on a fixed graph also has the replayed covers' vector
    (:func:`_replayed_calibration`).  Of them, Algorithm 1 keeps the one that leaves the least noise in the local
    estimates (:func:`noise_left`); Algorithm 2 and redrawn graphs, with no fixed covers to replay the noise
    path on, the least mean sigma^2.  ``details`` records which, and what the other choice would have left."""
    if min(plan.degrees) < 1:
        agent = plan.degrees.index(min(plan.degrees))
        raise ConfigError("topology.graph", f"agent {agent} has no neighbour: TOP-DP needs at least one per agent")
    # RDP prices a decayed sequence in microseconds (PLD composes one distribution per decay step, seconds
    # each); its sigma is safe for every accountant, since tight and PLD are never above RDP.
    accountant = "rdp" if plan.relation == "add-remove" else plan.accountant
    cache: dict[tuple[float, float], float] = {}
    base = []
    for epsilon, rate in zip(plan.budgets, plan.sample_rates, strict=True):
        if (epsilon, rate) not in cache:
            try:
                cache[(epsilon, rate)] = calibrate_scale(
                    lambda s, q=rate: decayed_history_event(s, q, plan.rounds, gamma, period, setup_releases), 1,
                    epsilon, plan.delta, accountant, describe=f"{plan.rounds} decayed rounds at rate {rate}",
                    relation=plan.relation)
            except PrivacyError as error:
                raise _unreachable_budget(error, plan.rounds, gamma, period) from None
        base.append(cache[(epsilon, rate)] * (1 + 1e-9))  # a margin for the float64 sums of the ledger
    base = np.array(base)

    def drawn(values: np.ndarray) -> np.ndarray:
        return round_up_to_float32(torch.from_numpy(values)).double().numpy()

    def met(start: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """From ``start``, raise the short agents until every joint multiplier meets its base."""
        sigmas = start
        for _ in range(100):
            factors = precision_factors(plan, alpha, sigmas, per_cover, topology_aware)
            short = sigmas / np.sqrt(factors) < base
            if not short.any():
                return sigmas, factors
            sigmas = np.where(short, drawn(base * np.sqrt(factors) * (1 + 1e-7)), sigmas)
        return None

    first = met(drawn(base))
    if first is None:
        raise ConfigError("algorithm.alpha", "TOP-DP's noise could not be calibrated for these budgets: reusing "
                                             "neighbours' noise leaves residuals too small; try another alpha or "
                                             "topology_aware = false")
    # Raising alone stops far above what the test needs: from the base, where neighbours' noise looks almost
    # fully reusable, short agents are raised for factors that vanish once they are raised.  So also walk
    # towards the fixed point sigma = base sqrt(f(sigma)) with damped steps that may lower sigma, raise each
    # step's vector until it passes, and keep the passing vector with the least mean noise (a review measured
    # mean sigma^2 963 from raising alone where 125 passes, on Erdos-Renyi N = 30, p = 0.2, alpha = 0.25).
    # Two walks: from the raised vector, and from the base with alternate agents' sigma raised by half (equal
    # sigmas are a fixed point on symmetric graphs, e.g. a ring, where unequal ones can need less noise).
    candidates = [first]
    alternate = np.where(np.arange(len(base)) % 2 == 0, 1.0, 1.5)
    for sigmas in (first[0], drawn(base * alternate)):
        for _ in range(FIXED_POINT_STEPS):
            target = base * np.sqrt(precision_factors(plan, alpha, sigmas, per_cover, topology_aware))
            sigmas = drawn(np.maximum(base, (sigmas + target) / 2))
            passing = met(sigmas)
            if passing is not None:
                candidates.append(passing)
    worst_case = "the largest joint release the graph allows, every round, per agent"
    options = [(sigmas, factors, worst_case) for sigmas, factors in candidates]
    simulated = (per_cover and topology_aware and plan.public is not None and not plan.redrawn
                 and len(plan.degrees) + sum(plan.degrees) <= NOISE_PATH_STATE_LIMIT)
    if per_cover and topology_aware and plan.public is not None:
        # also sound: the replay shares one sigma per budget, which costs agents with few cover groups (the
        # leaves of a star) and spares the others
        replayed = _replayed_calibration(plan, alpha, gamma, period, setup_releases, drawn, base)
        if replayed is not None:
            options.append((replayed[0], replayed[1].max(axis=0),
                            "the joint releases of the covers the run will draw (public, replayed before the first "
                            "round), one sigma per budget"))
    selection: dict[str, Any]
    if simulated:
        # Of sound vectors, the least noise on average is not the least noise in the models: unequal sigmas stop
        # the reuse of eq. 5 (a neighbour's noise above one's own cannot be reused), and with it the messages that
        # carry a neighbour's row on (eq. 5c).  On Fig. 9's synchronous ring, mean sigma^2 85 without reuse leaves
        # 1.6x the noise that 215 with it leaves, and three seeds lost 1.2-1.5 accuracy points to it
        # (docs/reproduction.md).  So the vectors are compared by the run's own noise path.
        left = noise_left(plan, alpha, [option[0] for option in options], gamma, period)
        chosen = int(np.argmin(left))
        least = int(np.argmin([np.mean(option[0] ** 2) for option in options]))
        selection = {"selected_by": "the least noise left in the estimates (noise_left: the run's covers "
                                    f"replayed, its last {NOISE_PATH_ROUNDS} rounds exactly)",
                     "noise_left": float(left[chosen]), "least_mean_sigma2_noise_left": float(left[least]),
                     "sound_vectors_compared": len(options)}
    else:
        chosen = int(np.argmin([np.mean(option[0] ** 2) for option in options]))
        selection = {"selected_by": "the least mean sigma^2 (no noise path replayed: Algorithm 2, a redrawn "
                                    "graph, no topology-aware noise, or more than "
                                    f"{NOISE_PATH_STATE_LIMIT} agents and edges)"}
    sigmas, factors, method = options[chosen]
    paper = {
        "method": "TOP-DP Theorem 1 (eq. 7), the paper's calibration, reported beside ours",
        "noise_multiplier_theorem1": [theorem1_noise_multiplier(e, plan.delta, plan.rounds, n)
                                      for e, n in zip(plan.budgets, plan.sizes, strict=True)],
        "epsilon_theorem1": [theorem1_epsilon(s, plan.delta, plan.rounds, n)
                             for s, n in zip(sigmas.tolist(), plan.sizes, strict=True)],
        "decay": {"gamma": gamma, "period": period},
    }
    ours = {"view": "joint: every noisy copy of a round's sum (the estimate and each message) as one release",
            "calibrated_for": method, "base_noise_multipliers": base.tolist(),
            "precision_factors": factors.tolist(), **selection}
    return Calibrated(GaussianMechanism(torch.tensor(sigmas, dtype=torch.float32), plan.clip), sigmas.tolist(), paper,
                      ours)


#: Rounds before the end of a run over which :func:`noise_left` follows the covers exactly; older rounds are
#: weighted as the oldest quarter of them on average (by then the agents have mixed, and a round's noise reaches
#: the end through the network average alone, by a weight that no longer depends on its age).
NOISE_PATH_ROUNDS = 300
#: Largest state (agents plus directed edges) :func:`noise_left` follows: its quadratic form is a dense float64
#: matrix of that side (128 MB here), carried back one round at a time.
NOISE_PATH_STATE_LIMIT = 4000


def noise_left(plan: NoisePlan, alpha: float, vectors: Sequence[np.ndarray], gamma: float = 1.0,
               period: int = 1) -> np.ndarray:
    """Per sigma_0 vector, the expected mean squared noise Algorithm 1 leaves in the local estimates at the end of
    the run, in units of ``(lambda C)^2``: the run's own mixing with the gradient left out, on the covers and
    selections ``j*`` it will draw (public: replayed from ``plan.public``).  The state is the estimates ``x`` and
    the rows ``r`` each agent last received, and each round is linear in it::

        x_i^j = alpha x_i + (1 - alpha) r_ki + sigma_i^j / L_i z_g      (eq. 5c: the group g that reuses k's r_ki)
        x_i  <- alpha x_i + (1 - alpha) r_j*i + sigma_i / L_i z_i        (line 19)
        r_ij <- x_i^j where j is covered, else the new x_i                (lines 20-22)

    after the setup's ``x_i = sigma_i / L_i z_i``, sent to every neighbour (line 6).  The final mean square is
    a quadratic form ``Q`` of the state, carried back a round at a time (``Q <- A^T Q A``), so each fresh draw
    weighs ``b^T Q b`` (``b``: the rows it enters) times its variance: exact over the last
    :data:`NOISE_PATH_ROUNDS` rounds, the older rounds weighted as the oldest quarter of those on average.  The
    greedy cover depends on sigma only through which reuse is usable (eq. 5b), so the vectors that agree on it
    share the covers, the weights and one backward pass.  Checked against the rounds themselves with the
    gradient zeroed (``tests/algorithms/test_top_dp.py``)."""
    assert plan.public is not None
    public = plan.public
    network = public.network(0)
    planner, selector = CoverPlanner(network), InEdges(network)
    out, into = planner.edges, planner.in_edges
    in_row = {(int(s), int(d)): e for e, (s, d) in enumerate(into.tolist())}
    arrives_as = np.array([in_row[(int(s), int(d))] for s, d in out.tolist()], dtype=np.int64)
    batch = public.expected_batches
    stack = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    n, size = stack.shape[1], stack.shape[1] + len(into)           # state: the estimates, then each in-edge's row
    reused, sender = into[:, 0], into[:, 1]
    residual, usable = residual_multipliers(stack[:, sender],   # eq. 5a as reuse_coefficients, every vector at once
                                            (1 - alpha) * stack[:, reused] * batch[sender] / batch[reused])
    estimate_variance = (stack / batch) ** 2                                      # (V, N) per unit of decay
    message_variance = (residual / batch[sender]) ** 2                            # (V, E_in): the group reusing e
    decay = gamma ** (2 * (np.arange(plan.rounds) // period))
    exact = min(plan.rounds, NOISE_PATH_ROUNDS)
    left = np.zeros(len(stack))
    patterns = np.unique(usable, axis=0, return_inverse=True)[1].reshape(-1)
    for pattern in np.unique(patterns):
        members = np.flatnonzero(patterns == pattern)
        rounds = []
        for k in range(plan.rounds - exact, plan.rounds):   # each round's public generator is its own
            generator = public.generator(k)
            via = planner.plan(alpha, stack[members[0]], batch, generator).via                 # lines 10-17
            rounds.append((k, via, selector.choose(generator).cpu().numpy()))                  # line 18
        quadratic = np.zeros((size, size))
        quadratic[np.arange(n), np.arange(n)] = 1.0 / n
        recent = []
        for k, via, jstar in reversed(rounds):
            groups = cover_groups(via)
            # each new state row is an outbox row (lines 20-22): an estimate, or a group's message ...
            origin = np.empty(size, dtype=np.int64)
            origin[:n] = np.arange(n)
            origin[n + arrives_as] = np.where(groups.edge_group >= 0, n + groups.edge_group, out[:, 0])
            sent = n + len(groups.first)
            # ... which is (line 19, eq. 5c) alpha x_i + (1 - alpha) r, with r = r_j*i or the group's r_ki
            own = np.concatenate([np.arange(n), out[groups.first, 0]])
            read = np.concatenate([n + jstar, n + groups.via])
            mixes = sparse.csr_matrix((np.tile([alpha, 1 - alpha], sent), np.stack([own, read], 1).reshape(-1),
                                       np.arange(0, 2 * sent + 1, 2)), shape=(sent, size))
            copies = _copies(origin, sent)
            outbox = copies.T @ (copies.T @ quadratic).T          # the form on the outbox rows, S^T Q S
            # each outbox row's fresh draw weighs b^T Q b: sigma_i / L_i z_i and a group's residual z_g
            weights = np.diag(outbox)
            recent.append(estimate_variance[members] @ weights[:n]
                          + message_variance[members][:, groups.via] @ weights[n:])
            left[members] += decay[k] * recent[-1]
            quadratic = np.asarray(mixes.T @ (mixes.T @ outbox).T)  # a round back: A^T Q A, A = S C
        if exact < plan.rounds:   # the older rounds and the setup, at the mean weight of the oldest exact quarter
            settled = np.mean(recent[-max(1, exact // 4):], axis=0)
            left[members] += (decay[: plan.rounds - exact].sum() + 1.0) * settled
        else:                     # the setup (line 6): x_i and every neighbour's copy of it
            origin = np.empty(size, dtype=np.int64)
            origin[:n], origin[n + arrives_as] = np.arange(n), out[:, 0]
            copies = _copies(origin, n)
            left[members] += estimate_variance[members] @ np.diag(copies.T @ (copies.T @ quadratic).T)
    return left


def _copies(origin: np.ndarray, sources: int) -> sparse.csr_matrix:
    """``S``: row ``r`` of the state is a copy of row ``origin[r]`` of ``sources`` released rows."""
    return sparse.csr_matrix((np.ones(len(origin)), origin, np.arange(len(origin) + 1)), shape=(len(origin), sources))


def _replayed_calibration(plan: NoisePlan, alpha: float, gamma: float, period: int, setup_releases: int,
                          drawn: Callable[[np.ndarray], np.ndarray], base: np.ndarray,
                          ) -> tuple[np.ndarray, np.ndarray] | None:
    """sigma_0 per agent meeting its budget over the joint releases of the covers the run will draw: each
    agent's history is the setup release at sigma_0 and round t's joint Gaussian of multiplier
    ``sigma_0 gamma^floor(t / period) / sqrt(f_t)`` (:func:`replayed_factors`, each ``f_t`` rounded up to
    one of a few levels), priced by RDP at integer orders in closed form (:func:`_history_epsilon`; the
    run's ledger, RDP at more orders or PLD, is never above it).  Agents with the same budget and rate
    share one sigma, their largest need: which reuse is usable depends only on sigma ratios, so with
    one group the covers do not move and one replay settles it (with several, the groups' sigmas are
    raised until every agent's meets its own replayed history).  ``None`` under replace-one, or if that
    does not settle (the caller keeps the worst case)."""
    if plan.relation != "add-remove":
        return None
    epochs = (np.arange(plan.rounds) // period).astype(np.int64)

    def needed(epsilon: float, rate: float, history: np.ndarray) -> float:
        keys, counts = np.unique(np.stack([epochs, _rounded_up(history)]), axis=1, return_counts=True)
        coefficients = np.concatenate([np.ones(int(setup_releases > 0)), gamma ** keys[0] / np.sqrt(keys[1])])
        weights = np.concatenate([[setup_releases] if setup_releases else [], counts]).astype(np.float64)

        def excess(scale: float) -> float:  # log(spent / budget): decreasing in scale, nearly linear near the root
            return math.log(max(_history_epsilon(scale, coefficients, weights, rate, plan.delta), 1e-300) / epsilon)

        low, high = 1e-3, 1.0
        while excess(high) > 0:
            low, high = high, high * 2
        return narrow_bracket(excess, low, high, REPLAY_TOLERANCE)

    def need(sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        factors = replayed_factors(plan, alpha, sigmas, gamma, period)
        return np.array([needed(e, q, factors[:, i]) for i, (e, q) in
                         enumerate(zip(plan.budgets, plan.sample_rates, strict=True))]) * (1 + 1e-7), factors

    groups = np.unique(np.stack([plan.budgets, plan.sample_rates]), axis=1, return_inverse=True)[1].reshape(-1)
    sigmas = drawn(base)
    for _ in range(30):  # one sigma per (budget, rate) group, raised to its largest need until all are met
        required, factors = need(sigmas)
        if not (sigmas < required).any():
            return sigmas, factors
        largest = np.zeros(groups.max() + 1)
        np.maximum.at(largest, groups, required)
        sigmas = np.maximum(sigmas, drawn(largest[groups]))
    return None


#: Relative width to which the replay's sigma_0 is found (its safe end is kept, then raised by 1e-7).
REPLAY_TOLERANCE = 1e-12
#: Integer RDP orders of :func:`_history_epsilon` (a subset of orders only makes the converted epsilon larger).
INTEGER_ORDERS = np.arange(2, 129)
_LOG_BINOMIAL = np.array([[math.lgamma(a + 1) - math.lgamma(k + 1) - math.lgamma(a - k + 1) if k <= a else -np.inf
                           for k in range(INTEGER_ORDERS[-1] + 1)] for a in INTEGER_ORDERS])


def _history_epsilon(scale: float, coefficients: np.ndarray, counts: np.ndarray, rate: float, delta: float) -> float:
    """Epsilon at ``delta`` of ``counts[j]`` Poisson-sampled Gaussian releases of multiplier
    ``scale * coefficients[j]`` at rate ``rate``: RDP at integer orders in closed form (Mironov, Talwar &
    Zhang 2019: ``log sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)) / (a - 1)``), converted
    by dp_accounting's ``compute_epsilon`` (an order that overflowed to NaN counts as infinite, not as the
    epsilon of 0 that conversion would read from it)."""
    a = INTEGER_ORDERS[:, None].astype(np.float64)
    k = np.arange(INTEGER_ORDERS[-1] + 1, dtype=np.float64)[None, :]
    total = np.zeros(len(INTEGER_ORDERS))
    for coefficient, count in zip(coefficients.tolist(), counts.tolist(), strict=True):
        sigma = scale * coefficient
        if rate >= 1:
            total += count * INTEGER_ORDERS / (2 * sigma**2)
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = _LOG_BINOMIAL + (a - k) * math.log1p(-rate) + k * math.log(rate) + (k * k - k) / (2 * sigma**2)
        terms = np.where(k <= a, terms, -np.inf)
        peak = terms.max(axis=1)
        total += count * (peak + np.log(np.exp(terms - peak[:, None]).sum(axis=1))) / (INTEGER_ORDERS - 1)
    total = np.where(np.isnan(total), np.inf, total)
    return float(rdp_privacy_accountant.compute_epsilon(INTEGER_ORDERS, total, delta)[0])


#: Distinct precision factors one agent's replayed history is priced with (each round's rounded up to one of
#: them: sound, and a handful of composed events keeps calibration to a fraction of a second per agent).
HISTORY_LEVELS = 6


def _rounded_up(factors: np.ndarray) -> np.ndarray:
    """Each factor rounded up to one of at most :data:`HISTORY_LEVELS` levels: quantiles of its distinct values."""
    distinct = np.unique(factors)
    if len(distinct) <= HISTORY_LEVELS:
        return factors
    levels = np.unique(np.quantile(distinct, np.linspace(0, 1, HISTORY_LEVELS + 1)[1:], method="higher"))
    return levels[np.searchsorted(levels, factors)]


def reuse_coefficients(alpha: float, sigma: np.ndarray, expected_batch: np.ndarray, src: np.ndarray,
                       via: np.ndarray) -> np.ndarray:
    """``c_ik = (1 - alpha) sigma_k L_i / L_k`` for sender ``src[e]`` and reused neighbour ``via[e]`` (eq. 5a)."""
    return (1 - alpha) * sigma[via] * expected_batch[src] / expected_batch[via]


def residual_multipliers(sigma_sender: np.ndarray, reused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sqrt(sigma_i^2 - c_ik^2)`` (eq. 5b) and whether it is usable; where it is not (the neighbour's
    noise alone would exceed the sender's), the full ``sigma_i`` is returned instead."""
    variance = sigma_sender**2 - reused**2
    usable = variance > 1e-12 * sigma_sender**2
    return np.where(usable, np.sqrt(np.where(usable, variance, 1.0)), sigma_sender), usable


@dataclass(frozen=True)
class Cover:
    """One round's cover (Algorithm 1 lines 10-17) over the out-edges ``(i, j)``: ``via[e]`` is the
    in-edge ``(k, i)`` whose estimate the message to ``j`` reuses (-1: ``j`` gets the local estimate,
    lines 20-22), ``multiplier[e]`` its residual sigma, and the counts the run reports."""

    via: np.ndarray
    multiplier: np.ndarray
    fallback: int      # coverable edges left uncovered because every candidate's noise was too large
    uncoverable: int   # edges whose receiver is adjacent to all the sender's other neighbours


class CoverPlanner:
    """The greedy cover of eq. 4 for the agents one engine holds, over their neighbours in a random (public) order.

    The public graph (:meth:`Network.public_graph`, known to every agent) gives each neighbour ``k``'s own
    neighbours, so a shard of a sharded run covers its agents' out-edges exactly as the simulator
    does: ids are global, out- and in-edges are the shard's (rows of ``network.out_edges`` and
    ``network.in_edges``), and the random orders are drawn for every agent of the run in id order,
    so that the public generator ends in the same state on every shard.  Per sender, the receivers
    that each neighbour ``k`` can cover (``N_i \\ ({k} u N_k)``) are precomputed as bit masks over the
    sender's neighbours, so a round's greedy pass is a few integer operations per neighbour.

    ``max_groups`` bounds, over every agent of the run, the messages one sender's cover can form: a
    neighbour ``k`` forms one only if it can cover some receiver, ``N_i \\ ({k} u N_k)`` non-empty.
    """

    def __init__(self, network: Network) -> None:
        neighbours = network.public_graph().neighbours
        sets = [set(nb) for nb in neighbours]
        self.degrees = [len(nb) for nb in neighbours]
        self.max_groups = max((sum(len(sets[i]) - 1 > len(sets[i] & sets[k]) for k in mine)
                               for i, mine in enumerate(neighbours)), default=0)
        self.edges = network.out_edges.cpu().numpy()
        self.in_edges = network.in_edges.cpu().numpy()
        in_index = {(int(s), int(d)): e for e, (s, d) in enumerate(self.in_edges.tolist())}
        out_index = {(int(s), int(d)): e for e, (s, d) in enumerate(self.edges.tolist())}
        self.local = {int(i) for i in network.agent_ids.cpu().tolist()}
        #: per local sender i, per position p of neighbour k in its list: the mask of positions q of the
        #: receivers k can cover, the in-edge (k, i), and the out-edge (i, j) of every position q
        self.masks: dict[int, list[int]] = {}
        self.via_edge: dict[int, list[int]] = {}
        self.out_edge: dict[int, list[int]] = {}
        for i in sorted(self.local):
            mine = neighbours[i]
            self.masks[i] = [sum(1 << q for q, j in enumerate(mine) if j != k and j not in sets[k]) for k in mine]
            self.via_edge[i] = [in_index[(k, i)] for k in mine]
            self.out_edge[i] = [out_index[(i, j)] for j in mine]
        # N_i^j = N_i \ ({j} u N_j): the neighbours of i that can cover j
        self.coverable = np.array([bool(sets[i] - {j} - sets[j]) for i, j in self.edges.tolist()], dtype=bool)

    def plan(self, alpha: float, sigma: np.ndarray, expected_batch: np.ndarray, generator: torch.Generator) -> Cover:
        """One round's cover; ``sigma`` and ``expected_batch`` are indexed by global id (only the held agents'
        and their neighbours' entries are read)."""
        via = np.full(len(self.edges), -1, dtype=np.int64)
        multiplier = sigma[self.edges[:, 0]].astype(np.float64)
        k, i = self.in_edges[:, 0], self.in_edges[:, 1]                                   # line 13, per (k, i)
        residual, usable = residual_multipliers(sigma[i], reuse_coefficients(alpha, sigma, expected_batch, i, k))
        usable_list = usable.tolist()
        for agent, degree in enumerate(self.degrees):
            order = torch.randperm(degree, generator=generator, device=generator.device).tolist()  # line 12
            if agent not in self.local:
                continue
            masks, via_edge, out_edge = self.masks[agent], self.via_edge[agent], self.out_edge[agent]
            uncovered = (1 << degree) - 1
            for position in order:
                if not uncovered:
                    break
                in_edge = via_edge[position]
                if not usable_list[in_edge]:
                    continue
                targets = uncovered & masks[position]                                          # N_i^* n N_i^k
                uncovered &= ~targets                                                          # line 17
                while targets:                                                                 # lines 14-16
                    bit = targets & -targets
                    edge = out_edge[bit.bit_length() - 1]
                    via[edge], multiplier[edge] = in_edge, residual[in_edge]
                    targets ^= bit
        left = via < 0
        return Cover(via, multiplier, int((left & self.coverable).sum()), int((left & ~self.coverable).sum()))


@dataclass(frozen=True)
class CoverGroups:
    """A cover's messages (lines 14-16): one per in-edge ``(k, i)`` that covers some receivers of ``i``.

    ``via[g]`` is group ``g``'s in-edge, ``first[g]`` the first out-edge it covers (its residual
    multiplier and noise key), and ``edge_group[e]`` the group of out-edge ``e`` (-1: uncovered)."""

    via: np.ndarray
    first: np.ndarray
    edge_group: np.ndarray


def cover_groups(via: np.ndarray) -> CoverGroups:
    """Group a cover's out-edges by the neighbour estimate they reuse (``via``, -1 for uncovered)."""
    covered = np.flatnonzero(via >= 0)
    group_via, first, inverse = np.unique(via[covered], return_index=True, return_inverse=True)
    edge_group = np.full(len(via), -1, dtype=np.int64)
    edge_group[covered] = inverse.reshape(-1)
    return CoverGroups(group_via.astype(np.int64), covered[first].astype(np.int64), edge_group)


class RowGaussian:
    """Gaussian noise with a multiplier per released row, and what each view observes of it.

    ``multipliers[r]`` (float64, rounded up to float32 when drawn) is row ``r``'s noise; ``full[o]``
    is local agent ``o``'s sigma_t, what each receiver is charged in view (a); ``edges`` are the
    out-edges as (sender's local row, receiver's global id): the receivers that observe the sender
    this round (the ledger's sender rows are local, its receivers global ids)."""

    #: Rows drawn per block: one row of the paper's MLP (79,510 floats) is 318 KB, so the block stays in
    #: a core's L2 cache while it is scaled and added, instead of a second (R, d) buffer in memory.
    BLOCK_BYTES = 2**19

    def __init__(self, multipliers: np.ndarray, owners: np.ndarray, full: np.ndarray, clip: float,
                 edges: np.ndarray) -> None:
        self.multipliers = np.asarray(multipliers, dtype=np.float64)
        self.owners = np.asarray(owners, dtype=np.int64)
        self.full = np.asarray(full, dtype=np.float64)
        self.clip = float(clip)
        self.edges = edges
        self.scales = round_up_to_float32(torch.from_numpy(self.multipliers * self.clip))

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        """``values[r] += scales[r] * N(0, 1)``, drawn block by block into one small buffer (eq. 5b's residual
        noise, or the full sigma_t for local estimates and uncovered receivers)."""
        if noise.exact:  # secure mode: the rounded Gaussian release, sampled exactly on a grid
            released = noise.on_grid(grid_gaussian_release, owners.tolist(), values.double().cpu().numpy(), self.clip,
                                     self.multipliers, slots)
            values.copy_(torch.from_numpy(released))
            return
        count, dim = values.shape
        rows, keys = owners.tolist(), None if slots is None else list(slots)
        block = max(1, min(count, self.BLOCK_BYTES // (values.element_size() * dim)))
        buffer = torch.empty(block, dim, dtype=noise.dtype, device=values.device)
        scales = self.scales.to(values.device)
        for start in range(0, count, block):
            stop = min(count, start + block)
            draws = noise.normal(rows[start:stop], buffer[: stop - start], None if keys is None else keys[start:stop])
            add_noise(values[start:stop], draws, scales[start:stop])

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> dp_accounting.DpEvent:
        """View (b): all of the owner's rows on one batch, one Gaussian with ``sum_r sigma_r^-2``."""
        mine = self.multipliers[self.owners == owner]
        return gaussian_event(float(np.sum(mine**-2.0) ** -0.5), sample_rate)

    def receiver_event(self, owner: int, sample_rate: float) -> dp_accounting.DpEvent:
        """View (a): the noise a receiver does not know, sigma_{t,i} (eq. 5a)."""
        return gaussian_event(float(self.full[owner]), sample_rate)

    def observed_by(self, senders: np.ndarray, receivers: np.ndarray,
                    rates: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[dp_accounting.DpEvent]]:
        """Every neighbour of a releasing agent observes it this round (now, or inside a later estimate)."""
        keep = np.isin(self.edges[:, 0], np.unique(senders))
        src, dst = self.edges[keep, 0], self.edges[keep, 1]
        events = {int(i): self.receiver_event(int(i), float(rates[i])) for i in np.unique(src)}
        return src, dst, [events[int(i)] for i in src]


def report(counts: dict[str, int]) -> dict[str, Any]:
    """The run report's TOP-DP counters, with the fraction of messages that reused a neighbour's noise."""
    total = counts["reduced"] + counts["full"]
    return {**counts, "reduced_fraction": counts["reduced"] / total if total else math.nan}


#: Names of the counters TOP-DP keeps in its state (checkpointed with it): messages with residual noise,
#: with full noise, coverable ones that fell back to full noise, and uncoverable ones.
COUNTERS: tuple[str, ...] = ("reduced", "full", "fallback", "uncoverable")
