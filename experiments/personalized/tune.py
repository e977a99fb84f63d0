"""Tune wake-ups per agent (T_i = T/n) and the trade-off mu for each MovieLens config on the validation split,
then run the tuned configs on the test split: the procedure of Bellet et al. (supplementary D.2), once per seed,
with mu tuned too (the paper fixes mu = 0.04 for data centred by each user's mean rating; with the public
centring that privacy requires, each user's offset is learned, which a larger mu helps without noise and hurts
with it, so every method gets the same grid).

For every seed, config and candidate (T_i, mu), the run is made with ``personalized.validation = true``
(train on 80% of each user's training ratings, evaluate on the other 20%; the test ratings are not
read); the pair with the lowest validation RMSE is kept, and the config is run once more on the test
split with it.  Each seed (``experiment.seed``) draws its own 80/20 split, ALS features, graph, clocks
and noise, and is tuned on its own validation split, as five independent runs of the paper's protocol
would be.  A grid search, since one run per candidate is cheap (seconds) and the curve in T_i is
smooth.  ``OUT/table.json`` holds, per config, each seed's validation RMSE per candidate, tuned T_i and
test RMSE, and the mean and sample std over seeds; each test run's results folder is ``OUT/NAME/seed-S``
(for ``decentdp report``, which must ignore the tuned ``personalized.wakeups`` to group a config's seeds).

    python experiments/personalized/tune.py --data-dir ../shared/data --out results/personalized-table \
        --seeds 0 1 2 3 4
    decentdp report results/personalized-table --metric rmse_mean --ignore personalized.wakeups \
        --ignore personalized.mu --paper experiments/personalized/paper-movielens.toml
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from decentdp.config import load_config
from decentdp.personalized.runner import run_personalized

HERE = Path(__file__).parent
CONFIGS = ("movielens-local", "movielens-nonprivate", "movielens-eps1", "movielens-eps0.5", "movielens-eps0.1")
GRID = (10, 25, 50, 100, 200, 400)
MU_GRID = (0.04, 0.2, 1.0)
PAPER = {"movielens-local": 1.2834, "movielens-nonprivate": 0.9502, "movielens-eps1": 0.9527,
         "movielens-eps0.5": 0.9545, "movielens-eps0.1": 0.9855}


def tune_and_test(path: Path, seed: int, grid: list[int], mu_grid: list[float], data_dir: str,
                  out: Path) -> dict[str, object]:
    """One seed of one config: validation RMSE per candidate (T_i, mu), then the test run at the best pair."""
    base = load_config(path)
    assert base.personalized is not None
    tuned = base.personalized.method == "cd"
    candidates = [(wakeups, mu) for mu in mu_grid for wakeups in grid] if tuned else \
        [(base.personalized.wakeups, base.personalized.mu)]
    scores = {}
    for wakeups, mu in candidates:
        config = load_config(path, [f"experiment.seed={seed}", "personalized.validation=true",
                                    f"personalized.wakeups={wakeups}", f"personalized.mu={mu}"])
        summary, _, _ = run_personalized(config, data_dir=data_dir, log=lambda _line: None)
        scores[f"{wakeups}@{mu:g}"] = summary["rmse_mean"]
        print(f"{path.stem} seed {seed}: wakeups {wakeups}, mu {mu:g}: validation RMSE {summary['rmse_mean']:.4f}",
              flush=True)
    best = min(scores, key=scores.__getitem__)
    wakeups, mu = int(best.split("@")[0]), float(best.split("@")[1])
    config = load_config(path, [f"experiment.seed={seed}", f"personalized.wakeups={wakeups}", f"personalized.mu={mu}"])
    summary, _, _ = run_personalized(config, out, data_dir=data_dir, log=lambda _line: None)
    print(f"{path.stem} seed {seed}: test RMSE {summary['rmse_mean']:.4f} with wakeups {wakeups}, mu {mu:g}",
          flush=True)
    return {"validation_rmse": scores, "wakeups": wakeups, "mu": mu, "rmse_mean": summary["rmse_mean"],
            "epsilon_max": summary["epsilon_max"], "paper_epsilon_max": summary["paper_epsilon_max"],
            "epsilon_max_rdp": summary["epsilon_max_rdp"], "wall_seconds": summary["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--grid", type=int, nargs="+", default=list(GRID), help="candidate wake-ups per agent")
    parser.add_argument("--mu-grid", type=float, nargs="+", default=list(MU_GRID), help="candidate values of mu")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="experiment.seed of each run (paper: 5)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    table: dict[str, dict[str, object]] = {}
    for name in args.configs:
        runs = {seed: tune_and_test(HERE / f"{name}.toml", seed, args.grid, args.mu_grid, args.data_dir,
                                    out / name / f"seed-{seed}") for seed in args.seeds}
        rmse = [float(run["rmse_mean"]) for run in runs.values()]  # type: ignore[arg-type]
        table[name] = {"rmse_mean": statistics.mean(rmse), "rmse_std": statistics.stdev(rmse) if len(rmse) > 1 else 0.0,
                       "paper_rmse": PAPER.get(name), "seeds": runs}
        print(f"{name}: test RMSE {table[name]['rmse_mean']:.4f} ± {table[name]['rmse_std']:.4f} over "
              f"{len(rmse)} seeds (paper {PAPER.get(name)})", flush=True)
        (out / "table.json").write_text(json.dumps({**table, "wall_seconds": time.perf_counter() - clock},
                                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
