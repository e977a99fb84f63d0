"""Agents sharded over processes: a :class:`Network` over one contiguous shard, with halo exchange.

A sharded run splits the global agent ids ``0..N-1`` into contiguous shards (:func:`shard_bounds`).
Each shard holds its agents' rows of every state tensor, their data, batches, noise streams and
ledger rows, and runs the *same* algorithm code as the simulator through :class:`ShardNetwork`,
which implements the primitives of :class:`~decentdp.algorithms.base.Network` over the shard and
overrides the helpers built on them where sending less is faster:

* ``exchange`` (a primitive) delivers per-edge messages: an edge's message crosses to the shard
  holding its receiver only when that shard differs from the sender's;
* ``mix``, ``mix_add``, ``neighbor_sum``, ``broadcast`` need the rows of remote neighbours: each
  shard sends each peer shard once per call the rows *its* neighbours there need (the halo of the
  graph cut), never one row per edge, nor the whole ``(N, d)`` matrix;
* ``exchange_rows`` sends each peer shard, once, every distinct row its in-edges from here carry,
  with the index of the row each of those edges received;
* ``swap`` sends each paired agent's row to the shard of its partner, and nothing else;
* ``aggregate`` is :class:`~decentdp.algorithms.base.Network`'s own: it sums what arrived, locally.

``public_graph`` is the whole run's graph (every shard holds the whole public topology).

Every network call that moves rows is a *collective*: all shards make the same calls in the same
order (the algorithms do, since their control flow depends on public values only), and each call is
one :meth:`Transport.exchange` with the shard's peers.  The transport is the only part that knows
processes exist (:mod:`decentdp.runtime.distributed.ray_backend` implements it with gloo messages between Ray
worker processes; :class:`LocalTransport` with threads, for tests).

Draws are keyed by global agent id (:mod:`decentdp.rng`), Poisson sampling draws the round-wide
vector and keeps the shard's slice (:class:`ShardSampler`), and the scheduler plans globally and
keeps the shard's rows, so a shard selects exactly the batches, noise and plans of the simulator;
only float summation orders differ.  Ledgers are split and merged by :func:`split_ledger` and
:func:`merge_ledgers`, so that a checkpoint is the simulator's and resumes on any number of shards.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from decentdp.algorithms.base import RoundPlan, State, ragged_rows_key
from decentdp.errors import DecentDPError
from decentdp.privacy.events import EventTable
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import Mechanism, NoiseDraw
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.sampling import AgentData, CyclicSampler, PoissonSampler
from decentdp.results.files import write_durably, write_failure
from decentdp.rng import AgentRandom
from decentdp.runtime.network import GraphSequence, SimulatedNetwork
from decentdp.runtime.scheduler import Scheduler
from decentdp.runtime.simulator import Simulator
from decentdp.topology import Topology

Payload = Any
"""What one shard sends another in one collective: a tensor, or a tuple of tensors."""


def shard_bounds(n_agents: int, shards: int) -> list[int]:
    """Boundaries of ``shards`` contiguous, balanced shards: shard ``s`` holds ids ``b[s] .. b[s+1]-1``."""
    if not 1 <= shards <= n_agents:
        raise ValueError(f"{shards} shards for {n_agents} agents")
    return [n_agents * s // shards for s in range(shards + 1)]


def payload_bytes(payload: Payload) -> int:
    """Bytes of the tensors in a payload (what crosses between processes, without framing)."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return sum(payload_bytes(item) for item in payload)


class Transport(Protocol):
    """Moves payloads between shards; the only part of a sharded run that knows processes exist."""

    bytes_sent: int

    def exchange(self, outgoing: Mapping[int, Payload]) -> dict[int, Payload]:
        """One collective step: send ``outgoing[t]`` to each peer shard ``t`` and return what each of
        them sent this shard in the same step (every peer sends one payload per step)."""
        ...


