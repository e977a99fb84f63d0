"""Write the configs of TOP-DP's Figs. 5, 6, 7, 9, 10 and 11 (Guo et al., Section VII) from those of Fig. 3, and the
job list that runs every figure at full size with three seeds.

The Fig. 3 configs beside this script (one per method and protocol at alpha = 0.25) are the source of
every shared setting (MNIST i.i.d., the MLP with 100 hidden units, batch 64, clip 4, epsilon 1, the
learning-rate fade, TOP-DP's decay); each figure changes one thing:

* Fig. 5, connection rate: Erdos-Renyi with p = 0.1 and 0.4 (Fig. 3 is 0.2), synchronous, alpha = 0.25.
* Fig. 6, number of agents: N = 40 and 50 (Fig. 3 is 30), synchronous, alpha = 0.25.
* Fig. 7, the noise decay's parameters (eq. 6b), TOP-DP only, synchronous, alpha = 0.25: gamma in
  {0.7, 0.8, 0.9, 1.0} and period in {8, 10, 12}.  Our reading of the period's unit: the main experiments'
  period is 1000 iterations, and Section VII-D puts "the first two reduction steps" within "the first
  20 epochs", so an epoch on the paper's axis is 100 iterations (our ``eval_every``) and periods 8-12
  are 800-1200 rounds.  Every gamma meets every period (gamma = 1 never decays, so it is one config:
  Fig. 10's TOP alone at alpha = 0.25; gamma 0.9 at period 1000 is Fig. 3's own config).
* Fig. 9, topology (Fig. 8): ring, star with two star agents (``two-star``), tree, partial mesh
  (``partial-mesh``: a ring plus every other link with probability 0.1, our choice: the paper draws
  the graph without saying how dense), N = 30, synchronous and asynchronous, alpha = 0.25 (the paper
  does not state alpha for Fig. 9; 0.25 is that of Figs. 5-6).
* Figs. 10 (synchronous) and 11 (asynchronous), topology-aware noise reduction alone ("TOP"): TOP-DP
  with ``decay_gamma = 1`` at alpha in {0.25, 0.5, 0.75}; TOP+ND and the baselines are Fig. 3's configs.
* The short paper's Fig. 8 (``../shared/papers/001_*``, Section V-E): "a larger (0.75) and smaller (0.125)"
  alpha in the synchronous mode, 6 methods; 0.75 is Fig. 3's, so ``short8-<method>-a0.125`` adds the smaller.

Run ``python experiments/top-dp/generate.py``; every config is validated before it is written.  It also
writes ``jobs.tsv``: three seeds of every figure's config, each run into ``results/<config>-s<seed>/`` here,
for ``experiments/run_jobs.py`` (Figs. 3 and 4 first, then Figs. 10-11, then the rest; each group seed by seed).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from decentdp.config import validate_config
from decentdp.topology import PARAM_USERS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from run_jobs import run_line  # noqa: E402

METHODS = ("top-dp", "optimal", "udp", "li18-ma", "li18", "no-noise")
TOPOLOGIES: dict[str, dict[str, Any]] = {
    "ring": {"graph": "ring"},
    "two-star": {"graph": "two-star"},
    "tree": {"graph": "tree"},
    "partial-mesh": {"graph": "partial-mesh", "p": 0.1},
}
ALPHAS = (0.25, 0.5, 0.75)
SHORT_PAPER_ALPHA = 0.125  # the short paper's Fig. 8, beside Fig. 3's 0.75
DECAY_GAMMAS = (0.7, 0.8, 0.9)  # and 1.0, which never decays: Fig. 10's TOP alone
DECAY_PERIODS = (800, 1000, 1200)
SEEDS = (0, 1, 2)
HEADER = ("# TOP-DP (Guo et al.) {figure}: {change}; every other setting as in fig3-{method}-{mode}-a0.25.toml\n"
          "# (2000 rounds, as there). Written by experiments/top-dp/generate.py: edit "
          "that, not this file.\n")


def template(method: str, mode: str) -> dict[str, Any]:
    """The Fig. 3 config of ``method`` in ``mode`` (``sync`` or ``async``) at alpha = 0.25."""
    with (HERE / f"fig3-{method}-{mode}-a0.25.toml").open("rb") as handle:
        return tomllib.load(handle)


def variant(method: str, mode: str, name: str, topology: dict[str, Any]) -> dict[str, Any]:
    """The template with ``name`` and the ``topology`` fields changed (``p`` dropped where unused)."""
    raw = template(method, mode)
    raw["experiment"]["name"] = name
    raw["topology"] = {**raw["topology"], **topology}
    if raw["topology"]["graph"] not in PARAM_USERS["p"]:
        raw["topology"].pop("p")
    return raw


def top_only(mode: str, alpha: float, name: str) -> dict[str, Any]:
    """TOP-DP's Fig. 3 config at ``alpha`` with the noise decay off (``decay_gamma = 1``): TOP alone."""
    with (HERE / f"fig3-top-dp-{mode}-a{alpha}.toml").open("rb") as handle:
        raw = tomllib.load(handle)
    raw["experiment"]["name"] = name
    raw["algorithm"]["decay_gamma"] = 1.0
    return raw


