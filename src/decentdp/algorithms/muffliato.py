"""Muffliato-SGD (Cyffers, Even, Bellet, Massoulié, NeurIPS 2022, arXiv:2206.05091; specs B.2), a baseline of DPDL.

Each round every agent injects one noisy gradient step, then the agents run ``K`` noise-free
Chebyshev-accelerated gossip steps (authors' ``private_step_gd`` and ``acceleratedsimulation``)::

    u_v = (sum_b clip_C(grad l(theta_v; b)) + sigma_v C xi) / L_v        (step 1: one release per round)
    u_v <- u_v min(1, G / |u_v|)                                          (step 2: post-processing clip)
    y^0 = theta - eta u                                                   (step 3)
    y^1 = W y^0 ;  y^{t+1} = gamma W y^t + (1 - gamma) y^{t-1}            (step 4, t < K)
    gamma = 2 (1 - sqrt(l2 (1 - l2/4))) / (1 - l2/2)^2                    (``gamma_tcheb``)

with ``l2`` the spectral gap of ``W`` (Metropolis-Hastings, the authors' ``hamilton`` weights, is
``topology.mixing = "metropolis-hastings"``) and ``K = T_mix`` by default (``graphutils.T_mix``,
with sigma the agents' median noise multiplier, at least 1/2 so that a non-private run gets
``log(N) / sqrt(l2)`` steps).  The graph may be redrawn each round (``topology.redraw_every``).

**Accounting.** Budgets hold on the ledger's per-agent (local-DP) view, which bounds every observer: whatever a
node sees is post-processing of the senders' releases. What one node ``v`` learns of ``u`` is priced by the
observer-view accountant (:mod:`decentdp.privacy.observer_pricing`: over the explicit view, or round by round for a
long run) over the run's whole view: every gossip message of every round, each agent's own sigma, the run's
neighbouring relation, and what ``v`` knows (its own injections); reported as
``nonadaptive_epsilon_pairwise_network`` (row ``u``, column ``v``; never above ``u``'s local epsilon) and
``nonadaptive_epsilon_pairwise_max``: exact only for gradients fixed in advance, since ``v`` does not see the model
``u`` takes its gradient at, which carries noise ``v`` does not hold (a 4-agent path exceeds it,
:mod:`decentdp.privacy.observer_view`); the sound bound for every observer is the local epsilon. A direct neighbour
receives ``u``'s noisy injection itself, so its epsilon is the local one. The authors' bound (``contrib``,
:mod:`decentdp.privacy.network_dp`), which composes messages that share one noise vector as if independent and each
round separately, is reported as ``paper_epsilon_pairwise_network``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import AlgorithmSettings, Network, RoundContext, RunFacts, SettingsAlgorithm, State
from decentdp.algorithms.registry import register
from decentdp.privacy import network_dp
from decentdp.privacy.accounting import RDP_ORDERS
from decentdp.privacy.observer_pricing import Builder, ViewRecipe, pairwise_results, priced_view
from decentdp.privacy.observer_view import LinearView
from decentdp.privacy.report import AlgorithmPrivacy
from decentdp.results.files import epsilon_json


class MuffliatoSettings(AlgorithmSettings):
    """Muffliato's settings (specs B.2)."""

    gossip_steps: int = Field(0, ge=0, description="accelerated gossip steps per round (0: T_mix of the graph)")
    update_clip: float | None = Field(None, gt=0, description="G: post-processing clip of the noisy gradient "
                                                              "(the authors' L; none by default)")


def accelerated_gossip(network: Network, x: torch.Tensor, steps: int, gamma: float) -> torch.Tensor:
    """``steps`` Chebyshev-accelerated gossip steps from ``y^0 = x``: ``y^1 = W y^0``, then
    ``y^{t+1} = gamma W y^t + (1 - gamma) y^{t-1}``."""
    previous, current = x, network.mix(x)
    for _ in range(steps - 1):
        previous, current = current, network.mix_add(current, previous, (1 - gamma) / gamma).mul_(gamma)
    return current