class Mailbox:
    """Payloads delivered to one shard, keyed by (collective step, sender), awaited by the shard's round
    (the receiving end of :class:`LocalTransport`)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._items: dict[tuple[int, int], Payload] = {}
        self._ready = threading.Condition()
        self._aborted: str | None = None

    def put(self, step: int, sender: int, payload: Payload) -> None:
        with self._ready:
            self._items[(step, sender)] = payload
            self._ready.notify_all()

    def abort(self, reason: str) -> None:
        """Wake a waiting round with ``ConnectionAbortedError(reason)`` (a peer failed; nothing will come)."""
        with self._ready:
            self._aborted = reason
            self._ready.notify_all()

    def take(self, step: int, senders: Sequence[int]) -> dict[int, Payload]:
        """Wait for every sender's payload of ``step``; a peer silent for ``timeout`` seconds is lost."""
        keys = [(step, sender) for sender in senders]
        with self._ready:
            self._ready.wait_for(lambda: self._aborted is not None or all(key in self._items for key in keys),
                                 timeout=self.timeout)
            if self._aborted is not None:
                raise ConnectionAbortedError(self._aborted)
            if not all(key in self._items for key in keys):
                missing = [sender for step_, sender in keys if (step_, sender) not in self._items]
                raise TimeoutError(f"no message from shard(s) {missing} in step {step} after {self.timeout:g} s")
            return {sender: self._items.pop((step, sender)) for sender in senders}


class LocalTransport:
    """Shards as threads of one process (tests, and the sharding's own cost): payloads are copied into
    the receiving shard's :class:`Mailbox`, as a transport between processes delivers copies."""

    def __init__(self, shard: int, mailboxes: Sequence[Mailbox]) -> None:
        self.shard = shard
        self.mailboxes = mailboxes
        self.step = 0
        self.bytes_sent = 0

    def exchange(self, outgoing: Mapping[int, Payload]) -> dict[int, Payload]:
        step, self.step = self.step, self.step + 1
        for peer, payload in outgoing.items():
            self.bytes_sent += payload_bytes(payload)
            copied = payload.clone() if isinstance(payload, torch.Tensor) else tuple(item.clone() for item in payload)
            self.mailboxes[peer].put(step, self.shard, copied)
        return self.mailboxes[self.shard].take(step, list(outgoing))


