"""``experiments/top-dp/figures.py``: each TOP-DP paper figure drawn from the runs that have finished."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from conftest import fake_run, load_script

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "top-dp" / "figures.py"


def _load() -> ModuleType:
    return load_script(SCRIPT, "top_dp_figures")


@pytest.fixture
def figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script, drawing from and into temporary folders."""
    module = _load()
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(module, "FIGURES", tmp_path / "figures")
    (tmp_path / "figures").mkdir()
    return module


def test_a_figure_draws_its_finished_runs_in_panels_and_leaves_out_the_rest(figures: ModuleType, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    results = tmp_path / "results"
    for algorithm in ("dp-dsgd", "dp-dsgt"):
        for lr in (0.1, 0.2):
            for seed in range(2):
                fake_run(results / f"fig3-{algorithm}-{lr}-s{seed}", 0.7 + lr, seed=seed,
                         algorithm={"name": algorithm, "lr": lr})
    fake_run(results / "fig3-dp-dsgd-0.3-s0", 0.9, finished=False, algorithm={"name": "dp-dsgd", "lr": 0.3})
    fake_run(results / "other-s0", 0.5, algorithm={"name": "dp-dsgd", "lr": 0.4})  # another figure's run
    figure = figures.Figure("test", ("fig3-*",), ("algorithm.lr", "topology.graph"))  # graph: not varied, dropped
    written = figures.draw(figure, tmp_path / "tables")
    assert written == tmp_path / "figures" / "top-dp-test.png" and written.stat().st_size > 0
    table = (tmp_path / "tables" / "test.md").read_text()
    assert "4 settings from 8 runs" in table and "0.4" not in table
    assert "left out 1 unfinished run(s)" in capsys.readouterr().err
    assert figures.draw(figures.Figure("none", ("fig99-*",), ("algorithm.lr",)), None) is None


def test_every_paper_figures_panel_fields_are_config_fields() -> None:
    """The figures name their panels by config fields a run has (a renamed field would draw nothing)."""
    from decentdp.cli.report import flatten
    from decentdp.config import load_config

    fields = set()
    for config in sorted(SCRIPT.parent.glob("fig*.toml")) + sorted(SCRIPT.parent.glob("short8-*.toml")):
        fields |= set(flatten(load_config(config).to_toml_dict()))
    for figure in _load().FIGURE_LIST:
        assert set(figure.panels) <= fields, figure.name


def test_a_run_the_panel_field_leaves_alone_is_drawn_in_every_panel(figures: ModuleType, tmp_path: Path) -> None:
    """Fig. 7: TOP-DP without decay (gamma 1) has a decay period that changes nothing; it is every panel's reference,
    one series with one colour, while the table keeps it once."""
    results = tmp_path / "results"
    for gamma, period in ((0.9, 500), (0.9, 1000), (0.5, 500), (0.5, 1000)):
        fake_run(results / f"fig7-g{gamma}-p{period}-s0", 0.8, algorithm={"name": "top-dp", "decay_gamma": gamma,
                                                                            "decay_period": period})
    fake_run(results / "fig10-top-only-s0", 0.7, algorithm={"name": "top-dp", "decay_gamma": 1.0,
                                                            "decay_period": 1000})
    figure = figures.Figure("fig7", ("fig7-*", "fig10-top-only-s*"), ("algorithm.decay_period",),
                            every_panel=("fig10-top-only-s*",))
    from decentdp.cli.report import build_report, find_runs, panel_figure

    report = build_report(find_runs(sorted(results.iterdir()))[0])
    assert len(report.rows) == 5
    drawn = panel_figure(figures.in_every_panel(report, "algorithm.decay_period", figure.every_panel),
                         ["algorithm.decay_period"])
    labels = [ax.get_legend_handles_labels()[1] for ax in drawn.axes]
    assert [sorted(found) for found in labels] == [["decay_gamma=0.5", "decay_gamma=0.9", "decay_gamma=1"]] * 2
    assert figures.draw(figure, None) is not None
