"""engine.device: resolution and its errors, data moved once, and a sampler that reads no device value
while it samples (its look-ahead gives the same batches, bit for bit, as sampling on demand)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from decentdp.config import validate_config
from decentdp.data.datasets import load_dataset
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment
from decentdp.experiment.loop import run_experiment
from decentdp.gradients.flat_model import FlatModel
from decentdp.gradients.memory import available_memory
from decentdp.models import build_model, classification_loss
from decentdp.privacy.ledger import PrivacyLedger
from decentdp.privacy.mechanisms import GaussianMechanism
from decentdp.privacy.oracle import DataOracle
from decentdp.privacy.sampling import AgentData, PoissonSampler
from decentdp.rng import AgentRandom
from decentdp.runtime.network import SimulatedNetwork
from decentdp.topology import build_topology
from decentdp.util.device import resolve_device

from conftest import tiny_config


def test_cpu_and_auto_without_cuda_resolve_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec,message", [
    ("gpu", "unknown device 'gpu'"),
    ("cuda:", "unknown device"),
    ("CUDA", "unknown device"),
    ("cuda", "torch sees no CUDA device"),
    ("cuda:1", "torch sees no CUDA device"),
])
def test_bad_devices_name_engine_device(spec: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_device(spec)
    assert error.value.field == "engine.device"


def test_a_device_index_out_of_range_names_engine_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"2 CUDA device\(s\), numbered 0..1") as error:
        resolve_device("cuda:2")
    assert error.value.field == "engine.device"
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_the_config_checks_the_spelling_and_the_build_checks_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    assert validate_config(tiny_config()).engine.device == "auto"
    with pytest.raises(ConfigError, match="engine.device"):
        validate_config(tiny_config(engine={"device": "tpu"}))
    config = validate_config(tiny_config(engine={"device": "cuda:0"}))  # valid anywhere: a GPU config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device") as error:
        build_experiment(config)
    assert error.value.field == "engine.device"


def test_the_ray_backend_computes_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper's review: the Ray workers are given no GPU and exchange rows as gloo messages of CPU tensors, yet
    engine.device = 'auto' (the default) or 'cuda' built a Ray run on CUDA, to fail deep inside the workers.
    'cuda' with 'ray' is refused when the config is read; 'auto' builds on the CPU, with a warning where CUDA
    is present."""
    with pytest.raises(ConfigError, match="cannot run with engine.backend = 'ray'") as error:
        validate_config(tiny_config(engine={"backend": "ray", "device": "cuda:0"}))
    assert error.value.field == "engine.device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    raw = tiny_config(engine={"backend": "ray", "workers": 2}, privacy={"epsilon": "inf"})  # (no calibration: fast)
    experiment = build_experiment(validate_config(raw))
    assert experiment.device == torch.device("cpu") and experiment.data.x.device.type == "cpu"
    assert [warning for warning in experiment.warnings if "engine.backend = 'ray'" in warning] == [
        "engine.device = 'auto' computes on the CPU with engine.backend = 'ray' (its workers are given no GPU), "
        "although this machine has CUDA: engine.backend = 'simulator' would use it"]


def test_a_run_is_built_on_its_device(device: torch.device) -> None:
    raw = tiny_config(engine={"device": device.type}, privacy={"epsilon": "inf"})  # (no calibration: fast)
    experiment = build_experiment(validate_config(raw))
    assert experiment.device.type == device.type
    assert experiment.data.x.device.type == device.type and experiment.data.indices[0].device.type == device.type
    assert experiment.initial_state()["params"].device.type == device.type
    assert experiment.sample_rates.device.type == "cpu"  # host values: read without a device round trip
    if device.type == "cpu":
        assert experiment.memory.limit_bytes == pytest.approx(available_memory(), rel=0.2)


