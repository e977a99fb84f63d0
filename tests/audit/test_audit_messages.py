"""The message audit: a Dirac gradient canary planted exactly, a non-private run refuted by a large bound, a
deliberate noise bug (halved noise) caught above the nominal epsilon, the honest DP-DSGD never above it, and
clear errors for bad inputs.  Each training is a block of 2 agents on the bundled digits, q = 1."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decentdp.audit.blocks import BlockNetwork, Chunk, ChunkStore, audit_experiment, audit_spec
from decentdp.audit.messages import CANARY_LABEL, CanaryModel, canary_coordinate, run_message_audit
from decentdp.audit.settings import AuditSection
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.build import Experiment
from decentdp.privacy.mechanisms import GaussianMechanism, NoiseDraw
from decentdp.topology import build_topology


def _experiment(epsilon: float, rounds: int = 1, algorithm: str = "dp-dsgd", **sections: dict[str, Any]) -> Experiment:
    return audit_experiment(validate_config({
        "experiment": {"name": "audit", "rounds": rounds}, "data": {"dataset": "digits"},
        "topology": {"agents": 2}, "model": {"name": "linear"},
        "algorithm": {"name": algorithm, "lr": 0.1, "batch_size": 16},
        "privacy": {"epsilon": epsilon, "delta": 1e-5, "clip": 1.0}, **sections}))


@pytest.fixture(scope="module")
def private() -> Experiment:
    return _experiment(1.0)


class HalvedNoise(GaussianMechanism):
    """A planted bug: half the calibrated noise is added, while the nominal event is still charged."""

    def __init__(self, honest: GaussianMechanism) -> None:
        super().__init__(honest.noise_multipliers, honest.sensitivity)
        self.scales = honest.scales / 2

    def perturb(self, values: torch.Tensor, owners: torch.Tensor, noise: NoiseDraw,
                slots: Sequence[int] | None = None) -> None:
        super().perturb(values, owners, noise, slots)


def _audit(models: int, **fields: Any) -> AuditSection:
    return AuditSection(models=models, selection_fraction=0.1, chunk=models, threshold_rule="gaussian", **fields)


def test_the_canary_gradient_is_exactly_c_times_a_reserved_direction(private: Experiment) -> None:
    model = private.model
    coordinate = canary_coordinate(model, "1.bias", 3)  # linear: Flatten (0), Linear (1)
    assert coordinate == model.numels[0] + 3
    canary = CanaryModel(model, coordinate, clip=2.0)
    params = model.initial_parameters().repeat(2, 1)
    x = private.dataset.x_train[:6].reshape(2, 3, 1, 8, 8)
    y = private.dataset.y_train[:6].reshape(2, 3).clone()
    y[0, 2] = CANARY_LABEL
    mask = torch.ones(2, 3)
    sums, norms = canary.clipped_gradient_sums(params, x, y, mask, 2.0)
    real_mask = mask.clone()
    real_mask[0, 2] = 0.0
    real, _ = model.clipped_gradient_sums(params, x, y.clamp(min=0), real_mask, 2.0)
    assert sums[0, coordinate] == 2.0 and sums[1, coordinate] == 0.0
    others = torch.ones(model.dim, dtype=torch.bool)
    others[coordinate] = False
    torch.testing.assert_close(sums[:, others], real[:, others])
    assert norms[0, 2] == 2.0


def test_block_network_mixes_each_block_alone() -> None:
    topology = build_topology("ring", 3)
    network = BlockNetwork(topology, blocks=4)
    x = torch.randn(12, 5)
    w = torch.tensor(topology.mixing, dtype=torch.float32)
    torch.testing.assert_close(network.mix(x), torch.cat([w @ x[3 * b:3 * b + 3] for b in range(4)]))
    assert network.out_edges.max() == 11 and len(network.out_edges) == 4 * 6
    assert torch.equal(network.aggregate(network.broadcast(x)), network.neighbor_sum(x))


def test_a_non_private_release_gives_a_large_bound() -> None:
    outcome = run_message_audit(_experiment(float("inf")), _audit(300))
    assert outcome.summary["epsilon_nominal"] == float("inf")
    assert outcome.summary["epsilon_lower_bound"] > 3.0  # 270 runs per world separate perfectly: ln(270 / 3.7)


@pytest.mark.slow
def test_halved_noise_is_caught_above_the_nominal_epsilon(private: Experiment) -> None:
    honest = run_message_audit(private, _audit(25_000))
    bugged = run_message_audit(private, _audit(25_000), wrap_mechanism=HalvedNoise)
    assert honest.summary["epsilon_ledger"] == pytest.approx(1.0, abs=1e-3)  # the ledger charged the nominal event
    assert 0.3 < honest.summary["epsilon_lower_bound"] <= 1.0
    assert bugged.summary["epsilon_lower_bound"] > 1.0


def test_bad_inputs_are_clear_errors(private: Experiment) -> None:
    with pytest.raises(ConfigError, match="audit.canary_index"):
        run_message_audit(private, _audit(100, canary_index=10**6))
    with pytest.raises(ConfigError, match="audit.canary_parameter.*no parameter"):
        run_message_audit(private, _audit(100, canary_parameter="conv.weight"))
    with pytest.raises(ConfigError, match="audit.models.*--models"):  # the config's field, and the flag that sets it
        run_message_audit(private, _audit(20))
    with pytest.raises(ConfigError, match="audit.target"):
        run_message_audit(private, _audit(100, target=2))


@pytest.mark.parametrize(("algorithm", "sections", "field"), [
    ("dp-dsgd", {"privacy": {"epsilon": 1.0, "noise": "secure"}}, "privacy.noise"),
    ("dp-dsgd", {"augmentation": {"kind": "shift"}}, "augmentation.kind"),
    ("dp-dsgd", {"averaging": {"kind": "ema"}}, "averaging.kind"),
    ("decor", {"privacy": {"epsilon": 1.0, "colluding": [[0, 1]]}}, "privacy.colluding"),  # DECOR calibrates for it
])
def test_settings_the_blocks_do_not_run_are_refused_not_dropped(algorithm: str, sections: dict[str, Any],
                                                                 field: str) -> None:
    with pytest.raises(ConfigError) as error:
        _experiment(1.0, algorithm=algorithm, **sections)
    assert error.value.field == field


def test_chunks_kept_in_a_folder_give_the_same_audit_from_separate_processes(private: Experiment,
                                                                              tmp_path: Path) -> None:
    """The full audit's chunks trained by two 'processes' (--chunks 0:2 and 2:4) into one --chunk-dir, then read by
    a third that trains nothing, give the scores and bound of the audit run in one go; the bound first covers
    whatever chunks exist; a folder of another audit is refused (a process with other threads is not another audit)."""
    settings = AuditSection(models=400, selection_fraction=0.1, chunk=100, threshold_rule="gaussian")
    whole = run_message_audit(private, settings)
    folder = tmp_path / "chunks"
    first = run_message_audit(private, settings, store=ChunkStore(folder, range(0, 2)))
    assert first.summary["chunks"] == "2 of 4" and first.summary["models"] == 200
    assert np.array_equal(first.scores, whole.scores[:400])
    second = run_message_audit(private, settings, store=ChunkStore(folder, range(2, 4)))
    assert sorted(path.name for path in folder.glob("chunk-*.npz")) == [f"chunk-0000{i}.npz" for i in range(4)]
    read = run_message_audit(private, settings, store=ChunkStore(folder, range(0, 0)))  # trains nothing
    assert read.summary["chunks"] == "4 of 4"
    # the time is the chunks' own, as stored, summed: the reader's is the trainers' (it read in milliseconds)
    assert read.summary["wall_seconds"] == second.summary["wall_seconds"] > first.summary["wall_seconds"] > 0
    assert read.summary["seconds_per_model"] == pytest.approx(read.summary["wall_seconds"] / 800)
    assert np.array_equal(read.scores, whole.scores) and np.array_equal(read.member, whole.member)
    for key in ("epsilon_lower_bound", "epsilon_eq25", "models", "noise_multiplier", "epsilon_ledger"):
        assert read.summary[key] == whole.summary[key], key
    assert audit_spec(private.config.model_copy(update={"engine": private.config.engine.model_copy(
        update={"threads": 3})}), settings, "messages", 4) == audit_spec(private.config, settings, "messages", 4)
    other = AuditSection(models=400, selection_fraction=0.1, chunk=100, threshold_rule="gaussian", target=1)
    with pytest.raises(ConfigError) as error:
        run_message_audit(private, other, store=ChunkStore(folder))
    assert error.value.field == "--chunk-dir"


@pytest.mark.parametrize("damage", ["file", "spec", "chunk"])
def test_a_damaged_chunk_dir_is_one_clear_error(tmp_path: Path, damage: str) -> None:
    """--chunk-dir naming a file, an unreadable spec.json or a damaged chunk: a ConfigError naming --chunk-dir and
    the file (they were FileExistsError's, JSONDecodeError's and BadZipFile's tracebacks)."""
    folder = tmp_path / "chunks"
    spec = {"kind": "messages", "chunks": 2}
    if damage == "file":
        folder.write_text("not a folder\n")
    else:
        store = ChunkStore(folder)
        store.open(spec, 2)
        store.save(0, 7, Chunk(np.zeros(4), np.ones(4, dtype=bool), 1.0, 2.0, 3.0))
        assert store.load(0, 7) is not None
        damaged = folder / ("spec.json" if damage == "spec" else "chunk-00000.npz")
        damaged.write_bytes(damaged.read_bytes()[:10])
    with pytest.raises(ConfigError) as error:
        store = ChunkStore(folder)
        store.open(spec, 2)
        store.load(0, 7)
    assert error.value.field == "--chunk-dir"
    assert str(folder / {"file": "", "spec": "spec.json", "chunk": "chunk-00000.npz"}[damage]) in str(error.value)


def test_muffliato_is_refused_as_many_blocks(tmp_path: Path) -> None:
    """Its gossip steps come from the spectral gap, 0 on the audit's disconnected copies: it crashed, or (with
    gossip_steps set) trained NaN models and reported a bound of 0 (a review); one block (one-run) still runs it."""
    with pytest.raises(ConfigError) as error:
        run_message_audit(_experiment(1.0, algorithm="muffliato"), _audit(100))
    assert error.value.field == "algorithm.name"


def test_a_personalized_config_is_refused_not_audited_as_the_default_algorithm() -> None:
    """The [personalized] section was ignored and the default [algorithm] (dp-dsgt) audited instead (a review)."""
    raw = validate_config({"experiment": {"name": "p"}, "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": 1.0,
                                                                     "neighbouring": "replace-one"},
                           "personalized": {"dataset": "synthetic", "agents": 6, "dim": 4, "wakeups": 2}})
    with pytest.raises(ConfigError) as error:
        audit_experiment(raw)
    assert error.value.field == "personalized"


