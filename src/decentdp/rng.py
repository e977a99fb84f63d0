"""Keyed random streams: reproducible ones for simulation, secret per-agent ones for deployment.

Two modes (``privacy.noise``):

* **simulation** (:class:`AgentRandom`, the default): every draw is keyed by ``(run seed, agent id,
  round, purpose, step)`` and a ``torch.Generator`` is seeded from a SHA-256 hash of that key.
  Anyone who knows the seed recomputes every noise vector and every batch, so the noise protects
  nothing against a reader of the config: right for research, wrong for deployment.
* **secure** (:class:`SecureRandom`): each agent's noise and Poisson sampling come from *its own*
  32-byte key, drawn from the operating system's entropy and never written next to results
  (:class:`AgentKeys`), through ChaCha20 (a cryptographic stream cipher, via the ``cryptography``
  package); Gaussians are built in float64 and hardened as Opacus's secure mode does (see
  :meth:`SecureRandom.normal`).  Public choices (the scheduler's, an algorithm's random neighbour)
  stay keyed by the seed: they protect nothing and should be checkable.

In simulation mode the keyed design has three consequences:

* a run is bit-for-bit reproducible on CPU for a given seed;
* resuming from a checkpoint needs no generator state: round ``k`` draws the same numbers whether
  or not the run was interrupted before it;
* agent ``i``'s draws do not depend on how many agents share its process, so a multi-machine
  engine holding a shard of agents reproduces the simulator exactly.

Two kinds of stream exist.  *Per-agent* streams (:meth:`AgentRandom.generator`,
:meth:`AgentRandom.normal`) are what an agent draws for itself, e.g. its privacy noise: a shard
needs only its own agents' keys.  A *round-wide* stream (:meth:`AgentRandom.round_generator`) is
one generator for a whole round and purpose, used where one vectorised draw over every agent is
much cheaper than one generator per agent (Poisson sampling).  A round-wide stream stays
independent of sharding as long as every shard draws the *whole* vector and keeps its agents'
slices (see :class:`~decentdp.privacy.sampling.PoissonSampler`); its key uses the agent placeholder
``*``, which no per-agent key (an integer agent id) can equal, so the two kinds never collide.

Per-agent streams are drawn one of two ways (``engine.noise_streams``), with the same keys:
``per-row`` re-seeds one generator per row (the CPU default: fastest there), ``batched`` draws every
row in one vectorised computation of the counter-based Philox4x32-10 generator (Salmon et al.
2011), keyed by each row's seed and counting along the row (the CUDA default: one set of kernels
instead of one launch per agent).  Batched draws are a pure function of (key, position), so the
CPU and a GPU compute the same integers; the Gaussians agree up to the last-bit rounding of
``log``/``cos``/``sin`` on each device.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import IntEnum
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from decentdp.errors import ConfigError


class Stream(IntEnum):
    """What a draw is for; distinct purposes never share random numbers."""

    SAMPLING = 1
    NOISE = 2
    SCHEDULE = 3  #: public choices of the scheduler (who is online, who pairs with whom)
    PUBLIC = 4    #: public choices of an algorithm (e.g. a random neighbour)
    AUGMENTATION = 5  #: random augmentations of an agent's sampled records (decentdp.data.augment)


#: The agent field of round-wide keys; per-agent keys hold a decimal integer there instead.
ROUND_WIDE = "*"


def _key_seed(seed: int, agent: int | str, round_index: int, stream: Stream, step: int,
              slot: int | None = None) -> int:
    """The 63-bit seed of one key: the first 8 bytes of SHA-256(key), shifted to 63 bits.

    ``slot`` (e.g. the receiver of a per-edge message) extends the key only when given, so keys
    without one are those of earlier versions and runs stay reproducible across versions."""
    key = f"{seed}/{agent}/{round_index}/{int(stream)}/{step}" + ("" if slot is None else f"/{slot}")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def stream_seed(seed: int, agent: int, round_index: int, stream: Stream, step: int = 0,
                slot: int | None = None) -> int:
    """A 63-bit seed derived from the key by SHA-256."""
    return _key_seed(seed, int(agent), round_index, stream, step, slot)


def round_stream_seed(seed: int, round_index: int, stream: Stream, step: int = 0) -> int:
    """The seed of the round-wide stream of ``(round, stream, step)``; never equal to a per-agent key."""
    return _key_seed(seed, ROUND_WIDE, round_index, stream, step)


#: Philox4x32's round multipliers and Weyl key increments (Salmon et al. 2011; Random123).
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF
#: Elements of one batched draw computed at once (its int64 temporaries stay near 100 MB).
_PHILOX_CHUNK = 1 << 21
NOISE_STREAMS: tuple[str, ...] = ("per-row", "batched")


def record_hash(records: np.ndarray, seed: int) -> np.ndarray:
    """A keyed hash (uint64) of each record index, from the record's index and ``seed`` alone: what a record's
    fixed placement is drawn from (its cyclic batch, its side of a validation split), so that no record's
    placement depends on which other records exist.  The splitmix64 finaliser (Steele, Lea & Flood 2014),
    element-wise, applied to the index xor the finalised seed."""
    key = _splitmix64(np.asarray([seed], dtype=np.uint64))[0]
    return _splitmix64(np.asarray(records, dtype=np.uint64) ^ key)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic, as in its definition)."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of ``a * m`` for 32-bit ``a`` (held in int64) and ``m``, exactly: the
    product is formed from 16-bit halves, so that no int64 intermediate overflows."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    m_hi, m_lo = m >> 16, m & 0xFFFF
    middle = a_hi * m_lo + a_lo * m_hi
    low = a_lo * m_lo + ((middle & 0xFFFF) << 16)
    high = (a_hi * m_hi + (middle >> 16) + (low >> 32)) & _MASK32
    return high, low & _MASK32


def philox4x32(counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor], rounds: int = 10) -> list[torch.Tensor]:
    """Philox4x32-``rounds`` of the 4-word ``counter`` under the 2-word ``key``, elementwise over
    broadcastable int64 tensors holding 32-bit words (Random123's known answers are tested)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, PHILOX_MULTIPLIERS[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_WEYL[0]) & _MASK32, (k1 + PHILOX_WEYL[1]) & _MASK32
    return [c0, c1, c2, c3]


def below_on_grid(probabilities: np.ndarray | float) -> np.ndarray:
    """The largest multiple of ``2^-53`` at or below each probability, exactly (a float64 scaled by a power of
    two and floored loses nothing).  Every uniform this module or torch draws in float64 lies on the ``2^-53``
    grid (or its midpoints, or one step up), so ``u < below_on_grid(p)`` holds with probability at most
    ``below_on_grid(p) <= p``; comparing with ``p`` itself could hold with probability up to ``p + 2^-53``, and a
    mechanism priced at ``p`` (a sampling rate, a randomized-response probability) must never run above it."""
    return np.floor(np.asarray(probabilities, dtype=np.float64) * 2.0**53) * 2.0**-53


def _unit53(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """A float64 uniform in [0, 1) from 53 bits of two 32-bit words."""
    return ((high >> 5) * 67108864 + (low >> 6)).double() * 2.0 ** -53


def philox_rows(seeds: Sequence[int], dim: int, out: torch.Tensor, uniform: bool = False) -> torch.Tensor:
    """Fill ``out`` (``(len(seeds), dim)``) in one vectorised computation: row ``r`` is keyed by the 64-bit
    ``seeds[r]`` and column ``c`` uses counter block ``c // 2``, so a row does not depend on which rows
    are drawn with it.  Each block's four words give two 53-bit uniforms; ``uniform`` keeps them (in
    ``[0, 1)``), else Box-Muller turns them into two standard normals, computed in float64."""
    device, blocks = out.device, (dim + 1) // 2
    keys = torch.tensor([int(seed) for seed in seeds], dtype=torch.int64, device=device)
    key = (keys & _MASK32, (keys >> 32) & _MASK32)
    rows_per_chunk = max(1, _PHILOX_CHUNK // max(1, blocks))
    for start in range(0, len(seeds), rows_per_chunk):
        rows = slice(start, min(len(seeds), start + rows_per_chunk))
        count = rows.stop - rows.start
        counter = torch.arange(blocks, dtype=torch.int64, device=device).expand(count, blocks)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        a, b, c, d = philox4x32((counter, zero, zero, zero), (key[0][rows, None], key[1][rows, None]))
        first, second = _unit53(a, b), _unit53(c, d)
        if not uniform:
            radius = torch.sqrt(-2.0 * torch.log1p(-first))  # first < 1: log1p(-first) is finite
            angle = 2.0 * torch.pi * second
            first, second = radius * torch.cos(angle), radius * torch.sin(angle)
        pairs = torch.stack([first, second], dim=2).reshape(count, 2 * blocks)
        out[rows].copy_(pairs[:, :dim])
    return out


class AgentRandom:
    """Simulation mode: keyed generators for one run, holding only the public seed (no state).

    Noise that anyone can recompute protects nothing: the simulator reproduces the mechanism's
    *distribution* exactly, which is what a simulation needs, and every run in this mode says so
    once (``SIMULATION_NOTICE``).  Deployments use :class:`SecureRandom`.
    """

    #: Whether draws are secret (per-agent keys) rather than recomputable from the seed.
    secure = False
    #: Precision the noise is drawn and added in (float32 here: fast and bit-reproducible).
    noise_dtype = torch.float32
    #: How per-agent rows are drawn (same keys either way; see the module docstring).
    streams = "per-row"

    def __init__(self, seed: int, device: torch.device | str = "cpu", streams: str = "per-row") -> None:
        if streams not in NOISE_STREAMS:
            raise ValueError(f"unknown noise streams {streams!r}; allowed: {', '.join(NOISE_STREAMS)}")
        self.seed = int(seed)
        self.device = torch.device(device)
        self.streams = streams

    def for_agents(self, agent_ids: Sequence[int]) -> AgentRandom:
        """The source a process holding only ``agent_ids`` gets: the same (it holds no secret) here."""
        return self

    def fingerprint_key(self) -> bytes:
        """The key of the run's data fingerprint (``setup.json``'s ``data_fingerprint``, an HMAC of the records):
        from the public seed here, where the noise is public too."""
        return hashlib.sha256(f"decentdp data fingerprint {self.seed}".encode()).digest()

    def record_uniforms(self, round_index: int, step: int, lengths: Sequence[int]) -> torch.Tensor:
        """``sum(lengths)`` float64 uniforms in [0, 1) for Poisson sampling, agent ``i``'s records in its
        slice (one round-wide draw here, see the module docstring)."""
        generator = self.round_generator(round_index, Stream.SAMPLING, step)
        return torch.rand(int(sum(lengths)), generator=generator, dtype=torch.float64, device=generator.device)

    def generator(self, agent: int, round_index: int, stream: Stream, step: int = 0) -> torch.Generator:
        """The generator agent ``agent`` uses for ``stream`` in round ``round_index`` (sub-step ``step``)."""
        generator = torch.Generator(self.device)
        generator.manual_seed(stream_seed(self.seed, agent, round_index, stream, step))
        return generator

    def round_generator(self, round_index: int, stream: Stream, step: int = 0) -> torch.Generator:
        """The round-wide generator of ``stream`` in round ``round_index`` (sub-step ``step``), shared by all agents.

        Only for draws made as one vector over every agent of the run, of which each agent (or
        shard) uses a fixed slice; see the module docstring.
        """
        generator = torch.Generator(self.device)
        generator.manual_seed(round_stream_seed(self.seed, round_index, stream, step))
        return generator

    def normal(self, agents: Sequence[int], dim: int, round_index: int, stream: Stream, step: int = 0,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
               workers: int = 1, slots: Sequence[int] | None = None, uniform: bool = False) -> torch.Tensor:
        """Standard normal draws of shape ``(len(agents), dim)``, row ``r`` from agent ``agents[r]``'s stream.

        With ``per-row`` streams, row ``r`` equals ``torch.empty(dim).normal_(generator=self.generator(agents[r],
        ...))``; with ``batched`` streams, :func:`philox_rows` under the same seeds.  Either way a shard
        holding any subset of agents draws the same rows.  One generator object is
        re-seeded for every row instead of creating one per agent (re-seeding resets all of its
        state, cached normal samples included), which removes most of the per-agent overhead.
        ``out``, if given, is a ``(len(agents), dim)`` tensor that receives the draws (and is
        returned), so that the caller can draw straight into a buffer; its dtype wins over ``dtype``.
        ``workers > 1`` fills contiguous groups of rows in that many threads (torch's sampling
        kernels release the GIL and are single-threaded); the draws are the same.  ``slots[r]``, if
        given, extends row ``r``'s key (per-edge noise: one stream per (sender, receiver)).
        ``uniform`` draws from U[0, 1) instead (the source of Laplace noise).
        """
        if out is None:
            out = torch.empty(len(agents), dim, dtype=dtype, device=self.device)
        elif out.shape != (len(agents), dim) or (dim > 1 and out.stride(1) != 1):
            # Rows must be contiguous: normal_ fills a strided row by another path, with other values.
            raise ValueError(f"out: expected shape {(len(agents), dim)} with contiguous rows, "
                             f"got shape {tuple(out.shape)} with strides {out.stride()}")
        keys = [None] * len(agents) if slots is None else list(slots)
        seeds = [stream_seed(self.seed, agent, round_index, stream, step, slot)
                 for agent, slot in zip(agents, keys, strict=True)]
        return self._fill(seeds, out, uniform, workers)

    def edge_normal(self, edges: Sequence[tuple[int, int]], dim: int, round_index: int, step: int = 0,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal draws of shape ``(len(edges), dim)``, row ``r`` from the secret that the two ends of
        ``edges[r]`` share (per-edge noise that cancels in pairs: DECOR).  Both ends draw the same row, in
        any order of the pair and in any process.  Here the secret is the key ``(seed, "e<lo>-<hi>", round,
        NOISE, step)``: recomputable from the seed like every simulation draw (an edge field never equals
        an agent id or the round-wide ``*``, so edge streams never meet agent streams)."""
        seeds = [_key_seed(self.seed, _edge_field(*edge), round_index, Stream.NOISE, step) for edge in edges]
        return self._fill(seeds, torch.empty(len(edges), dim, dtype=dtype, device=self.device), False, 1)

    def _fill(self, seeds: list[int], out: torch.Tensor, uniform: bool, workers: int) -> torch.Tensor:
        """Row ``r`` of ``out`` drawn from the 63-bit ``seeds[r]`` (per-row generators or batched Philox)."""
        if self.streams == "batched":
            return philox_rows(seeds, out.shape[1], out, uniform) if seeds else out

        def fill(rows: range) -> None:
            generator = torch.Generator(out.device)
            for row in rows:
                generator.manual_seed(seeds[row])
                if uniform:
                    out[row].uniform_(generator=generator)
                else:
                    out[row].normal_(generator=generator)

        groups = min(workers, len(seeds))
        if groups <= 1:
            fill(range(len(seeds)))
            return out
        bounds = [len(seeds) * k // groups for k in range(groups + 1)]
        with ThreadPoolExecutor(groups) as pool:
            list(pool.map(fill, [range(bounds[k], bounds[k + 1]) for k in range(groups)]))
        return out


def _edge_field(i: int, j: int) -> str:
    """The agent field of an edge's keys: the same for ``(i, j)`` and ``(j, i)``."""
    if i == j:
        raise ValueError(f"an edge joins two agents, got ({i}, {j})")
    return f"e{min(i, j)}-{max(i, j)}"


SIMULATION_NOTICE = ("privacy.noise = 'simulation': every noise vector and batch is recomputable from "
                     "experiment.seed, so this run is not private against anyone who reads its config; "
                     "use privacy.noise = 'secure' for a deployment")
"""Said once by every simulation-mode run (log and ``privacy.json``)."""

KEY_BYTES = 32


class AgentKeys:
    """The secret keys of the agents one process holds: 32 bytes each, from the OS's entropy.

    One key per agent, so that no agent (and no shard of a multi-machine run) can strip another
    agent's noise.  Keys never appear in a results folder: :meth:`save` writes them to a file of its
    own with mode 0600 in a directory of mode 0700 (see ``privacy.key_dir``), so that a resumed run
    re-draws the *same* noise for rounds it replays after its last checkpoint (fresh noise there
    would release those rounds twice).  ``repr`` never shows a key.
    """

    def __init__(self, keys: dict[int, bytes]) -> None:
        if any(len(key) != KEY_BYTES for key in keys.values()):
            raise ValueError(f"every agent key must hold {KEY_BYTES} bytes")
        self._keys = dict(keys)

    @classmethod
    def generate(cls, agent_ids: Sequence[int]) -> AgentKeys:
        return cls({int(agent): secrets.token_bytes(KEY_BYTES) for agent in agent_ids})

    def __repr__(self) -> str:
        return f"AgentKeys({len(self._keys)} agents)"

    @property
    def agent_ids(self) -> list[int]:
        return sorted(self._keys)

    def key(self, agent: int) -> bytes:
        try:
            return self._keys[int(agent)]
        except KeyError:
            raise KeyError(f"this process holds no key for agent {agent}") from None

    def subset(self, agent_ids: Sequence[int]) -> AgentKeys:
        """The keys of ``agent_ids`` only (what one shard of a multi-machine run receives)."""
        return AgentKeys({int(agent): self.key(agent) for agent in agent_ids})

    def save(self, path: Path) -> None:
        """Write the keys to ``path`` (created with mode 0600; its directory with mode 0700)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump({str(agent): key.hex() for agent, key in self._keys.items()}, handle)

    @classmethod
    def load(cls, path: Path) -> AgentKeys:
        with open(path) as handle:
            return cls({int(agent): bytes.fromhex(key) for agent, key in json.load(handle).items()})


def _keystream(key: bytes, nonce: bytes, n_bytes: int) -> bytes:
    """``n_bytes`` of the ChaCha20 keystream of (key, nonce): a cryptographic pseudo-random stream."""
    cipher = Cipher(algorithms.ChaCha20(key, nonce), mode=None)
    return cipher.encryptor().update(bytes(n_bytes))


def _nonce(round_index: int, stream: Stream, step: int, slot: int | None) -> bytes:
    """ChaCha20's 16-byte nonce (4-byte block counter 0, then 12 bytes naming the draw's purpose)."""
    name = f"{round_index}/{int(stream)}/{step}" + ("" if slot is None else f"/{slot}")
    return bytes(4) + hashlib.sha256(name.encode()).digest()[:12]


def _uniform53(raw: bytes, count: int) -> np.ndarray:
    """``count`` float64 uniforms in [0, 1) on the 2^-53 grid, from 8 bytes each."""
    return (np.frombuffer(raw, dtype=np.uint64, count=count) >> np.uint64(11)) * 2.0**-53


def _derive(secret: bytes, info: str) -> bytes:
    """32 bytes of HKDF-SHA256 of ``secret`` for the purpose ``info`` (keys for distinct purposes never meet)."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info.encode()).derive(secret)


def agreement_key(agent_key: bytes) -> X25519PrivateKey:
    """An agent's X25519 key pair, derived from its secret key (so that the key file holds one secret per agent
    and a resumed run agrees on the same edge keys)."""
    return X25519PrivateKey.from_private_bytes(_derive(agent_key, "decentdp/x25519"))


def public_agreement_keys(keys: AgentKeys) -> dict[int, bytes]:
    """The raw X25519 public keys of the agents ``keys`` holds: what each agent publishes to its neighbours."""
    return {agent: agreement_key(keys.key(agent)).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw) for agent in keys.agent_ids}


def edge_key(own: int, own_key: bytes, peer: int, peer_public: bytes) -> bytes:
    """The 32-byte secret that agents ``own`` and ``peer`` share: X25519 of one's private key and the other's
    public key (both ends compute the same value), through HKDF bound to the (unordered) pair."""
    shared = agreement_key(own_key).exchange(X25519PublicKey.from_public_bytes(peer_public))
    return _derive(shared, f"decentdp/edge/{_edge_field(own, peer)}")


def hardened_normals(u: np.ndarray, dim: int) -> np.ndarray:
    """``dim`` normals from ``4 dim`` uniforms: the sum of four Box-Muller normals over two (Holohan & Braghin
    2021, as in Opacus's secure mode; see :meth:`SecureRandom.normal`)."""
    radius = np.sqrt(-2.0 * np.log1p(-u[: 2 * dim]))  # 1 - u lies in (0, 1]: the log is finite
    angle = 2.0 * np.pi * u[2 * dim:]
    pairs = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])  # 4 dim normals
    return pairs.reshape(4, dim).sum(axis=0) / 2.0