def test_moving_a_dataset_keeps_it_when_it_is_already_there(device: torch.device) -> None:
    dataset = load_dataset("digits")
    moved = dataset.to(device)
    assert moved.x_test.device.type == device.type and torch.equal(moved.y_train.cpu(), dataset.y_train)
    assert moved.to(moved.x_train.device) is moved


def _data(sizes: list[int]) -> AgentData:
    generator = torch.Generator().manual_seed(0)
    total = sum(sizes)
    order = torch.randperm(total, generator=generator)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return AgentData(torch.randn(total, 2, generator=generator), torch.arange(total),
                     tuple(order[start:start + size] for start, size in zip(starts, sizes, strict=True)))


def test_sampling_ahead_gives_the_batches_sampling_on_demand_gives(device: torch.device) -> None:
    """In any order of requests: steps within a round, skipped rounds (a resume), a round asked twice."""
    data = _data([7, 1, 30, 12, 3])
    data = AgentData(data.x.to(device), data.y.to(device), tuple(idx.to(device) for idx in data.indices))
    rates = torch.tensor([0.5, 0.9, 0.2, 1e-12, 0.7], dtype=torch.float64)
    ahead = PoissonSampler(data, rates, AgentRandom(4, device=device), lookahead=True)
    on_demand = PoissonSampler(data, rates, AgentRandom(4, device=device), lookahead=False)
    for round_index, step in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (7, 0), (7, 1), (7, 2), (8, 0), (8, 1),
                              (8, 2), (3, 0), (3, 0), (9, 0)]:
        a, b = ahead.sample(round_index, step), on_demand.sample(round_index, step)
        assert torch.equal(a.mask, b.mask) and torch.equal(a.y, b.y) and torch.equal(a.x, b.x)
        assert a.mask.shape[1] == max(1, int(a.sizes.max()))  # the width is the round's largest batch
        assert a.sizes[3] == 0  # rate ~ 0: nothing selected, padding only


def test_an_oracle_samples_clips_and_releases_on_its_device(device: torch.device) -> None:
    """Batches, sums and noise stay on the device; the ledger (host values) charges the active agents."""
    n_agents, per_agent = 5, 40
    generator = torch.Generator().manual_seed(1)
    module = build_model("mlp", (1, 8, 8), 10, seed=3).to(device)
    model = FlatModel(module, classification_loss)
    x = torch.randn(n_agents * per_agent, 1, 8, 8, generator=generator).to(device)
    y = torch.randint(0, 10, (n_agents * per_agent,), generator=generator).to(device)
    data = AgentData(x, y, tuple(torch.arange(i * per_agent, (i + 1) * per_agent, device=device)
                                 for i in range(n_agents)))
    rates = torch.full((n_agents,), 0.25, dtype=torch.float64)
    rng = AgentRandom(7, device=device)
    mechanism = GaussianMechanism(torch.full((n_agents,), 1.5), 1.0)
    oracle = DataOracle(model, PoissonSampler(data, rates, rng), PrivacyLedger(n_agents, math.inf, 1e-5), rng,
                        mechanism, 1.0)
    params = model.initial_parameters().repeat(n_agents, 1)
    active = torch.tensor([True, False, True, True, False], device=device)
    oracle.begin(0, active)
    released = oracle.gradient(params)
    assert released.device.type == device.type and torch.isfinite(released).all()
    assert bool((released[~active] == 0).all()) and bool((released[active].abs().sum(dim=1) > 0).all())
    assert oracle.ledger.releases().tolist() == [1, 0, 1, 1, 0]


def test_a_checkpoint_resumes_only_on_its_kind_of_device(tmp_path: Path) -> None:
    """CPU and CUDA generators differ: a replayed round on the other kind would release new noise."""
    config = validate_config(tiny_config(privacy={"epsilon": "inf"}, engine={"device": "cpu"}))
    run_experiment(config, tmp_path / "run", progress=False, stop_after=2)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["device"] == "cpu"
    torch.save({**saved, "device": "cuda:0"}, checkpoint)  # as if written on a GPU machine
    with pytest.raises(ConfigError, match="written on cuda") as error:
        run_experiment(config, tmp_path / "run", progress=False, resume=True)
    assert error.value.field == "engine.device"
    torch.save(saved, checkpoint)
    assert run_experiment(config, tmp_path / "run", progress=False, resume=True).summary["finished"]


