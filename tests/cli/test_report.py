"""``decentdp report``: grouping by the fields that differ, statistics over seeds, paper values, figures,
and clear refusals of folders that cannot share a table."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from decentdp.cli.main import main
from decentdp.cli.report import (
    IGNORED_FIELDS,
    IGNORED_SECTIONS,
    build_report,
    csv_text,
    epsilon_figure,
    field_figure,
    find_runs,
    markdown,
    panel_figure,
    read_paper,
    round_figure,
)
from decentdp.errors import ConfigError, DecentDPError

from conftest import fake_run, tiny_config

REPO = Path(__file__).resolve().parents[2]


def report_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["report", *args, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_groups_by_differing_fields_with_mean_and_std_over_seeds(tmp_path: Path, capsys) -> None:
    accuracies = {1.0: [0.70, 0.74, 0.72], 8.0: [0.80, 0.86]}
    for epsilon, values in accuracies.items():
        for seed, accuracy in enumerate(values):
            fake_run(tmp_path / "runs" / f"e{epsilon}-s{seed}", accuracy, seed=seed, epsilon=epsilon,
                     spent=0.9 * epsilon + 0.01 * seed)
    result = report_json(capsys, str(tmp_path / "runs"))
    assert result["fields"] == ["privacy.epsilon"]
    rows = result["rows"]
    assert [row["privacy.epsilon"] for row in rows] == [1.0, 8.0]
    for row, values in zip(rows, accuracies.values(), strict=True):
        assert row["n"] == len(values)
        assert row["mean"] == pytest.approx(statistics.fmean(values))
        assert row["std"] == pytest.approx(statistics.stdev(values))
        assert row["seeds"] == list(range(len(values)))
    assert rows[0]["epsilon_spent"] == pytest.approx(0.9 + 0.02)  # the largest over seeds
    assert rows[1]["worst_agent"] == pytest.approx(statistics.fmean(values) - 0.01)


def test_implied_fields_are_not_columns_but_stay_in_the_rows(tmp_path: Path) -> None:
    # The learning rate is chosen per algorithm, so the algorithm column alone tells the groups apart.
    fake_run(tmp_path / "a", 0.7, algorithm={"name": "dp-dsgt", "lr": 0.1})
    fake_run(tmp_path / "b", 0.6, algorithm={"name": "dp-dsgd", "lr": 0.3})
    report = build_report(find_runs([tmp_path])[0])
    assert report.fields[:2] == ["algorithm.name", "algorithm.lr"]  # then DSGD's own settings
    assert report.labels == ["algorithm.name"]
    assert {row["algorithm.lr"] for row in report.rows} == {0.1, 0.3}
    assert "Also differing, set by the columns above: algorithm.lr, " in markdown(report)


def test_seeds_names_and_engine_settings_do_not_split_groups(tmp_path: Path) -> None:
    fake_run(tmp_path / "a", 0.7, seed=0, experiment={"name": "first"}, engine={"threads": 1})
    fake_run(tmp_path / "b", 0.8, seed=1, experiment={"name": "second"}, engine={"threads": 2})
    report = build_report(find_runs([tmp_path / "a", tmp_path / "b", tmp_path / "a"])[0])  # a folder given twice
    assert len(report.rows) == 1 and report.rows[0]["n"] == 2


def test_runs_of_one_setting_that_share_a_seed_are_refused_naming_the_folders(tmp_path: Path, capsys) -> None:
    """A review: a bit-identical copy of seed 0, and a run differing only in eval_every (an ignored field), were
    counted as seeds of their own and weighted the mean ± std (and --paired kept one of them silently)."""
    fake_run(tmp_path / "a", 0.7, seed=0)
    fake_run(tmp_path / "copy", 0.7, seed=0)
    fake_run(tmp_path / "eval1", 0.7, seed=0, experiment={"eval_every": 1})
    fake_run(tmp_path / "s1", 0.8, seed=1)
    fake_run(tmp_path / "b", 0.8, seed=0, algorithm={"lr": 0.3})
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "copy"), str(tmp_path / "s1"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "share a seed" in err and f"seed 0: {tmp_path / 'a'}, {tmp_path / 'copy'} (the same config)" in err
    assert "Traceback" not in err and not out.exists()
    with pytest.raises(DecentDPError, match="differing only in experiment.eval_every"):
        build_report(find_runs([tmp_path / "a", tmp_path / "eval1", tmp_path / "b"])[0])
    with pytest.raises(DecentDPError, match="share a seed"):
        build_report(find_runs([tmp_path / "a", tmp_path / "copy", tmp_path / "b"])[0], paired="algorithm.lr=0.3")
    single = build_report(find_runs([tmp_path / "a", tmp_path / "s1", tmp_path / "b"])[0])
    assert sorted(row["seeds"] for row in single.rows) == [[0], [0, 1]]


def test_where_a_run_logs_or_keeps_its_keys_does_not_split_groups(tmp_path: Path) -> None:
    """A helper's review: two seeds of one setting came out as four rows, keyed by tracking and key_dir.  Every
    placement field (where a run computes or logs) is ignored, as is privacy.key_dir."""
    from decentdp.config.schema import PLACEMENT_FIELDS

    assert all(name in IGNORED_FIELDS or name.startswith(IGNORED_SECTIONS) for name in PLACEMENT_FIELDS)
    fake_run(tmp_path / "a", 0.7, seed=0, privacy={"noise": "secure", "key_dir": str(tmp_path / "k1")},
             tracking={"backend": "tensorboard", "log_dir": str(tmp_path / "log1")})
    fake_run(tmp_path / "b", 0.8, seed=1, privacy={"noise": "secure", "key_dir": str(tmp_path / "k2")})
    report = build_report(find_runs([tmp_path / "a", tmp_path / "b"])[0])
    assert len(report.rows) == 1 and report.rows[0]["n"] == 2


def _drop_field(folder: Path, section: str, key: str) -> None:
    """Rewrite a fake run as a run of an older library, whose config had no ``section.key``."""
    summary = json.loads((folder / "summary.json").read_text())
    del summary["config"][section][key]
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.toml").write_text(tomli_w.dumps(summary["config"]))


def test_a_field_an_older_run_lacks_counts_as_its_default(tmp_path: Path) -> None:
    """data.validation_split came in after runs of one setting were written: the old run (no field) and the new
    one (its default, "exact-count") are seeds of one row, while a run that sets another value is a row of its
    own.  They were two rows, which left seed-1 runs out of the consensus tables."""
    held_out = {"validation_fraction": 0.2}  # (the split is read only where records are held out)
    _drop_field(fake_run(tmp_path / "old", 0.7, seed=0, data=held_out), "data", "validation_split")
    fake_run(tmp_path / "new", 0.8, seed=1, data=held_out)
    report = build_report(find_runs([tmp_path])[0])
    assert len(report.rows) == 1 and report.rows[0]["n"] == 2
    fake_run(tmp_path / "other", 0.9, seed=2, data={**held_out, "validation_split": "per-record"})
    assert sorted(row["n"] for row in build_report(find_runs([tmp_path])[0]).rows) == [1, 2]


def test_paper_values_match_the_most_specific_row(tmp_path: Path, capsys) -> None:
    fake_run(tmp_path / "runs" / "a", 0.90, epsilon=1.0)
    fake_run(tmp_path / "runs" / "b", 0.95, epsilon=10.0)
    paper = tmp_path / "paper.toml"
    paper.write_text('source = "test paper"\nunit = "percent"\nrow = [\n'
                     '  { value = 80.0, match = { "algorithm.name" = "dp-dsgt" } },\n'
                     '  { value = 89.0, std = 0.5, match = { "algorithm.name" = "dp-dsgt", '
                     '"privacy.epsilon" = 1.0 } },\n]\n')
    rows = report_json(capsys, str(tmp_path / "runs"), "--paper", str(paper))["rows"]
    assert rows[0]["paper"] == pytest.approx(0.89) and rows[0]["paper_std"] == pytest.approx(0.005)
    assert rows[0]["difference"] == pytest.approx(0.01)
    assert rows[1]["paper"] == pytest.approx(0.80)


def test_out_writes_table_csv_json_and_figures(tmp_path: Path, capsys) -> None:
    for seed in range(2):
        fake_run(tmp_path / "runs" / f"p{seed}", 0.7 + seed / 100, seed=seed, epsilon=2.0, spent=1.8)
        fake_run(tmp_path / "runs" / f"n{seed}", 0.9, seed=seed, epsilon=math.inf, spent=None)
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| epsilon | seeds |" in table and "| inf | 2 | 90.00 ± 0.00 |" in table
    assert {path.name for path in out.iterdir()} == {"report.md", "report.csv", "report.json",
                                                     "accuracy_mean_vs_round.png", "accuracy_mean_vs_epsilon.png"}
    assert (out / "report.csv").read_text().splitlines()[0].startswith("privacy.epsilon,n,seeds,metric,mean,std")
    assert json.loads((out / "report.json").read_text())["rows"][1]["epsilon_spent"] is None


def test_figures_tell_more_series_than_colours_apart(tmp_path: Path) -> None:
    """Past the colour cycle's ten colours, every series of either figure still differs from every other in colour,
    line style or marker, and the legend of so many stands beside the axes, not over the data."""
    for lr in range(12):
        fake_run(tmp_path / f"lr{lr}", 0.5 + lr / 100, epsilon=2.0, spent=1.8, algorithm={"lr": 0.01 * (lr + 1)})
    report = build_report(find_runs([tmp_path])[0])
    for figure in (epsilon_figure(report), round_figure(report)):
        ax = figure.axes[0]
        handles, _ = ax.get_legend_handles_labels()
        lines = [handle[0] if isinstance(handle, tuple) else handle for handle in handles]  # an errorbar: its line
        assert len(lines) == 12
        looks = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines}
        assert len(looks) == 12
        assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_position().x1 * figure.bbox.width * 0.99


def test_paper_rows_may_match_fields_these_runs_leave_unset(tmp_path: Path, capsys) -> None:
    """The consensus paper file has rows for Fiedler graphs (``topology.fiedler``); a report of runs on other
    graphs, which leave that field unset, still takes its values from the rows that match."""
    fake_run(tmp_path / "runs" / "a", 0.90, epsilon=1.0)
    paper = tmp_path / "paper.toml"
    paper.write_text('row = [\n'
                     '  { value = 70.0, match = { "topology.graph" = "fiedler", "topology.fiedler" = 0.06 } },\n'
                     '  { value = 89.0, match = { "algorithm.name" = "dp-dsgt" } },\n]\n')
    rows = report_json(capsys, str(tmp_path / "runs"), "--paper", str(paper))["rows"]
    assert rows[0]["paper"] == pytest.approx(0.89)


def test_consensus_paper_file_reads_and_names_config_fields() -> None:
    source, rows = read_paper(REPO / "experiments" / "consensus" / "paper.toml")
    assert "Bayrooti" in source and len(rows) > 100
    dsgt_eps1 = [row for row in rows if row.match == {"data.dataset": "mnist", "algorithm.name": "dp-dsgt",
                                                      "privacy.epsilon": 1.0, "topology.graph": "complete",
                                                      "data.overlap_t": 1.0}]
    assert [row.value for row in dsgt_eps1] == [pytest.approx(0.8924)]


def test_correlated_paper_file_reads_the_decor_plots_ring_and_central_curves() -> None:
    source, rows = read_paper(REPO / "experiments" / "correlated" / "paper.toml")
    assert "DECOR" in source and len(rows) == 12
    decor_eps1 = [row for row in rows if row.match == {"data.dataset": "mnist", "algorithm.name": "decor",
                                                       "privacy.epsilon": 1.0, "topology.graph": "ring"}]
    assert [row.value for row in decor_eps1] == [pytest.approx(0.9281)]



def test_dpdl_paper_file_reads_table_one_with_our_block_labels() -> None:
    source, rows = read_paper(REPO / "experiments" / "dpdl" / "paper.toml")
    assert "Table I" in source and len(rows) == 5 * 6 * 6  # methods x blocks x (graph, N) columns
    cell = [row for row in rows if row.match == {"data.dataset": "mnist", "algorithm.name": "dpdl",
                                                 "topology.graph": "complete", "topology.agents": 10,
                                                 "data.dirichlet_alpha": 0.1, "privacy.epsilon": 4.0}]
    assert [(row.value, row.std) for row in cell] == [(pytest.approx(0.965), pytest.approx(0.003))]

def test_against_draws_the_metric_over_a_config_field_with_the_papers_values(tmp_path: Path, capsys) -> None:
    """Bayrooti et al.'s Fig. 1 shape: accuracy against the normalized Fiedler value, one series per algorithm, the
    paper's values as open markers; the complete graph (no Fiedler target) is left out and said to be."""
    values = {("dp-dsgt", 0.06): 0.90, ("dp-dsgt", 0.7): 0.92, ("dp-dsgd", 0.06): 0.75, ("dp-dsgd", 0.7): 0.88}
    for (algorithm, fiedler), accuracy in values.items():
        for seed in range(2):
            fake_run(tmp_path / "runs" / f"{algorithm}-{fiedler}-s{seed}", accuracy + seed / 100, seed=seed,
                     algorithm={"name": algorithm}, topology={"graph": "fiedler", "fiedler": fiedler, "agents": 10})
    fake_run(tmp_path / "runs" / "complete", 0.93, algorithm={"name": "dp-dsgt"},
             topology={"graph": "complete", "agents": 10})
    paper = tmp_path / "paper.toml"
    paper.write_text('source = "test paper"\nunit = "percent"\nrow = [\n'
                     '  { value = 89.0, std = 0.5, match = { "algorithm.name" = "dp-dsgt", '
                     '"topology.fiedler" = 0.06 } },\n]\n')
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "runs"), "--paper", str(paper), "--out", str(out),
                 "--against", "topology.fiedler"]) == 0
    assert (out / "accuracy_mean_vs_topology.fiedler.png").stat().st_size > 0
    report = build_report(find_runs([tmp_path / "runs"])[0], paper_file=paper)
    ax = field_figure(report, "topology.fiedler").axes[0]
    ours = {label: line for line, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    assert set(ours) == {"algorithm=dp-dsgd", "algorithm=dp-dsgt"}
    x, y = ours["algorithm=dp-dsgd"][0].get_data()
    assert list(x) == [0.06, 0.7] and list(y) == pytest.approx([75.5, 88.5])
    open_markers = [line for line in ax.lines if line.get_markerfacecolor() == "none"]
    assert len(open_markers) == 1 and list(open_markers[0].get_ydata()) == [89.0]
    assert "1 group(s) without topology.fiedler left out" in ax.get_title()


@pytest.mark.parametrize(("args", "message"), [
    (["--against", "topology.fiedler"], "--against: topology.fiedler is not a config field that differs"),
    (["--against", "algorithm.name"], "--against: algorithm.name is not a number in any group"),
    (["--against", "algorithm.lr"], "--against: draws a figure: give --out DIR as well"),
    (["--panels", "topology.graph"], "--panels: topology.graph is not a config field that differs"),
    (["--panels", "algorithm.name", "--panels", "algorithm.name"], "--panels: give one or two different fields"),
    (["--panels", "algorithm.name", "--panels", "algorithm.lr", "--panels", "privacy.epsilon"],
     "--panels: give one or two different fields"),
    (["--panels", "algorithm.lr"], "--panels: draws a figure: give --out DIR as well"),
])
def test_a_figure_option_that_cannot_be_drawn_is_refused(tmp_path: Path, capsys, args: list[str],
                                                         message: str) -> None:
    """One message naming the option, no traceback, nothing written (the last case of each option omits --out)."""
    fake_run(tmp_path / "runs" / "a", 0.7, algorithm={"name": "dp-dsgt", "lr": 0.1})
    fake_run(tmp_path / "runs" / "b", 0.6, algorithm={"name": "dp-dsgd", "lr": 0.2})
    out = tmp_path / "out"
    with_out = [] if "give --out" in message else ["--out", str(out)]
    assert main(["report", str(tmp_path / "runs"), *args, *with_out]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert not out.exists()


#: Hand-edited or corrupt summary.json values (json.dumps writes a NaN as NaN, which json.loads reads back).
HAND_EDITS = {"wall_seconds": "n/a", "epsilon_observer": ["x"], "epsilon_local_max": "abc", "accuracy_mean": math.nan}


@pytest.mark.parametrize(("setup", "args", "message"), [
    ("mixed-datasets", [], "evaluated on different data"),
    ("validation-and-test", [], "digits, validation split 0.2: "),
    ("unfinished", [], "has not finished"),
    ("stopped", [], "stopped after round"),
    ("stopped", ["--skip-unfinished"], "none of the 1 results folder(s) holds a finished run"),
    ("empty", [], "no results folder under"),
    ("missing", [], "no such results folder"),
    ("plain", ["--metric", "loss_max"], "no numeric 'loss_max'"),
    ("bad-epsilon", [], "summary.json: epsilon_max must be a number, \"inf\" or null, got 'abc'"),
    ("edit:wall_seconds", [], "summary.json: wall_seconds must be a number or null, got 'n/a'"),
    ("edit:epsilon_observer", [], "summary.json: epsilon_observer must be a text naming who"),
    ("edit:epsilon_local_max", [], "summary.json: epsilon_local_max must be a number"),
    ("edit:accuracy_mean", [], "'accuracy_mean' in summary.json is not a finite number (NaN"),
    ("edit-seed", [], "summary.json: config.experiment.seed must be an integer, got 'zero'"),
    ("plain", ["--ignore", "privacy.nothing"], "--ignore: privacy.nothing is not a config field"),
    ("plain", ["--paper", "PAPER:unit = 'points'"], "unit must be one of"),
    ("plain", ["--paper", "PAPER:row = [{ value = 1.0, match = { 'privacy.nope' = 1 } }]"], "privacy.nope"),
    ("plain", ["--paper", "PAPER:row = [{ value = 1.0, match = { 'algorithm.name' = 'dp-dsgt' } },"
                                      "{ value = 2.0, match = { 'privacy.epsilon' = 5.0 } }]"], "all match one group"),
    ("plain", ["--paper", "PAPER:row = 5"], "row must be a list of tables"),
    ("plain", ["--paper", "PAPER:row = [{ value = 50, std = 'x', match = { 'algorithm.name' = 'dp-dsgt' } }]"],
     "row 1: std must be a non-negative finite number"),
    ("plain", ["--paper", "PAPER:row = [{ value = 50, std = -1, match = { 'algorithm.name' = 'dp-dsgt' } }]"],
     "row 1: std must be a non-negative finite number"),
    ("plain", ["--paper", "PAPER:row = [{ value = nan, match = { 'algorithm.name' = 'dp-dsgt' } }]"],
     "row 1 needs a finite numeric value"),
    ("null-round", [], "metrics.jsonl, line 1: round must be an integer"),
    ("list-row", [], "metrics.jsonl, line 2: a row must be a JSON object"),
])
def test_bad_input_is_one_clear_error(tmp_path: Path, capsys, setup: str, args: list[str], message: str) -> None:
    runs = tmp_path / "runs"
    if setup == "mixed-datasets":
        fake_run(runs / "a", 0.7)
        fake_run(runs / "b", 0.7, data={"dataset": "mnist"})
    elif setup == "validation-and-test":
        fake_run(runs / "a", 0.7, data={"validation_fraction": 0.2})
        fake_run(runs / "b", 0.7)
    elif setup == "unfinished":
        fake_run(runs / "a", 0.7)
        (runs / "b").mkdir()
        (runs / "b" / "config.toml").write_text((runs / "a" / "config.toml").read_text())
    elif setup == "stopped":
        fake_run(runs / "a", 0.7, finished=False)
    elif setup == "empty":
        runs.mkdir()
    elif setup == "plain":
        fake_run(runs / "a", 0.7)
    elif setup in ("null-round", "list-row"):  # a hand-edited metrics.jsonl: refused before anything is written
        metrics = fake_run(runs / "a", 0.7) / "metrics.jsonl"
        metrics.write_text('{"round": null, "accuracy_mean": 0.5}\n' if setup == "null-round" else
                           '{"round": 0, "accuracy_mean": 0.5}\n[1, 2]\n')
    elif setup == "bad-epsilon":  # a hand-edited summary
        summary = fake_run(runs / "a", 0.7) / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "epsilon_max": "abc"}))
    elif setup.startswith("edit:"):  # a hand-edited or corrupt summary field (a review: each crashed with a traceback)
        key = setup.removeprefix("edit:")
        _edit_summary(fake_run(runs / "a", 0.7), **{key: HAND_EDITS[key]})
    elif setup == "edit-seed":
        summary = json.loads((fake_run(runs / "a", 0.7) / "summary.json").read_text())
        summary["config"]["experiment"]["seed"] = "zero"
        (runs / "a" / "summary.json").write_text(json.dumps(summary))
    if args and args[-1].startswith("PAPER:"):
        paper = tmp_path / "paper.toml"
        paper.write_text(args[-1].removeprefix("PAPER:") + "\n")
        args = [*args[:-1], str(paper)]
    out = tmp_path / "out"
    assert main(["report", str(runs), *args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert not out.exists()  # nothing written


@pytest.mark.slow
def test_report_reads_a_real_run(tmp_path: Path, capsys) -> None:
    """A real run through `decentdp run`, then `decentdp report --json` on its folder."""
    config = tmp_path / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_config()))
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--no-progress", "--threads", "1"]) == 0
    capsys.readouterr()
    (row,) = report_json(capsys, str(tmp_path))["rows"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert row["n"] == 1 and row["seeds"] == [0] and row["std"] is None
    assert row["mean"] == summary["accuracy_mean"] and row["epsilon_spent"] == summary["epsilon_max"]
    assert 0 < row["epsilon_spent"] <= 5.0


def test_links_to_results_folders_are_followed_once_without_looping(tmp_path: Path) -> None:
    first = fake_run(tmp_path / "runs" / "a", 0.7)
    second = fake_run(tmp_path / "runs" / "b", 0.6, seed=1)
    fake_run(tmp_path / "runs" / ".hidden" / "c", 0.5, seed=2)
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    (chosen / "a").symlink_to(first, target_is_directory=True)
    (chosen / "again").symlink_to(first, target_is_directory=True)
    (chosen / "b").symlink_to(second, target_is_directory=True)
    (chosen / "up").symlink_to(tmp_path, target_is_directory=True)  # a link back up the tree
    assert [run.path for run in find_runs([chosen])[0]] == [first.resolve(), second.resolve()]


def test_skip_unfinished_leaves_out_running_and_stopped_runs_and_names_them(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    fake_run(runs / "done-s0", 0.70)
    fake_run(runs / "done-s1", 0.74, seed=1)
    fake_run(runs / "stopped", 0.10, seed=2, finished=False)
    (runs / "running").mkdir()
    (runs / "running" / "config.toml").write_text((runs / "done-s0" / "config.toml").read_text())
    assert main(["report", str(runs), "--json"]) == 2
    assert "--skip-unfinished" in capsys.readouterr().err
    assert main(["report", str(runs), "--skip-unfinished", "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]
    assert [(row["n"], row["mean"]) for row in rows] == [(2, pytest.approx(0.72))]
    err = captured.err
    assert "left out 2 unfinished run(s)" in err and "running" in err and "stopped" in err
    assert json.loads(captured.out)["skipped"] == [str((runs / "running").resolve()), str((runs / "stopped").resolve())]
    out = tmp_path / "out"  # a review: the folders left out were named on stderr only, not in the report's files
    assert main(["report", str(runs), "--skip-unfinished", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert f"Left out 2 unfinished run(s) (--skip-unfinished): {(runs / 'running').resolve()}, " in text
    assert json.loads((out / "report.json").read_text())["skipped"][1] == str((runs / "stopped").resolve())
    capsys.readouterr()
    (runs / "starting").mkdir()  # a run that has made its folder, not yet its config, given by name (a glob)
    named = [str(folder) for folder in sorted(runs.iterdir())]
    assert main(["report", *named, "--json"]) == 2
    assert "no results folder under" in capsys.readouterr().err
    assert main(["report", *named, "--skip-unfinished", "--json"]) == 0
    assert "left out 3 unfinished run(s)" in capsys.readouterr().err


def test_panels_draw_a_paper_figures_sub_plots_with_one_look_per_series(tmp_path: Path, capsys) -> None:
    """TOP-DP's Fig. 3 shape: one panel per (schedule, alpha), one curve per algorithm inside each, mean over seeds; a
    series keeps its colour in every panel, the figure has one legend, and an empty cell says so."""
    finals = {("dp-dsgd", 0.25): 0.80, ("dp-dsgd", 0.5): 0.82, ("dp-dsgt", 0.25): 0.70, ("dp-dsgt", 0.5): 0.72,
              ("dp-dsgd", 0.75): 0.84}
    for (algorithm, lr), accuracy in finals.items():
        for seed in range(2):
            fake_run(tmp_path / "runs" / f"{algorithm}-{lr}-s{seed}", accuracy + seed / 100, seed=seed,
                     curve=(0.1, 0.2 + seed / 10),
                     algorithm={"name": algorithm, "lr": lr, "batch_size": 32 if lr == 0.5 else 16})
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out), "--panels", "algorithm.lr"]) == 0
    assert (out / "accuracy_mean_vs_round_by_algorithm.lr.png").stat().st_size > 0
    report = build_report(find_runs([tmp_path / "runs"])[0])
    assert "algorithm.batch_size" in report.fields  # set by the panel field: it names no series below
    fig = panel_figure(report, ["algorithm.lr"])
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["lr=0.25", "lr=0.5", "lr=0.75"]
    curves = [{label: line for line, label in zip(*ax.get_legend_handles_labels(), strict=True)} for ax in axes]
    both = ["algorithm=dp-dsgd", "algorithm=dp-dsgt"]
    assert [sorted(found) for found in curves] == [both, both, ["algorithm=dp-dsgd"]]
    assert curves[0]["algorithm=dp-dsgd"].get_color() == curves[2]["algorithm=dp-dsgd"].get_color()
    assert curves[0]["algorithm=dp-dsgd"].get_color() != curves[0]["algorithm=dp-dsgt"].get_color()
    assert list(curves[1]["algorithm=dp-dsgt"].get_ydata()) == pytest.approx([10.0, 25.0, 72.5])
    assert len(fig.legends) == 1
    two = panel_figure(report, ["algorithm.lr", "algorithm.name"])
    assert [ax.get_title() for ax in two.axes][:2] == ["lr=0.25, algorithm=dp-dsgd", "lr=0.25, algorithm=dp-dsgt"]
    assert two.axes[5].get_title() == "lr=0.75, algorithm=dp-dsgt (no runs)" and not two.axes[5].lines


def test_panel_aliases_make_one_method_under_two_names_one_series(tmp_path: Path) -> None:
    """TOP-DP's two protocols are two registered algorithms; the panels tell the protocols apart, so with an alias the
    method is one series: one label, one colour, one legend entry."""
    for algorithm, lr in (("dp-dsgd", 0.25), ("dp-dsgt", 0.5), ("dp-dinno", 0.25), ("dp-dinno", 0.5)):
        fake_run(tmp_path / "runs" / f"{algorithm}-{lr}", 0.8, algorithm={"name": algorithm, "lr": lr})
    report = build_report(find_runs([tmp_path / "runs"])[0])
    plain = panel_figure(report, ["algorithm.lr"])
    assert len(plain.legends[0].get_texts()) == 3
    fig = panel_figure(report, ["algorithm.lr"], {"dp-dsgt": "dp-dsgd"})
    curves = [{label: line for line, label in zip(*ax.get_legend_handles_labels(), strict=True)} for ax in fig.axes]
    assert [sorted(found) for found in curves] == [["algorithm=dp-dinno", "algorithm=dp-dsgd"]] * 2
    assert curves[0]["algorithm=dp-dsgd"].get_color() == curves[1]["algorithm=dp-dsgd"].get_color()
    assert sorted(text.get_text() for text in fig.legends[0].get_texts()) == ["algorithm=dp-dinno", "algorithm=dp-dsgd"]


def test_paired_differences_are_taken_seed_by_seed_within_each_cell(tmp_path: Path, capsys) -> None:
    """--paired algorithm.name=dp-dsgt --within privacy.epsilon: each dp-dsgd setting against the dp-dsgt run of
    its epsilon, on the seeds both have; a seed-shared offset that the spread over seeds hides is exact here."""
    shift = {0: 0.0, 1: 0.10, 2: -0.05}                       # each seed's split moves both methods alike
    for epsilon, gap in ((1.0, -0.02), (8.0, 0.01)):
        for seed in range(3):
            fake_run(tmp_path / f"dsgt-e{epsilon}-s{seed}", 0.8 + shift[seed], seed=seed, epsilon=epsilon,
                     algorithm={"name": "dp-dsgt", "lr": 0.1})
            if seed < 2 or epsilon == 8.0:                    # dp-dsgd lacks seed 2 at epsilon 1
                fake_run(tmp_path / f"dsgd-e{epsilon}-s{seed}", 0.8 + shift[seed] + gap, seed=seed, epsilon=epsilon,
                         algorithm={"name": "dp-dsgd", "lr": 0.3})
    runs, _ = find_runs([tmp_path])
    report = build_report(runs, paired="algorithm.name=dp-dsgt", within=["privacy.epsilon"])
    rows = {(row["algorithm.name"], row["privacy.epsilon"]): row for row in report.rows}
    low, high = rows[("dp-dsgd", 1.0)], rows[("dp-dsgd", 8.0)]
    assert low["paired_difference"] == pytest.approx(-0.02) and low["paired_std"] == pytest.approx(0.0, abs=1e-12)
    assert (low["paired_above"], low["paired_seeds"]) == (0, 2)
    assert high["paired_difference"] == pytest.approx(0.01) and (high["paired_above"], high["paired_seeds"]) == (3, 3)
    assert high["std"] > 5 * abs(high["paired_difference"])  # the unpaired spread hides the gap
    assert rows[("dp-dsgt", 1.0)]["paired_difference"] is None  # a reference is not compared with itself
    assert main(["report", str(tmp_path), "--paired", "algorithm.name=dp-dsgt", "--within", "privacy.epsilon"]) == 0
    assert "+1.00 ± 0.00, 3 of 3" in capsys.readouterr().out


def test_an_ambiguous_reference_is_refused(tmp_path: Path) -> None:
    """Two dp-dsgt settings (two step sizes) for one epsilon: --within privacy.epsilon cannot pick one."""
    for lr in (0.1, 0.2):
        fake_run(tmp_path / f"dsgt-{lr}", 0.7, algorithm={"name": "dp-dsgt", "lr": lr})
    fake_run(tmp_path / "dsgd", 0.6, algorithm={"name": "dp-dsgd", "lr": 0.3})
    runs, _ = find_runs([tmp_path])
    with pytest.raises(ConfigError) as error:
        build_report(runs, paired="algorithm.name=dp-dsgt", within=["privacy.epsilon"])
    assert error.value.field == "--within" and "they differ in algorithm.lr" in error.value.message


@pytest.mark.parametrize(("argv", "field", "fragment"), [
    (["--paired", "algorithm.name"], "--paired", "must be FIELD=VALUE"),
    (["--paired", "algorithm.name=dp-dinno"], "--paired", "no run has algorithm.name = dp-dinno"),
    (["--paired", "algorithm.name=dp-dsgt", "--within", "topology.grph"], "--within", "is not another config field"),
    (["--within", "privacy.epsilon"], "--within", "give --paired as well"),
])
def test_bad_paired_options_name_the_option(tmp_path: Path, argv: list[str], field: str, fragment: str) -> None:
    fake_run(tmp_path / "a", 0.7, algorithm={"name": "dp-dsgt", "lr": 0.1})
    fake_run(tmp_path / "b", 0.6, algorithm={"name": "dp-dsgd", "lr": 0.3})
    runs, _ = find_runs([tmp_path])
    paired = argv[argv.index("--paired") + 1] if "--paired" in argv else None
    within = [argv[argv.index("--within") + 1]] if "--within" in argv else []
    with pytest.raises(ConfigError) as error:
        build_report(runs, paired=paired, within=within)
    assert error.value.field == field and fragment in error.value.message


def test_epsilon_towards_a_narrower_observer_is_marked_with_everyone_togethers(tmp_path: Path) -> None:
    """DECOR's budgets name one curious agent; the table's accuracy pools every agent's model, so a row whose
    runs budget a narrower observer is marked, and the footnote gives everyone together's epsilon (a reviewer
    found DECOR's 4.0 beside DP-DSGT's 4.0 with nothing saying they bound different observers)."""
    fake_run(tmp_path / "plain", 0.8)
    narrow = fake_run(tmp_path / "narrow", 0.9, algorithm={"name": "dp-dsgd"})
    summary = json.loads((narrow / "summary.json").read_text())
    summary.update(epsilon_observer="one curious agent: its own noise known", epsilon_local_max=123.4)
    (narrow / "summary.json").write_text(json.dumps(summary))
    text = markdown(build_report(find_runs([tmp_path])[0]))
    assert text.count(" †") == 1 and "| 4.200 † |" in text
    assert "† ε spent towards a narrower observer than everyone together: one curious agent" in text
    assert "bounded by epsilon_local: up to 123.400" in text


def test_out_refuses_a_folder_holding_other_files_and_redraws_an_earlier_report(tmp_path: Path, capsys) -> None:
    """A reviewer's notes/report.md was overwritten without a word; a results folder got a report mixed in."""
    run = fake_run(tmp_path / "runs" / "a", 0.7)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "plan.txt").write_text("my notes")
    for out in (notes, run):
        assert main(["report", str(tmp_path / "runs"), "--out", str(out)]) == 2
        assert "holds files that are not an earlier report's" in capsys.readouterr().err
    assert sorted(p.name for p in notes.iterdir()) == ["plan.txt"]
    again = tmp_path / "report"
    for _ in range(2):  # writing the same report folder twice is a redraw
        assert main(["report", str(tmp_path / "runs"), "--out", str(again)]) == 0


def _edit_summary(folder: Path, **changes: Any) -> Path:
    """A fake run's summary.json with ``changes`` written over it (a run of another kind, or a hand edit)."""
    summary = folder / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), **changes}))
    return folder