class ShardNetwork(SimulatedNetwork):
    """The :class:`~decentdp.algorithms.base.Network` of shard ``shard`` (global ids ``bounds[shard] ..
    bounds[shard+1]-1``) of a run over ``topology``.

    Rows are the shard's agents; the halo is every remote agent with a neighbour here.  ``mix`` and
    ``neighbor_sum`` apply the shard's rows of W (resp. the adjacency), restricted to the columns of
    local and halo agents, to the local rows extended by the halo rows received (dense, or CSR blocks
    as in :class:`SimulatedNetwork`).  ``global_edges`` (the public graph) lets the scheduler pair
    agents exactly as the simulator does.
    """

    def __init__(self, topology: Topology, bounds: Sequence[int], shard: int, transport: Transport,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.topology = topology
        self.device = torch.device(device)
        self.transport = transport
        lo, hi = bounds[shard], bounds[shard + 1]
        self.shard, self.lo = shard, lo
        self.n_agents = hi - lo
        self.n_total = topology.n_agents
        self.agent_ids = torch.arange(lo, hi, device=self.device)
        edges = np.asarray(topology.edges(), dtype=np.int64).reshape(-1, 2)
        owner = np.searchsorted(np.asarray(bounds), np.arange(self.n_total), side="right") - 1  # shard of each id
        local_src, local_dst = owner[edges[:, 0]] == shard, owner[edges[:, 1]] == shard
        out_edges, in_edges = edges[local_src], edges[local_dst]
        as_tensor = lambda array: torch.as_tensor(array, dtype=torch.long, device=self.device)  # noqa: E731
        self.global_edges = as_tensor(edges)
        self.out_edges, self.in_edges = as_tensor(out_edges), as_tensor(in_edges)

        # The halo: remote sources of in-edges, ascending (hence grouped by shard); what each peer needs.
        halo = np.unique(in_edges[owner[in_edges[:, 0]] != shard, 0])
        self.peers = sorted({int(owner[agent]) for agent in halo})
        self._send = {peer: as_tensor(np.unique(out_edges[owner[out_edges[:, 1]] == peer, 0]) - lo)
                      for peer in self.peers}
        self.halo_ids = as_tensor(halo)
        columns = np.concatenate([np.arange(lo, hi), halo])  # local rows, then the halo
        column_of = np.full(self.n_total, -1, dtype=np.int64)
        column_of[columns] = np.arange(len(columns))
        adjacency = topology.adjacency()
        self.degrees = torch.tensor(adjacency[lo:hi].sum(axis=1), dtype=dtype, device=self.device)
        self._mixing = self._operator(topology.mixing[lo:hi][:, columns], dtype)
        self._adjacency = self._operator(adjacency[lo:hi][:, columns], dtype)
        self.in_weights = torch.tensor(topology.mixing[in_edges[:, 1], in_edges[:, 0]], dtype=dtype,
                                       device=self.device)
        self._in_source_column = as_tensor(column_of[in_edges[:, 0]])

        # Per-edge messages: edges between two shards, in global edge order on both sides.
        out_owner, in_owner = owner[out_edges[:, 1]], owner[in_edges[:, 0]]
        self._edges_local = (as_tensor(np.flatnonzero(out_owner == shard)),
                             as_tensor(np.flatnonzero(in_owner == shard)))
        self._edges_out = {peer: as_tensor(np.flatnonzero(out_owner == peer)) for peer in self.peers}
        self._edges_in = {peer: as_tensor(np.flatnonzero(in_owner == peer)) for peer in self.peers}
        self._neighbours = {(int(s), int(d)) for s, d in out_edges.tolist()}
        self._owner = as_tensor(owner)

    def rows(self, agent_ids: torch.Tensor) -> torch.Tensor:
        return agent_ids - self.lo

    def _with_halo(self, x: torch.Tensor) -> torch.Tensor:
        """The local rows followed by the halo rows, received from the peers (one collective step)."""
        received = self.transport.exchange({peer: x.index_select(0, rows) for peer, rows in self._send.items()})
        return torch.cat([x, *(received[peer] for peer in self.peers)]) if self.peers else x

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(self._mixing, self._with_halo(x))

    def mix_add(self, x: torch.Tensor, into: torch.Tensor, alpha: float) -> torch.Tensor:
        return super().mix_add(self._with_halo(x), into, alpha)

    def neighbor_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(self._adjacency, self._with_halo(x))

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_halo(x).index_select(0, self._in_source_column)

    def exchange(self, messages: torch.Tensor) -> torch.Tensor:
        out = messages.new_empty(len(self.in_edges), *messages.shape[1:])
        local_out, local_in = self._edges_local
        out[local_in] = messages[local_out]
        received = self.transport.exchange({peer: messages[rows] for peer, rows in self._edges_out.items()})
        for peer, rows in self._edges_in.items():
            out[rows] = received[peer]
        return out

    def exchange_rows(self, rows: torch.Tensor, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Edges within the shard read ``rows`` in place; each peer gets the distinct rows its edges from here
        carry (a row sent to several of its agents crosses once) and, per edge, which of them."""
        index = torch.empty(len(self.in_edges), dtype=torch.long, device=pick.device)
        local_out, local_in = self._edges_local
        index[local_in] = pick[local_out]
        outgoing = {}
        for peer, edges in self._edges_out.items():
            distinct, which = torch.unique(pick[edges], return_inverse=True)
            outgoing[peer] = (rows.index_select(0, distinct), which)
        received = self.transport.exchange(outgoing)
        parts, offset = [rows], len(rows)
        for peer in self.peers:
            values, which = received[peer]
            index[self._edges_in[peer]] = offset + which
            parts.append(values)
            offset += len(values)
        return torch.cat(parts) if len(parts) > 1 else rows, index

    def swap(self, x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        """Row ``i`` gets agent ``partner[i]``'s row; a remote partner's shard sends that row with the
        pair's ids, so that both ends check that the pairing is mutual."""
        ids = self.agent_ids
        paired = partner != ids
        for agent, other in zip(ids[paired].tolist(), partner[paired].tolist(), strict=True):
            if (agent, other) not in self._neighbours:
                raise ValueError(f"agents {agent} and {other} are not a pair of neighbours in this round")
        partner_shard = self._owner[partner]
        with_shard = {peer: torch.nonzero(paired & (partner_shard == peer)).squeeze(1)
                      for peer in [self.shard, *self.peers]}
        received = self.transport.exchange({peer: (ids[rows], partner[rows], x.index_select(0, rows))
                                            for peer, rows in with_shard.items() if peer != self.shard})
        out = x.clone()
        local = with_shard[self.shard]
        sources = self.rows(partner[local])
        if not torch.equal(partner[sources], ids[local]):
            raise ValueError("a pairing is not mutual in this round")
        out[local] = x[sources]
        for peer, (their_ids, their_partners, values) in received.items():
            rows = with_shard[peer][torch.argsort(partner[with_shard[peer]])]  # ordered as the peer sends
            if not (torch.equal(their_ids, partner[rows]) and torch.equal(their_partners, ids[rows])):
                raise ValueError(f"a pairing with shard {peer}'s agents is not mutual in this round")
            out[rows] = values
        return out


class ShardGraphs:
    """The shard's view of a run's :class:`~decentdp.runtime.network.GraphSequence`: the same graph of
    each round (fixed or redrawn), as a :class:`ShardNetwork` built once per graph."""

    def __init__(self, graphs: GraphSequence, bounds: Sequence[int], shard: int, transport: Transport,
                 device: torch.device) -> None:
        self.graphs = graphs
        self.bounds, self.shard, self.transport, self.device = bounds, shard, transport, device
        self._source: SimulatedNetwork | None = None
        self._network: ShardNetwork | None = None

    def at(self, round_index: int) -> ShardNetwork:
        network = self.graphs.at(round_index)
        if network is not self._source:
            self._source = network
            self._network = ShardNetwork(network.topology, self.bounds, self.shard, self.transport,
                                         device=self.device)
        return self._network


@dataclass(frozen=True)
class _GlobalGraph:
    """What the scheduler reads of a network: the public graph's edges and the rows to keep."""

    out_edges: torch.Tensor
    agent_ids: torch.Tensor


class ShardScheduler(Scheduler):
    """A :class:`Scheduler` that plans over the whole public graph (every shard computes the same pairs)
    and keeps the shard's rows."""

    def plan(self, round_index: int, network: ShardNetwork) -> RoundPlan:
        return super().plan(round_index, _GlobalGraph(network.global_edges, network.agent_ids))


class ShardSampler(PoissonSampler):
    """Poisson batches of the agents ``lo .. hi-1`` of ``data``: the round-wide draw over every slot of
    the run, of which this shard keeps its own contiguous slice, so its batches are the simulator's.

    The shard keeps a copy of its agents' records only (an agent's records, possibly shared with
    others in overlapping splits, are copied once per agent), so the rest of the training set can be
    freed in its process."""

    def __init__(self, data: AgentData, sample_rates: torch.Tensor, rng: Any, lo: int, hi: int) -> None:
        owned = data.indices[lo:hi]
        records = torch.cat([index.long() for index in owned])
        starts = np.cumsum([0, *[len(index) for index in owned]])
        local = tuple(torch.arange(start, stop) for start, stop in zip(starts[:-1], starts[1:], strict=True))
        super().__init__(AgentData(data.x[records], data.y[records], local), sample_rates[lo:hi], rng)
        self.all_lengths = [len(index) for index in data.indices]
        self.first_slot = sum(self.all_lengths[:lo])

    def draws(self, round_index: int, step: int = 0) -> torch.Tensor:
        if self.rng.secure:  # each agent's slice comes from its own key, and the shard holds only its agents'
            return self.rng.record_uniforms(round_index, step, self.lengths)
        everyone = self.rng.record_uniforms(round_index, step, self.all_lengths)
        return everyone[self.first_slot:self.first_slot + self.n_slots]


class ShardMechanism:
    """A run's mechanism seen from a shard: its per-agent tables are indexed by global id, the shard's
    owners are local rows, so owners are shifted by the shard's first id on the way in and noise rows
    shifted back on the way to the shard's :class:`~decentdp.privacy.mechanisms.NoiseDraw`."""

    def __init__(self, mechanism: Mechanism, lo: int) -> None:
        self.mechanism = mechanism
        self.lo = lo

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        self.mechanism.perturb(values, owners + self.lo, _ShiftedNoise(noise, self.lo), slots)

    def agent_event(self, owner: int, sample_rate: float, rows: int) -> Any:
        return self.mechanism.agent_event(owner + self.lo, sample_rate, rows)

    def receiver_event(self, owner: int, sample_rate: float) -> Any:
        return self.mechanism.receiver_event(owner + self.lo, sample_rate)

    def __getattr__(self, name: str) -> Any:  # the mechanism's own settings (e.g. a clipping bound)
        return getattr(self.mechanism, name)


class _ShiftedNoise:
    """A shard's :class:`~decentdp.privacy.mechanisms.NoiseDraw` taking global rows (see :class:`ShardMechanism`)."""

    def __init__(self, noise: NoiseDraw, lo: int) -> None:
        self.noise = noise
        self.lo = lo

    def normal(self, rows: Sequence[int], out: torch.Tensor, slots: Sequence[int] | None = None,
               workers: int = 1) -> torch.Tensor:
        return self.noise.normal([row - self.lo for row in rows], out, slots, workers)

    def laplace(self, rows: Sequence[int], out: torch.Tensor, slots: Sequence[int] | None = None) -> torch.Tensor:
        return self.noise.laplace([row - self.lo for row in rows], out, slots)

    def on_grid(self, release: Any, rows: Sequence[int], values: Any, sensitivity: float, multipliers: Any,
                slots: Sequence[int] | None = None) -> Any:
        return self.noise.on_grid(release, [row - self.lo for row in rows], values, sensitivity, multipliers, slots)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.noise, name)


def ragged_keys(keys: Iterable[str]) -> set[str]:
    """The ragged per-agent entries among a state's keys: those with a companion
    :func:`~decentdp.algorithms.base.ragged_rows_key` (each agent's number of rows)."""
    names = set(keys)
    return {key for key in names if ragged_rows_key(key) in names}


def per_agent_keys(state: Mapping[str, torch.Tensor], n_total: int) -> set[str]:
    """The state entries held by agent (sharded): one row per agent, or ragged (:func:`ragged_keys`); the others
    (counters, shared schedules) are the same in every shard and replicated."""
    ragged = ragged_keys(state)
    return ragged | {key for key, value in state.items() if value.dim() > 0 and value.shape[0] == n_total}


def state_layout(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each state entry's number of rows (-1 for a scalar): what :func:`sharded_keys` compares."""
    return {key: value.shape[0] if value.dim() > 0 else -1 for key, value in state.items()}


def sharded_keys(layouts: Sequence[Mapping[str, int]], bounds: Sequence[int]) -> set[str]:
    """The per-agent entries of a state the shards hold (e.g. after a setup phase that added entries):
    those with, in every shard, one row per agent it holds (:func:`state_layout` of each shard's state),
    and the ragged ones whose row counts are such.  With a single shard this is :func:`per_agent_keys`' rule."""
    sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    rows = {key for key in layouts[0]
            if all(layout.get(key) == size for layout, size in zip(layouts, sizes, strict=True))}
    return rows | {key for key in ragged_keys(layouts[0]) if ragged_rows_key(key) in rows}


def agent_rows(state: Mapping[str, torch.Tensor], key: str, rows: slice) -> torch.Tensor:
    """Agents ``rows`` (counted from the state's first agent) of a per-agent entry, ragged or not."""
    value = state[key]
    if ragged_rows_key(key) not in state:
        return value[rows]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(state[ragged_rows_key(key)].cpu(), 0)])
    return value[int(starts[rows.start]):int(starts[rows.stop])]