def configs() -> dict[str, tuple[dict[str, Any], str]]:
    """Every generated config by file stem, with its header comment."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for method in METHODS:
        for p in (0.1, 0.4):
            name = f"fig5-{method}-p{p}"
            out[name] = (variant(method, "sync", name, {"p": p}),
                         HEADER.format(figure="Fig. 5", change=f"connection rate {p}", method=method, mode="sync"))
        for agents in (40, 50):
            name = f"fig6-{method}-n{agents}"
            out[name] = (variant(method, "sync", name, {"agents": agents}),
                         HEADER.format(figure="Fig. 6", change=f"{agents} agents", method=method, mode="sync"))
        name = f"short8-{method}-a{SHORT_PAPER_ALPHA}"
        raw = variant(method, "sync", name, {})
        raw["algorithm"]["alpha"] = SHORT_PAPER_ALPHA
        out[name] = (raw, HEADER.format(figure="short paper, Fig. 8", change=f"alpha {SHORT_PAPER_ALPHA}",
                                        method=method, mode="sync"))
        for mode in ("sync", "async"):
            for label, topology in TOPOLOGIES.items():
                name = f"fig9-{method}-{mode}-{label}"
                out[name] = (variant(method, mode, name, topology),
                             HEADER.format(figure="Fig. 9", change=f"{label} topology", method=method, mode=mode))
    for gamma in DECAY_GAMMAS:
        for period in DECAY_PERIODS:
            if (gamma, period) == (0.9, 1000):
                continue  # Fig. 3's own config
            name = f"fig7-top-dp-g{gamma}-p{period}"
            raw = variant("top-dp", "sync", name, {})
            raw["algorithm"] |= {"decay_gamma": gamma, "decay_period": period}
            out[name] = (raw, HEADER.format(figure="Fig. 7", change=f"decay gamma {gamma}, period {period} rounds",
                                            method="top-dp", mode="sync"))
    for figure, mode in (("fig10", "sync"), ("fig11", "async")):
        for alpha in ALPHAS:
            name = f"{figure}-top-only-a{alpha}"
            out[name] = (top_only(mode, alpha, name),
                         HEADER.replace("-a0.25.toml", f"-a{alpha}.toml").format(
                             figure=f"Fig. {figure[3:]}", change="topology-aware noise reduction alone (no decay)",
                             method="top-dp", mode=mode))
    return out


def figure_configs() -> list[str]:
    """Every figure's config stems, in the order the job list runs them (Figs. 3-4, 10-11, then 5, 6, 7, 9 and the
    short paper's 8); each config once, however many figures draw it."""
    stems = [path.stem for pattern in ("fig3-*", "fig4-*") for path in sorted(HERE.glob(f"{pattern}.toml"))]
    generated = list(configs())
    stems += [s for prefix in ("fig10-", "fig11-", "fig5-", "fig6-", "fig7-", "fig9-", "short8-")
              for s in generated if s.startswith(prefix)]
    return list(dict.fromkeys(stems))


def write_jobs() -> None:
    """``jobs.tsv``: three seeds of every config at full size (the configs' 2000 rounds). Figs. 3 and 4 (the
    issue's first figures) run first, then the other figures; each group seed by seed (seed 0 of every config
    first), so that a whole figure's first seed, every method beside every other, comes early. Each
    run writes into ``results/`` here (kept in the repository without checkpoints and figures) and is skipped
    once its ``summary.json`` exists, wherever the list runs."""
    lines = ["# Generated by experiments/top-dp/generate.py: python experiments/run_jobs.py "
             "experiments/top-dp/jobs.tsv --workers 2 (DATA_DIR defaults to ../shared/data)"]
    stems = figure_configs()
    first = [s for s in stems if s.startswith(("fig3-", "fig4-"))]
    rest = [s for s in stems if s not in first]
    order = [(s, seed) for group in (first, rest) for seed in SEEDS for s in group]
    lines += [run_line(stem, f"experiments/top-dp/{stem}.toml", seed, "${DATA_DIR:-../shared/data}",
                       f"experiments/top-dp/results/{stem}-s{seed}") for stem, seed in order]
    (HERE / "jobs.tsv").write_text("\n".join(lines) + "\n")


def main() -> None:
    written = 0
    for stem, (raw, header) in configs().items():
        validate_config(raw)  # raises, naming the field, before anything is written
        (HERE / f"{stem}.toml").write_text(header + tomli_w.dumps(raw))
        written += 1
    write_jobs()
    print(f"wrote {written} configs and jobs.tsv to {HERE}")


if __name__ == "__main__":
    main()
