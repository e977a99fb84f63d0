"""Bayrooti et al.'s Figure 3 from the full audit's chunks: the distribution of the loss on z, with and without z.

Each chunk of ``decentdp audit mia --chunk-dir`` keeps every trained model's score (minus its loss on the
audited record z) and whether z was in its training set.  This plots, for each audited folder, the two
histograms of the loss on z (models trained on D' = D + z against D), as the paper's Figure 3 does for
non-private SGD (left) and DP-SGD at epsilon = 1 (right); separable histograms mean a strong attack, overlapping
ones a weak one.  It reads the chunks only, trains nothing::

    python experiments/audits/loss_distributions.py --out docs/figures/audit-loss-distributions.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

FULL = Path(__file__).resolve().parent / "full"
#: chunk folder -> panel title, in the order of the figure (the paper's two panels first).
PANELS = {
    "mia-central-nonprivate": "central SGD, non-private",
    "mia-central-dpsgd": "central DP-SGD, ε = 1",
    "mia-dp-dsgd": "DP-DSGD, ε = 1",
    "mia-dp-dsgt": "DP-DSGT, ε = 1",
    "mia-dp-dinno": "DP-DiNNO, ε = 1",
}


def losses(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """The losses on z of the models trained with z (members) and without it, over every chunk of a folder."""
    scores, member = [], []
    for chunk in sorted(folder.glob("chunk-*.npz")):
        with np.load(chunk) as data:
            scores.append(data["scores"])
            member.append(data["member"])
    if not scores:
        raise SystemExit(f"{folder}: no chunk-*.npz (run decentdp audit mia --chunk-dir {folder} first)")
    loss, with_z = -np.concatenate(scores), np.concatenate(member).astype(bool)
    return loss[with_z], loss[~with_z]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/audit-loss-distributions.png"))
    args = parser.parse_args()
    present = {name: title for name, title in PANELS.items() if (FULL / name).is_dir()}
    figure, axes = plt.subplots(1, len(present), figsize=(3.2 * len(present), 2.8), squeeze=False)
    for axis, (name, title) in zip(axes[0], present.items(), strict=True):
        members, others = losses(FULL / name)
        bins = np.linspace(min(members.min(), others.min()), np.quantile(np.r_[members, others], 0.99), 50)
        axis.hist(others, bins=bins, alpha=0.6, density=True, label=f"trained on D ({len(others)})")
        axis.hist(members, bins=bins, alpha=0.6, density=True, label=f"trained on D' = D + z ({len(members)})")
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("loss on z")
    axes[0][0].set_ylabel("density")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
