"""What a new user meets (issue 37): damaged files, closed pipes and shared results folders get one message
naming the file or the folder, no traceback and nothing half-written; the run names one accountant."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from tests.conftest import tiny_config

import decentdp.cli.main as cli
from decentdp.cli.main import EXIT_USER_ERROR, main
from decentdp.config import validate_config
from decentdp.errors import ConfigError
from decentdp.experiment.record import LOCK_FILE, ResultsFolder
from decentdp.results.files import CHECKPOINT_FILE


def _call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A config file and the results folder of its finished run."""
    folder = tmp_path_factory.mktemp("run")
    config = folder / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_config()), encoding="utf-8")
    code, _, err = _call(["run", str(config), "--out", str(folder / "out"), "--no-progress"])
    assert code == 0, err
    return config, folder / "out"


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda data: b"", "is empty"),
    (lambda data: data[: len(data) // 2], "cannot be read"),
    (lambda data: b"not a checkpoint at all" * 40, "cannot be read"),
])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_writes_nothing(finished: tuple[Path, Path],
                                                                            tmp_path: Path, damage, expected) -> None:
    config, out = finished
    copy = tmp_path / "out"
    copy.mkdir()
    for file in out.iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    checkpoint = copy / CHECKPOINT_FILE
    checkpoint.write_bytes(damage(checkpoint.read_bytes()))
    before = {file.name: file.read_bytes() for file in copy.iterdir()}
    code, _, err = _call(["run", str(config), "--out", str(copy), "--resume", "--no-progress"])
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert str(checkpoint) in err and expected in err and "--resume" in err
    assert {file.name: file.read_bytes() for file in copy.iterdir()} == before


def test_a_closed_pipe_ends_the_output_quietly(finished: tuple[Path, Path]) -> None:
    """``decentdp report ... --json | head``: the reader leaves early; no BrokenPipeError traceback.  The
    report here prints more than a pipe holds (a short one fits in the pipe and never meets the closed end)."""
    _, out = finished
    program = ("import sys; import decentdp.cli.main as cli; "
               "cli._COMMANDS['report'] = lambda args: [print('x' * 1000) for _ in range(2000)] and 0; "
               f"sys.exit(cli.main(['report', {str(out)!r}, '--json']))")
    result = subprocess.run(["sh", "-c", f"'{sys.executable}' -c \"{program}\" | head -c 5"], capture_output=True,
                            text=True, timeout=120)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_the_resume_hint_after_an_interrupt_can_be_pasted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           finished: tuple[Path, Path]) -> None:
    """The printed command carries the --data-dir the run was given (without it, pasting it fails)."""
    config, _ = finished
    out = tmp_path / "out"

    def interrupted(*args, **kwargs):
        out.mkdir()
        (out / CHECKPOINT_FILE).write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr("decentdp.experiment.loop.run_experiment", interrupted)
    code, _, err = _call(["run", str(config), "--out", str(out), "--data-dir", "/data/here", "--no-progress"])
    assert code == 130 and f"--resume --out {out} --data-dir /data/here" in err


def test_a_large_run_summarises_its_epsilons_on_one_line() -> None:
    """943 agents' epsilons are not printed one by one: their range and median, the values in summary.json."""
    line = cli._per_agent([1.0] * 940 + [0.5, None, 2.0])
    assert line == "943 agents: min 0.500, median 1.000, max inf; each in summary.json"
    assert cli._per_agent([1.0, None]) == "1.000, inf"


