"""`decentdp audit messages|mia` and `decentdp attack inversion`: the JSON line later checks read, the results
folder, the non-private message, and input errors printed without a traceback (bundled digits, small runs)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import tomli_w

from decentdp.cli.main import main

#: RDP calibrates in milliseconds (tightness is the message-audit tests' concern, not these)
_BASE = {"experiment": {"name": "audit", "rounds": 2}, "data": {"dataset": "digits"},
         "topology": {"agents": 2}, "model": {"name": "linear"},
         "algorithm": {"name": "dp-dsgd", "lr": 0.1, "batch_size": 16},
         "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": 1.0, "accountant": "rdp"},
         "audit": {"models": 200, "chunk": 100}}


def _config(tmp_path: Path, **sections: dict) -> Path:
    raw = {name: dict(values) for name, values in _BASE.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    path = tmp_path / "audit.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_audit_messages_json_and_results_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    assert main(["audit", "messages", str(_config(tmp_path)), "--models", "150", "--json", "--out", str(out)]) == 0
    summary = _last_json(capsys.readouterr().out)
    assert {"epsilon_lower_bound", "epsilon_nominal", "models", "wall_seconds", "bound_exceeds"} <= set(summary)
    assert summary["models"] == 150 and summary["epsilon_nominal"] == 1.0 and summary["bound_exceeds"] == []
    assert 0.0 <= summary["epsilon_lower_bound"] <= 1.0
    assert json.loads((out / "audit.json").read_text())["models"] == 150
    with (out / "scores.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 300 and sum(row["part"] == "select" for row in rows) == 2 * summary["selection_runs"]


def test_audit_of_a_non_private_config_says_the_bound_is_unbounded(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, privacy={"epsilon": "inf"})
    assert main(["audit", "messages", str(config), "--json"]) == 0
    text = capsys.readouterr().out
    assert "non-private" in text and "unbounded" in text
    summary = _last_json(text)
    assert summary["epsilon_nominal"] is None and summary["epsilon_lower_bound"] > 3.0


def test_audit_mia_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, topology={"agents": 3}, model={"name": "mlp", "options": {"hidden": 16}},
                     audit={"per_digit": 20})
    assert main(["audit", "mia", str(config), "--models", "60", "--json"]) == 0
    summary = _last_json(capsys.readouterr().out)
    assert summary["audit"] == "mia" and summary["models"] == 60
    assert summary["epsilon_ledger"] == pytest.approx(1.0, abs=1e-3)
    assert 0.0 <= summary["epsilon_lower_bound"] <= 1.0


@pytest.mark.parametrize(("args", "message"), [
    (["--models", "8"], "--models"),
    (["--set", "audit.canary_index=100000"], "audit.canary_index"),
    (["--set", "audit.modles=3"], "audit.modles"),
    (["--chunks", "0:2"], "--chunks"),  # without --chunk-dir
    (["--chunk-dir", "CHUNKS", "--chunks", "2"], "--chunks"),
    (["--chunk-dir", "CHUNKS", "--chunks", "3:1"], "--chunks"),
])
def test_bad_audit_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                            message: str) -> None:
    args = [str(tmp_path / "chunks") if arg == "CHUNKS" else arg for arg in args]
    assert main(["audit", "messages", str(_config(tmp_path)), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_mia_needs_one_digit_per_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "mia", str(_config(tmp_path)), "--models", "50"]) == 2
    assert "topology.agents" in capsys.readouterr().err


def test_attack_inversion_json_and_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("skimage", reason="scikit-image is the audit extra")
    config = _config(tmp_path, model={"name": "mlp", "options": {"hidden": 32}},
                     audit={"images": 1, "iterations": 60, "epsilons": [1.0]})
    out = tmp_path / "inversion"
    assert main(["attack", "inversion", str(config), "--json", "--out", str(out)]) == 0
    summary = _last_json(capsys.readouterr().out)
    assert {"ssim_nonprivate", "ssim_private", "psnr_nonprivate", "psnr_private", "mse_nonprivate",
            "mse_private"} <= set(summary)
    assert summary["ssim_nonprivate"] > summary["ssim_private"]
    assert (out / "reconstructions.png").stat().st_size > 0 and (out / "scores.csv").is_file()


def test_attack_inversion_of_a_momentum_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ND-MM / DPDL-MM through the CLI: the release is named in the summary, and the private one scores lower."""
    pytest.importorskip("skimage", reason="scikit-image is the audit extra")
    config = _config(tmp_path, model={"name": "mlp", "options": {"hidden": 32}},
                     audit={"images": 1, "iterations": 60, "epsilons": [1.0], "release": "momentum-difference",
                            "momentum_round": 2})
    assert main(["attack", "inversion", str(config), "--json", "--out", str(tmp_path / "mm")]) == 0
    summary = _last_json(capsys.readouterr().out)
    assert summary["release"] == "momentum-difference"
    assert summary["ssim_nonprivate"] > summary["ssim_private"]


