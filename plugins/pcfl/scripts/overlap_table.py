"""The set-up measurements of the PCFL runs of an ``fl compare`` folder, as a Markdown table (README).

PCFL logs what its set-up measured into round 1's record of ``metrics.jsonl``: overlap precision and recall
against the dataset's ground truth, overlap pairs and sizes, synthetic samples. This prints their mean and
population std over the seeds of each compared entry:

    python plugins/pcfl/scripts/overlap_table.py pcfl-sine
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

KEYS = [("pcfl/overlap_precision", "precision", 3), ("pcfl/overlap_recall", "recall", 3),
        ("pcfl/overlap_pair_fraction", "pairs i≠k with D^{i,k} ≠ ∅", 3),
        ("pcfl/overlap_mean_size", "mean \\|D^{i,k}\\|", 1),
        ("pcfl/synthetic_got", "synthetic samples (all clients)", 0),
        ("pcfl/synthetic_acceptance", "acceptance of u' draws", 5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the fl compare --out folder")
    args = ap.parse_args()
    rows = defaultdict(list)
    for run in sorted((args.out / "runs").iterdir()):
        path = run / "metrics.jsonl"
        if not path.exists():
            continue
        first = json.loads(path.read_text().splitlines()[0])
        if "pcfl/overlap_pairs" not in first:
            continue
        rows[re.sub(r"-seed\d+$", "", run.name)].append(first)
    print("| runs | " + " | ".join(label for _, label, _ in KEYS) + " |")
    print("|---|" + "---:|" * len(KEYS))
    for name, recs in rows.items():
        cells = []
        for key, _, digits in KEYS:
            vals = np.array([r[key] for r in recs if key in r], dtype=np.float64)
            cells.append(f"{vals.mean():.{digits}f} ± {vals.std():.{digits}f}" if vals.size else "n/a")
        print(f"| {name} ({len(recs)} seeds) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
