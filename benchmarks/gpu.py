"""Issue 9's table on every device this machine has, in one run, and the CPU A/B of the round's plumbing.

Part 1, the table (per device: the CPU always, CUDA when torch sees it), median seconds of one
private round of DP-DSGD (epsilon = 1, delta = 1e-5, C = 10, noise calibrated for 1000 rounds) on
MNIST, the settings of ``dp_overhead.py``:

* ConvNet, N = 10, complete graph, one class per agent, expected batch 256 (MNIST at 32x32);
* MLP (one hidden layer of 100), N = 100, ring, IID, expected batch 256;
* logistic regression (``linear``), N = 1000, ring, IID, expected batch 16;

and the paper run (``experiments/consensus/table1-dsgt-eps10.toml``: DP-DSGT, ConvNet, N = 10,
every agent evaluated on the 10,000 test images every 20 rounds) as a ``decentdp run`` subprocess
with ``engine.device`` set: its run loop (the summary's ``wall_seconds``) and its whole process
(start to exit: imports, data, calibration, rounds, evaluations, plots).  On CUDA every timed
round ends with a synchronisation, so a round's time is its device time.

Part 2, the plumbing A/B on the CPU (issue 9, items 3 and 4), interleaved, ``--repeats`` times:

* mixing: the previous revision's sparse mixing (CSR blocks of 8 rows, one product per block)
  against :class:`~decentdp.runtime.network.SimulatedNetwork` (one CSR product written into its
  result), for a DSGT round's ``mix`` and ``mix_add``;
* sampling: the previous revision's sampler (``nonzero`` over the slots, then the round's largest
  batch read back, ``int(counts.max())``) against :class:`~decentdp.privacy.sampling.PoissonSampler`
  (prefix sums over all slots, fixed shapes), both drawing the same uniforms.

Run from the repository root::

    .venv/bin/python benchmarks/gpu.py --json                      # everything, full paper run
    .venv/bin/python benchmarks/gpu.py --paper-rounds 100 --json   # a shorter paper run
    .venv/bin/python benchmarks/gpu.py --only plumbing             # part 2 only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import DEFAULT_DATA_DIR, EPSILON, REPO_ROOT, ExperimentFactory, experiment_config, machine_info
from decentdp.privacy.sampling import AgentData, PoissonSampler
from decentdp.rng import AgentRandom
from decentdp.runtime.network import SimulatedNetwork
from decentdp.topology import build_topology
from decentdp.util.device import synchronize
from dp_overhead import SETTINGS

TABLE = ("convnet_n10", "mlp_n100", "logistic_n1000")
PAPER_CONFIG = REPO_ROOT / "experiments" / "consensus" / "table1-dsgt-eps10.toml"


def devices() -> list[torch.device]:
    """The CPU, and the current CUDA device when there is one."""
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found.append(torch.device("cuda", torch.cuda.current_device()))
    return found


def round_seconds(key: str, device: torch.device, factory: ExperimentFactory, warmup: int, rounds: int) -> float:
    """Median seconds of one private round of setting ``key`` on ``device`` (device time included)."""
    setting = next(s for s in SETTINGS if s.key == key)
    raw = experiment_config(setting.model, setting.agents, setting.batch, EPSILON, setting.graph, setting.partition,
                            setting.image_size)
    raw["engine"]["device"] = str(device)
    experiment = factory.build(raw)
    state = experiment.initial_state()
    times = []
    with torch.no_grad():
        for k in range(warmup + rounds):
            start = time.perf_counter()
            state = experiment.algorithm.round(state, experiment.simulator.context(k))
            synchronize(device)
            if k >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def paper_run(device: torch.device, rounds: int, data_dir: Path) -> dict[str, float]:
    """The paper run as ``decentdp run`` on ``device``: seconds of its run loop and of its whole process."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "decentdp.cli", "run", str(PAPER_CONFIG), "--data-dir", str(data_dir),
                   "--out", str(Path(out) / "run"), "--set", f"experiment.rounds={rounds}",
                   "--set", "experiment.eval_every=20", "--set", f"engine.device={device}"]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO_ROOT)
        process = time.perf_counter() - start
        summary = json.loads((Path(out) / "run" / "summary.json").read_text())
    return {"loop_seconds": float(summary["wall_seconds"]), "process_seconds": process,
            "accuracy_mean": float(summary["accuracy_mean"])}


# -- part 2: the previous revision's plumbing, kept here as the reference it is compared with ---------------
def blocked_operator(matrix: torch.Tensor, rows: int = 8) -> list[tuple[slice, torch.Tensor]]:
    """The previous revision's sparse operator: CSR blocks of ``rows`` consecutive rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return [(slice(start, start + rows), matrix[start:start + rows].to_sparse_csr())
                for start in range(0, matrix.shape[0], rows)]


def blocked_mix(blocks: list[tuple[slice, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for rows, block in blocks:
        out[rows] = block @ x
    return out


def blocked_mix_add(blocks: list[tuple[slice, torch.Tensor]], x: torch.Tensor, into: torch.Tensor,
                    alpha: float) -> torch.Tensor:
    for rows, block in blocks:
        into[rows].mul_(alpha).add_(block @ x)
    return into


def previous_sample(sampler: PoissonSampler, round_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous revision's selection: ``nonzero`` over the slots, then the width read back."""
    n_agents = sampler.data.n_agents
    rates = sampler.sample_rates.to(torch.float64).to(sampler.device)
    chosen = torch.nonzero(sampler.draws(round_index) < rates[sampler.owners]).squeeze(1)
    owner = sampler.owners[chosen]
    counts = torch.bincount(owner, minlength=n_agents)
    width = max(1, int(counts.max()))
    position = torch.arange(len(chosen), device=chosen.device) - (torch.cumsum(counts, 0) - counts)[owner]
    index = sampler._first[:, None].repeat(1, width)
    index[owner, position] = sampler.records[chosen]
    mask = torch.zeros(n_agents, width, device=index.device)
    mask[owner, position] = 1.0
    flat = index.reshape(-1)
    return sampler.data.x.index_select(0, flat), mask