def test_one_writer_per_results_folder(tmp_path: Path) -> None:
    """A second run on a folder another run is writing is refused, naming the writer's process, and so is
    --resume of it; once the first ends, the folder is free and holds no lock file."""
    config = validate_config(tiny_config())
    out = tmp_path / "out"
    first = ResultsFolder(out)
    first.open(config, resume=False)
    with pytest.raises(ConfigError, match=rf"being written by another run \(process {os.getpid()}\)"):
        ResultsFolder(out).open(config, resume=False)
    (out / CHECKPOINT_FILE).write_bytes(b"")
    with pytest.raises(ConfigError, match="being written by another run"):
        ResultsFolder(out).open(config, resume=True)
    first.close()
    assert not (out / LOCK_FILE).exists()


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path: Path) -> None:
    """The folder is created (and locked) before the build; a build that fails removes it again."""
    config = tmp_path / "bad.toml"
    config.write_text(tomli_w.dumps(tiny_config(data={"dataset": "mnist", "partition": "iid"})), encoding="utf-8")
    out = tmp_path / "results" / "never"
    code, _, err = _call(["run", str(config), "--out", str(out), "--data-dir", str(tmp_path / "nothing"),
                          "--no-progress"])
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert not out.exists()


def test_a_run_names_one_accountant_from_its_log_to_its_summary(tmp_path: Path) -> None:
    """With privacy.accountant = "rdp" the log said eps(rdp) 4 and then (TIGHT) 3.562, and summary.json said
    tight: every epsilon a run prints is now by the accountant it was configured with."""
    config = tmp_path / "rdp.toml"
    config.write_text(tomli_w.dumps(tiny_config(privacy={"epsilon": 5.0, "delta": 1e-5, "clip": 1.0,
                                                         "accountant": "rdp"})), encoding="utf-8")
    code, out, err = _call(["run", str(config), "--out", str(tmp_path / "out"), "--no-progress", "--json"])
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    last_row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().strip().splitlines()[-1])
    assert summary["epsilon_accountant"] == last_row["epsilon_accountant"] == "rdp"
    assert summary["epsilon_max"] == pytest.approx(last_row["epsilon_max"])
    assert "(RDP," in out and "(TIGHT" not in out and "eps(rdp)" in err


def _ratings(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "u.data").write_text("\n".join(lines) + "\n", encoding="latin-1")
    return folder


def test_movielens_files_with_few_users_or_huge_ids_are_refused_before_allocating(tmp_path: Path) -> None:
    """3 users with 10 neighbours asked ended in a RuntimeError deep in the runner, and a huge user id
    allocated 7 GiB and died: the first names personalized.neighbours, the second the file and line."""
    from decentdp.data.movielens import load_movielens
    from decentdp.errors import DataError

    few = _ratings(tmp_path / "few", [f"{u}\t{i}\t{(u + i) % 5 + 1}\t0" for u in (1, 2, 3) for i in range(1, 9)])
    with pytest.raises(ConfigError, match="personalized.neighbours.*has 3 user ids"):
        load_movielens(few, 0, neighbours=10)
    huge = _ratings(tmp_path / "huge", ["1\t1\t5\t0", "2\t2\t4\t0", "900000\t3\t3\t0"])
    with pytest.raises(DataError, match=r"u\.data, line 3: ids are used as indices"):
        load_movielens(huge, 0)


@pytest.mark.parametrize(("assignment", "field"), [("audit.batch_sizes=[0]", "audit.batch_sizes.0"),
                                                   ("audit.batch_sizes=[100000000]", "audit.batch_sizes.0"),
                                                   ("audit.epsilons=[-1.0]", "audit.epsilons.0")])
def test_an_inversion_attack_refuses_impossible_batches_and_budgets(assignment: str, field: str) -> None:
    """A batch of 0 ended in a ZeroDivisionError, a huge one tried to allocate 20 TiB, and a negative epsilon
    was reported as privacy.epsilon: each is refused before anything runs, naming the audit field."""
    config = Path(__file__).resolve().parents[1] / "experiments" / "audits" / "inversion-mnist.toml"
    code, _, err = _call(["attack", "inversion", str(config), "--set", assignment])
    assert code == EXIT_USER_ERROR and field in err and "Traceback" not in err