def test_a_cuda_checkpoint_resumed_on_ray_is_told_the_simulator_and_refused_before_ray_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: a simulation-mode checkpoint written on CUDA, resumed with engine.backend = 'ray', was told to add
    --set engine.device=cuda, which the config refuses with Ray (its workers are given no GPU), and only after Ray
    had started.  The message says the run can only continue on the simulator backend with CUDA, naming
    engine.backend, and comes before Ray starts."""
    from decentdp.runtime.distributed import ray_backend

    def ray_started(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("Ray was started for a resume the device check refuses")

    monkeypatch.setattr(ray_backend, "distribute", ray_started)
    config = validate_config(tiny_config(privacy={"epsilon": "inf"}, engine={"device": "cpu"}))
    run_experiment(config, tmp_path / "run", progress=False, stop_after=2)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    torch.save({**torch.load(checkpoint, weights_only=True), "device": "cuda:0"}, checkpoint)  # (a GPU machine's)
    on_ray = validate_config(tiny_config(privacy={"epsilon": "inf"}, engine={"backend": "ray", "workers": 2}))
    with pytest.raises(ConfigError, match=r"written on cuda and Ray's workers compute on the CPU: .*can only continue "
                                          r"on the simulator backend with cuda: resume with --set "
                                          r"engine.backend=simulator --set engine.device=cuda$") as error:
        run_experiment(on_ray, tmp_path / "run", progress=False, resume=True)
    assert error.value.field == "engine.backend"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: host synchronisation is a CUDA matter")
def test_sampling_ahead_and_mixing_never_wait_for_the_device() -> None:
    """torch's sync debug mode raises on any operation that waits for the device: after the first batch
    (sampled on demand), batches and mixing run without one."""
    device = torch.device("cuda")
    data = _data([50, 80, 20, 60])
    data = AgentData(data.x.to(device), data.y.to(device), tuple(idx.to(device) for idx in data.indices))
    sampler = PoissonSampler(data, torch.full((4,), 0.3, dtype=torch.float64), AgentRandom(1, device=device))
    network = SimulatedNetwork(build_topology("ring", 300, seed=0), device=device)
    x = torch.randn(300, 64, device=device)
    sampler.sample(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(1, 6):
            sampler.sample(k)
            network.mix_add(x, network.mix(x), 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: host synchronisation is a CUDA matter")
@pytest.mark.parametrize("algorithm,schedule", [("dp-dsgd", {}), ("dpdl", {}), ("li18-ma", {"kind": "pairing"}),
                                                 ("li18-ma", {"offline_probability": 0.3})])
def test_a_private_round_never_waits_for_the_device(algorithm: str, schedule: dict[str, object]) -> None:
    """Whole rounds (sampling, clipping, noise, the ledger's charge, mixing; cross-gradients; a pairing
    plan; offline agents) under torch's sync debug mode 'error', which raises on any read-back: the
    oracle's bookkeeping runs on host values known before the round.  The first round is a warm-up
    (its batch is sampled on demand, and graph-derived host copies are made once)."""
    config = validate_config(tiny_config(algorithm={"name": algorithm}, schedule=schedule,
                                         topology={"graph": "ring", "agents": 6}))
    experiment = build_experiment(config, device=torch.device("cuda"))
    simulator = experiment.simulator
    state = simulator.setup(experiment.initial_state())
    state = experiment.algorithm.round(state, simulator.context(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for k in range(1, 4):
                state = experiment.algorithm.round(state, simulator.context(k))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(state["params"]).all()