def test_only_observers_narrower_than_everyone_together_are_marked_each_named(tmp_path: Path) -> None:
    """A review: cyclic runs' epsilon_observer (CYCLIC_AGENT_VIEW) is everyone together, yet got the † and a footnote
    saying everyone together was bounded only by inf; and with two narrower observers only the first was named."""
    from decentdp.algorithms.decor import PAIRWISE_VIEW
    from decentdp.cli.report import EVERYONE_TOGETHER
    from decentdp.privacy.report import AGENT_VIEW, CYCLIC_AGENT_VIEW

    assert AGENT_VIEW.startswith(EVERYONE_TOGETHER) and CYCLIC_AGENT_VIEW.startswith(EVERYONE_TOGETHER)
    assert not PAIRWISE_VIEW.startswith(EVERYONE_TOGETHER)
    _edit_summary(fake_run(tmp_path / "cyclic", 0.8, data={"sampling": "cyclic"}), epsilon_observer=CYCLIC_AGENT_VIEW)
    text = markdown(build_report(find_runs([tmp_path])[0]))
    assert "†" not in text and "narrower observer" not in text
    _edit_summary(fake_run(tmp_path / "decor", 0.9, algorithm={"name": "dp-dinno"}), epsilon_observer=PAIRWISE_VIEW,
                  epsilon_local_max=50.0)
    _edit_summary(fake_run(tmp_path / "other", 0.9, algorithm={"name": "dp-dsgd"}),
                  epsilon_observer="an eavesdropper: one edge", epsilon_local_max=60.0)
    text = markdown(build_report(find_runs([tmp_path])[0]))
    assert text.count("†") == 2 and text.count("‡") == 2  # a cell and a footnote each
    assert f"† ε spent towards a narrower observer than everyone together: {PAIRWISE_VIEW.split(':')[0]}" in text
    assert "up to 50.000" in text
    assert "‡ ε spent towards a narrower observer than everyone together: an eavesdropper. " in text
    assert "up to 60.000" in text


