"""Per-domain test accuracy of every run of an `fl compare` output folder (the paper's Table 1 layout).

`fl compare` tabulates means over clients; the paper's Table 1 also lists every domain (client). This script
reloads each run's final checkpoint, scores every client's personal model on its own test split (the core's
evaluation protocol, last round), and prints one row per algorithm: per-client accuracy and the mean over clients,
each as mean (std) over the seeds, in percent.

    python plugins/fedc2i/scripts/per_domain_table.py OUT_DIR [--plugins a,b,...] > table.md
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from pflkit.core import Simulation


def client_accuracies(run_dir: Path) -> Dict[str, float]:
    """Client name -> test accuracy of its personal model after the run's last round."""
    sim = Simulation.resume(run_dir, tensorboard=False)  # restores all client and server state, runs nothing
    try:
        ids = list(sim.client_ids)
        replies = sim.comm.send(sim.server.configure_evaluate(sim.completed_round, ids), accounted=False)
        names = sim.data.bundle.group_names
        if names is None or len(names) != len(ids) or sim.cfg.partition.name != "by_group":
            names = [f"client {c}" for c in ids]
        return {names[c]: replies[c]["metric_sum"] / replies[c]["num_samples"] for c in ids}
    finally:
        sim.logger.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--plugins", "-p", default=None, help="labels to include, in order (default: results.json's)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    results = json.loads((args.out_dir / "results.json").read_text())
    labels: List[str] = args.plugins.split(",") if args.plugins else results["algorithms"]
    rows, columns = [], None
    for label in labels:
        runs = results["results"][label]["runs"]
        per_seed = [client_accuracies(Path(r["run_dir"])) for r in runs]
        columns = columns or list(per_seed[0])
        acc = np.array([[s[c] for c in columns] for s in per_seed]) * 100  # [seeds, clients]
        avg = acc.mean(axis=1)
        cells = [f"{m:.2f} ({s:.2f})" for m, s in zip(acc.mean(axis=0), acc.std(axis=0))]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | **{avg.mean():.2f} ({avg.std():.2f})** |")
    print("| method | " + " | ".join(columns) + " | avg |")
    print("|---|" + "---|" * (len(columns) + 1))
    print("\n".join(rows))
    print(f"\nTest accuracy (%) of every client's personal model after round {results['rounds']}, mean (population "
          f"std) over seeds {', '.join(map(str, results['seeds']))}.")


if __name__ == "__main__":
    main()