def test_a_report_over_a_personalized_run_and_a_consensus_run_names_each(finished: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """Issue 37: a report over a digits run and a personalized run claimed "dataset = digits" for both (the
    personalized run's config holds unused defaults), and with --out it crashed on the personalized metrics
    (KeyError: 'round').  Each run now names its own dataset, so the two are refused as one table, saying
    why; the personalized run alone is reported, its files written."""
    demo = Path(__file__).resolve().parents[1] / "experiments" / "personalized" / "demo-synthetic.toml"
    personal = tmp_path / "personal"
    assert _call(["run", str(demo), "--out", str(personal)])[0] == 0
    _, consensus = finished
    code, _, err = _call(["report", str(consensus), str(personal), "--json"])
    assert code == EXIT_USER_ERROR and "digits" in err and "synthetic" in err and "Traceback" not in err
    code, out, err = _call(["report", str(personal), "--out", str(tmp_path / "report"), "--json"])
    assert code == 0 and "Traceback" not in err, err
    shared = json.loads(out.strip().splitlines()[-1])["shared"]
    assert shared["data.dataset"] == "synthetic" and shared["algorithm.name"] == "personalized cd"
    assert "topology.graph" not in shared and "model.name" not in shared   # defaults that never ran


def _mnist_npz(folder: Path, **arrays: np.ndarray) -> Path:
    """An MNIST-style ``mnist.npz`` of a few random images (the Keras layout), with ``arrays`` replaced."""
    rng = np.random.default_rng(0)
    layout = {"x_train": rng.integers(0, 256, (64, 8, 8), dtype=np.uint8), "y_train": np.arange(64) % 10,
              "x_test": rng.integers(0, 256, (16, 8, 8), dtype=np.uint8), "y_test": np.arange(16) % 10}
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "mnist.npz", **{**layout, **arrays})
    return folder / "mnist.npz"


def _one_hot(labels: np.ndarray) -> np.ndarray:
    return np.eye(10)[labels]


@pytest.mark.parametrize(("arrays", "array", "expected"), [
    ({"y_train": _one_hot(np.arange(64) % 10)}, "y_train", "y_train.argmax(axis=1)"),
    ({"y_train": (np.arange(64) % 10) + 0.5}, "y_train", "label 0.5 at index 0 is not a whole"),
    ({"x_test": np.zeros((0, 8, 8), "uint8"), "y_test": np.zeros(0)}, "x_test",
     "the test split holds no images"),
    ({"y_test": np.arange(15) % 10}, "y_test", "expected one label per image, shape (16,)"),
    ({"x_train": np.zeros((64, 8, 8), "float32")}, "x_train", "expected uint8 images"),
])
def test_user_mnist_files_in_other_shapes_are_refused_naming_file_and_array(tmp_path: Path, arrays: dict,
                                                                           array: str, expected: str) -> None:
    """Keras-style one-hot labels crashed in models.py with a shape error, fractional labels were truncated
    to classes in silence, and an empty test split trained, printed "acc nan" and ended in a ValueError: each
    is refused before training, naming the file and the array, and leaves no results folder."""
    data = tmp_path / "data"
    npz = _mnist_npz(data, **arrays)
    config = tmp_path / "mnist.toml"
    config.write_text(tomli_w.dumps(tiny_config(data={"dataset": "mnist", "partition": "iid"})), encoding="utf-8")
    out = tmp_path / "out"
    code, _, err = _call(["run", str(config), "--out", str(out), "--data-dir", str(data), "--no-progress"])
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert f"{npz}, array {array}:" in err and expected in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_user_mnist_labels_as_a_column_or_whole_floats_are_read(tmp_path: Path) -> None:
    """Keras' ``(n, 1)`` label column and floats holding whole classes (3.0) are class indices as they stand."""
    from decentdp.data.datasets import load_dataset

    labels = np.arange(64) % 10
    _mnist_npz(tmp_path, y_train=labels[:, None].astype(np.float32))
    dataset = load_dataset("mnist", tmp_path)
    assert dataset.y_train.tolist() == labels.tolist() and dataset.input_shape == (1, 8, 8)