def test_the_target_is_audited_at_its_own_budget() -> None:
    """With privacy.agent_epsilons = [8, 1], agent 0 runs at epsilon 8: the audit's target must get the run's
    multiplier for agent 0 and report 8 as nominal (it got the smallest budget's noise and reported 1)."""
    from decentdp.audit.blocks import block_simulation
    from decentdp.experiment.build import build_experiment

    raw = {"experiment": {"name": "audit", "rounds": 1}, "data": {"dataset": "digits"}, "topology": {"agents": 2},
           "model": {"name": "linear"}, "algorithm": {"name": "dp-dsgd", "lr": 0.1, "batch_size": 16},
           "privacy": {"agent_epsilons": [8.0, 1.0], "delta": 1e-5, "clip": 1.0}}
    run_sigmas = build_experiment(validate_config(raw)).noise_multipliers.tolist()
    experiment = audit_experiment(validate_config(raw))
    x, y = experiment.dataset.x_train, experiment.dataset.y_train
    parts = [np.asarray(rows.cpu()) for rows in experiment.data.indices]
    run = block_simulation(experiment, x, y, parts, 0, int(parts[1][0]), np.array([True, False]), seed=0)
    # (the target also holds the audited record, so its rate, and sigma, differ a little: 1.5e-4 here)
    assert run.noise_multipliers == pytest.approx(run_sigmas, rel=1e-3)
    settings = _audit(100)
    assert run_message_audit(experiment, settings).summary["epsilon_nominal"] == 8.0