def test_an_ignored_field_that_differs_inside_a_row_is_named_and_no_single_target_shown(tmp_path: Path,
                                                                                        capsys) -> None:
    """A review: --ignore privacy.epsilon averaged an epsilon-2 and an epsilon-4 run into one row without a word, and
    the row's ε target (and rounds) came from its first run alone."""
    fake_run(tmp_path / "e4", 0.8, seed=0, epsilon=4.0, experiment={"rounds": 4})
    fake_run(tmp_path / "e2", 0.7, seed=1, epsilon=2.0, experiment={"rounds": 6})
    _edit_summary(tmp_path / "e2", rounds=6)
    report = build_report(find_runs([tmp_path])[0], ignore=["privacy.epsilon", "experiment.rounds"])
    (row,) = report.rows
    assert row["epsilon_target"] == (2.0, 4.0) and row["rounds"] == (4, 6)
    text = markdown(report)
    assert "| 2.000 / 4.000 |" in text
    assert "differ in the ignored field privacy.epsilon: 4 (e4), 2 (e2)." in text
    assert "differ in the ignored field experiment.rounds: 4 (e4), 6 (e2)." in text
    result = report_json(capsys, str(tmp_path), "--ignore", "privacy.epsilon", "--ignore", "experiment.rounds")
    assert result["rows"][0]["ignored_varying"] == {"privacy.epsilon": [4.0, 2.0], "experiment.rounds": [4, 6]}
    assert "privacy.epsilon=4 / 2; experiment.rounds=4 / 6" in csv_text(report)   # the CSV says it too
    assert result["rows"][0]["epsilon_target"] == [2.0, 4.0]
    plain = build_report(find_runs([tmp_path / "e4"])[0], ignore=["privacy.epsilon"])
    assert "ignored_varying" not in plain.rows[0] and "ignored field" not in markdown(plain)


