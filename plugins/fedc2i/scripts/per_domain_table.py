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
from typing import Dict, List, Tuple

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


def finished_runs(out_dir: Path) -> Dict[str, List[Tuple[int, Path]]]:
    """Label -> [(seed, run directory)] of the finished runs under ``OUT_DIR/runs`` (``<label>-seed<k>``). Read from
    the folders, not from results.json: a later ``fl compare`` into the same folder rewrites that file with its
    own rows only."""
    found: Dict[str, List[Tuple[int, Path]]] = {}
    for run_dir in sorted((out_dir / "runs").iterdir()):
        label, _, seed = run_dir.name.rpartition("-seed")
        summary = run_dir / "summary.json"
        if not label or not seed.isdigit() or not summary.is_file():
            continue
        done = json.loads(summary.read_text())
        if done.get("interrupted") or done.get("rounds_completed") != done.get("rounds"):
            continue
        found.setdefault(label, []).append((int(seed), run_dir))
    return {label: sorted(runs) for label, runs in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--plugins", "-p", default=None, help="labels to include, in order (default: every label found)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    found = finished_runs(args.out_dir) if (args.out_dir / "runs").is_dir() else {}
    labels: List[str] = args.plugins.split(",") if args.plugins else sorted(found)
    missing = [label for label in labels if label not in found]
    if not labels or missing:
        raise SystemExit(f"no finished runs of {', '.join(missing) or 'any label'} under {args.out_dir / 'runs'}; "
                         f"found: {', '.join(sorted(found)) or 'none'}")
    rows, columns, seeds, rounds = [], None, set(), set()
    for label in labels:
        per_seed = [client_accuracies(run_dir) for _, run_dir in found[label]]
        seeds.update(seed for seed, _ in found[label])
        rounds.update(json.loads((d / "summary.json").read_text())["rounds"] for _, d in found[label])
        columns = columns or list(per_seed[0])
        acc = np.array([[s[c] for c in columns] for s in per_seed]) * 100  # [seeds, clients]
        avg = acc.mean(axis=1)
        cells = [f"{m:.2f} ({s:.2f})" for m, s in zip(acc.mean(axis=0), acc.std(axis=0))]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | **{avg.mean():.2f} ({avg.std():.2f})** |")
    print("| method | " + " | ".join(columns) + " | avg |")
    print("|---|" + "---|" * (len(columns) + 1))
    print("\n".join(rows))
    print(f"\nTest accuracy (%) of every client's personal model after round {', '.join(map(str, sorted(rounds)))}, "
          f"mean (population std) over seeds {', '.join(map(str, sorted(seeds)))}.")


if __name__ == "__main__":
    main()