def dense_mixing(network: Network) -> np.ndarray:
    """The whole run's mixing matrix W (public, :meth:`Network.public_graph`) as the network applies it: its
    weights rounded to the network's dtype, in float64."""
    w = network.public_graph().dense_mixing()
    return torch.from_numpy(w).to(network.in_weights.dtype).double().numpy()


@register
class Muffliato(SettingsAlgorithm):
    """Muffliato-SGD: one noisy gradient step, then accelerated gossip; pairwise network-DP accounting."""

    name: ClassVar[str] = "muffliato"
    reports_colluding: ClassVar[bool] = True
    Settings = MuffliatoSettings

    def __init__(self, settings: MuffliatoSettings) -> None:
        super().__init__(settings)
        self._graph: tuple[Network, float, int, np.ndarray] | None = None

    @property
    def round_temporaries(self) -> int:
        return 4  # the gradient, the step and two gossip iterates

    def init_state(self, params: torch.Tensor) -> State:
        rdp = torch.zeros(params.shape[0], params.shape[0], len(RDP_ORDERS), dtype=torch.float64,
                          device=params.device)
        return {"params": params, "pairwise_rdp": rdp}

    def gossip(self, w: np.ndarray, sigmas: np.ndarray, n_total: int) -> tuple[float, int]:
        """gamma and K of a graph with mixing matrix ``w`` (K = T_mix unless ``gossip_steps`` is set), from
        every agent's sigma (public): the median, at least 1/2."""
        gap = network_dp.spectral_gap(w)
        sigma = max(0.5, float(np.median(sigmas)))
        steps = self.settings.gossip_steps or network_dp.mixing_steps(gap, n_total, sigma)
        return network_dp.chebyshev_gamma(gap), steps

    def _prepare(self, ctx: RoundContext, sigmas: np.ndarray) -> tuple[float, int, np.ndarray]:
        """gamma, K and the authors' pairwise coefficients of this round's network (computed once per graph)
        from the whole graph's W and every agent's sigma (public), the coefficients' rows those of the
        local senders (the rows of the state's ``pairwise_rdp`` held here)."""
        net = ctx.network
        if self._graph is None or self._graph[0] is not net:
            w = dense_mixing(net)
            gamma, steps = self.gossip(w, sigmas, net.n_total)
            polys = network_dp.gossip_polynomials(w, steps, gamma)[:steps]  # messages y^0 .. y^{K-1}
            coefficients = network_dp.pairwise_coefficients(polys, (w > 0).astype(float))
            self._graph = (net, gamma, steps, coefficients[net.agent_ids.cpu().numpy()])
        return self._graph[1], self._graph[2], self._graph[3]

    def round(self, state: State, ctx: RoundContext) -> State:
        oracle = ctx.oracle
        sigmas = np.zeros(ctx.network.n_total) if oracle.mechanism is None else \
            oracle.mechanism.noise_multipliers.double().cpu().numpy()        # every agent's (public)
        gamma, steps, coefficients = self._prepare(ctx, sigmas)
        update = oracle.gradient(state["params"])                                    # step 1
        if self.settings.update_clip is not None:                                   # step 2
            update.mul_((self.settings.update_clip / update.norm(dim=1, keepdim=True).clamp(min=1e-12)).clamp(max=1))
        injected = update.mul_(-ctx.lr).add_(state["params"])                       # step 3
        params = accelerated_gossip(ctx.network, injected, steps, gamma)             # step 4
        rdp = network_dp.round_pairwise_rdp(coefficients, sigmas[ctx.network.agent_ids.cpu().numpy()],  # local senders
                                            oracle.sample_rates.double().cpu().numpy())
        return {"params": params,
                "pairwise_rdp": state["pairwise_rdp"] + torch.from_numpy(rdp).to(state["pairwise_rdp"].device)}

    def _rounds(self, facts: RunFacts) -> Iterator[tuple[np.ndarray, float, int]]:
        """Each round's (W, gamma, K) in turn, computed once per graph (a redrawn graph is a new network);
        one graph's W is held at a time."""
        n = len(facts.noise_multipliers)
        current: Network | None = None
        for k in range(facts.rounds):
            network = facts.network(k)
            if network is not current:  # a new graph (a redrawn one), else the last round's values
                w = dense_mixing(network)
                current, values = network, (w, *self.gossip(w, facts.noise_multipliers, n))
            yield values

    def view_recipe(self, facts: RunFacts) -> ViewRecipe:
        """The run's view for the observer-view accountant (:mod:`decentdp.privacy.observer_pricing`): its
        sizes, counted without building it, and :meth:`unroll`."""
        n = len(facts.noise_multipliers)
        received = np.zeros(n, dtype=np.int64)
        for w, _, steps in self._rounds(facts):
            received += steps * ((w > 0) & ~np.eye(n, dtype=bool)).sum(axis=1)
        return ViewRecipe(received.tolist(), n * facts.rounds, n * facts.rounds, state_size=n, round_sources=2 * n,
                          unroll=lambda builder: self.unroll(builder, facts))

    def linear_view(self, facts: RunFacts) -> LinearView:
        """The whole run as one explicit :class:`~decentdp.privacy.observer_view.LinearView`."""
        return self.view_recipe(facts).dense().view()

    def unroll(self, builder: Builder, facts: RunFacts) -> None:
        """Steps 1-4 of every round unrolled over sources: each agent's injection
        ``theta_v - (eta / L_v)(x_v + sigma_v xi_v)`` (its noise known to itself alone), then every gossip
        message ``y^t_w`` (``t < K``) that ``w`` sends to each neighbour.  The initial model is public; the
        models are the state carried between rounds."""
        n = len(facts.noise_multipliers)
        own = [{agent} for agent in range(n)]
        theta = builder.zeros(n)
        for k, (w, gamma, steps) in enumerate(self._rounds(facts)):
            theta = builder.carry(theta)
            receiver, sender = np.nonzero((w > 0) & ~np.eye(n, dtype=bool))   # v mixes w's value: w sends to v
            scale = facts.lr(k) / facts.expected_batches
            noisy = builder.data(range(n)) + facts.noise_multipliers[:, None] * builder.noise(np.ones(n), own)
            previous = theta - scale[:, None] * noisy                                      # step 3: y^0
            builder.send(receiver, previous[sender])
            current = w @ previous                                                         # y^1
            for _ in range(steps - 1):                                                     # y^2 .. y^K
                builder.send(receiver, current[sender])
                previous, current = current, gamma * (w @ current) + (1 - gamma) * previous
            theta = current

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """eps_{u->v} (and towards each ``privacy.colluding`` set): the observer-view accountant's, capped by u's
        local epsilon (:func:`~decentdp.privacy.observer_pricing.priced_view`), or the local epsilon alone when
        the view is too large or not linear (a post-processing clip); and the authors' bound, labelled
        ``paper_``."""
        local = np.asarray(facts.local_epsilon, dtype=float)
        n = len(local)
        observers = [[agent] for agent in range(n)] + [list(members) for members in facts.colluding]
        capped = np.repeat(local[:, None], len(observers), axis=1)
        if self.settings.update_clip is not None:
            note = "not linear (algorithm.update_clip clips the noisy update): each sender's local epsilon"
        elif not (facts.noise_multipliers > 0).all():
            note = "an agent adds no noise: each sender's local epsilon"
        else:
            capped, note = priced_view(local, self.view_recipe(facts), observers, facts.relation, facts.delta)
        paper = np.minimum(network_dp.pairwise_epsilon(state["pairwise_rdp"].cpu().numpy(), facts.delta),
                           local[:, None])
        np.fill_diagonal(paper, 0.0)
        return pairwise_results(capped, facts.colluding, note, {"paper_epsilon_pairwise_network": epsilon_json(paper)})

