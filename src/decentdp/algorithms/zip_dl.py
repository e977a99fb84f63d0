"""Zip-DL (Biswas, Frey, Gaudel, Kermarrec, Lerévérend, Pires, Sharma, Taïani, PoPETs 2025): zero-sum noise.

Each round every agent takes its local step, then sends each neighbour its model plus a noise vector of its
own, drawn so that the noise it spreads over one gossip round sums to zero in the receivers' average
(authors' ``ZeroSumSharing`` in ``decentralizepy``)::

    x_i^{t+1/2} = x_i^t - eta g_i                              (the configured optimizer's step on the oracle's g_i)
    m_{i->j}    = x_i^{t+1/2} + n_{i->j},   j in N(i) and j = i (its own copy)
    sum_j w_ji n_{i->j} = 0                                    (zero sum, weighted by what each receiver gives i)
    x_j^{t+1}   = sum_i w_ji m_{i->j}

``n_{i->.}`` is ``sigma_z eta C / L_i`` (the unit of the step's own noise) times i.i.d. normals projected onto
the hyperplane ``w_{.i}^T n = 0`` (``algorithm.zero_sum_noise = sigma_z``).  The authors subtract the plain
mean (an unweighted zero sum), which cancels in the network's average only when every receiver weighs its
neighbours alike; the weighted projection cancels exactly for any doubly-stochastic W (Metropolis-Hastings),
and the two agree on regular graphs with uniform weights.

**Privacy.** The zero-sum noise protects a message from the one neighbour that receives it; all of an agent's
neighbours together cancel it. So budgets hold, as for every algorithm, on the ledger's agent view of the oracle's
own noise (``privacy.epsilon``: the local epsilon); a non-private run (``epsilon = 'inf'``) carries the zero-sum
noise alone and promises nothing against all neighbours. What one neighbour, or a ``privacy.colluding`` set, learns
of each sender is priced by the observer-view accountant over every message of the run (each draw held by its
sender, the run's relation), capped by the local epsilon: ``nonadaptive_epsilon_pairwise_network`` /
``nonadaptive_epsilon_pairwise_max``, exact only for gradients fixed in advance (a neighbour does not see the model
the sender's gradient is taken at; :mod:`decentdp.privacy.observer_pricing`), so the sound bound for every observer
stays the local one. The unrolled run takes SGD's own step (momentum re-sends past gradients, weight decay past
models: both linear); Adam's step is not linear in the gradients, so under Adam each sender's local epsilon is
reported instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field

from decentdp.algorithms.base import (
    Float32,
    Network,
    RoundContext,
    RunFacts,
    State,
    once_per_graph,
    prefixed,
    unprefixed,
)
from decentdp.algorithms.components.optim import SGD, Optimizer, OptimizerAlgorithm, OptimizerSettings
from decentdp.algorithms.registry import register
from decentdp.privacy.observer_pricing import Builder, ViewRecipe, pairwise_results, priced_view
from decentdp.privacy.observer_view import LinearView
from decentdp.privacy.report import AlgorithmPrivacy


class ZipDLSettings(OptimizerSettings):
    """Zip-DL's settings: the local optimizer's, and the zero-sum noise's size."""

    zero_sum_noise: Float32 = Field(1.0, ge=0.0, description="sigma_z: std of the i.i.d. draws projected to a zero "
                                                           "sum, in units of eta C / L_i (the step's own noise "
                                                           "unit, so that it compares with sigma)")


def zero_sum(draws: torch.Tensor, weights: torch.Tensor, sender: torch.Tensor, n_agents: int) -> torch.Tensor:
    """``draws`` (one row per message: ``sender[r]``'s, weighted ``weights[r]`` by its receiver) projected, per
    sender, onto the hyperplane ``sum_r weights[r] n_r = 0``: ``n = g - w (w^T g) / (w^T w)``."""
    weighted = torch.zeros(n_agents, draws.shape[1], dtype=draws.dtype, device=draws.device)
    weighted.index_add_(0, sender, draws * weights[:, None])
    norms = torch.zeros(n_agents, dtype=draws.dtype, device=draws.device).index_add_(0, sender, weights ** 2)
    return draws - weights[:, None] * (weighted / norms[:, None])[sender]