def test_paper_rows_that_match_no_setting_are_listed_and_a_wrong_kind_of_value_refused(tmp_path: Path,
                                                                                      capsys) -> None:
    """A review: a typo in a match value ("dp-dsgtt"), or a string "4" for a number, matched nothing without a word."""
    fake_run(tmp_path / "runs" / "a", 0.90, epsilon=4.0)
    paper = tmp_path / "paper.toml"
    paper.write_text('source = "p"\nrow = [\n  { value = 89.0, match = { "algorithm.name" = "dp-dsgt" } },\n'
                     '  { value = 80.0, match = { "algorithm.name" = "dp-dsgtt", "privacy.epsilon" = 4.0 } },\n]\n')
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "runs"), "--paper", str(paper), "--out", str(out)]) == 0
    assert "Paper rows that match no setting here: row 2 (algorithm.name = dp-dsgtt, privacy.epsilon = 4)." in \
        (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["paper_unmatched"] == [
        {"row": 2, "match": {"algorithm.name": "dp-dsgtt", "privacy.epsilon": 4.0}}]
    capsys.readouterr()
    paper.write_text('source = "p"\nrow = [{ value = 89.0, match = { "privacy.epsilon" = "4" } }]\n')
    assert main(["report", str(tmp_path / "runs"), "--paper", str(paper), "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert f"{paper}: row 1: match privacy.epsilon = '4' is a string, but privacy.epsilon is a number" in err
    assert "Traceback" not in err and not (tmp_path / "out2").exists()
    paper.write_text('source = "p"\nrow = [{ value = 89.0, match = { "privacy.epsilon" = 4 } }]\n')  # 4 equals 4.0
    assert report_json(capsys, str(tmp_path / "runs"), "--paper", str(paper))["rows"][0]["paper"] == pytest.approx(0.89)


def test_a_missing_or_short_metrics_file_is_named_not_silently_dropped(tmp_path: Path) -> None:
    """A review: a setting whose one seed lacked metrics.jsonl vanished from the round figure (and one seed without
    it emptied its setting's curve), and a seed whose metrics stopped early shortened the curve while the table
    showed the last round, without a word."""
    fake_run(tmp_path / "alone", 0.7, algorithm={"name": "dp-dsgd"})
    (tmp_path / "alone" / "metrics.jsonl").unlink()
    fake_run(tmp_path / "s0", 0.8, seed=0)
    fake_run(tmp_path / "s1", 0.9, seed=1)
    (tmp_path / "s1" / "metrics.jsonl").unlink()
    fake_run(tmp_path / "short", 0.6, algorithm={"name": "dp-dinno"})  # rows at rounds 0, 2, 4; cut after 2
    metrics = tmp_path / "short" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))
    report = build_report(find_runs([tmp_path])[0])
    text = markdown(report)
    assert f"{tmp_path / 'alone'}: no accuracy_mean in its metrics.jsonl (missing or empty); the round figures do " \
           "not draw algorithm=dp-dsgd." in text
    assert f"{tmp_path / 's1'}: no accuracy_mean in its metrics.jsonl (missing or empty); the round figures draw " \
           "algorithm=dp-dsgt from the other 1 seed(s)." in text
    assert f"{tmp_path / 'short'}: its metrics.jsonl stops at round 2, the run at round 4" in text
    drawn = {line.get_label(): list(line.get_ydata()) for line in round_figure(report).axes[0].lines}
    assert drawn["algorithm=dp-dsgt"] == pytest.approx([10.0, 50.0, 80.0])  # seed 0's curve, the seed that has one
    assert "algorithm=dp-dsgd" not in drawn
    complete = build_report(find_runs([tmp_path / "s0"])[0])
    assert "metrics.jsonl" not in markdown(complete)


def test_epsilon_figure_keeps_privacy_fields_apart_and_marks_a_narrower_observer(tmp_path: Path) -> None:
    """A review: the ε figure joined runs differing in privacy.clip into one line (its series key dropped every
    privacy.* field), and drew DECOR's pairwise ε beside others' everyone-together ε without a mark."""
    from decentdp.algorithms.decor import PAIRWISE_VIEW

    for clip in (1.0, 2.0):
        for epsilon in (2.0, 4.0):
            fake_run(tmp_path / f"c{clip}-e{epsilon}", 0.7 + epsilon / 100 + clip / 10, epsilon=epsilon,
                     spent=epsilon, privacy={"clip": clip})
    _edit_summary(fake_run(tmp_path / "decor", 0.9, epsilon=4.0, spent=4.0, algorithm={"name": "dp-dsgd"}),
                  epsilon_observer=PAIRWISE_VIEW, epsilon_local_max=40.0)
    report = build_report(find_runs([tmp_path])[0])
    ax = epsilon_figure(report).axes[0]
    series = {container.get_label(): container.lines[0] for container in ax.containers}
    assert sorted(series) == ["algorithm=dp-dsgd, clip=1 †", "algorithm=dp-dsgt, clip=1", "algorithm=dp-dsgt, clip=2"]
    assert list(series["algorithm=dp-dsgt, clip=2"].get_xdata()) == [2.0, 4.0]
    assert series["algorithm=dp-dsgd, clip=1 †"].get_markerfacecolor() == "none"
    assert series["algorithm=dp-dsgt, clip=1"].get_markerfacecolor() != "none"
    assert "open markers †: ε towards the worst single agent" in ax.get_title()


def test_a_runs_metric_plot_title_says_towards_whom_a_narrower_epsilon_is() -> None:
    """A review: each run's accuracy.png said "epsilon 4 at delta 1e-05" for DECOR too, whose epsilon names one
    curious agent, not everyone together (the CLI's final line says towards whom)."""
    from decentdp.algorithms.decor import PAIRWISE_VIEW
    from decentdp.experiment.record import metrics_title
    from decentdp.privacy.report import CYCLIC_AGENT_VIEW

    summary = {"name": "r", "algorithm": "decor", "n_agents": 4, "epsilon_max": 4.0, "delta": 1e-5}
    assert metrics_title(summary) == "r: decor, 4 agents, epsilon 4 at delta 1e-05"
    assert metrics_title({**summary, "epsilon_observer": CYCLIC_AGENT_VIEW}) == metrics_title(summary)
    assert metrics_title({**summary, "epsilon_observer": PAIRWISE_VIEW}) == (
        f"r: decor, 4 agents, epsilon 4 at delta 1e-05\nepsilon towards {PAIRWISE_VIEW.split(':')[0]}")


def test_rows_priced_by_different_accountants_each_say_which(tmp_path: Path) -> None:
    """The footnote said "(PLD, RDP accountant)" for the whole table and left the reader to guess each row's."""
    _edit_summary(fake_run(tmp_path / "a", 0.8, algorithm={"name": "dp-dsgd"}), epsilon_accountant="pld")
    _edit_summary(fake_run(tmp_path / "b", 0.7, algorithm={"name": "dp-dsgt"}), epsilon_accountant="rdp")
    text = markdown(build_report(find_runs([tmp_path])[0]))
    assert "4.200 (PLD) |" in text and "4.200 (RDP) |" in text and "each row's accountant beside it" in text
    single = markdown(build_report(find_runs([tmp_path / "a"])[0]))
    assert "(PLD accountant)" in single and "(PLD) |" not in single


def test_many_unmatched_paper_rows_are_named_briefly(tmp_path: Path) -> None:
    """A report over a subset of a paper's cells named every other cell on one line (115 of them for Fig. 1)."""
    fake_run(tmp_path / "runs" / "a", 0.90, epsilon=4.0)
    rows = ",\n".join(f'  {{ value = {80 + k}.0, match = {{ "privacy.epsilon" = {k + 10}.0 }} }}' for k in range(8))
    paper = tmp_path / "paper.toml"
    paper.write_text(f'source = "p"\nrow = [\n{rows},\n]\n')
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "runs"), "--paper", str(paper), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "row 5 (privacy.epsilon = 14); and 3 more (all in report.json, paper_unmatched)." in text
    assert "row 6 (" not in text
    assert len(json.loads((out / "report.json").read_text())["paper_unmatched"]) == 8


