"""Figures the CLI prints are rounded towards the safe side (a review of the CLI): a calibrated sigma and every
epsilon up, an audit's lower bound down, and huge epsilons in scientific notation, not as 300 digits."""

from __future__ import annotations

import json
import math

import pytest

from decentdp.cli.main import main
from decentdp.privacy.accounting import epsilon_spent

_SAMPLING = ["--delta", "1e-5", "--sample-rate", "0.5", "--steps", "10", "--accountant", "rdp"]


def _printed_number(text: str, before: str) -> float:
    return float(text.split(before)[1].split()[0])


def test_a_calibrated_sigma_is_printed_rounded_up_and_reaches_at_most_the_target(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "sigma", "--epsilon", "1", *_SAMPLING, "--json"]) == 0
    text = capsys.readouterr().out
    exact = json.loads(text.splitlines()[-1])["sigma"]
    printed = _printed_number(text, "sigma = ")
    assert printed >= exact
    assert epsilon_spent(printed, 1e-5, 0.5, 10, 1, accountant="rdp") <= 1.0
    assert _printed_number(text, "epsilon reached with this sigma: ") <= 1.0
    assert _printed_number(text, "epsilon reached with this sigma: ") >= \
        epsilon_spent(printed, 1e-5, 0.5, 10, 1, accountant="rdp")


def test_a_spent_epsilon_is_printed_rounded_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "epsilon", "--sigma", "6.71663", *_SAMPLING, "--json"]) == 0
    text = capsys.readouterr().out
    exact = json.loads(text.splitlines()[-1])["epsilon"]
    assert exact > 1.0  # (the rounded-to-nearest sigma of the old output spent more than its target)
    assert _printed_number(text, "spends epsilon = ") >= exact


def test_lower_bounds_round_down_and_upper_bounds_up() -> None:
    from decentdp.results.files import epsilon_text, lower_bound_text

    assert lower_bound_text(1.2349) == "1.234" and epsilon_text(1.2341) == "1.235"
    assert float(lower_bound_text(0.99999999, significant=6)) <= 0.99999999
    assert lower_bound_text(math.inf) == "inf" and lower_bound_text(-math.inf) == "-inf"


def test_huge_epsilons_are_printed_in_scientific_notation_rounded_up() -> None:
    from decentdp.results.files import epsilon_text

    assert epsilon_text(1e300) == "1.00000e+300"
    assert float(epsilon_text(1.234567891e12)) >= 1.234567891e12 and "e+12" in epsilon_text(1.234567891e12)
    assert epsilon_text(4.2) == "4.200"
