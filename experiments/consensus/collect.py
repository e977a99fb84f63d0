"""Print our finished consensus runs beside the paper's numbers, as a Markdown table.

Usage: ``python experiments/consensus/collect.py [RESULTS_DIR]`` (default ``results``): reads every
``RESULTS_DIR/table*/summary.json`` written by ``decentdp run`` on the configs in this folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Bayrooti et al., Table 1 (complete graph, t = 1): mean accuracy (%) over five trials.
PAPER_TABLE1: dict[str, dict[str, float]] = {
    "central": {"inf": 98.22, "100": 96.16, "10": 94.73, "1": 92.04, "0.5": 90.82},
    "dsgd": {"inf": 95.38, "100": 92.34, "10": 91.27, "1": 87.26, "0.5": 84.07},
    "dsgt": {"inf": 98.13, "100": 96.13, "10": 96.54, "1": 89.24, "0.5": 85.41},
    "dinno": {"inf": 97.81, "100": 95.41, "10": 93.21, "1": 89.66, "0.5": 86.22},
}


def main(results: Path) -> None:
    """One row per finished Table 1 run: ours (mean, min, max over agents), the paper's, the gap."""
    print("| run | ours: mean (min–max) % | paper % | ours − paper | ε spent (PLD) | wall time |")
    print("|---|---:|---:|---:|---:|---:|")
    for summary_file in sorted(results.glob("table1-*/summary.json")):
        summary = json.loads(summary_file.read_text())
        _, method, eps = summary["name"].split("-")
        paper = PAPER_TABLE1[method][eps.removeprefix("eps")]
        ours = 100 * summary["accuracy_mean"]
        spread = f"{100 * summary['accuracy_min']:.2f}–{100 * summary['accuracy_max']:.2f}"
        epsilon = summary["epsilon_max"]
        epsilon_text = epsilon if isinstance(epsilon, str) else f"{epsilon:.3f}"
        print(f"| {summary['name']} | {ours:.2f} ({spread}) | {paper:.2f} | {ours - paper:+.2f} | "
              f"{epsilon_text} | {summary['wall_seconds'] / 60:.1f} min |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results"))