def test_a_report_written_again_removes_the_figures_it_did_not_draw(tmp_path: Path) -> None:
    """A review: the earlier report's epsilon figure stayed in --out beside a new, non-private report."""
    fake_run(tmp_path / "runs" / "a", 0.9)
    fake_run(tmp_path / "plain" / "b", 0.9, epsilon=math.inf, spent=None)
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert (out / "accuracy_mean_vs_epsilon.png").exists()
    assert main(["report", str(tmp_path / "plain"), "--out", str(out)]) == 0
    assert sorted(path.name for path in out.glob("*.png")) == ["accuracy_mean_vs_round.png"]


def test_paired_compares_within_the_tables_columns_by_default_and_refuses_no_comparison(tmp_path: Path) -> None:
    """A review: the default --within was every other differing field, including what each algorithm sets for
    itself (its learning rate), so no group found a reference and the column was all dashes, without a word."""
    for seed in (0, 1):
        fake_run(tmp_path / f"a{seed}", 0.90 + seed / 100, seed=seed, algorithm={"name": "dp-dsgd", "lr": 0.1})
        fake_run(tmp_path / f"b{seed}", 0.85, seed=seed, algorithm={"name": "dp-dsgt", "lr": 0.3})
    report = build_report(find_runs([tmp_path])[0], paired="algorithm.name=dp-dsgt")
    row = next(row for row in report.rows if row["algorithm.name"] == "dp-dsgd")
    assert row["paired_difference"] == pytest.approx(0.055) and (row["paired_above"], row["paired_seeds"]) == (2, 2)
    assert "(seeds above it)" in markdown(report)
    with pytest.raises(ConfigError, match="no setting has a algorithm.name = dp-dsgt run with the same algorithm.lr"):
        build_report(find_runs([tmp_path])[0], paired="algorithm.name=dp-dsgt", within=["algorithm.lr"])


