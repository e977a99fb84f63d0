"""Per-row against batched keyed noise streams on this machine (``engine.noise_streams``).

Issue 9 asked for per-agent keyed streams drawn for all agents in one call (a counter-based
generator such as Philox, as JAX and torch's CUDA generator use).  ``rng.philox_rows`` is that
design: Philox4x32-10 keyed per row, in vectorised torch int64 arithmetic, the same integers on
every device.  This script times it against ``AgentRandom.normal``'s per-row streams (one re-seeded
generator per row) for the shapes of the issue's table, on the CPU and, where torch sees one, on
CUDA.  On the 2-core CPU the batched draw was 26-71x slower, which is why ``auto`` keeps per-row
streams on the CPU and uses batched ones on CUDA (one set of kernels instead of a launch per row).

    OMP_NUM_THREADS=1 python benchmarks/keyed_streams.py
"""
import time

import torch

from decentdp.rng import AgentRandom, Stream

SHAPES = [(10, 100_000), (100, 10_000), (1000, 7850), (1000, 100)]


def _time(rng: AgentRandom, rows: int, dim: int) -> float:
    """Seconds for one draw of ``rows`` rows of ``dim`` (after one warm-up draw)."""
    out = torch.empty(rows, dim, device=rng.device)
    rng.normal(list(range(rows)), dim, 2, Stream.NOISE, out=out)
    if rng.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    rng.normal(list(range(rows)), dim, 3, Stream.NOISE, out=out)
    if rng.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for rows, dim in SHAPES:
            batched = _time(AgentRandom(0, device=device, streams="batched"), rows, dim)
            per_row = _time(AgentRandom(0, device=device, streams="per-row"), rows, dim)
            print(f"{device:4s} rows {rows:5d} dim {dim:7d}: batched Philox {batched * 1e3:8.1f} ms   "
                  f"per-row {per_row * 1e3:8.1f} ms   batched / per-row {batched / per_row:5.1f}")


if __name__ == "__main__":
    main()