def shard_state(state: Mapping[str, torch.Tensor], per_agent: set[str], rows: slice) -> dict[str, torch.Tensor]:
    """A shard's part of a whole run's state: its rows of per-agent entries, a copy of the others."""
    return {key: (agent_rows(state, key, rows) if key in per_agent else value).clone() for key, value in state.items()}


@dataclass
class Shard:
    """What one process of a sharded run holds: its agents' rows of everything, and the round loop."""

    bounds: list[int]
    index: int
    oracle: DataOracle
    simulator: Simulator

    @property
    def rows(self) -> slice:
        """This shard's rows of a global ``(N, ...)`` tensor."""
        return slice(self.bounds[self.index], self.bounds[self.index + 1])

    @property
    def ledger(self) -> PrivacyLedger:
        return self.oracle.ledger

    def load(self, ledger: dict[str, Any], scheduler: dict[str, Any], rng: AgentRandom,
             agents_per_pass: int | None) -> None:
        """Continue a run: the shard's rows of its (whole-run) ledger, the scheduler's state, the run's
        random source (its keys, for a secure run) and pass size, as a checkpoint holds them."""
        self.oracle.ledger = split_ledger(type(self.oracle.ledger), ledger, self.rows.start, self.rows.stop)
        self.simulator.scheduler.load_state_dict(scheduler)
        rng = rng.for_agents(range(self.rows.start, self.rows.stop))  # a secure run: this shard's keys only
        for part in (self.oracle, self.oracle.sampler, self.simulator, self.simulator.scheduler):
            part.rng = rng
        self.oracle.agents_per_pass = agents_per_pass