def _sweep_file(tmp_path: Path) -> Path:
    """A sweep over the tiny config whose own ``set`` table fixes experiment.rounds = 3."""
    (tmp_path / "base.toml").write_text(tomli_w.dumps(tiny_config(privacy={"epsilon": 5.0, "accountant": "rdp"})))
    path = tmp_path / "sweep.toml"
    path.write_text(tomli_w.dumps({"sweep": {"config": "base.toml", "method": "random", "trials": 3,
                                             "validation_fraction": 0.2, "set": {"experiment.rounds": 3}}})
                    + '\n[space]\n"algorithm.lr" = { low = 0.05, high = 0.5, log = true }\n')
    return path


def test_sweep_takes_set_and_trials_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``decentdp sweep --set`` overrides the base config after the file's set table (the command line wins),
    and ``--trials`` replaces sweep.trials; both are kept for a resume (sweep.toml's first line says so)."""
    from decentdp.tuning import sweep as sweep_module
    from decentdp.tuning.sweep import Sweep

    seen = []

    class Stop(Exception):
        pass

    class Runner:
        def __init__(self, sweep: Sweep, out: Path) -> None:
            seen.append(sweep)
            raise Stop

    monkeypatch.setattr(sweep_module, "SweepRunner", Runner)  # (the command imports it when it runs)
    with pytest.raises(Stop):
        main(["sweep", str(_sweep_file(tmp_path)), "--out", str(tmp_path / "out"), "--set", "experiment.rounds=2",
              "--set", "algorithm.batch_size=8", "--trials", "1"])
    sweep = seen[0]
    assert sweep.trials == 1 and sweep.base["experiment"]["rounds"] == 2
    trial = validate_config(sweep.trial_config({"algorithm.lr": 0.1}, 0))
    assert trial.experiment.rounds == 2 and trial.algorithm.batch_size == 8
    assert sweep.options == ["--set", "experiment.rounds=2", "--set", "algorithm.batch_size=8", "--trials", "1"]


@pytest.mark.parametrize(("args", "expected"), [
    (["--set", "privacy.epsilonn=1"], "--set: with 'privacy.epsilonn=1', the sweep's base config is invalid"),
    (["--set", "nosuch.key=1"], "--set: with 'nosuch.key=1'"),
    (["--set", "topology.graph=erdos-renyi"], "--set: with 'topology.graph=erdos-renyi'"),
    (["--set", "experiment.seed=3"], "--set: experiment.seed is set by the sweep itself"),
    (["--set", "privacy"], "--set: expected KEY=VALUE"),
    (["--trials", "0"], "argument --trials: expected a positive integer"),
])
def test_a_bad_sweep_option_is_one_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   args: list[str], expected: str) -> None:
    out = tmp_path / "out"
    try:
        code = main(["sweep", str(_sweep_file(tmp_path)), "--out", str(out), *args])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and expected in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", [["audit", "messages"], ["audit", "mia"], ["attack", "inversion"]])