def test_momentum_difference_needing_more_records_than_the_set_is_a_config_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("skimage", reason="scikit-image is the audit extra")
    config = _config(tmp_path, model={"name": "mlp", "options": {"hidden": 32}},
                     audit={"images": 1, "iterations": 1, "release": "momentum-difference", "momentum_round": 10**6})
    assert main(["attack", "inversion", str(config)]) == 2
    assert "audit.momentum_round" in capsys.readouterr().err


def test_audit_mia_audits_the_target_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37: audit.target was ignored by the membership audit (agent 0 always); the canary now sits with the
    target agent, labelled with its digit, and a target beyond the agents is refused naming audit.target."""
    from decentdp.audit.mia import membership_data
    from decentdp.audit.settings import load_audit_config
    from decentdp.experiment.build import build_experiment

    config = _config(tmp_path, topology={"agents": 3}, model={"name": "mlp", "options": {"hidden": 16}},
                     audit={"per_digit": 20, "target": 2})
    experiment_config, audit = load_audit_config(config)
    x, y, _ = membership_data(build_experiment(experiment_config), audit.digits, audit.per_digit, audit.target)
    assert int(y[-1]) == audit.digits[2]
    assert main(["audit", "mia", str(config), "--models", "60", "--json"]) == 0
    assert _last_json(capsys.readouterr().out)["models"] == 60
    wrong = _config(tmp_path, topology={"agents": 3}, audit={"per_digit": 20, "target": 3})
    assert main(["audit", "mia", str(wrong), "--models", "60"]) == 2
    assert "audit.target" in capsys.readouterr().err


def test_audit_chunks_from_two_commands_meet_in_one_folder(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Two commands train the two halves of an audit into one --chunk-dir; a third, given no chunks to train,
    reads both and prints the bound of the whole audit (the bound of the one-go audit)."""
    config, chunks = str(_config(tmp_path)), str(tmp_path / "chunks")
    common = ["audit", "messages", config, "--models", "150", "--set", "audit.chunk=75", "--json"]
    assert main([*common, "--chunk-dir", chunks, "--chunks", "0:1"]) == 0
    text = capsys.readouterr().out
    half = _last_json(text)
    assert half["chunks"] == "1 of 2" and half["models"] == 75 and half["complete"] is False
    assert "interim bound over 1 of 2 chunks" in text  # its confidence is for one look, not the best of several
    assert main([*common, "--chunk-dir", chunks, "--chunks", "1:2"]) == 0
    capsys.readouterr()
    assert main([*common, "--chunk-dir", chunks, "--chunks", "0:0"]) == 0
    text = capsys.readouterr().out
    whole = _last_json(text)
    assert "interim" not in text
    assert main(common) == 0
    alone = _last_json(capsys.readouterr().out)
    assert whole["chunks"] == "2 of 2" and whole["complete"] and whole["models"] == alone["models"] == 150
    assert whole["epsilon_lower_bound"] == alone["epsilon_lower_bound"]


def test_an_audit_of_a_folder_or_of_a_config_without_an_audit_table_says_so(tmp_path: Path, capsys) -> None:
    """A reviewer's `audit mia DIR` said "no such config file", and a run config without [audit] was refused for
    its agents and digits instead of for the missing table."""
    (tmp_path / "run.toml").write_text((Path(__file__).resolve().parents[2] / "experiments" / "demo.toml").read_text())
    for target, message in ((tmp_path, "is a directory"), (tmp_path / "run.toml", "has no [audit] table")):
        assert main(["audit", "mia", str(target)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_a_bound_above_the_nominal_epsilon_warns_with_its_false_alarm_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """The warning is a test at the bound's confidence: an exactly tight, correct mechanism may trip it in up to
    1 - confidence of audits, and the message says so rather than calling the accounting wrong outright."""
    from decentdp.cli.audit import _verdict

    _verdict({"epsilon_nominal": 1.0, "epsilon_lower_bound": 1.2, "confidence": 0.95})
    assert "WARNING" in (text := capsys.readouterr().out) and "at most 5% of audits" in text
    _verdict({"epsilon_nominal": 1.0, "epsilon_lower_bound": 0.8, "confidence": 0.95})
    assert capsys.readouterr().out == ""


def _strict_json(text: str) -> dict:
    """``text`` parsed as strict JSON: NaN and Infinity, which Python writes by default, are refused."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_bad_out_folder_is_refused_before_the_audit_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out afile/sub` (afile a file) was found only once the audit had finished, and its result was lost in a
    traceback; the folder is now created, or refused naming --out, before anything trains."""
    (tmp_path / "afile").write_text("")
    assert main(["audit", "messages", str(_config(tmp_path)), "--out", str(tmp_path / "afile" / "sub")]) == 2
    captured = capsys.readouterr()
    assert "--out" in captured.err and "afile" in captured.err and "Traceback" not in captured.err
    assert "audit messages" not in captured.out  # nothing ran


@pytest.mark.parametrize("json_line", [True, False])
def test_results_that_cannot_be_written_keep_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, json_line: bool) -> None:
    """A results folder that fails at the end (a full disk) is one clear error naming --out, and the summary is
    not lost: the --json line is printed before the folder is written, and without --json the error holds it."""
    import decentdp.cli.audit as cli

    def full_disk(path: Path, rows: list) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "_csv", full_disk)
    args = ["audit", "messages", str(_config(tmp_path)), "--models", "150", "--out", str(tmp_path / "out")]
    assert main([*args, "--json"] if json_line else args) == 2
    captured = capsys.readouterr()
    assert "--out" in captured.err and "No space left on device" in captured.err and "Traceback" not in captured.err
    if json_line:
        assert _last_json(captured.out)["models"] == 150
    else:
        assert '"epsilon_lower_bound"' in captured.err and '"models": 150' in captured.err