def make_shard(simulator: Simulator, bounds: list[int], index: int, transport: Transport,
               rng: AgentRandom | None = None) -> Shard:
    """Shard ``index`` of the run that ``simulator`` runs in one process: its algorithm, graphs and schedules,
    and its privacy stack (``simulator.oracle``: the agents' data and sampling rates, the gradient engine, the
    calibrated mechanism, the ledger and the random streams), restricted to the agents ``bounds[index] ..
    bounds[index+1]-1`` (keyed draws make their batches and noise the simulator's).  ``rng`` is the shard's
    random source (a secure run's: its agents' keys only); by default the run's, restricted."""
    lo, hi = bounds[index], bounds[index + 1]
    full = simulator.oracle
    device = full.device
    rng = rng if rng is not None else full.rng.for_agents(range(lo, hi))
    whole_sampler = full.sampler
    sampler = whole_sampler.shard(lo, hi) if isinstance(whole_sampler, CyclicSampler) else \
        ShardSampler(whole_sampler.data, full.sample_rates, rng, lo, hi)
    ledger = split_ledger(type(full.ledger), full.ledger.state_dict(), lo, hi)
    mechanism = None if full.mechanism is None else ShardMechanism(full.mechanism, lo)
    oracle = DataOracle(full.model, sampler, ledger, rng, mechanism, full.clip_norm,
                        agents_per_pass=full.agents_per_pass, agent_ids=torch.arange(lo, hi, device=device),
                        augmentation=full.augmentation)
    whole = simulator.scheduler
    scheduler = ShardScheduler(whole.kind, rng, whole.n_total, whole.offline_probability, whole.participation,
                               device=device)
    graphs = ShardGraphs(simulator.graphs, bounds, index, transport, device)
    return Shard(bounds, index, oracle, Simulator(simulator.algorithm, graphs, oracle, scheduler, simulator.schedule,
                                                  rng, averaging=simulator.averaging))