@register
class ZipDL(OptimizerAlgorithm):
    """Decentralized SGD whose gossip messages carry per-receiver noise that sums to zero."""

    name: ClassVar[str] = "zip-dl"
    reports_colluding: ClassVar[bool] = True
    Settings = ZipDLSettings

    def __init__(self, optimizer: Optimizer, zero_sum_noise: float) -> None:
        super().__init__(optimizer)
        self.zero_sum_noise = zero_sum_noise

    @classmethod
    def from_settings(cls, settings: ZipDLSettings) -> ZipDL:
        return cls(settings.build(), settings.zero_sum_noise)

    @property
    def round_temporaries(self) -> int:
        return 4  # the update, the half step, and the per-edge messages (about two more rows per agent)

    def round(self, state: State, ctx: RoundContext) -> State:
        net, oracle = ctx.network, ctx.oracle
        grad = oracle.gradient(state["params"])
        half, opt = self.optimizer.step(state["params"], grad, unprefixed("opt", state), ctx.lr, inplace=False)
        local = torch.arange(net.n_agents, device=half.device)
        senders = torch.cat([net.rows(net.out_edges[:, 0]), local])            # out-edges, then own copies
        out_weights, self_weights = once_per_graph(net, "zip-dl weights", lambda: self._weights(net))
        weights = torch.cat([out_weights, self_weights])
        draw = oracle.message_noise()
        g = torch.empty(len(senders), half.shape[1], dtype=draw.dtype, device=half.device)
        slots = [*net.out_edges[:, 1].tolist(), *[-1] * net.n_agents]          # keyed by receiver (-1: own copy)
        draw.normal(senders.cpu().tolist(), g, slots)
        scale = self.zero_sum_noise * ctx.lr * oracle.clip_norm / oracle.expected_batch.to(half.device).double()
        noise = zero_sum(g.double(), weights, senders, net.n_agents) * scale[senders, None]
        messages = half[senders] + noise.to(half.dtype)
        received = net.exchange(messages[: len(net.out_edges)])                 # m_{i->j} over the graph
        mixed = net.aggregate(received, net.in_weights.to(half.dtype))
        own = messages[len(net.out_edges):] * self_weights.to(half.dtype)[:, None]
        return {"params": mixed + own, **prefixed("opt", opt)}

    @staticmethod
    def _weights(net: Network) -> tuple[torch.Tensor, torch.Tensor]:
        """``w_ji`` of each out-edge ``(i, j)`` (the weight its receiver gives the sender) and each local agent's
        ``w_ii``, float64 on the network's device, from the public graph."""
        graph = net.public_graph()
        lookup = {(src, dst): float(w) for (src, dst), w in zip(graph.edges.tolist(), graph.weights, strict=True)}
        device = net.in_weights.device
        out = torch.tensor([lookup[(src, dst)] for src, dst in net.out_edges.tolist()], dtype=torch.float64,
                           device=device)
        own = torch.from_numpy(graph.self_weights[net.agent_ids.cpu().numpy()]).to(device)
        return out, own

    def _rounds(self, facts: RunFacts) -> Iterator[tuple[int, np.ndarray]]:
        """Each round's index and dense W (public), computed once per graph."""
        current: Network | None = None
        for k in range(facts.rounds):
            network = facts.network(k)
            if network is not current:
                current, w = network, network.public_graph().dense_mixing()
            yield k, w

    def view_recipe(self, facts: RunFacts) -> ViewRecipe:
        """The run's view for the observer-view accountant (:mod:`decentdp.privacy.observer_pricing`): its
        sizes, counted without building it, and :meth:`unroll`."""
        n = len(facts.noise_multipliers)
        received, draws, widest = np.zeros(n, dtype=np.int64), 0, 0
        for _, w in self._rounds(facts):
            links = (w > 0) & ~np.eye(n, dtype=bool)
            received += links.sum(axis=1)
            draws += n + int(links.sum()) + n
            widest = max(widest, 3 * n + int(links.sum()))
        return ViewRecipe(received.tolist(), draws, n * facts.rounds, state_size=self._carried_rows(n),
                          round_sources=widest,
                          unroll=lambda builder: self.unroll(builder, facts))

    def linear_view(self, facts: RunFacts) -> LinearView:
        """The whole run as one explicit :class:`~decentdp.privacy.observer_view.LinearView`."""
        return self.view_recipe(facts).dense().view()

    def _carried_rows(self, n: int) -> int:
        """Rows of the state one round carries into the next: the models, and SGD's momentum buffers."""
        return 2 * n if isinstance(self.optimizer, SGD) and self.optimizer.momentum else n

    def unroll(self, builder: Builder, facts: RunFacts) -> None:
        """Every round unrolled over sources: ``x_i + sigma_i xi_i`` over ``L_i`` (the oracle's release), the
        run's own SGD step taken on these expressions (momentum, Nesterov and weight decay are linear), each
        message ``m_{i->j}`` with its zero-sum draw (held by its sender alone), the aggregation.  The initial
        model is public; the models (and momentum buffers) are the state carried between rounds."""
        if not isinstance(self.optimizer, SGD):
            raise ValueError("only SGD's step is linear in the gradients: a run under Adam cannot be unrolled")
        n = len(facts.noise_multipliers)
        own = [{agent} for agent in range(n)]
        state = builder.zeros(self._carried_rows(n))
        for k, w in self._rounds(facts):
            state = builder.carry(state)
            theta, buffers = torch.from_numpy(state[:n]), {"momentum": torch.from_numpy(state[n:])}
            receiver, sender = np.nonzero((w > 0) & ~np.eye(n, dtype=bool))        # sender's message to receiver
            scale = facts.lr(k) / facts.expected_batches
            update = builder.data(range(n)) + facts.noise_multipliers[:, None] * builder.noise(np.ones(n), own)
            gradient = torch.from_numpy(update / facts.expected_batches[:, None])
            stepped, buffers = self.optimizer.step(theta, gradient, buffers, facts.lr(k))
            half = stepped.numpy()
            senders = np.concatenate([sender, np.arange(n)])
            receivers = np.concatenate([receiver, np.arange(n)])
            weights = w[receivers, senders]
            g = builder.noise(np.ones(len(senders)), [{int(s)} for s in senders])
            noise = zero_sum(torch.from_numpy(g), torch.from_numpy(weights), torch.from_numpy(senders), n).numpy()
            messages = half[senders] + (self.zero_sum_noise * scale)[senders, None] * noise
            builder.send(receiver, messages[: len(sender)])
            theta_next = np.zeros_like(half)
            np.add.at(theta_next, receivers, weights[:, None] * messages)
            state = np.concatenate([theta_next, *(buffer.numpy() for buffer in buffers.values())])

    def privacy_results(self, state: State, facts: RunFacts) -> AlgorithmPrivacy:
        """What one neighbour (or a ``privacy.colluding`` set) learns of each sender, by the observer-view
        accountant over every message, capped by the sender's local epsilon; the local epsilon alone under
        Adam (not linear), or where an agent adds no noise (a run without privacy releases unclipped means, whose
        data terms the view's unit sensitivity would not bound)."""
        local = np.asarray(facts.local_epsilon, dtype=float)
        observers = [[agent] for agent in range(len(local))] + [list(members) for members in facts.colluding]
        capped = np.repeat(local[:, None], len(observers), axis=1)
        if not isinstance(self.optimizer, SGD):
            note = "not linear (algorithm.optimizer = 'adam'): each sender's local epsilon"
        elif not (facts.noise_multipliers > 0).all():
            note = "an agent adds no noise: each sender's local epsilon"
        else:
            capped, note = priced_view(local, self.view_recipe(facts), observers, facts.relation, facts.delta)
        return pairwise_results(capped, facts.colluding, note)
