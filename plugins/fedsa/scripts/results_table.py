#!/usr/bin/env python
"""FedSA against FedAvg and FedProx on the embedded digits dataset: pathological and Dir(0.1) partitions, seeds.

Metric (the paper's): accuracy of the *global* model on every client's test split, uniform mean over clients,
averaged over the last 10 evaluated rounds (``eval.final_k=10``); mean +- std (population, over seeds). All rows
share the model, optimiser, rounds and partition, so only the algorithm differs.

The runs are ``fl compare`` runs (``pflkit.core.results.compare.run_comparison``), one comparison per partition, under
``--out``/<partition>/: each has its own results.md / results.json / curves.png, and rerunning reuses finished runs.
This script only adds what one comparison cannot show: the two partitions side by side, and FedSA's diagnostics
(means over rounds of the ``fedsa/*`` scalars in each run's metrics.jsonl).

    python plugins/fedsa/scripts/results_table.py                      # full table (3 seeds)
    python plugins/fedsa/scripts/results_table.py --seeds 0 --rounds 12 --jobs 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

# One row per entry: a plain algorithm or a labelled variant ``NAME+key=value``. client_weighting=samples separates
# FedSA's skew handling from its uniform (paper) mean, which differs from FedAvg's sample-weighted mean on
# unbalanced partitions; trainer.name=fedprox shows the aggregator combining with another trainer by configuration.
ROWS = ["fedavg", "fedprox", "fedsa", "fedsa+aggregator.client_weighting=samples", "fedsa+aggregator.cv_norm=rank",
        "fedsa+trainer.name=fedprox"]
PARTITIONS: Dict[str, Dict[str, Any]] = {  # table column -> partition settings (20 clients each)
    "pathological (2 classes/client)": {"name": "pathological", "classes_per_client": 2},
    "Dir(0.1)": {"name": "dirichlet", "alpha": 0.1},
}
DIAGNOSTICS = ("fedsa/high_share", "fedsa/macro_classes", "fedsa/unclustered")


def shared_layer(rounds: int, model: str, partition: Dict[str, Any]) -> Dict[str, Any]:
    """Settings of every run (the partition follows the run seed, the same for every row of one seed)."""
    return {
        "rounds": rounds, "device": "cpu", "checkpoint": {"every": 0},
        "partition": dict(partition, num_clients=20),
        "participation": {"join_ratio": 1.0},
        "model": {"name": model},
        "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
        "eval": {"final_k": 10},
    }


def run_diagnostics(run_dir: Path) -> Optional[Dict[str, float]]:
    """Means over rounds of FedSA's logged diagnostics; None for a run that logs none (not a FedSA aggregator)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if DIAGNOSTICS[0] in r]
    if not rows:
        return None
    return {key: statistics.mean(r[key] for r in rows) for key in DIAGNOSTICS}


def _fmt(stat: Dict[str, float]) -> str:
    return f"{100 * stat['mean']:.2f} +- {100 * stat['std']:.2f}"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--runs", type=Path, default=Path("fedsa-table"),
                    help="fl compare output folder (one subfolder per partition); finished runs there are reused")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)

    from pflkit.core import run_comparison

    columns = {}
    for part_label, partition in PARTITIONS.items():
        columns[part_label] = run_comparison(ROWS, args.seeds, [shared_layer(args.rounds, args.model, partition)],
                                             args.runs / partition["name"], jobs=args.jobs)

    lines = [f"Global-model accuracy (%), uniform mean over the 20 clients' test splits, mean of the last 10 of "
             f"{args.rounds} rounds; mean +- std over seeds {args.seeds}. digits (8x8), model {args.model}, "
             f"join ratio 1, 1 local epoch, SGD lr 0.05, batch 32.", "",
             "| method | " + " | ".join(PARTITIONS) + " | FedSA: high-dispersion share / Macro-Classes / "
             "unclustered (per partition) |",
             "|---|" + "---|" * len(PARTITIONS) + "---|"]
    for row in ROWS:
        cells, diag = [], []
        for results in columns.values():
            entry = results["results"][row]
            cells.append(_fmt(entry["final_uniform"]))
            per_run = [run_diagnostics(Path(r["run_dir"])) for r in entry["runs"]]
            if per_run and per_run[0] is not None:
                diag.append(f"{100 * statistics.mean(d['fedsa/high_share'] for d in per_run):.2f}% / "
                            f"{statistics.mean(d['fedsa/macro_classes'] for d in per_run):.1f} / "
                            f"{statistics.mean(d['fedsa/unclustered'] for d in per_run):.1f}")
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {' ; '.join(diag) if diag else '-'} |")
    lines += ["", "Per-run numbers and curves: " + ", ".join(r["files"]["json"] for r in columns.values()) + "."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