def test_a_chunk_copied_or_renamed_is_refused(private: Experiment, tmp_path: Path) -> None:
    """Chunk files carry their audit's digest, index and seed: a chunk copied from another seed's folder, or saved
    under another index, was combined into the bound (a copy of chunk 0 as chunk 1 was counted twice)."""
    import shutil

    settings = AuditSection(models=200, selection_fraction=0.1, chunk=100, threshold_rule="gaussian")
    folder = tmp_path / "chunks"
    run_message_audit(private, settings, store=ChunkStore(folder))
    shutil.copy(folder / "chunk-00000.npz", folder / "chunk-00001.npz")     # renamed: the index differs
    with pytest.raises(ConfigError, match="chunk-00001.npz was written as another chunk.*index"):
        run_message_audit(private, settings, store=ChunkStore(folder))
    other = _experiment(1.0, experiment={"name": "audit", "rounds": 1, "seed": 1})
    elsewhere = tmp_path / "seed1"
    run_message_audit(other, settings, store=ChunkStore(elsewhere, range(0, 1)))
    shutil.copy(elsewhere / "chunk-00000.npz", folder / "chunk-00001.npz")  # another audit's chunk 0
    with pytest.raises(ConfigError, match="spec_digest"):
        run_message_audit(private, settings, store=ChunkStore(folder))