def interleaved(pairs: dict[str, Callable[[], Any]], repeats: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each function, timed in turn ``repeats`` times (``inner`` calls each)."""
    for run in pairs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for repeat in range(repeats):
        order = list(pairs.items()) if repeat % 2 == 0 else list(reversed(pairs.items()))
        for name, run in order:
            start = time.perf_counter()
            for _ in range(inner):
                run()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(values) for name, values in times.items()}


def mixing_ab(agents: int, dim: int, p: float, repeats: int) -> dict[str, Any]:
    """A DSGT round's ``mix`` and ``mix_add`` on an Erdos-Renyi graph: 8-row blocks against one product."""
    topology = build_topology("erdos-renyi", agents, p=p, seed=0)
    network = SimulatedNetwork(topology)
    blocks = blocked_operator(torch.tensor(topology.mixing, dtype=torch.float32))
    x = torch.randn(agents, dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(blocked_mix(blocks, x), network.mix(x))  # the same numbers, bit for bit
    timed = interleaved({"before": lambda: blocked_mix_add(blocks, x, blocked_mix(blocks, x), 0.5),
                         "after": lambda: network.mix_add(x, network.mix(x), 0.5)}, repeats, 5)
    sparse = network._mixing.layout == torch.sparse_csr
    return {**timed, "ratio": timed["before"] / timed["after"],
            "nonzeros_per_row": network._mixing.values().numel() / agents if sparse else None}


def sampling_ab(agents: int, batch: int, repeats: int) -> dict[str, Any]:
    """One round's Poisson batches over MNIST's 60,000 records split evenly: the previous sampler against ours."""
    per_agent = 60_000 // agents
    data = AgentData(torch.randn(60_000, 1, 28, 28), torch.zeros(60_000, dtype=torch.long),
                     tuple(torch.arange(i * per_agent, (i + 1) * per_agent) for i in range(agents)))
    sampler = PoissonSampler(data, torch.full((agents,), batch / per_agent, dtype=torch.float64), AgentRandom(0))
    assert torch.equal(previous_sample(sampler, 3)[1], sampler.sample(3).mask)
    counter = iter(range(10**9))  # a fresh round every call, as in a run
    timed = interleaved({"before": lambda: previous_sample(sampler, next(counter)),
                         "after": lambda: sampler.sample(next(counter))}, repeats, 20)
    return {**timed, "ratio": timed["before"] / timed["after"]}


def plumbing(repeats: int) -> dict[str, Any]:
    """Before/after of mixing and sampling on the CPU, in one process."""
    results: dict[str, Any] = {}
    for agents, dim, p in ((1000, 7850, 0.01), (100, 79510, 0.05), (3000, 7850, 0.004)):
        results[f"mixing_n{agents}_d{dim}"] = mixing_ab(agents, dim, p, repeats)
    for agents, batch in ((10, 256), (1000, 16)):
        results[f"sampling_n{agents}_b{batch}"] = sampling_ab(agents, batch, repeats)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--only", choices=["table", "paper", "plumbing"], action="append",
                        help="parts to run (repeatable; default: all)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per setting and device")
    parser.add_argument("--paper-rounds", type=int, default=2000, help="rounds of the paper run (2000 in the paper)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved repeats of the plumbing A/B")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    parts = set(args.only or ["table", "paper", "plumbing"])
    found = devices()
    result: dict[str, Any] = {"machine": {**machine_info(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                          "devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu"
                                                      for d in found]},
                              "settings": {}}
    factory = ExperimentFactory(args.data_dir)
    for device in found:
        name = device.type
        if "table" in parts:
            for key in TABLE:
                seconds = round_seconds(key, device, factory, args.warmup, args.rounds)
                result["settings"].setdefault(key, {})[name] = seconds
                print(f"{key:>16} on {name}: {seconds * 1e3:8.1f} ms per DP round", flush=True)
        if "paper" in parts:
            paper = paper_run(device, args.paper_rounds, args.data_dir)
            result.setdefault("paper_run", {"rounds": args.paper_rounds})[name] = paper
            print(f"      paper run on {name} ({args.paper_rounds} rounds): loop {paper['loop_seconds']:.1f} s, "
                  f"process {paper['process_seconds']:.1f} s", flush=True)
    if "plumbing" in parts:
        result["plumbing"] = plumbing(args.repeats)
        for key, figures in result["plumbing"].items():
            print(f"{key:>24}: before {figures['before'] * 1e3:7.2f} ms, after {figures['after'] * 1e3:7.2f} ms, "
                  f"before/after {figures['ratio']:.2f}", flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
