"""``decentdp list`` prints types and summaries as people read them (a review of the CLI): no validator
functions with memory addresses, ``X | None`` for optional fields, and an algorithm's whole first paragraph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decentdp.cli.main import main


def test_list_fields_shows_plain_types(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "fields"]) == 0
    text = capsys.readouterr().out
    assert "0x" not in text and "Annotated" not in text and "Optional" not in text
    assert any(line.split()[:3] == ["algorithm.lr_final", "float", "|"] for line in text.splitlines())
    assert main(["list", "fields", "--json"]) == 0
    assert "0x" not in capsys.readouterr().out


def test_list_algorithms_shows_the_whole_first_paragraph(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "algorithms", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    rows = entries if isinstance(entries, list) else next(iter(entries.values()))
    li18 = next(row for row in rows if row["name"] == "li18")
    assert not li18["description"].endswith(" as a"), li18["description"]


@pytest.mark.parametrize("template", ["central-dpsgd", "local"])
def test_templates_of_algorithms_without_messages_set_no_unread_topology(
        template: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / f"{template}.toml"
    assert main(["init", str(config), "--template", template]) == 0
    capsys.readouterr()
    assert main(["run", str(config), "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