def test_a_row_merged_across_paper_rows_gets_no_paper_value(tmp_path: Path) -> None:
    """A review: --ignore merged runs of two settings the paper lists apart, and the first run's paper value was
    shown for both; the other paper row was named as matching nothing."""
    fake_run(tmp_path / "runs" / "a", 0.90, epsilon=4.0)
    fake_run(tmp_path / "runs" / "b", 0.80, epsilon=2.0, seed=1)
    paper = tmp_path / "paper.toml"
    paper.write_text('source = "p"\nrow = [\n  { value = 89.0, match = { "privacy.epsilon" = 4.0 } },\n'
                     '  { value = 79.0, match = { "privacy.epsilon" = 2.0 } },\n]\n')
    report = build_report(find_runs([tmp_path / "runs"])[0], ignore=["privacy.epsilon"], paper_file=paper)
    assert report.rows[0]["paper"] is None and report.paper_unmatched == []
    assert "No paper value in the row(s) whose runs, merged by --ignore, match different paper rows" in \
        markdown(report)


def test_a_metric_other_than_accuracy_needs_the_papers_unit_and_keeps_four_figures(tmp_path: Path) -> None:
    """A review: a paper file without unit divided an RMSE by 100, and the table showed 0.9502 and 0.9527 both
    as 0.95 (two places suit percent only)."""
    for seed, value in enumerate((0.9502, 0.9527)):
        run = fake_run(tmp_path / "runs" / f"r{seed}", 0.9, seed=seed)
        _edit_summary(run, rmse_mean=value)
    paper = tmp_path / "paper.toml"
    paper.write_text('source = "p"\nrow = [{ value = 0.95, match = { "algorithm.name" = "dp-dsgt" } }]\n')
    with pytest.raises(ConfigError, match='give unit = "fraction"'):
        build_report(find_runs([tmp_path / "runs"])[0], metric="rmse_mean", paper_file=paper)
    paper.write_text('source = "p"\nunit = "fraction"\nrow = [{ value = 0.95, match = { "algorithm.name" = '
                     '"dp-dsgt" } }]\n')
    text = markdown(build_report(find_runs([tmp_path / "runs"])[0], metric="rmse_mean", paper_file=paper))
    assert "| 0.9515 ± 0.001768 |" in text and "| 0.95 | +0.00145 |" in text


