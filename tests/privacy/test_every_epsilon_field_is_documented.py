"""Every epsilon a run writes is named, with its observer, in the README's table of reported epsilons.

A field that reaches ``privacy.json`` or ``summary.json`` without a row there has no observer a user can read,
and a paper's figure without the ``paper_`` prefix reads as a bound we vouch for (a reviewer found TOP-DP's
per-receiver RDP matrix published as ``epsilon_pairwise_rdp``, below one receiver's exact loss).  Each registered
algorithm runs two rounds (with a colluding set where it reports one) and every epsilon-valued field it writes
must appear in the table's first column.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tests.conftest import tiny_config

from decentdp.algorithms import algorithm_class, algorithm_names
from decentdp.config import validate_config
from decentdp.experiment.loop import run_experiment

README = Path(__file__).resolve().parents[2] / "README.md"

#: Fields whose name holds "epsilon" but whose value is a setting, not a reported loss.
SETTINGS = {"epsilon_target": "the configured budget (README's table of files lists it among a row's settings)"}


def documented_fields() -> set[str]:
    """The backticked names in the first column of the README's table "Every ε a run reports"."""
    text = README.read_text()
    start = text.index("**Every ε a run reports")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|"):
            rows.append(line)
    return {name for row in rows[2:] for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def epsilon_fields(folder: Path) -> set[str]:
    """The top-level fields of the run's ``privacy.json`` and ``summary.json`` that hold an epsilon (names
    holding "epsilon"; strings such as ``epsilon_accountant`` describe one and are not themselves one)."""
    fields = set()
    for name in ("privacy.json", "summary.json"):
        content = json.loads((folder / name).read_text())
        fields |= {key for key, value in content.items() if "epsilon" in key and not isinstance(value, str)}
    return fields - set(SETTINGS)


@pytest.mark.parametrize("name", [name for name in algorithm_names()
                                  if algorithm_class(name).__module__.startswith("decentdp.")])
def test_every_epsilon_a_run_writes_has_a_row_naming_its_observer(name: str, tmp_path: Path) -> None:
    colluding = {"colluding": [[0, 1]]} if algorithm_class(name).reports_colluding else {}
    raw = tiny_config(experiment={"rounds": 2, "eval_every": 2},
                      algorithm={"name": name, "lr": 0.1, "batch_size": 10_000},  # full batches: fast pricing
                      privacy={"epsilon": "inf" if name == "no-noise" else 2.0, **colluding},
                      topology={"graph": "ring", "agents": 4}, engine={"threads": 1})
    run_experiment(validate_config(raw), tmp_path / "run", progress=False, log=lambda line: None)
    missing = epsilon_fields(tmp_path / "run") - documented_fields()
    assert not missing, f"{name} writes {sorted(missing)}: add a row to README's table of reported epsilons"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    unlabelled = [key for key in paper_figures(summary) if not any(
        isinstance(summary.get(stem + "_view"), str) for stem in stems(key))]
    assert not unlabelled, f"{name}'s summary.json shows {unlabelled} without the view they bound"


def paper_figures(content: dict[str, object]) -> list[str]:
    """A file's ``paper_`` epsilons: a paper's own accounting, which is not our bound."""
    return [key for key in content if key.startswith("paper_") and "epsilon" in key
            and not isinstance(content[key], str)]


def stems(key: str) -> list[str]:
    """The names a field's view may carry: the field's own and each shorter prefix of it at an underscore
    (``paper_epsilon_max`` is described by ``paper_epsilon_max_view`` or ``paper_epsilon_view``)."""
    parts = key.split("_")
    return ["_".join(parts[:end]) for end in range(len(parts), 1, -1)]


def test_the_table_is_found_and_names_the_fields_every_run_writes() -> None:
    assert {"epsilon", "epsilon_rdp", "epsilon_max", "epsilon_per_agent"} <= documented_fields()
