"""Why simulation-mode noise keeps one re-seeded Mersenne Twister per row on the CPU.

Issue 9 asked for per-agent keyed streams drawn for all agents in one call (a counter-based
generator such as Philox, as JAX and torch's CUDA generator use).  This script measures such a
design on the CPU: Philox4x32-10 keyed per row, written in vectorised torch int64 arithmetic (torch
has no keyed batched Philox on the CPU), against ``AgentRandom.normal`` (one re-seeded generator
per row).  It is not used by the library: on this machine it was 13-70x slower for every shape of
the issue's table, so the CPU keeps per-row generators; a GPU kernel is where batched Philox pays.

    OMP_NUM_THREADS=1 python benchmarks/keyed_streams.py
"""
import time

import torch

from decentdp.rng import AgentRandom, Stream

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # and Weyl key increments
MASK = 0xFFFFFFFF


def mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * m`` (``a`` int64 below 2^32), exactly, in 16-bit halves."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    m_hi, m_lo = m >> 16, m & 0xFFFF
    mid = a_hi * m_lo + a_lo * m_hi
    lo = a_lo * m_lo + ((mid & 0xFFFF) << 16)
    hi = (a_hi * m_hi + (mid >> 16) + (lo >> 32)) & MASK
    return hi, lo & MASK


def philox(counter: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 of counters ``(counter, 0, 0, 0)`` under per-element keys."""
    zero = torch.zeros_like(counter)
    c0, c1, c2, c3 = counter, zero, zero, zero
    for _ in range(10):
        hi0, lo0 = mulhilo(c0, M0)
        hi1, lo1 = mulhilo(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0
        key0 = (key0 + W0) & MASK
        key1 = (key1 + W1) & MASK
    return [c0, c1, c2, c3]


def normal_rows(keys0: torch.Tensor, keys1: torch.Tensor, dim: int) -> torch.Tensor:
    """``(rows, dim)`` normals, row ``r`` from key ``(keys0[r], keys1[r])``, by Box-Muller."""
    rows, blocks = len(keys0), (dim + 1) // 2
    counter = torch.arange(blocks, dtype=torch.int64).expand(rows, blocks)
    a, b, c, d = philox(counter, keys0[:, None].expand(rows, blocks), keys1[:, None].expand(rows, blocks))
    u1 = ((a << 21) ^ b).double() * 2.0**-53
    u2 = ((c << 21) ^ d).double() * 2.0**-53
    radius = torch.sqrt(-2 * torch.log1p(-u1.clamp(max=1 - 2**-53)))
    return torch.cat([radius * torch.cos(2 * torch.pi * u2), radius * torch.sin(2 * torch.pi * u2)], 1)[:, :dim]


def main() -> None:
    torch.set_num_threads(1)
    rng = AgentRandom(0)
    for rows, dim in [(10, 100_000), (100, 10_000), (1000, 7850), (1000, 100)]:
        keys = torch.randint(0, 2**32, (rows,), dtype=torch.int64)
        start = time.perf_counter()
        normal_rows(keys, keys ^ 0x1234, dim)
        batched = time.perf_counter() - start
        start = time.perf_counter()
        rng.normal(list(range(rows)), dim, 3, Stream.NOISE)
        per_row = time.perf_counter() - start
        print(f"rows {rows:5d} dim {dim:7d}: batched Philox (torch) {batched * 1e3:8.1f} ms   "
              f"per-row Mersenne Twister {per_row * 1e3:8.1f} ms   ratio {batched / per_row:5.1f}")


if __name__ == "__main__":
    main()