def test_non_finite_values_as_the_library_stores_them_are_refused_and_json_stays_strict(tmp_path: Path) -> None:
    """A review: summaries store a NaN as the text "nan", which read as a missing metric (wrong message), and a
    NaN worst agent reached the JSON as NaN, which a strict parser refuses; a null wall time counted as 0 s."""
    bad = fake_run(tmp_path / "bad" / "a", 0.9)
    _edit_summary(bad, accuracy_mean="nan")
    with pytest.raises(DecentDPError, match="is not a finite number"):
        build_report(find_runs([tmp_path / "bad"])[0])
    _edit_summary(bad, accuracy_mean=0.9, accuracy_min="nan")
    with pytest.raises(DecentDPError, match="is not a finite number"):
        build_report(find_runs([tmp_path / "bad"])[0])
    fake_run(tmp_path / "ok" / "a", 0.9)
    _edit_summary(fake_run(tmp_path / "ok" / "b", 0.8, seed=1), wall_seconds=None)
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "ok"), "--out", str(out)]) == 0
    rows = json.loads((out / "report.json").read_text(), parse_constant=lambda name: pytest.fail(name))["rows"]
    assert rows[0]["wall_seconds"] == 1.0
    header, line = (out / "report.csv").read_text().splitlines()
    cells = dict(zip(header.split(","), line.split(","), strict=True))
    assert cells["runs"].count(";") == 1 and "—" not in line


