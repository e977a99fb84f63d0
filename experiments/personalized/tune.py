"""Tune wake-ups per agent (T_i = T/n) for each MovieLens config on the validation split, then run the
tuned configs on the test split: the procedure of Bellet et al. (supplementary D.2).

For every config and every candidate T_i, the run is made with ``personalized.validation = true``
(train on 80% of each user's training ratings, evaluate on the other 20%; the test ratings are not
read); the T_i with the lowest validation RMSE is kept, and the config is run once more on the test
split with it.  A grid search, since one run per candidate is cheap (seconds) and the curve in T_i
is smooth; its results go to ``OUT/tuning.json``, the final table to ``OUT/table.json`` and each test
run's results folder to ``OUT/NAME`` (for ``decentdp report``).

    python experiments/personalized/tune.py --data-dir ../shared/data --out results/personalized-table
    decentdp report results/personalized-table --metric rmse_mean \
        --paper experiments/personalized/paper-movielens.toml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from decentdp.config import load_config
from decentdp.personalized.runner import run_personalized

HERE = Path(__file__).parent
CONFIGS = ("movielens-local", "movielens-nonprivate", "movielens-eps1", "movielens-eps0.5", "movielens-eps0.1")
GRID = (10, 25, 50, 100, 200, 400)
PAPER = {"movielens-local": 1.2834, "movielens-nonprivate": 0.9502, "movielens-eps1": 0.9527,
         "movielens-eps0.5": 0.9545, "movielens-eps0.1": 0.9855}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--grid", type=int, nargs="+", default=list(GRID), help="candidate wake-ups per agent")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tuning, table = {}, {}
    for name in args.configs:
        path = HERE / f"{name}.toml"
        base = load_config(path)
        assert base.personalized is not None
        grid = args.grid if base.personalized.method == "cd" else [base.personalized.wakeups]
        scores = {}
        for wakeups in grid:
            config = load_config(path, ["personalized.validation=true", f"personalized.wakeups={wakeups}"])
            summary, _, _ = run_personalized(config, data_dir=args.data_dir, log=lambda _line: None)
            scores[wakeups] = summary["rmse_mean"]
            print(f"{name}: wakeups {wakeups}: validation RMSE {summary['rmse_mean']:.4f}", flush=True)
        best = min(scores, key=scores.__getitem__)
        tuning[name] = {"validation_rmse": scores, "best_wakeups": best}
        config = load_config(path, [f"personalized.wakeups={best}"])
        summary, _, _ = run_personalized(config, out / name, data_dir=args.data_dir, log=lambda _line: None)
        table[name] = {"wakeups": best, "rmse_mean": summary["rmse_mean"], "paper_rmse": PAPER.get(name),
                       "epsilon_max": summary["epsilon_max"], "epsilon_max_paper": summary["epsilon_max_paper"],
                       "epsilon_max_rdp": summary["epsilon_max_rdp"], "wall_seconds": summary["wall_seconds"]}
        print(f"{name}: test RMSE {summary['rmse_mean']:.4f} with wakeups {best} (paper {PAPER.get(name)})",
              flush=True)
        (out / "tuning.json").write_text(json.dumps(tuning, indent=2) + "\n")
        (out / "table.json").write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