def test_non_finite_losses_give_strict_json_and_means_over_the_finite_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An audit accepts up to half NaN scores (diverged trainings), and the mean loss on z was then NaN, written as
    the invalid JSON token NaN in the --json line and audit.json; the means are now over the finite losses, the
    others are counted, and whatever is not finite is null."""
    import decentdp.audit.mia as mia

    honest = mia.classification_loss

    def quarter_diverged(logits, labels):  # noqa: ANN001, ANN202
        loss = honest(logits, labels).clone()
        loss[::4] = float("nan")
        return loss

    monkeypatch.setattr(mia, "classification_loss", quarter_diverged)
    config = _config(tmp_path, topology={"agents": 3}, model={"name": "mlp", "options": {"hidden": 16}},
                     audit={"per_digit": 20})
    out = tmp_path / "out"
    assert main(["audit", "mia", str(config), "--models", "60", "--set", "audit.chunk=30", "--json", "--out",
                 str(out)]) == 0
    summary = _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["loss_non_finite"] == 30  # every 4th of each chunk's 60 models
    assert 0 < summary["loss_member_mean"] < 100 and 0 < summary["loss_non_member_mean"] < 100
    assert _strict_json((out / "audit.json").read_text()) == summary


def test_a_read_that_trains_nothing_leaves_no_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--chunks 0:0 --chunk-dir typo-dir` wrote typo-dir/spec.json, so the folder then refused the audit it was
    meant for if its settings differed."""
    assert main(["audit", "messages", str(_config(tmp_path)), "--chunk-dir", str(tmp_path / "typo-dir"),
                 "--chunks", "0:0"]) == 2
    assert "--chunks" in capsys.readouterr().err
    assert not (tmp_path / "typo-dir").exists()


def test_the_banner_says_how_many_blocks_a_chunk_simulates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A chunk holds audit.chunk trainings of each world, 2 x audit.chunk blocks: the banner and the field's
    description said audit.chunk blocks."""
    from decentdp.audit.blocks import audit_blocks
    from decentdp.audit.settings import AuditSection

    assert [len(blocks) for blocks in audit_blocks(150, 75)] == [150, 150]
    assert "2 x chunk blocks" in (AuditSection.model_fields["chunk"].description or "")
    assert main(["audit", "messages", str(_config(tmp_path)), "--models", "150", "--set", "audit.chunk=75"]) == 0
    assert "150 blocks (75 per world) at a time" in capsys.readouterr().out


def test_a_bound_above_the_ledgers_epsilon_warns_too(capsys: pytest.CaptureFixture[str]) -> None:
    """The ledger's epsilon (what the accountant reports as spent) is a claim as much as the budget is, and for some
    algorithms far below it (Li18: 0.147 at budget 1): a bound above it was not flagged.  The warning names which
    claim is exceeded, and the summary's bound_exceeds lists them."""
    from decentdp.cli.audit import _verdict

    exceeded = _verdict({"epsilon_nominal": 1.0, "epsilon_ledger": 0.147, "epsilon_lower_bound": 0.5,
                         "confidence": 0.95})
    text = capsys.readouterr().out
    assert exceeded == ["epsilon_ledger"]
    assert "WARNING" in text and "ledger" in text and "0.147" in text and "nominal" not in text
    assert _verdict({"epsilon_nominal": 1.0, "epsilon_ledger": 1.0, "epsilon_lower_bound": 1.2,
                     "confidence": 0.95}) == ["epsilon_nominal", "epsilon_ledger"]
    assert "nominal" in capsys.readouterr().out
    assert _verdict({"epsilon_nominal": 1.0, "epsilon_ledger": 0.9, "epsilon_lower_bound": 0.5,
                     "confidence": 0.95}) == []
    assert capsys.readouterr().out == ""