class SecureRandom(AgentRandom):
    """Secure mode: each agent's noise and sampling from its own secret key through ChaCha20.

    Not reproducible across runs by design.  Public streams (:meth:`round_generator` for the
    scheduler and ``ctx.public_generator``) still come from the seed.  Keystreams are produced on
    the host and moved to ``device``.
    """

    secure = True
    #: Noise is drawn and added in float64, then the released value is rounded once (see :meth:`normal`).
    noise_dtype = torch.float64

    def __init__(self, seed: int, keys: AgentKeys, device: torch.device | str = "cpu",
                 public_keys: dict[int, bytes] | None = None) -> None:
        super().__init__(seed, device)
        self.keys = keys
        if public_keys is not None:  # a shard: the run's published keys, its own agents' secrets
            self.public_keys = public_keys

    @property
    def keys(self) -> AgentKeys:
        """The secret keys of the agents this process holds (replaced when a secure run resumes)."""
        return self._keys

    @keys.setter
    def keys(self, keys: AgentKeys) -> None:
        self._keys = keys
        #: Every agent's X25519 public key (published; a shard receives all of them with its own secrets).
        self.public_keys = public_agreement_keys(keys)
        self._edge_keys: dict[tuple[int, int], bytes] = {}

    def for_agents(self, agent_ids: Sequence[int]) -> SecureRandom:
        """The same run's source holding the keys of ``agent_ids`` only (what one shard receives)."""
        return SecureRandom(self.seed, self.keys.subset(agent_ids), self.device, self.public_keys)

    def fingerprint_key(self) -> bytes:
        """The data fingerprint's key, derived from every agent's secret: a plain hash of the records would let
        anyone holding all records but one test which candidate is in the data; keyed, ``setup.json`` tells
        nothing of them, and a resumed run (its keys restored) recomputes the same value."""
        return _derive(b"".join(self.keys.key(agent) for agent in self.keys.agent_ids), "data fingerprint")

    def edge_secret(self, i: int, j: int) -> bytes:
        """The key agents ``i`` and ``j`` share (:func:`edge_key`), computed by whichever end this process holds;
        kept in memory only, never written."""
        pair = (min(i, j), max(i, j))
        if pair not in self._edge_keys:
            held = [agent for agent in pair if agent in set(self.keys.agent_ids)]
            if not held:
                raise KeyError(f"this process holds the key of neither end of edge {pair}")
            own, peer = held[0], pair[1] if held[0] == pair[0] else pair[0]
            if peer not in self.public_keys:
                raise ConfigError("privacy.noise", f"secure mode: agent {own} has no published X25519 key of its "
                                                   f"neighbour {peer}, so the two cannot agree on their edge key; "
                                                   "every agent of a secure run must publish one")
            self._edge_keys[pair] = edge_key(own, self.keys.key(own), peer, self.public_keys[peer])
        return self._edge_keys[pair]

    def edge_normal(self, edges: Sequence[tuple[int, int]], dim: int, round_index: int, step: int = 0,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Row ``r`` from the ChaCha20 keystream of the key the ends of ``edges[r]`` agreed on by X25519
        (:meth:`edge_secret`): hardened float64 normals, as :meth:`normal` draws."""
        out = torch.empty(len(edges), dim, dtype=dtype, device=self.device)
        for row, (i, j) in enumerate(edges):
            raw = _keystream(self.edge_secret(i, j), _nonce(round_index, Stream.NOISE, step, None), 32 * dim)
            out[row].copy_(torch.from_numpy(hardened_normals(_uniform53(raw, 4 * dim), dim)))
        return out

    def _uniforms(self, agent: int, count: int, round_index: int, stream: Stream, step: int,
                  slot: int | None = None) -> np.ndarray:
        raw = _keystream(self.keys.key(agent), _nonce(round_index, stream, step, slot), 8 * count)
        return _uniform53(raw, count)

    def words(self, agent: int, round_index: int, stream: Stream, step: int = 0,
              slot: int | None = None) -> Callable[[int], np.ndarray]:
        """Agent ``agent``'s stream of uniform 64-bit words for one key: ``words(n)`` returns its next ``n``
        (the ChaCha20 keystream, continued call after call), for exact samplers that reject a
        variable number of draws (:mod:`decentdp.privacy.discrete`)."""
        encryptor = Cipher(algorithms.ChaCha20(self.keys.key(agent), _nonce(round_index, stream, step, slot)),
                           mode=None).encryptor()

        def take(count: int) -> np.ndarray:
            return np.frombuffer(encryptor.update(bytes(8 * count)), dtype=np.uint64).copy()

        return take

    def record_uniforms(self, round_index: int, step: int, lengths: Sequence[int]) -> torch.Tensor:
        """Agent ``i``'s slice drawn from agent ``i``'s key alone (the keys of the agents this process holds)."""
        parts = [self._uniforms(agent, int(length), round_index, Stream.SAMPLING, step)
                 for agent, length in zip(self.keys.agent_ids, lengths, strict=True)]
        return torch.from_numpy(np.concatenate(parts)).to(self.device)

    def normal(self, agents: Sequence[int], dim: int, round_index: int, stream: Stream, step: int = 0,
               dtype: torch.dtype = torch.float64, out: torch.Tensor | None = None,
               workers: int = 1, slots: Sequence[int] | None = None, uniform: bool = False) -> torch.Tensor:
        """Standard normal (or, with ``uniform``, U[0, 1)) draws of shape ``(len(agents), dim)``, row
        ``r`` from agent ``agents[r]``'s key.

        Each normal is the sum of four Box–Muller normals computed in float64, divided by two
        (Holohan & Braghin 2021, as in Opacus's secure mode): a single float sample carries
        tell-tale low-order bits that floating-point attacks on DP samplers read off the output
        (Mironov 2012; Jin et al. 2022), and the sum smooths them.  Callers add the noise in
        float64 and round the released value once.  ``workers`` is accepted for the interface and
        unused (the cipher is faster than the transforms).
        """
        if out is None:
            out = torch.empty(len(agents), dim, dtype=dtype, device=self.device)
        keys = [None] * len(agents) if slots is None else list(slots)
        per_value = 1 if uniform else 4
        for row, (agent, slot) in enumerate(zip(agents, keys, strict=True)):
            u = self._uniforms(int(agent), per_value * dim, round_index, stream, step, slot)
            values = u if uniform else hardened_normals(u, dim)
            out[row].copy_(torch.from_numpy(values))
        return out


def agent_random(seed: int, secure: bool, streams: str, n_agents: int, device: torch.device) -> AgentRandom:
    """A run's randomness: reproducible from ``seed`` (simulation mode), or per-agent secret keys fresh from
    the OS (``secure``; a resume puts the run's saved keys back).  ``streams`` (``engine.noise_streams``):
    ``auto`` is one vectorised draw on an accelerator, one re-seeded generator per row on a CPU."""
    if secure:
        return SecureRandom(seed, AgentKeys.generate(range(n_agents)), device=device)
    if streams == "auto":
        streams = "batched" if device.type == "cuda" else "per-row"
    return AgentRandom(seed, device=device, streams=streams)
