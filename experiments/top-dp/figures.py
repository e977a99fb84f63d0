"""Draw each of TOP-DP's paper figures (Guo et al., Section VII) from the finished runs in ``results/`` here.

One PNG per paper figure in ``docs/figures/top-dp-<figure>.png``, the figure's sub-plots as panels
(``decentdp report --panels``: curves against round, mean ± std over seeds), and its table on stdout (or
``--tables DIR``: ``<figure>.md``).  A figure draws the runs that have finished; unfinished ones are named
and left out, and a figure with no finished run is skipped.  Each figure takes the runs its text compares,
reusing Fig. 3's where they are the same setting:

* Fig. 3: 6 methods, sync / async (rows) × alpha 0.25 / 0.5 / 0.75 (columns);
* Fig. 4: TOP-DP, Optimal, Li18+MA at epsilon 0.5, 1 (Fig. 3's), 2, 4, sync, alpha 0.25: panels by epsilon;
* Fig. 5: connection rate 0.1, 0.2 (Fig. 3's) and 0.4; Fig. 6: 30 (Fig. 3's), 40 and 50 agents;
* Fig. 7: TOP-DP's decay gamma (curves) × period (panels); gamma 1 (no decay) is Fig. 10's alpha-0.25 run, drawn
  in every panel;
* Fig. 9: sync / async (rows) × ring, two-star, tree, partial mesh (columns);
* Figs. 10 and 11: TOP alone (no decay) beside TOP+ND and the baselines of Fig. 3, by alpha;
* the short paper's Fig. 8: alpha 0.125 and 0.75 (Fig. 3's), sync.

Run ``python experiments/top-dp/figures.py`` (``--only fig3`` for one figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from decentdp.cli.report import Report, build_report, find_runs, markdown, panel_figure
from decentdp.results.files import pyplot

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FIGURES = HERE.parent.parent / "docs" / "figures"
FIG3_SYNC = "fig3-*-sync-a0.25-s*"  # Fig. 3's synchronous alpha-0.25 runs: the setting Figs. 4-7 vary
#: TOP-DP in the pairing protocol (Alg. 2) is registered as its own algorithm; the panels say which protocol ran,
#: so it is one series with the synchronous TOP-DP (one label and colour), as in the paper's figures.
SERIES_ALIASES = {"top-dp-async": "top-dp"}


@dataclass(frozen=True)
class Figure:
    """A paper figure: the run folders it draws (globs under ``results/``) and the fields of its panels."""

    name: str
    runs: tuple[str, ...]
    panels: tuple[str, ...]
    ignore: tuple[str, ...] = ("experiment.rounds",)
    #: Runs (globs, among ``runs``) of a setting the first panel field leaves alone, drawn in every panel of it.
    every_panel: tuple[str, ...] = ()


FIGURE_LIST = (
    Figure("fig3", ("fig3-*",), ("schedule.kind", "algorithm.alpha")),
    Figure("fig4", ("fig4-*", "fig3-top-dp-sync-a0.25-s*", "fig3-optimal-sync-a0.25-s*",
                    "fig3-li18-ma-sync-a0.25-s*"), ("privacy.epsilon",)),
    Figure("fig5", ("fig5-*", FIG3_SYNC), ("topology.p",)),
    Figure("fig6", ("fig6-*", FIG3_SYNC), ("topology.agents",)),
    # Without decay (gamma 1) the period changes nothing: that run is every period's reference.
    Figure("fig7", ("fig7-*", "fig3-top-dp-sync-a0.25-s*", "fig10-top-only-a0.25-s*"), ("algorithm.decay_period",),
           every_panel=("fig10-top-only-a0.25-s*",)),
    Figure("fig9", ("fig9-*",), ("schedule.kind", "topology.graph")),
    Figure("fig10", ("fig10-*", "fig3-*-sync-*"), ("algorithm.alpha",)),
    Figure("fig11", ("fig11-*", "fig3-*-async-*"), ("algorithm.alpha",)),
    Figure("short-fig8", ("short8-*", "fig3-*-sync-a0.75-s*"), ("algorithm.alpha",)),
)


def in_every_panel(report: Report, field: str, patterns: tuple[str, ...]) -> Report:
    """``report`` with each group of runs whose folder matches ``patterns`` repeated under every value of ``field``
    (same label and colour in each panel); the other groups as they are."""
    values = list(dict.fromkeys(row[field] for row in report.rows))
    rows, groups = [], []
    for row, group in zip(report.rows, report.groups, strict=True):
        everywhere = any(fnmatch(run.path.name, pattern) for run in group.runs for pattern in patterns)
        for value in values if everywhere else [row[field]]:
            rows.append({**row, field: value})
            groups.append(group)
    return dataclasses.replace(report, rows=rows, groups=groups)


def draw(figure: Figure, tables: Path | None) -> Path | None:
    """Write ``docs/figures/top-dp-<name>.png`` from the figure's finished runs and print its table; None when
    none has finished."""
    folders = sorted({path for pattern in figure.runs for path in RESULTS.glob(pattern) if path.is_dir()})
    if not folders:
        print(f"{figure.name}: no runs yet", file=sys.stderr)
        return None
    runs, skipped = find_runs(folders, skip_unfinished=True)
    if skipped:
        print(f"{figure.name}: left out {len(skipped)} unfinished run(s)", file=sys.stderr)
    if not runs:
        return None
    report = build_report(runs, ignore=figure.ignore)
    panels = [name for name in figure.panels if name in report.fields]  # a field no finished run varies yet
    table = f"## {figure.name}\n\n{markdown(report)}"
    print(table)
    if tables is not None:
        tables.mkdir(parents=True, exist_ok=True)
        (tables / f"{figure.name}.md").write_text(table)
    if not panels:
        return None
    if figure.every_panel:
        report = in_every_panel(report, panels[0], figure.every_panel)
    drawn = panel_figure(report, panels, SERIES_ALIASES)
    if drawn is None:
        return None
    out = FIGURES / f"top-dp-{figure.name}.png"
    drawn.savefig(out, dpi=110)
    pyplot().close(drawn)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], choices=[f.name for f in FIGURE_LIST],
                        help="draw this figure only (repeatable)")
    parser.add_argument("--tables", type=Path, metavar="DIR", help="also write each figure's table here")
    args = parser.parse_args(argv)
    for figure in FIGURE_LIST:
        if not args.only or figure.name in args.only:
            written = draw(figure, args.tables)
            if written is not None:
                print(f"wrote {written}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