def test_audits_and_attacks_take_threads_as_run_does(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--threads N`` is ``--set engine.threads=N`` (winning over it), given to torch before the audit runs;
    0 is refused as for ``decentdp run``."""
    import torch

    from decentdp.cli import audit as audit_cli

    config = Path(__file__).resolve().parents[1] / "experiments" / "audits" / "messages-dsgd.toml"
    seen = []

    def record(*args: object) -> tuple[dict, object]:
        seen.append(torch.get_num_threads())
        return {}, lambda out: None  # (the summary, and what would write it into --out)

    monkeypatch.setattr(audit_cli, "_audit" if command[0] == "audit" else "_attack", record)
    before = torch.get_num_threads()
    try:
        assert main([*command, str(config), "--set", "engine.threads=3", "--threads", "2"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [2] and "threads: 2 (engine.threads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([*command, str(config), "--threads", "0"])
    assert info.value.code == EXIT_USER_ERROR and "--threads: expected a positive integer" in capsys.readouterr().err


def test_report_epsilon_figure_has_a_title_a_named_series_and_plain_ticks(tmp_path: Path) -> None:
    """accuracy_mean_vs_epsilon.png had no title, a legend saying "all runs" and ticks such as 2×10⁰."""
    from decentdp.cli.report import build_report, epsilon_figure, find_runs

    config = tmp_path / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_config(privacy={"epsilon": 2.0, "delta": 1e-5, "clip": 1.0,
                                                         "accountant": "rdp"})), encoding="utf-8")
    for epsilon in ("2", "3"):
        code, _, err = _call(["run", str(config), "--out", str(tmp_path / "runs" / epsilon), "--no-progress",
                              "--set", f"privacy.epsilon={epsilon}"])
        assert code == 0, err
    figure = epsilon_figure(build_report(find_runs([tmp_path / "runs"])[0]))
    figure.canvas.draw()
    axes = figure.axes[0]
    assert "against ε spent" in axes.get_title() and "digits" in axes.get_title()
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["dp-dsgt"]
    ticks = [label.get_text() for label in axes.get_xticklabels(which="both") if label.get_text()]
    assert "2" in ticks and "3" in ticks and all(label.replace(".", "").isdigit() for label in ticks), ticks


def test_consensus_figure_starts_at_the_first_positive_distance_with_a_mathtext_label() -> None:
    """The round-0 distance (the models start equal) stretched the log axis, and the label read θ_i."""
    from decentdp.results.files import consensus_figure

    rows = [{"round": r, "consensus_distance": d} for r, d in ((0, 0.0), (10, 0.02), (20, 0.035), (30, 0.03))]
    figure = consensus_figure(rows, "tiny")
    figure.canvas.draw()  # parses the mathtext
    axes = figure.axes[0]
    assert list(axes.lines[0].get_xdata()) == [10, 20, 30] and axes.get_yscale() == "log"
    assert axes.get_ylim()[0] > 0.01 and r"$\sqrt{" in axes.get_ylabel() and r"\theta_i" in axes.get_ylabel()
    assert "θ" not in axes.get_ylabel()
    flat = consensus_figure([{**row, "consensus_distance": 0.0} for row in rows])  # one pooled model
    assert flat.axes[0].get_yscale() == "linear" and list(flat.axes[0].lines[0].get_ydata()) == [0.0] * 4


def test_personalized_neighbours_beyond_the_users_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Ten neighbours for three MovieLens users was clamped in silence while setup.json recorded 10: the run
    is refused naming personalized.neighbours and the users there are, and writes nothing."""
    data = _ratings(tmp_path / "data", [f"{u}\t{i}\t{(u + i) % 5 + 1}\t0" for u in (1, 2, 3) for i in range(1, 9)])
    config = tmp_path / "movielens.toml"
    config.write_text(tomli_w.dumps({"experiment": {"name": "ml", "seed": 0},
                                     "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": 1.0,
                                                 "neighbouring": "replace-one"},
                                     "personalized": {"dataset": "movielens-100k", "neighbours": 10}}))
    out = tmp_path / "out"
    code, _, err = _call(["run", str(config), "--out", str(out), "--data-dir", str(data)])
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert "personalized.neighbours: is 10" in err and "has 3 user ids" in err and not out.exists()


@pytest.mark.parametrize(("name", "damage"), [("summary.json", "{broken"), ("metrics.jsonl", "not a row")])
def test_a_report_over_a_damaged_results_file_names_it(finished: tuple[Path, Path], tmp_path: Path, name: str,
                                                      damage: str) -> None:
    """A results folder whose summary or metrics were cut short (a full disk, an editor): one message naming
    the file, no traceback, no table."""
    folder = tmp_path / "damaged"
    shutil.copytree(finished[1], folder)
    kept = (folder / name).read_text(encoding="utf-8") if name.endswith(".jsonl") else ""  # rows, then junk
    (folder / name).write_text(kept + damage + "\n", encoding="utf-8")
    code, out, err = _call(["report", str(folder)])
    assert code == 2 and f"{folder / name}" in err and "Traceback" not in err and not out.strip()
