"""Every ``[algorithm]`` setting of every registered algorithm changes what a run computes or reports.

A setting that validates but that no code reads would be silently ignored: a user would tune it, report it,
and change nothing.  For each algorithm's own settings (those beyond the common ``lr``, ``batch_size`` and
schedule), this file runs the tests' tiny digits run twice with the same seed, at the defaults and with the
setting moved (plus whatever it needs to act, e.g. momentum for Nesterov), and requires the final models,
the noise multipliers or the reported epsilons to differ.  A newly registered setting needs an entry in
:data:`MOVED`, so it cannot land untested.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import tiny_config

from decentdp.algorithms import algorithm_class, algorithm_names
from decentdp.algorithms.base import AlgorithmSettings
from decentdp.config import validate_config
from decentdp.experiment.loop import run_experiment

#: Each setting's moved value (keyed by setting name; an ``(algorithm, setting)`` key overrides it for one
#: algorithm).  Where the setting needs another to act (Nesterov needs momentum), a pair (the other settings, applied
#: to both runs; the moved value): the comparison is then against the run with those settings alone.
MOVED: dict[str | tuple[str, str], dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]] = {
    "optimizer": {"optimizer": "adam"},
    "momentum": {"momentum": 0.5},
    ("dp-cga", "momentum"): {"momentum": 0.9},  # its default is 0.5
    "nesterov": ({"momentum": 0.5}, {"nesterov": True}),
    "weight_decay": {"weight_decay": 0.5},
    "correlation": {"correlation": 1.0},
    "local_epsilon": {"local_epsilon": 0.5},   # a cap below the agents' local epsilon: more own noise
    "margin": {"margin": 0.0},
    "rho": {"rho": 2.0},
    "rho_growth": {"rho_growth": 2.0},
    "primal_steps": {"primal_steps": 2},
    # the optimizer's state is what a reset clears: Adam keeps moments across rounds
    "reset_optimizer_each_round": ({"optimizer": "adam"}, {"reset_optimizer_each_round": True}),
    "local_steps": {"local_steps": 2},
    "correction_decay": {"correction_decay": 0.9},
    "calibration_scale": {"calibration_scale": 0.9},
    "cross_coef": {"cross_coef": "mixing"},
    "include_self": {"include_self": False},
    "accounting": {"accounting": "independent"},
    "alpha": {"alpha": 0.9},
    "factorization": {"factorization": "independent"},
    "optimizer_iterations": {"optimizer_iterations": 1},
    "bands": {"bands": 1},
    "gossip_steps": {"gossip_steps": 1},       # fewer than the graph's T_mix, which 0 chooses
    "update_clip": {"update_clip": 0.01},
    "topology_aware": {"topology_aware": False},
    # the decay multiplies the noise every decay_period rounds: within a 4-round run only with a short period
    "decay_gamma": ({"decay_period": 2}, {"decay_gamma": 0.5}),
    "decay_period": {"decay_period": 2},
    "zero_sum_noise": {"zero_sum_noise": 0.5},
}

COMMON = set(AlgorithmSettings.model_fields)
CASES = [(name, key) for name in algorithm_names()
         for key in algorithm_class(name).Settings.model_fields if key not in COMMON]


def _fingerprint(name: str, settings: dict[str, Any], mixing: str = "metropolis-hastings",
                 ) -> tuple[np.ndarray, np.ndarray, str]:
    """Final models, noise multipliers and the summary's epsilons of a 4-round tiny run."""
    raw = tiny_config(experiment={"rounds": 4, "eval_every": 4},
                      algorithm={"name": name, "lr": 0.1, "batch_size": 16, **settings},
                      privacy={"epsilon": "inf" if name == "no-noise" else 2.0},
                      topology={"graph": "erdos-renyi", "agents": 5, "p": 0.7, "mixing": mixing},
                      engine={"threads": 1})
    result = run_experiment(validate_config(raw), None, progress=False)
    summary = result.summary
    epsilons = {key: value for key, value in summary.items() if "epsilon" in key}
    multipliers = np.asarray(summary.get("noise_multipliers") or [], dtype=float)
    return result.state["params"].to(torch.float64).cpu().numpy(), multipliers, repr(sorted(epsilons.items()))


@cache
def _default_fingerprint(name: str) -> tuple[np.ndarray, np.ndarray, str]:
    return _fingerprint(name, {})


def _mode_and_moved(name: str, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    entry = MOVED.get((name, key), MOVED.get(key))
    assert entry is not None
    return entry if isinstance(entry, tuple) else ({}, entry)


def test_every_setting_has_a_moved_value() -> None:
    missing = sorted({key for name, key in CASES if key not in MOVED and (name, key) not in MOVED})
    assert not missing, f"add a moved value for {missing} to MOVED"


@pytest.mark.parametrize(("name", "key"), CASES, ids=[f"{name}.{key}" for name, key in CASES])
def test_moving_a_setting_changes_the_run(name: str, key: str) -> None:
    mode, change = _mode_and_moved(name, key)
    default = _fingerprint(name, mode) if mode else _default_fingerprint(name)
    moved = _fingerprint(name, {**mode, **change})
    same_models = default[0].shape == moved[0].shape and np.array_equal(default[0], moved[0])
    same_noise = default[1].shape == moved[1].shape and np.array_equal(default[1], moved[1])
    assert not (same_models and same_noise and default[2] == moved[2]), \
        f"algorithm.{key} of '{name}' changed neither the models, the noise nor the reported epsilons"


#: The package's algorithms that talk over a graph (tests register toy ones of their own in the same process).
READERS = [name for name in algorithm_names() if not algorithm_class(name).pools_data
           and algorithm_class(name).__module__.startswith("decentdp.")]


@pytest.mark.parametrize("name", READERS)
def test_reads_mixing_says_whether_the_mixing_matrix_changes_the_run(name: str) -> None:
    """``Algorithm.reads_mixing`` decides whether a run that names ``topology.mixing`` is told it changes nothing,
    so it must be true exactly where the mixing changes the run: the tiny run's graph under Metropolis-Hastings
    and under plain averaging (which differ on it; max-degree does not, every edge touching a degree-4 agent)."""
    default = _default_fingerprint(name)
    averaged = _fingerprint(name, {}, mixing="average")
    same = all(np.array_equal(a, b) for a, b in zip(default[:2], averaged[:2], strict=True)) \
        and default[2] == averaged[2]
    assert same != algorithm_class(name).reads_mixing, \
        f"'{name}': reads_mixing = {algorithm_class(name).reads_mixing}, but the mixing " \
        f"{'changed nothing' if same else 'changed the run'}"


def test_a_mixing_the_algorithm_ignores_is_said_to_change_nothing() -> None:
    from decentdp.experiment.build import build_experiment

    def notes(name: str, mixing: str) -> list[str]:
        raw = tiny_config(algorithm={"name": name}, topology={"graph": "path", "mixing": mixing},
                          privacy={"epsilon": 2.0})
        return build_experiment(validate_config(raw)).setup["mixing_warnings"]

    assert notes("dp-dinno", "average") == ["topology.mixing = 'average' changes nothing: 'dp-dinno' weights its "
                                            "neighbours in its own update rule, not with a mixing matrix"]
    assert notes("dp-dinno", "metropolis-hastings") == []          # the default: nothing was asked
    assert "not doubly stochastic" in " ".join(notes("dp-dsgd", "average"))  # a reader keeps the topology's checks