def test_a_damaged_metrics_line_is_named_by_its_line_in_the_file(tmp_path: Path) -> None:
    """A review: each line was parsed alone, so every damaged line was reported as "line 1"."""
    run = fake_run(tmp_path / "a", 0.9)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:10] + "\n")
    with pytest.raises(DecentDPError, match=r"metrics.jsonl: line 2: "):
        find_runs([tmp_path])


def test_fields_a_run_did_not_read_neither_split_rows_nor_match_paper_rows(tmp_path: Path, capsys) -> None:
    """A knob left behind under a switch that is off (lr_final under a constant schedule, as a sweep leaves it)
    split one setting into two rows; and a Dirichlet run, whose data.overlap_t reads as its default 1.0, took the
    paper value of a row matching data.overlap_t = 1.  Neither field was read by those runs."""
    fake_run(tmp_path / "runs" / "a", 0.70, seed=0)
    fake_run(tmp_path / "runs" / "b", 0.72, seed=1, algorithm={"lr_final": 0.01})
    fake_run(tmp_path / "runs" / "decay", 0.80, seed=0, algorithm={"lr_final": 0.01, "lr_schedule": "logspace"})
    fake_run(tmp_path / "runs" / "dirichlet", 0.60, seed=0, data={"partition": "dirichlet", "dirichlet_alpha": 0.1})
    fake_run(tmp_path / "runs" / "overlap", 0.50, seed=0, data={"partition": "overlap", "overlap_t": 1.0})
    paper = tmp_path / "paper.toml"
    paper.write_text('row = [{ value = 50.0, match = { "data.overlap_t" = 1.0 } }]\n')
    result = report_json(capsys, str(tmp_path / "runs"), "--paper", str(paper))
    rows = {(row["data.partition"], row["algorithm.lr_schedule"]): row for row in result["rows"]}
    assert sorted(rows) == [("dirichlet", "constant"), ("iid", "constant"), ("iid", "logspace"),
                            ("overlap", "constant")]
    assert rows["iid", "constant"]["n"] == 2 and rows["iid", "constant"]["algorithm.lr_final"] is None
    assert rows["iid", "logspace"]["algorithm.lr_final"] == pytest.approx(0.01)
    assert rows["overlap", "constant"]["paper"] == pytest.approx(0.5)
    assert [rows[key]["paper"] for key in rows if key[0] != "overlap"] == [None] * 3
