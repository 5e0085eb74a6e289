#!/usr/bin/env python
"""FedSA against FedAvg and FedProx on the embedded digits dataset: pathological and Dir(0.1) partitions, seeds.

Metric (the paper's): accuracy of the *global* model on every client's test split, uniform mean over clients,
averaged over the last 10 evaluated rounds (``eval.final_k=10``); mean +- std over seeds. All rows share the model,
optimiser, rounds and partition, so only the algorithm differs. Rows whose plugin is not installed are listed as
missing instead of being silently dropped.

Kept cheap on purpose (a few CPU minutes with the defaults): 20 clients, join ratio 1, 1 local epoch, a small MLP
instead of the paper's ResNet-18, 20 rounds.

    python plugins/fedsa/scripts/results_table.py                      # full table (3 seeds)
    python plugins/fedsa/scripts/results_table.py --seeds 0 --rounds 12 --jobs 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# (row label, algorithm, extra config). "client_weighting=samples" separates FedSA's skew handling from its uniform
# (paper) mean, which differs from FedAvg's sample-weighted mean on unbalanced partitions; the FedSA + FedProx row
# shows the aggregator combining with another trainer through configuration alone.
ROWS: List[Tuple[str, str, Dict[str, Any]]] = [
    ("FedAvg", "fedavg", {}),
    ("FedProx (mu 0.01)", "fedprox", {}),
    ("FedSA (defaults)", "fedsa", {}),
    ("FedSA, client_weighting=samples", "fedsa", {"aggregator": {"client_weighting": "samples"}}),
    ("FedSA, cv_norm=rank", "fedsa", {"aggregator": {"cv_norm": "rank"}}),
    ("FedSA aggregator + FedProx clients", "fedsa", {"trainer": {"name": "fedprox"}}),
]
PARTITIONS: Dict[str, Dict[str, Any]] = {
    "pathological (2 classes/client)": {"name": "pathological", "classes_per_client": 2},
    "Dir(0.1)": {"name": "dirichlet", "alpha": 0.1},
}


def _run(job: Tuple[str, str, Dict[str, Any], str, int, int, str]) -> Dict[str, Any]:
    label, algorithm, extra, partition, seed, rounds, model = job
    import torch

    torch.set_num_threads(1)
    from pflkit.core import Simulation
    from pflkit.core.config import deep_merge, resolve

    layer = {
        "seed": seed, "rounds": rounds, "device": "cpu", "checkpoint": {"every": 0},
        "partition": dict(PARTITIONS[partition], num_clients=20),
        "participation": {"join_ratio": 1.0},
        "model": {"name": model},
        "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
        "eval": {"final_k": 10},
    }
    cfg = resolve([deep_merge(layer, extra)], algorithm=algorithm)
    start = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        summary = Simulation(cfg, run_dir=Path(tmp) / "run", tensorboard=False).run()
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    fedsa = [r for r in records if "fedsa/high_share" in r]
    return {
        "label": label, "partition": partition, "seed": seed,
        "final": summary["final"]["uniform"], "best": summary["best"]["uniform"],
        "high_share": statistics.mean(r["fedsa/high_share"] for r in fedsa) if fedsa else None,
        "macro_classes": statistics.mean(r["fedsa/macro_classes"] for r in fedsa) if fedsa else None,
        "unclustered": statistics.mean(r["fedsa/unclustered"] for r in fedsa) if fedsa else None,
        "cpu_seconds": time.process_time() - start,
    }


def _fmt(values: List[float]) -> str:
    mean = 100 * statistics.mean(values)
    std = 100 * statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} +- {std:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    ap.add_argument("--json", type=Path, default=None, help="write the per-run results here")
    args = ap.parse_args()

    from pflkit.core import ALGORITHMS, TRAINERS

    available, missing = [], []
    for label, algorithm, extra in ROWS:
        trainer = extra.get("trainer", {}).get("name")
        if algorithm not in ALGORITHMS.names() or (trainer and trainer not in TRAINERS.names()):
            missing.append(label)
        else:
            available.append((label, algorithm, extra))
    jobs = [(label, algo, extra, part, seed, args.rounds, args.model)
            for label, algo, extra in available for part in PARTITIONS for seed in args.seeds]
    wall = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_run, jobs))
    wall = time.perf_counter() - wall

    lines = [f"Global-model accuracy (%), uniform mean over the 20 clients' test splits, mean of the last 10 of "
             f"{args.rounds} rounds; mean +- std over seeds {args.seeds}. digits (8x8), model {args.model}, "
             f"join ratio 1, 1 local epoch, SGD lr 0.05, batch 32.", "",
             "| method | " + " | ".join(PARTITIONS) + " | FedSA: high-dispersion share / Macro-Classes / unclustered (per partition) |",
             "|---|" + "---|" * len(PARTITIONS) + "---|"]
    for label, _, _ in available:
        cells = []
        diag = []
        for part in PARTITIONS:
            runs = [r for r in results if r["label"] == label and r["partition"] == part]
            cells.append(_fmt([r["final"] for r in runs]))
            if runs[0]["high_share"] is not None:
                diag.append(f"{100 * statistics.mean(r['high_share'] for r in runs):.2f}% / "
                            f"{statistics.mean(r['macro_classes'] for r in runs):.1f} / "
                            f"{statistics.mean(r['unclustered'] for r in runs):.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {' ; '.join(diag) if diag else '-'} |")
    for label in missing:
        lines.append(f"| {label} | " + " | ".join("not installed" for _ in PARTITIONS) + " | - |")
    cpu = sum(r["cpu_seconds"] for r in results)
    lines += ["", f"{len(results)} runs, {cpu:.0f} CPU seconds in the runs, {wall:.0f} s wall with {args.jobs} "
                  f"worker(s)." + (f" Missing (plugin not installed): {', '.join(missing)}." if missing else "")]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