def split_ledger(kind: type[PrivacyLedger], state: dict[str, Any], lo: int, hi: int) -> PrivacyLedger:
    """The agents ``lo .. hi-1`` of a ledger saved with ``state_dict`` whose rows are consecutive agents
    (a whole run's: row ``i`` = agent ``i``; or a span of shards merged, starting at any agent)."""
    first = state["agent_ids"][0] if state["agent_ids"] else 0
    start, stop = lo - first, hi - first
    if start < 0 or state["agent_ids"][start:stop] != list(range(lo, hi)):
        raise ValueError("a shard's agents must be contiguous rows of the ledger")
    broadcast = state["broadcast_runs"]
    return kind.from_state_dict({
        **state,
        **{key: state[key][start:stop] for key in ("agent_ids", "budgets", "refused", "agent_runs")},
        "broadcast_runs": None if broadcast is None else broadcast[start:stop],
        "pairs": [[row - start, receiver, runs] for row, receiver, runs in state["pairs"] if start <= row < stop],
    })


def merge_ledgers(kind: type[PrivacyLedger], states: Sequence[dict[str, Any]]) -> PrivacyLedger:
    """One ledger of every agent from the shards' ``state_dict`` (in shard order): the simulator's ledger
    of the same run (the same histories of the same events; event ids renumbered)."""
    table = EventTable()
    merged: dict[str, Any] = {**states[0], "agent_ids": [], "budgets": [], "refused": [], "agent_runs": [],
                              "pairs": []}
    broadcast: list[Any] = []
    any_broadcast = any(state["broadcast_runs"] is not None for state in states)
    for state in states:
        events = EventTable.from_json(state["events"])
        ids = [table.intern(events[event]) for event in range(len(events))]
        remap = lambda runs, ids=ids: [[ids[event], count, first, last]  # noqa: E731
                                       for event, count, first, last in runs]
        offset = len(merged["agent_ids"])
        for key in ("agent_ids", "budgets", "refused"):
            merged[key] += state[key]
        merged["agent_runs"] += [remap(runs) for runs in state["agent_runs"]]
        if any_broadcast:  # a shard without per-receiver releases broadcast everything so far
            broadcast += [remap(runs) for runs in (state["broadcast_runs"] or state["agent_runs"])]
        merged["pairs"] += [[row + offset, receiver, remap(runs)] for row, receiver, runs in state["pairs"]]
    merged["events"] = table.to_json()
    merged["broadcast_runs"] = broadcast if any_broadcast else None
    return kind.from_state_dict(merged)


