"""``experiments/top-dp/mixing_noise.py``: how much gradient noise each of TOP-DP's protocols leaves in the average."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "top-dp" / "mixing_noise.py"


def test_pairing_keeps_only_the_active_agents_noise_and_synchronous_selection_adds_more() -> None:
    module = load_script(SCRIPT, "top_dp_mixing_noise")
    pairing = {alpha: module.noise_in_average("pairing", alpha, 0, rounds=200, replicas=300)
               for alpha in (0.25, 0.75)}
    synchronous = {alpha: module.noise_in_average("synchronous", alpha, 0, rounds=200, replicas=300)
                   for alpha in (0.25, 0.75)}
    n = module.AGENTS
    # Doubly stochastic pairs: the average moves by the active agents' noise alone, whatever alpha.
    assert pairing[0.25]["average_variance_per_round"] == pytest.approx(pairing[0.75]["average_variance_per_round"])
    assert 0.75 / n < pairing[0.25]["average_variance_per_round"] < 1.05 / n
    # Row-stochastic selection: the disagreement leaks into the average, more the more weight the neighbour has.
    assert synchronous[0.25]["average_variance_per_round"] > 1.8 / n
    assert synchronous[0.75]["average_variance_per_round"] > 1.1 / n
    assert synchronous[0.25]["average_variance_per_round"] > 1.4 * synchronous[0.75]["average_variance_per_round"]
