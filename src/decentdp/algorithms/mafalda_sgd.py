"""MAFALDA-SGD (Bellet, Cyffers et al., ICLR 2026, arXiv:2510.17480): decentralized SGD with matrix-factorization noise.

Every agent adds correlated noise to its gradients, the same lower-triangular ``C`` for all agents, optimised for
the run's graph so that the noise left in the agents' *models* is smallest (authors' code
``github.com/dimiarbre/MFDL``, MIT; the paper's text was not reachable, so lines cite that code, under
``MFDL/simulations/``)::

    g_u^t = (1 / L_u) (sum_b clip_C(grad l(x_u^t; b)) + sigma_u C (C^{-1} Z_u)_t)      (mfdl_optimizer.py:164-199)
    x_u^{t+1/2} = x_u^t - eta g_u^t                                                   (local step)
    x_u^{t+1}   = sum_v w_uv x_v^{t+1/2}                                              (average_step, :111-133)

with ``Z_u`` i.i.d. standard normal rows (row ``t`` drawn in round ``t``: ``decentralized_simulation.py:67-106,
:243``; ``(C^{-1} Z_u)_t`` by forward substitution from the previous outputs, which the state keeps) and batches
by cyclic participation (``data.sampling = 'cyclic'``, ``b`` fixed batches, batch ``t mod b`` in round ``t``:
``data_utils.py:8-45``).  ``C`` minimises ``tr(G X^{-1})``,
``X = C^T C``, under the participation's constraints (:mod:`decentdp.privacy.factorization`; workload ``p = 1``,
the models after averaging: ``workloads_generator.py:507-509``), with ``W`` the run's own mixing matrix and the
objective corrected (both explained there).  ``algorithm.factorization = 'independent'`` keeps ``C`` diagonal
(independent noise at the same participation: DP-D-SGD's, the authors' baseline) for comparisons.

**Privacy.** Each agent's noisy gradients are ``C x + sigma Z`` after the public map ``C``: one Gaussian mechanism
of multiplier ``sigma / sens(C)`` over the whole run (``sens(C) = 1`` after optimisation; a record is in one batch,
so it moves the ``ceil(T / b)`` rounds of that batch only). Its (epsilon, delta) is charged to the ledger once,
before round 0 (``privacy.epsilon``, the local epsilon: every observer together), and the rounds charge nothing
more. What one agent, or a ``privacy.colluding`` set, learns of each sender from the messages it receives is priced
by the observer-view accountant over the run's explicit view, each data term in its participation class
(:mod:`decentdp.privacy.observer_pricing`), capped by the local epsilon: ``nonadaptive_epsilon_pairwise_network`` /
``nonadaptive_epsilon_pairwise_max``, exact only for gradients fixed in advance
(:mod:`decentdp.privacy.observer_pricing`; the local epsilon is the sound bound). The authors' own guarantee, local
``mu``-GDP with ``mu = sens(C) / sigma`` converted by their ``delta(epsilon)`` (``epsilon_computation.py:10-18``),
is ``paper_epsilon_local``.

**State.**  A dense ``C`` needs every past output: ``noise_history`` keeps ``T`` rows of ``d`` per agent (``N T d``
numbers: 6.5 GB at N = 16, T = 1000 and an MLP of 10^5 parameters).  ``algorithm.bands = k`` keeps ``C`` (and
``X = C^T C``) to ``k`` diagonals, as banded matrix factorization does (BandMF, Choquette-Choo et al., NeurIPS
2023), so the state holds ``k`` rows per agent; with ``k`` at most the participation period ``b``, the mask holds
by itself.  On MNIST's 16-agent ring (T = 1000, b = 50) the models' noise ``tr(G X^{-1})`` is 0.053 of independent
noise's dense, 0.062 with 50 bands and 0.073 with 32 (``benchmarks/factorization.py``, ``docs/reproduction.md``).
A run whose history does not fit its memory plan is refused.  The history is the agents' secret noise: a
checkpoint that holds it, with the messages, reveals the gradients (treat it like the private data).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from threadpoolctl import threadpool_limits

from decentdp.algorithms.base import (
    AlgorithmSettings,
    Calibrated,
    NoisePlan,
    RoundContext,
    RunFacts,
    SettingsAlgorithm,
    State,
)
from decentdp.algorithms.muffliato import dense_mixing
from decentdp.algorithms.registry import register
from decentdp.errors import ConfigError
from decentdp.privacy.accounting import calibrate_noise_multiplier, gaussian_dp_epsilon
from decentdp.privacy.factorization import (
    MAX_ITERATIONS,
    Factorization,
    MatrixFactorizationMechanism,
    run_factorization,
)
from decentdp.privacy.mechanisms import round_up_to_float32
from decentdp.privacy.observer_pricing import Builder, ViewRecipe, pairwise_results, priced_view
from decentdp.privacy.observer_view import LinearView
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.results.files import epsilon_json

#: Who ``privacy.epsilon`` (the ledger's budget) names for this algorithm.
LOCAL_VIEW = ("everyone together: every message of the agent, every other agent's noise and data known; the whole "
              "run's correlated noise priced as one Gaussian mechanism of multiplier sigma / sens(C), charged before "
              "round 0, under cyclic participation (a record in the rounds of its one batch; no amplification)")


class MafaldaSettings(AlgorithmSettings):
    """MAFALDA-SGD's settings: which factorization, and how long its optimiser may run."""

    factorization: Literal["optimal", "independent"] = Field(
        "optimal", description="optimal: C optimised for the run's graph (MAFALDA); independent: C diagonal, "
                               "independent noise at the same participation (DP-D-SGD's, for comparison)")
    optimizer_iterations: int = Field(MAX_ITERATIONS, ge=1, le=10_000,
                                      description="most iterations of the factorization's optimiser (about "
                                                  "0.5 s each at T = 1000)")
    bands: int | None = Field(None, ge=1, description="C's non-zero diagonals (banded factorization: each agent "
                                                      "keeps this many past noise rows instead of T); unset: dense")