# -- checkpoints written by the shards ------------------------------------------------------------------------

#: The format of a checkpoint whose rows the shards wrote (the ``shards`` entry of ``checkpoint.pt``).
SHARD_CHECKPOINT_FORMAT = "decentdp-shards-1"
#: The folder of a results folder where the shards write their checkpoints.
SHARD_STORE = "shards"
#: A checkpoint's folder of shard files in :data:`SHARD_STORE`: its round, and a token, so that no write ever
#: replaces a file that a manifest (of this run, or of the run it resumed) names.
ROUND_FOLDER = re.compile(r"round-\d+-[0-9a-f]+")


@runtime_checkable
class ShardCheckpointWriter(Protocol):
    """An engine whose processes write their own shards of a checkpoint (``engine.backend = "ray"``)."""

    def write_shards(self, results: Path, round_done: int) -> dict[str, Any]:
        """Have every shard write its part of the checkpoint after ``round_done`` under ``results`` and
        return the manifest entry (:func:`shard_manifest`) that names the complete files; a shard that cannot
        write its file raises :class:`ShardWriteError` (the round's folder removed)."""
        ...


class ShardWriteError(DecentDPError):
    """A shard's part of a checkpoint that could not be written (a full disk, a file size limit, a folder that
    cannot be created), raised by the worker that wrote it: ``directory`` is the checkpoint's folder of shard
    files, ``reason`` the system's (:func:`~decentdp.results.files.write_failure`), and ``round_index`` the
    checkpoint's round once the driver knows it.  The runner turns it into its one message about the checkpoint
    (``--out``), instead of the worker's traceback; any other error of the workers (a lost worker among them) is
    not one."""

    def __init__(self, directory: str, reason: str, round_index: int | None = None) -> None:
        super().__init__(directory, reason, round_index)  # (all three in args: Ray sends the error back pickled)
        self.directory, self.reason, self.round_index = directory, reason, round_index

    def __str__(self) -> str:
        after = "" if self.round_index is None else f" after round {self.round_index}"
        return f"cannot write the checkpoint{after} into {self.directory} ({self.reason})"


