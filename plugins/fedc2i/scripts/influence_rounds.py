"""Figure 3 of the paper from a FedC2I run: the influence vectors of all clients (rows) in a few rounds.

    python plugins/fedc2i/scripts/influence_rounds.py RUN_DIR --rounds 1,2,10,20 --out influence.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from easydict import EasyDict

from pflkit_fedc2i.plots import _plt, draw_matrix
from pflkit_fedc2i.server import client_names


def matrices(run_dir: Path, n: int) -> dict:
    """Round -> M x M influence matrix (row m = lambda_m), read from the run's metrics.jsonl."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        mat = np.full((n, n), np.nan)
        for key, value in row.items():
            if key.startswith("fedc2i/influence/"):
                m, i = key.split("/")[2:4]
                mat[int(m), int(i)] = value
        if np.isfinite(mat).any():
            out[int(row["round"])] = mat
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--rounds", default="1,2,10,20")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = EasyDict(json.loads((args.run_dir / "config.json").read_text()))
    n = cfg.partition.num_clients
    names = client_names(EasyDict(hp=cfg.aggregator, cfg=cfg, num_clients=n))
    mats = matrices(args.run_dir, n)
    rounds = [r for r in (int(x) for x in args.rounds.split(",")) if r in mats]
    plt = _plt()
    fig, axes = plt.subplots(1, len(rounds), figsize=(3.3 * len(rounds), 3.6))
    axes = np.atleast_1d(axes)
    top = max(float(np.nanmax(mats[r])) for r in rounds)
    for ax, r in zip(axes, rounds):
        im = draw_matrix(ax, mats[r], names, f"round {r}", annotate=True, vmax=top)
        if ax is not axes[0]:  # row names once, at the left
            ax.set_ylabel("")
            ax.set_yticklabels([])
    fig.colorbar(im, ax=list(axes), fraction=0.015, pad=0.02)
    fig.suptitle(f"FedC2I influence vectors lambda_m (rows), gamma = {cfg.trainer.gamma}, seed {cfg.seed}",
                 fontsize=10)
    fig.savefig(args.out, dpi=90, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
