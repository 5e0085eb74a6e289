"""Per-domain accuracy of finished ``fl compare`` runs: each client's accuracy at the final round, by group name.

``fl compare`` tabulates means over clients; on feature-shift data (one domain per client, ``by_group``) the
per-domain numbers are the interesting ones (FedC2I's Table 1 layout). This reloads every run's final checkpoint
(``OUT/runs/<label>-seed<k>``), evaluates each client once more -- the same evaluation the run's last round did --
and prints one Markdown row per label: accuracy per domain (mean over seeds) and their mean.

    python plugins/fedrod/scripts/per_domain.py rod-proto-table
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from pflkit.core import Simulation, per_client_metric


def final_per_client(run_dir: Path) -> Dict[str, float]:
    """Group (domain) name -> that client's test accuracy with the run's final state."""
    sim = Simulation.resume(run_dir, tensorboard=False)
    results = sim.comm.send(sim.server.configure_evaluate(sim.completed_round, sim.client_ids), accounted=False)
    names = sim.data.bundle.group_names or [str(c) for c in sim.client_ids]
    return {names[c]: acc for c, acc in per_client_metric(results).items()}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)  # as fl compare runs them
    rows: Dict[str, List[Dict[str, float]]] = defaultdict(list)
    for run_dir in sorted(Path(out_dir, "runs").iterdir()):
        label = run_dir.name.rsplit("-seed", 1)[0]
        rows[label].append(final_per_client(run_dir))
    domains = list(next(iter(rows.values()))[0])
    print("| run | " + " | ".join(domains) + " | avg |")
    print("|---" * (len(domains) + 2) + "|")
    for label, runs in rows.items():
        acc = 100 * np.array([[r[d] for d in domains] for r in runs])
        cells = " | ".join(f"{v:.1f}" for v in acc.mean(axis=0))
        print(f"| {label} ({len(runs)} seeds) | {cells} | {acc.mean():.1f} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: per_domain.py FL_COMPARE_OUT_DIR")
    main(sys.argv[1])