def remove_round_folder(folder: Path) -> None:
    """Remove one checkpoint's folder of shard files, which no manifest names (its files could not all be
    written, or the manifest naming them could not), and the :data:`SHARD_STORE` above it if nothing else is
    left in it."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # (not empty: the previous checkpoint's files, or files of the user's)
        folder.parent.rmdir()


def remove_shard_checkpoints(results: Path) -> None:
    """Remove the shard files a sharded run wrote in the results folder ``results`` (the round folders of its
    :data:`SHARD_STORE`, then the store if nothing else is left in it): once a checkpoint that holds the state
    itself has replaced the manifest naming them, nothing names them.  Files the library did not write stay."""
    store = results / SHARD_STORE
    if not store.is_dir():
        return
    for folder in store.iterdir():
        if folder.is_dir() and ROUND_FOLDER.fullmatch(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
    if not any(store.iterdir()):
        store.rmdir()


def shard_file(index: int, shards: int) -> str:
    """The file name of shard ``index`` of ``shards``."""
    return f"shard-{index:04d}-of-{shards:04d}.pt"


def write_shard_checkpoint(directory: Path, shard: Shard, state: State, per_agent: set[str]) -> dict[str, Any]:
    """Shard ``shard``'s part of a checkpoint: its rows of every per-agent state entry (and a copy of the
    replicated ones), its ledger rows and its scheduler's state (the pairing's position; every other draw
    is keyed by round), written to a temporary name and renamed, so that a file under its final name is
    always complete.  Returns the file's manifest entry; a write that fails (a full disk: ``OSError``, or the
    ``RuntimeError`` torch raises for it) is a :class:`ShardWriteError` naming ``directory``."""
    lo, hi = shard.rows.start, shard.rows.stop
    path = directory / shard_file(shard.index, len(shard.bounds) - 1)
    payload = {"agents": [lo, hi], "per_agent": sorted(per_agent),
               "state": {key: value.detach().cpu() for key, value in state.items()},
               "ledger": shard.ledger.state_dict(), "scheduler": shard.simulator.scheduler.state_dict()}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_durably(path, lambda handle: torch.save(payload, handle))
    except (OSError, RuntimeError) as error:
        raise ShardWriteError(str(directory), write_failure(error)) from None
    return {"file": path.name, "agents": [lo, hi], "bytes": path.stat().st_size}


def shard_manifest(directory: str, n_agents: int, files: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``shards`` entry of a checkpoint: where the shard files lie (relative to the results folder) and
    which agents each holds; written by the driver once every file is complete."""
    return {"format": SHARD_CHECKPOINT_FORMAT, "directory": directory, "n_agents": n_agents, "files": list(files)}


def read_shard_checkpoints(directory: Path, files: Sequence[dict[str, Any]], lo: int, hi: int) -> dict[str, Any]:
    """Agents ``lo .. hi-1`` of a checkpoint written in shards of any sizes: ``state`` (their rows of
    per-agent entries, the replicated ones), ``per_agent`` (the names of the former), ``ledger`` (the
    merged ledger of the shards that hold them, a ``state_dict``; :func:`split_ledger` takes their rows)
    and ``scheduler``.  With ``0 .. N-1`` it is
    the whole run's checkpoint, as the simulator writes it; a shard of another split reads its own rows."""
    entries = sorted(files, key=lambda entry: entry["agents"][0])
    span = [entry for entry in entries if entry["agents"][0] < hi and entry["agents"][1] > lo]
    covered = [entry["agents"] for entry in span]
    if not span or covered[0][0] > lo or covered[-1][1] < hi or \
            any(left[1] != right[0] for left, right in zip(covered[:-1], covered[1:], strict=True)):
        raise ValueError(f"the checkpoint's shards {covered} do not cover agents {lo}..{hi - 1}")
    parts = []
    for entry in span:
        path = directory / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise ValueError(f"shard file {path} is missing or differs from the one the manifest names")
        parts.append(torch.load(path, weights_only=True, map_location="cpu"))
    first = span[0]["agents"][0]
    per_agent = set(parts[0]["per_agent"])
    for key, value in parts[0]["state"].items():  # replicated entries are the same in every shard, or unusable
        if key not in per_agent and not all(torch.equal(part["state"][key], value) for part in parts[1:]):
            raise ValueError(f"state entry {key!r} differs between the shards {covered}: it is a process's own "
                             "(not one row per agent, nor the same everywhere), so it cannot be merged or re-split")
    merged = {key: torch.cat([part["state"][key] for part in parts]) if key in per_agent else value
              for key, value in parts[0]["state"].items()}
    state = {key: agent_rows(merged, key, slice(lo - first, hi - first)) if key in per_agent else value
             for key, value in merged.items()}
    ledger = merge_ledgers(PrivacyLedger, [part["ledger"] for part in parts]).state_dict()
    return {"state": state, "per_agent": sorted(per_agent), "ledger": ledger, "scheduler": parts[0]["scheduler"]}