@register
class MafaldaSGD(SettingsAlgorithm):
    """Decentralized SGD whose agents add matrix-factorization noise, optimised for the run's graph."""

    name: ClassVar[str] = "mafalda-sgd"
    reports_colluding: ClassVar[bool] = True
    Settings = MafaldaSettings
    samplings: ClassVar[tuple[str, ...]] = ("cyclic",)
    sampling_note: ClassVar[str] = ("its correlated noise is priced over the whole run, where no amplification by "
                                    "Poisson sampling is proven; use data.sampling = 'cyclic' (b fixed batches, the "
                                    "participation its factorization is optimised for)")
    fixed_graph_reason: ClassVar[str | None] = "its factorization is optimised for one fixed graph"
    noise_modes: ClassVar[tuple[str, ...]] = ("simulation",)
    noise_mode_note: ClassVar[str] = ("it draws its correlated noise in simulation mode only (secure mode's hardened "
                                      "float64 draws are not combined yet)")

    def __init__(self, settings: MafaldaSettings) -> None:
        super().__init__(settings)
        self.factorization: Factorization | None = None

    @property
    def round_temporaries(self) -> int:
        return 3  # the gradient, the half step, the mixed models

    def calibrate(self, plan: NoisePlan) -> Calibrated:
        """The factorization for the run's graph, rounds and participation, and each agent's ``sigma_u`` so that its
        whole-run Gaussian (multiplier ``sigma_u / sens(C)``) meets its budget; the ledger charges it before round 0."""
        lonely = [agent for agent, neighbours in enumerate(plan.neighbours) if not neighbours]
        if lonely:
            raise ConfigError("topology.graph", f"agent(s) {lonely} have no neighbour: mafalda-sgd's factorization is "
                                                "optimised for the averaging with neighbours; choose a connected graph")
        if plan.public is None or plan.period is None:  # (the config admits cyclic sampling only: `samplings`)
            raise ValueError("mafalda-sgd calibrates on the run's public graph and cyclic batches (NoisePlan.public, "
                             "NoisePlan.period)")
        w = dense_mixing(plan.public.network(0))
        iterations = self.settings.optimizer_iterations if self.settings.factorization == "optimal" else 0
        factorization = run_factorization(w, plan.rounds, plan.period, max_iterations=iterations,
                                          bands=self.settings.bands)
        self.factorization = factorization
        sens = factorization.sensitivity
        multipliers = [0.0 if math.isinf(budget) else calibrate_noise_multiplier(
            budget, plan.delta, 1.0, 1, 1, plan.accountant, relation=plan.relation) for budget in plan.budgets]
        # sigma / sens(C) must not fall below the calibrated multiplier by rounding: the noise is built with C in
        # float32, whose sensitivity is 1 + 1e-8 where C's is 1 (a helper's measurement, 10 agents), so 1e-6 of slack
        sigmas = round_up_to_float32(torch.tensor(multipliers, dtype=torch.float64) * sens * (1 + 1e-6)).double()
        mechanism = MatrixFactorizationMechanism(sigmas.float(), plan.clip, factorization)
        mu = [sens / sigma if sigma > 0 else math.inf for sigma in sigmas.tolist()]
        paper = {"paper_mu_local": mu,
                 "paper_epsilon_local": [gaussian_dp_epsilon(value, plan.delta) for value in mu],
                 "paper_epsilon_local_view": "the authors' guarantee: local mu-GDP of each node's whole stream, mu = "
                                             "sens(C) / sigma under cyclic participation, converted by delta(eps) = "
                                             "Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) "
                                             "(epsilon_computation.py:10-18); add/remove, whatever the run's relation"}
        details = {"factorization": self.settings.factorization, "bands": factorization.bands,
                   "rounds": plan.rounds, "batches": plan.period,
                   "epochs": -(-plan.rounds // plan.period), "sensitivity": sens, "noise_loss": factorization.loss,
                   "noise_loss_independent": factorization.independent_loss,
                   "noise_loss_ratio": factorization.loss / factorization.independent_loss,
                   "optimizer_iterations": factorization.iterations, "optimizer_seconds": factorization.seconds,
                   "noise_history_bytes": 4 * len(plan.budgets) * factorization.bands * plan.dim}
        return Calibrated(mechanism, sigmas.tolist(), paper, details, LOCAL_VIEW)

    @property
    def history_rows(self) -> int:
        """The past noise outputs each agent keeps (0 before calibration: a non-private run keeps no history)."""
        return 0 if self.factorization is None else self.factorization.bands

    def memory_refusal(self, agents: int, dim: int, rounds: int, limit_bytes: int | None) -> ConfigError | None:
        """The refusal of a run whose noise history (``N min(T, bands) d`` float32 numbers) does not fit the memory
        plan beside one round's work, naming the setting; asked before the factorization is computed."""
        rows = rounds if self.settings.bands is None else min(self.settings.bands, rounds)
        needed = 4 * agents * rows * dim
        if limit_bytes is None or needed + 4 * (self.round_temporaries + 1) * agents * dim <= limit_bytes:
            return None
        field, remedy = (("experiment.rounds", "set algorithm.bands (a banded C keeps that many rows), or use fewer "
                          "rounds, agents or parameters") if self.settings.bands is None else
                         ("algorithm.bands", "use fewer bands, agents or parameters"))
        return ConfigError(field, f"mafalda-sgd keeps each agent's {rows} past noise rows of {dim} parameters: "
                                  f"{needed / 2**30:.3g} GiB for {agents} agents, beyond the "
                                  f"{limit_bytes / 2**30:.3g} GiB of the memory plan (engine.memory_limit_gb); "
                                  f"{remedy}")

    def init_state(self, params: torch.Tensor) -> State:
        history = torch.zeros(params.shape[0], self.history_rows, params.shape[1], dtype=params.dtype,
                              device=params.device)
        return {"params": params, "noise_history": history}

    def setup(self, state: State, ctx: RoundContext) -> State:
        """Before round 0: each agent's whole-run event charged to its ledger (refused agents release nothing)."""
        ctx.oracle.prepay()
        return state

    def round(self, state: State, ctx: RoundContext) -> State:
        oracle, history = ctx.oracle, state["noise_history"]
        mechanism = None if oracle.mechanism is None else oracle.mechanism.with_history(history)
        grad = oracle.gradient(state["params"], mechanism)                 # mfdl_optimizer.py:164-199
        half = state["params"] - ctx.lr * grad                             # local noisy step
        return {"params": ctx.network.mix(half), "noise_history": history}  # average_step

    # -- the run's view, for the observer-view accountant ----------------------------------------------------------
    def view_recipe(self, facts: RunFacts) -> ViewRecipe:
        """The run's view (:mod:`decentdp.privacy.observer_pricing`): dense only, since the correlated noise of a
        dense ``C`` makes the carried state grow with the rounds."""
        n = len(facts.noise_multipliers)
        w = dense_mixing(facts.network(0))
        received = facts.rounds * ((w > 0) & ~np.eye(n, dtype=bool)).sum(axis=1)
        return ViewRecipe(received.tolist(), n * facts.rounds, n * facts.rounds, state_size=n, round_sources=2 * n,
                          unroll=lambda builder: self.unroll(builder, facts), recursive_form=False)

    def linear_view(self, facts: RunFacts) -> LinearView:
        """The whole run as one explicit :class:`~decentdp.privacy.observer_view.LinearView`."""
        return self.view_recipe(facts).dense().view()

    def unroll(self, builder: Builder, facts: RunFacts) -> None:
        """Every round over sources: each agent's data term of round ``t`` (participation class ``t mod b``), its
        fresh draw ``z_t`` (std ``sigma_u``, held by itself alone), the injected ``sum_{s <= t} (C^{-1})_{ts} z_s``,
        the half step every neighbour receives, the averaging.  The initial model is public."""
        n = len(facts.noise_multipliers)
        if self.factorization is None:
            raise ValueError("the view of a run needs its factorization (a private run's calibration)")
        c_inverse, period = self.factorization.c_inverse, self.factorization.period
        w = dense_mixing(facts.network(0))
        receiver, sender = np.nonzero((w > 0) & ~np.eye(n, dtype=bool))   # v averages u's half step: u sends to v
        own = [{agent} for agent in range(n)]
        rows = np.arange(n)[:, None]
        columns = np.zeros((facts.rounds, n), dtype=np.int64)
        theta = builder.zeros(n)
        for t in range(facts.rounds):
            theta = builder.carry(theta)
            data = builder.data(range(n), [t % period] * n)
            draws = builder.noise(facts.noise_multipliers, own)
            columns[t] = draws.argmax(axis=1)                              # each draw is a unit expression
            injected = np.zeros_like(draws)
            injected[rows, columns[:t + 1].T] = c_inverse[t, :t + 1]
            half = theta - (facts.lr(t) / facts.expected_batches)[:, None] * (data + injected)
            builder.send(receiver, half[sender])
            theta = w @ half

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """Each sender's epsilon towards each single agent and ``privacy.colluding`` set (the observer-view
        accountant, class by class, capped by the local epsilon), and the local epsilon itself."""
        local = np.asarray(facts.local_epsilon, dtype=float)
        n = len(local)
        observers = [[agent] for agent in range(n)] + [list(members) for members in facts.colluding]
        if self.factorization is None or not (facts.noise_multipliers > 0).all():
            capped = np.repeat(local[:, None], len(observers), axis=1)
            note = "an agent adds no noise: each sender's local epsilon"
        else:
            with threadpool_limits(limits=torch.get_num_threads(), user_api="blas"):  # the run's threads
                capped, note = priced_view(local, self.view_recipe(facts), observers, facts.relation, facts.delta)
        labelled: dict[str, Any] = {"epsilon_local": epsilon_json(local),
                                    "epsilon_local_max": epsilon_json(float(local.max()) if n else 0.0)}
        result = pairwise_results(capped, facts.colluding, note, labelled)
        return AlgorithmPrivacy(result.report, ("nonadaptive_epsilon_pairwise_max", "epsilon_local_max"),
                                result.pairwise)

