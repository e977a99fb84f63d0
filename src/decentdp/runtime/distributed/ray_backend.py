"""``engine.backend = "ray"``: a run's agents sharded over Ray actor processes (the ``ray`` extra).

:func:`distribute` shards the run of a built :class:`~decentdp.runtime.simulator.Simulator` (its algorithm,
graphs, schedules and privacy stack, ``simulator.oracle``) as the config's
:class:`~decentdp.config.EngineSection` says: it starts a local Ray instance bound to the loopback interface,
or attaches to ``engine.address``, and starts ``engine.workers`` actors, each building one contiguous shard
of agents from the simulator (:func:`~decentdp.runtime.distributed.sharded.make_shard`), the one blueprint Ray
sends them.  It returns a :class:`RaySimulator` with the simulator's interface, which the runner
(``experiment/loop.py``) puts in the simulator's place and drives unchanged: the driver starts each round on
every worker, the workers exchange halo rows with their peers directly (gloo point-to-point messages in a
torch.distributed process group formed by the workers: :class:`GlooTransport`), and the driver fetches rows
only when the runner evaluates.

Checkpoints are written by the workers: at each checkpoint round every worker writes its shard (state
rows, ledger rows, scheduler) to ``shards/round-K-TOKEN/`` of the results folder (a temporary folder when
the run has none), each file renamed into place once complete; the runner's ``checkpoint.pt`` is then
only a manifest naming those files, written atomically by the driver after every worker has finished
(:meth:`RaySimulator.write_shards`).  A worker that cannot write its file (a full disk) ends the run with a
:class:`~decentdp.runtime.distributed.sharded.ShardWriteError` naming the round and its folder, which is
removed; the runner says it in one line.  A resume reads the files of any split, on any number of workers
or in the simulator (:func:`~decentdp.runtime.distributed.sharded.read_shard_checkpoints`).

Faults: when a worker process dies, every worker is replaced, each new worker reads its rows of the
last checkpoint's shard files, and the rounds since it are replayed; keyed draws make the replay
identical, and the ledgers restart from the checkpoint's, so no release is counted twice or lost.

Safety of a local instance: :data:`LOCAL_RAY_ENVIRONMENT` binds every Ray process to 127.0.0.1 and
keeps Ray from contacting anything else (see ``docs/distributed.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from decentdp.algorithms.base import State
from decentdp.config import EngineSection
from decentdp.errors import ConfigError
from decentdp.rng import AgentKeys
from decentdp.runtime.distributed.sharded import (
    ROUND_FOLDER,
    SHARD_STORE,
    Payload,
    ShardWriteError,
    make_shard,
    merge_ledgers,
    payload_bytes,
    per_agent_keys,
    read_shard_checkpoints,
    remove_round_folder,
    shard_bounds,
    shard_manifest,
    shard_state,
    sharded_keys,
    state_layout,
    write_shard_checkpoint,
)
from decentdp.runtime.simulator import Simulator, unwrapped
from decentdp.util.profiling import NO_TIMER, PhaseTimer

LOCAL_RAY_ENVIRONMENT = {
    # no usage statistics are collected or sent
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray replaces a loopback node address by the machine's outward address unless multi-node clusters
    # are disabled; with this, GCS, raylet, object store and workers all bind 127.0.0.1
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
"""Environment a local Ray instance starts with (read when ``ray`` is imported, inherited by its processes)."""

NO_OUTSIDE_HTTP = {
    # Ray's head process asks cloud metadata services (169.254.169.254, metadata.google.internal) which
    # cloud it runs on, even with usage statistics off; these send its HTTP requests to a closed loopback
    # port instead, while gRPC between Ray's own processes stays direct (loopback is exempt)
    "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
    "no_proxy": "127.0.0.1,localhost,::1", "NO_PROXY": "127.0.0.1,localhost,::1",
}
"""Environment of the Ray processes a local start spawns (restored in this process afterwards)."""

#: Seconds a worker waits for a peer's rows (and for the process group to form) before it gives up.
PEER_TIMEOUT = 300.0
#: Seconds to wait for the workers to start (placing them may wait for free CPUs on a cluster).
START_TIMEOUT = 300.0
#: Worker losses a run survives before it gives up.
MAX_RESTARTS = 3
#: Seconds Ray may take to record a worker's process as gone once a peer's exchange with it broke.
LOSS_GRACE = 60.0


def import_ray(local: bool) -> Any:
    """Ray, imported with the local-instance settings when this process will start one (set, not defaulted: a
    value the user's environment holds does not turn usage statistics or outward binding back on)."""
    if local:
        os.environ.update(LOCAL_RAY_ENVIRONMENT)
    try:
        import ray
    except ImportError:
        raise ConfigError("engine.backend", "'ray' needs Ray, which is not installed: "
                                            "pip install 'decentdp[ray]'") from None
    return ray


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def connect(address: str, workers: int) -> tuple[Any, bool]:
    """Ray, started here on loopback (``address`` empty) or attached to a cluster; and whether this
    process started it (and so shuts it down).  An unreachable address is a ConfigError."""
    if address and address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise ConfigError("engine.address", f"cannot reach a Ray cluster at {address!r} "
                                                f"({exc.strerror if isinstance(exc, OSError) else exc}); give "
                                                "'host:port' of a running cluster's head, 'auto', or leave it "
                                                "empty to start Ray on this machine") from None
    ray = import_ray(local=not address)
    if ray.is_initialized():  # this process already holds a Ray instance (e.g. a notebook's): use it if it is
        _check_held_instance(ray, address)  # the one engine.address names
        return ray, False
    if not address:
        handler = signal.getsignal(signal.SIGTERM)  # (ray.init replaces it)
        with _environment(NO_OUTSIDE_HTTP):
            ray.init(address="local", num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1")
        outward = _outward_addresses(ray)
        if outward:  # Ray read its settings when first imported, before decentdp could set them
            ray.shutdown()
            raise ConfigError("engine.backend", f"the local Ray instance bound {', '.join(outward)}, not 127.0.0.1 "
                                                "alone (ray was imported before the run set "
                                                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): run it in a process that has "
                                                "not imported ray")
        _exit_on_sigterm(handler)
        return ray, True
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise ConfigError("engine.address", f"cannot attach to a Ray cluster at {address!r}: {exc}") from None
    return ray, False


def _outward_addresses(ray: Any) -> list[str]:
    """The addresses other than loopback that a Ray instance's control store and nodes listen on."""
    gcs = ray.get_runtime_context().gcs_address
    hosts = {gcs.rpartition(":")[0], *(node["NodeManagerAddress"] for node in ray.nodes())}
    return sorted(host for host in hosts if host not in ("127.0.0.1", "localhost"))


def _check_held_instance(ray: Any, address: str) -> None:
    """Refuse a Ray instance this process already holds where it is not what ``engine.address`` asks for: with
    no address, one bound outside loopback (the run's data and keys would go to its nodes); with a
    ``host:port``, another cluster's."""
    gcs = ray.get_runtime_context().gcs_address
    if not address:
        outward = _outward_addresses(ray)
        if outward:
            raise ConfigError("engine.address", f"is empty (a local, loopback-only Ray), but this process already "
                                                f"holds a Ray instance on {', '.join(outward)}: give its address "
                                                "here to run on it, or call ray.shutdown() first")
    elif address != "auto" and address.removeprefix("ray://") != gcs:
        raise ConfigError("engine.address", f"is {address!r}, but this process already holds the Ray instance at "
                                            f"{gcs}: give that address, or call ray.shutdown() first")


def _exit_on_sigterm(before_ray: Any) -> None:
    """Make SIGTERM exit through Python's normal shutdown, which stops the Ray instance this process started
    and releases the results folder's lock (by default SIGTERM ends the process at once and leaves Ray's helper
    processes behind), unless the process had a handler of its own before ``ray.init`` (``before_ray``; the
    ``decentdp run`` command's, which stops the run as Ctrl-C does): that one is put back.
    Installed after ``ray.init``, which replaces the handler: its core worker's own handler ends the process
    with SIGABRT and a C++ stack dump."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_through_shutdown if before_ray in (signal.SIG_DFL, None) else before_ray)


def _exit_through_shutdown(number: int, frame: Any) -> None:
    """The SIGTERM handler of a process that started its own Ray instance: exit with the shell's 128 + signal."""
    sys.exit(128 + number)


def _without_keys(simulator: Simulator, put: Callable[[Simulator], Any]) -> Any:
    """``put(simulator)`` with a secure run's agent keys taken out while it is serialised: the blueprint
    every worker receives holds no key (each worker is given its own agents' keys, see ``_shard_rng``)."""
    rng = simulator.oracle.rng
    keys = getattr(rng, "keys", None)
    if keys is None:
        return put(simulator)
    rng.keys = AgentKeys({})
    try:
        return put(simulator)
    finally:
        rng.keys = keys


class ShardWorker:
    """One Ray actor: a shard of the run (its state rows, oracle, ledger, scheduler) and its transport."""

    def __init__(self, blueprint: Simulator, bounds: list[int], index: int, threads: int, rng: Any) -> None:
        torch.set_num_threads(threads)
        self.transport = GlooTransport(index)
        self.shard = make_shard(blueprint, bounds, index, self.transport, rng)
        self.state: State = {}

    def pid(self) -> int:
        return os.getpid()

    def rendezvous(self) -> str:
        """Where the workers of a cluster form their process group: this worker's node and a free port."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return f"tcp://{host}:{probe.getsockname()[1]}"

    def connect(self, rendezvous: str) -> None:
        """Join the run's gloo process group (every worker at once) at ``rendezvous`` (``tcp://`` on a
        cluster, ``file://`` when every worker runs on this machine)."""
        import torch.distributed as dist

        if rendezvous.startswith("file://") and sys.platform.startswith("linux"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: gloo's sockets stay on loopback
        dist.init_process_group("gloo", init_method=rendezvous, rank=self.transport.shard,
                                world_size=len(self.shard.bounds) - 1, timeout=timedelta(seconds=PEER_TIMEOUT))

    def load(self, state: State, ledger: dict[str, Any], scheduler: dict[str, Any], rng: Any,
             agents_per_pass: int | None) -> None:
        self.state = state
        self.shard.load(ledger, scheduler, rng, agents_per_pass)

    def layout(self) -> dict[str, int]:
        """Rows of each state entry (the driver tells per-agent entries from replicated ones)."""
        return state_layout(self.state)

    def write_checkpoint(self, directory: str, per_agent: set[str]) -> dict[str, Any]:
        """Write this shard's part of a checkpoint into ``directory``; its manifest entry."""
        return write_shard_checkpoint(Path(directory), self.shard, self.state, per_agent)

    def read_checkpoint(self, directory: str, files: list[dict[str, Any]], rng: Any,
                        agents_per_pass: int | None) -> None:
        """Continue from this shard's rows of a checkpoint written in shards (of this split or another)."""
        rows = self.shard.rows
        saved = read_shard_checkpoints(Path(directory), files, rows.start, rows.stop)
        self.load(saved["state"], saved["ledger"], saved["scheduler"], rng, agents_per_pass)

    def setup(self) -> tuple[float, float]:
        self.state = self.shard.simulator.setup(self.state)
        return self._clipping()

    def round(self, round_index: int) -> tuple[float, float]:
        self.state = self.shard.simulator.run(self.state, round_index, round_index + 1, lambda done, state: True)
        return self._clipping()

    def _clipping(self) -> tuple[float, float]:
        """The last release's clipped fraction and the samples it is over (to combine across shards)."""
        oracle = self.shard.oracle
        if oracle.last_batch_sizes is None or oracle.last_authorized is None:
            return 0.0, 0.0
        weight = float((oracle.last_batch_sizes.cpu() * oracle.last_authorized.float()).sum())
        return oracle.last_clipped_fraction, weight

    def values(self, key: str) -> torch.Tensor:
        return self.state[key]

    def ledger_state(self) -> dict[str, Any]:
        return self.shard.ledger.state_dict()

    def scheduler_state(self) -> dict[str, Any]:
        return self.shard.simulator.scheduler.state_dict()

    def bytes_sent(self) -> int:
        return self.transport.bytes_sent


#: Tensor dtypes a payload may hold, by their code in a header.
_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16,
           torch.uint8)
#: Header length: a count, then per tensor its dtype code, its number of dimensions and up to 6 sizes.
_HEADER = 64


def _header(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    head = torch.zeros(_HEADER, dtype=torch.long)
    head[0] = len(tensors)
    for k, tensor in enumerate(tensors):
        fields = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        head[1 + 8 * k:1 + 8 * k + len(fields)] = torch.tensor(fields)
    return head


def _allocate(head: torch.Tensor) -> tuple[torch.Tensor, ...]:
    values = head.tolist()
    tensors = []
    for k in range(values[0]):
        dtype, ndim = values[1 + 8 * k], values[2 + 8 * k]
        tensors.append(torch.empty(values[3 + 8 * k:3 + 8 * k + ndim], dtype=_DTYPES[dtype]))
    return tuple(tensors)


class PeerExchangeError(ConnectionError):
    """A worker's exchange of rows with its peers broke (a peer's process gone, or silent for
    :data:`PEER_TIMEOUT`): what a lost worker looks like to its peers, told apart from an error of the run's
    own code, which no restart would cure."""


class GlooTransport:
    """Payloads between workers as torch.distributed gloo point-to-point messages: per peer, a fixed-size
    header (each tensor's dtype and shape), then the tensors.  Chosen over Ray actor calls by
    measurement (``benchmarks/distributed_transport.py``: 5-35 times less time per exchange)."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.step = 0
        self.bytes_sent = 0

    def exchange(self, outgoing: Mapping[int, Payload]) -> dict[int, Payload]:
        import torch.distributed as dist

        step, self.step = self.step, self.step + 1
        sent = {peer: (payload,) if isinstance(payload, torch.Tensor) else tuple(payload)
                for peer, payload in outgoing.items()}
        heads = {peer: torch.empty(_HEADER, dtype=torch.long) for peer in sent}
        tag = step * _HEADER  # distinct tags for the header and each tensor of one step
        try:
            _wait([dist.isend(_header(tensors), peer, tag=tag) for peer, tensors in sent.items()] +
                  [dist.irecv(head, peer, tag=tag) for peer, head in heads.items()])
            received = {peer: _allocate(head) for peer, head in heads.items()}
            _wait([dist.isend(tensor.contiguous(), peer, tag=tag + 1 + k)
                   for peer, tensors in sent.items() for k, tensor in enumerate(tensors) if tensor.numel()] +
                  [dist.irecv(tensor, peer, tag=tag + 1 + k)
                   for peer, tensors in received.items() for k, tensor in enumerate(tensors) if tensor.numel()])
        except RuntimeError as exc:  # gloo's errors (a closed connection, a timeout) are RuntimeErrors
            raise PeerExchangeError(f"worker {self.shard}: exchange {step} with worker(s) {sorted(sent)} "
                                    f"failed: {exc}") from exc
        self.bytes_sent += sum(payload_bytes(tensors) for tensors in sent.values())
        return {peer: received[peer][0] if isinstance(outgoing[peer], torch.Tensor) else received[peer]
                for peer in sent}


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


@dataclasses.dataclass
class _Snapshot:
    """What a restart continues from: a round, and the shard files the workers wrote after it."""

    round_index: int
    directory: Path
    files: list[dict[str, Any]]


class ShardedState(Mapping[str, torch.Tensor]):
    """The state after one round, held by the workers; a key's rows are fetched when first read."""

    def __init__(self, engine: RaySimulator, keys: list[str], per_agent: set[str]) -> None:
        self._engine = engine
        self._keys = keys
        self._per_agent = per_agent
        self._values: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._values:
            if key not in self._keys:
                raise KeyError(key)
            engine = self._engine
            parts = engine.read(lambda: [worker.values.remote(key) for worker in
                                         (engine.workers if key in self._per_agent else engine.workers[:1])])
            self._values[key] = torch.cat(parts) if key in self._per_agent else parts[0]
        return self._values[key]

    def __contains__(self, key: object) -> bool:  # (Mapping's own would fetch the rows from every worker)
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _ShardedLedger:
    """The run's ledger while the workers hold it: the merged shards' ledgers, fetched once per round."""

    def __init__(self, engine: RaySimulator, kind: type) -> None:
        self._engine = engine
        self._kind = kind
        self._merged: tuple[int, Any] | None = None

    def current(self) -> Any:
        if self._merged is None or self._merged[0] != self._engine.version:
            states = self._engine.read(lambda: [worker.ledger_state.remote() for worker in self._engine.workers])
            self._merged = (self._engine.version, merge_ledgers(self._kind, states))
        return self._merged[1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)


class _RemoteScheduler:
    """The scheduler's checkpointed state: the workers' (all equal) once they run, else what was loaded."""

    def __init__(self, engine: RaySimulator, state: dict[str, Any]) -> None:
        self._engine = engine
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        if self._engine.launched:
            return self._engine.read(lambda: [self._engine.workers[0].scheduler_state.remote()])[0]
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state


class RaySimulator:
    """The simulator's interface (``setup``, ``run``, ``schedule``, ``scheduler``) over Ray workers."""

    def __init__(self, simulator: Simulator, engine: EngineSection, snapshot_every: int, ray: Any, owns_ray: bool,
                 log: Callable[[str], None] | None = None, per_agent: list[str] | None = None) -> None:
        #: The run's privacy stack in this process (the replaced simulator's oracle): once the workers hold the
        #: run, its ledger is theirs merged, and the last release's clipped fraction is theirs combined.
        self.oracle = simulator.oracle
        #: Where a lost worker is announced, in one line of our own (the run's log; stderr by default).
        self.log = log or (lambda line: print(line, file=sys.stderr))
        #: Calls left waiting when a worker failed: collected after the restart, so that Ray never prints
        #: their errors (a peer's transport trace) as unhandled.
        self._abandoned: list[Any] = []
        self.lost: list[int] = []  # the workers found lost by the last check (announced by the recovery)
        self.ray = ray
        self.owns_ray = owns_ray
        self.local = not engine.address  # every worker on this machine
        self._directory = tempfile.mkdtemp(prefix="decentdp-ray-")
        # where the workers write their checkpoints: the results folder's shards/ once the runner names it
        self._store = Path(self._directory) / SHARD_STORE
        self._attached = False  # whether the store is the results folder's (else a temporary one)
        self._committed: Path | None = None  # the shard files the results folder's manifest names
        self._starts = 0
        self.schedule = simulator.schedule
        self.scheduler = _RemoteScheduler(self, simulator.scheduler.state_dict())
        self.timer: PhaseTimer = NO_TIMER  # phases are timed inside the workers' processes, not here
        self.wrap_network: Callable[[object], object] = unwrapped
        self.bounds = shard_bounds(self.oracle.n_agents, engine.workers)
        self.threads = max(1, torch.get_num_threads() // engine.workers)
        self.snapshot_every = snapshot_every  # rounds between the workers' snapshots: the run's checkpoints
        self.blueprint = _without_keys(simulator, ray.put)  # what every worker builds its shard from
        self.workers: list[Any] = []
        self.launched = False
        self.version = 0  # rounds (and setup) run so far by this engine: the ledger view's cache key
        self.rounds_held = 0  # the rounds the workers' state has run (what a read after a loss replays to)
        self.restarts = 0
        self._snapshot: _Snapshot | None = None
        self._keys: list[str] = []
        self._per_agent: set[str] = set()
        #: The per-agent state entries the checkpoint this run resumes recorded (None: a new run, or not recorded).
        self._recorded_per_agent = per_agent
        self._start_workers()

    # -- workers -------------------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        actor = self.ray.remote(num_cpus=1, max_restarts=0)(ShardWorker)
        self.workers = [actor.remote(self.blueprint, self.bounds, index, self.threads, self._shard_rng(index))
                        for index in range(len(self.bounds) - 1)]
        try:
            if self.local:  # a file store: no listening socket at all (a TCP store listens on every interface)
                self._starts += 1
                rendezvous = f"file://{self._directory}/group-{self._starts}"
            else:
                rendezvous = self._wait([self.workers[0].rendezvous.remote()], START_TIMEOUT)[0]
            self._wait([worker.connect.remote(rendezvous) for worker in self.workers], START_TIMEOUT)
        except TimeoutError:
            self.close()
            raise ConfigError("engine.workers", f"{len(self.bounds) - 1} workers did not start within "
                                                f"{START_TIMEOUT:g} s (each needs a free CPU in the cluster)") from None
        except BaseException:
            self.close()  # no worker left behind
            raise

    def worker_pids(self) -> list[int]:
        """The workers' process ids (a test kills one)."""
        return self.ray.get([worker.pid.remote() for worker in self.workers])

    def bytes_sent(self) -> int:
        """Bytes of rows and messages the workers have sent each other (payload tensors only)."""
        return sum(self.ray.get([worker.bytes_sent.remote() for worker in self.workers]))

    def _wait(self, futures: list[Any], timeout: float | None = None) -> list[Any]:
        """Every result, failing as soon as one worker fails (its error is raised, not a peer's timeout).  No
        time limit unless ``timeout`` is given (the start): a round may take long, a lost worker fails its
        call, and a worker stuck waiting for a peer's rows fails after gloo's ``PEER_TIMEOUT``."""
        pending = list(futures)
        try:
            while pending:
                ready, pending = self.ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise TimeoutError(f"no worker finished within {timeout:g} s")
                self.ray.get(ready[0])
        except BaseException:
            self._abandoned.extend(pending)
            raise
        return self.ray.get(futures)

    def _settle_abandoned(self) -> None:
        """Collect (and drop) the results of calls abandoned when a worker failed: their workers are gone or
        restarted, and an error Ray never handed out is printed as a traceback that reads as a crash."""
        for future in self._abandoned:
            try:
                self.ray.get(future, timeout=PEER_TIMEOUT)
            except Exception:  # the failure this recovery handles (a lost peer, a broken connection)
                pass
        self._abandoned.clear()

    def _rows(self) -> list[slice]:
        return [slice(lo, hi) for lo, hi in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    def _load(self, snapshot: _Snapshot) -> None:
        """Every worker reads its rows of the snapshot's shard files (fresh workers, after a loss)."""
        rng, passes = self.oracle.rng, self.oracle.agents_per_pass
        self._wait([worker.read_checkpoint.remote(str(snapshot.directory), snapshot.files,
                                                  rng.for_agents(range(part.start, part.stop)), passes)
                    for worker, part in zip(self.workers, self._rows(), strict=True)])

    def _shard_rng(self, index: int) -> Any:
        """Worker ``index``'s random source: in a secure run, the keys of its own agents and no other's."""
        return self.oracle.rng.for_agents(range(self.bounds[index], self.bounds[index + 1]))

    def _launch(self, state: State) -> None:
        """Give the workers the run as it stands (new, or resumed from a checkpoint: split here for this
        number of workers) and take its ledger over."""
        oracle = self.oracle
        self._keys = list(state)
        # A resumed checkpoint's own record of its per-agent entries (found by the shards that ran its setup);
        # a new run's initial state, or a checkpoint without the record (written before it was kept, or by a
        # simulator run that never ran sharded), by shape: an entry with one row per agent (a replicated table
        # of as many rows is split too, wrongly)
        self._per_agent = set(self._recorded_per_agent) if self._recorded_per_agent is not None else \
            per_agent_keys(state, oracle.n_agents)
        ledger, scheduler = oracle.ledger.state_dict(), self.scheduler.state_dict()
        rng, passes = oracle.rng, oracle.agents_per_pass
        self._wait([worker.load.remote(shard_state(state, self._per_agent, part), ledger, scheduler,
                                       rng.for_agents(range(part.start, part.stop)), passes)
                    for worker, part in zip(self.workers, self._rows(), strict=True)])
        self.launched = True
        oracle.ledger = _ShardedLedger(self, type(oracle.ledger))

    def _stop_workers(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):  # a worker already gone
                self.ray.kill(worker)
        self.workers = []

    def close(self) -> None:
        """Stop the workers (and the Ray instance this process started)."""
        self._stop_workers()
        shutil.rmtree(self._directory, ignore_errors=True)
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()

    # -- rounds --------------------------------------------------------------------------------------------
    def _collect(self, results: list[tuple[float, float]]) -> None:
        total = sum(weight for _, weight in results)
        self.oracle.last_clipped_fraction = \
            sum(fraction * weight for fraction, weight in results) / total if total else 0.0
        self.version += 1

    def _round(self, round_index: int) -> None:
        """Run one round on every worker (after ``round_index`` rounds: see :meth:`_surviving`)."""
        self._collect(self._surviving(round_index, lambda: [worker.round.remote(round_index)
                                                            for worker in self.workers], f"round {round_index}"))
        self.rounds_held = round_index + 1

    def read(self, calls: Callable[[], list[Any]]) -> list[Any]:
        """The results of ``calls()`` that read the workers' state (rows, ledgers, the scheduler), surviving a
        worker lost since the last round as a round does."""
        return self._surviving(self.rounds_held, calls, f"a read of the state after {self.rounds_held} rounds")

    def _surviving(self, round_index: int, calls: Callable[[], list[Any]], doing: str) -> list[Any]:
        """The results of ``calls()`` (one call per worker, made when the workers hold the state after
        ``round_index`` rounds); on a lost worker, every worker is restarted from the last checkpoint,
        the rounds up to ``round_index`` are replayed, and the calls made again.  An error of the run's own
        code (``doing``: what the calls do, for its note) stops the workers and is raised at once, as the
        simulator raises it: a replay would raise it again."""
        recovering = False
        while True:
            try:
                if recovering:  # a loss during the replay is caught here too, and counted as another
                    self._recover(round_index)
                return self._wait(calls())
            except Exception as error:
                if not self._worker_lost(error):
                    self._stop_workers()  # its peers wait in a receive for rows that will not come
                    self._settle_abandoned()
                    raise self._own_error(error, doing) from None
                self._count_loss()
                recovering = True

    def _worker_lost(self, error: Exception) -> bool:
        """Whether ``error`` comes from a lost worker: its own call failed (``RayActorError``) or a peer's
        exchange with it broke (:class:`PeerExchangeError`, which may come first), and Ray's actor table
        records a worker's process as gone within :data:`LOSS_GRACE`.  The table, not a call: a worker busy in
        a long round, or waiting in a receive for a failed peer's rows, could not answer one.  The lost
        workers are kept in :attr:`lost` for the announcement."""
        if not isinstance(error, (self.ray.exceptions.RayActorError, PeerExchangeError)):
            return False
        deadline = time.monotonic() + LOSS_GRACE
        while True:
            self.lost = [index for index, worker in enumerate(self.workers) if self._gone(worker)]
            if self.lost or time.monotonic() > deadline:
                return bool(self.lost)
            time.sleep(0.1)

    def _gone(self, worker: Any) -> bool:
        """Whether Ray's control store records ``worker``'s actor as dead (its process exited or was lost).
        Read through Ray's internal state module: the public ``ray.util.state`` asks the dashboard, which a
        local instance does not start."""
        return self.ray._private.state.actors(actor_id=worker._actor_id.hex())["State"] == "DEAD"

    def _own_error(self, error: Exception, doing: str) -> Exception:
        """The error a worker's code raised, as the simulator would raise it (its own type and message, noted
        with where it was raised and the worker's traceback), not Ray's wrapper of it; any other error as is."""
        cause = getattr(error, "cause", None)
        if not isinstance(error, self.ray.exceptions.RayTaskError) or not isinstance(cause, Exception):
            return error
        traceback = str(error).split("\n", 1)[-1].rstrip()  # (Ray's message: the worker's name, its traceback)
        cause.add_note(f"(raised by a Ray worker in {doing}; the workers were stopped.  The worker's "
                       f"traceback:\n{traceback})")
        return cause

    def _count_loss(self) -> None:
        """Count a loss of workers; past :data:`MAX_RESTARTS` the run gives up."""
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            self.close()
            raise RuntimeError(f"Ray workers were lost {self.restarts} times; giving up")

    def _recover(self, round_index: int) -> None:
        """Fresh workers from the last checkpoint, replayed to ``round_index`` rounds."""
        snapshot = self._snapshot
        if snapshot is None:
            self.close()
            raise RuntimeError("a Ray worker was lost before the run's first checkpoint; start it again")
        self.log(f"Ray worker(s) {', '.join(map(str, self.lost))} lost after round {round_index}; replaying "
                 f"from the round-{snapshot.round_index} checkpoint on new workers "
                 f"(restart {self.restarts} of at most {MAX_RESTARTS})")
        self._stop_workers()
        self._settle_abandoned()
        self._start_workers()
        self._load(snapshot)
        for replayed in range(snapshot.round_index, round_index):
            self._collect(self._wait([worker.round.remote(replayed) for worker in self.workers]))
        self.rounds_held = round_index

    def setup(self, state: State) -> State:
        """The algorithm's setup phase on every worker (a new run; a worker lost in it ends the run, as no
        checkpoint precedes it)."""
        self._launch(state)
        self._collect(self._surviving(0, lambda: [worker.setup.remote() for worker in self.workers],
                                      "the setup phase"))
        layouts = self._wait([worker.layout.remote() for worker in self.workers])  # entries the setup added
        self._keys, self._per_agent = list(layouts[0]), sharded_keys(layouts, self.bounds)
        self._take_snapshot(0)
        return ShardedState(self, self._keys, self._per_agent)

    def _take_snapshot(self, round_index: int) -> _Snapshot:
        """Every worker writes its shard of the state after ``round_index`` into the store; once all have,
        it is what a lost worker restarts from, and the store keeps it and the results folder's only.  A worker
        that cannot write its file (a full disk) ends the run (the workers stopped) with a :class:`ShardWriteError`
        naming the round, and the round's folder, which no manifest names, is removed."""
        directory = self._store / f"round-{round_index:06d}-{secrets.token_hex(4)}"
        try:
            files = self._surviving(round_index, lambda: [worker.write_checkpoint.remote(str(directory),
                                                                                         self._per_agent)
                                                          for worker in self.workers],
                                    f"the checkpoint after {round_index} rounds")
        except ShardWriteError as error:  # (the workers are stopped: none writes into the folder any more)
            remove_round_folder(directory)
            raise ShardWriteError(error.directory, error.reason, round_index) from None
        self._snapshot = _Snapshot(round_index, directory, files)
        self._prune({directory, self._committed})
        return self._snapshot

    def _prune(self, keep: set[Path | None]) -> None:
        """Remove the store's round folders other than ``keep``; in a results folder, only once this run
        has committed a manifest (until then, the one a resumed run started from names older folders)."""
        if (not self._attached or self._committed is not None) and self._store.is_dir():
            for folder in self._store.iterdir():
                if ROUND_FOLDER.fullmatch(folder.name) and folder not in keep:
                    shutil.rmtree(folder, ignore_errors=True)

    def write_shards(self, results: Path, round_done: int) -> dict[str, Any]:
        """The checkpoint after ``round_done`` for the results folder ``results``: the workers write their
        shards under ``results/shards/`` (unless this round's are there already: the snapshot of a
        checkpoint round), and the manifest entry naming them is returned, for the runner to write
        atomically once every file is complete.  The folders of this and the previous manifest are kept
        (the previous until the new manifest replaces it), older ones removed.  A worker's failed write is a
        :class:`ShardWriteError` (:meth:`_take_snapshot`)."""
        store = Path(results) / SHARD_STORE
        snapshot = self._snapshot
        if store != self._store or snapshot is None or snapshot.round_index != round_done:
            self._store, self._attached = store, True
            snapshot = self._take_snapshot(round_done)
        self._prune({snapshot.directory, self._committed})
        self._committed = snapshot.directory
        return shard_manifest(str(snapshot.directory.relative_to(store.parent)), self.bounds[-1], snapshot.files)

    def run(self, state: State, start_round: int, rounds: int,
            after_round: Callable[[int, State], bool]) -> State:
        """Rounds ``start_round .. rounds-1`` on the workers; ``after_round`` sees each round's
        :class:`ShardedState` (rows are fetched only when read).  The workers stop when it returns."""
        if not self.launched:  # a resumed run: its first snapshot is where it resumes
            self._launch(dict(state))
            self.rounds_held = start_round
            self._take_snapshot(start_round)
        view: Mapping[str, torch.Tensor] = state
        try:
            for k in range(start_round, rounds):
                self._round(k)
                view = ShardedState(self, self._keys, self._per_agent)
                if (k + 1) % self.snapshot_every == 0:
                    self._take_snapshot(k + 1)
                if not after_round(k + 1, view):
                    break
            final, ledger = dict(view), self.oracle.ledger.current()  # kept once the workers are gone
        finally:
            self.close()
        self.oracle.ledger = ledger
        return final


def check_worker_count(workers: int, agents: int) -> None:
    """Refuse more Ray workers than agents (each worker holds at least one): checked by the run before anything is
    written, and by ``decentdp run --dry-run``."""
    if workers > agents:
        raise ConfigError("engine.workers", f"{workers} workers for {agents} agent(s): each worker holds "
                                            "at least one agent")


def distribute(simulator: Simulator, engine: EngineSection, snapshot_every: int,
               log: Callable[[str], None] | None = None, per_agent: list[str] | None = None) -> RaySimulator:
    """The run that ``simulator`` runs in this process, sharded over ``engine.workers`` Ray workers: the
    :class:`RaySimulator` that replaces it, taking a snapshot every ``snapshot_every`` rounds (the run's
    checkpoints).  The engine settings are checked before anything is written; ``log`` receives the engine's
    own announcements (a lost worker); ``per_agent`` are the per-agent state entries the checkpoint a resumed
    run continues from recorded (its ``per_agent``), which its state is split by."""
    check_worker_count(engine.workers, simulator.oracle.n_agents)
    ray, owns = connect(engine.address, engine.workers)
    try:
        return RaySimulator(simulator, engine, snapshot_every, ray, owns, log=log, per_agent=per_agent)
    except BaseException:
        if owns and ray.is_initialized():
            ray.shutdown()
        raise
