"""Results table of the FedCP README: FedCP vs FedAvg, Local, FedPer, FedRep, Ditto on the embedded digits set.

Every method runs on the same partition (the partition depends only on the seed and the partition settings, which
are fixed here) with the same model and local-training settings; only the algorithm differs. Methods whose plugin
is not installed are reported as missing.

    python plugins/fedcp/scripts/results_table.py                      # 20 clients, 20 rounds, seeds 0 1 2
    python plugins/fedcp/scripts/results_table.py --jobs 4 --rounds 30 --out /tmp/table.md
    python plugins/fedcp/scripts/results_table.py --methods fedcp "fedcp+trainer.lambda_mmd=1" fedavg

A method is an algorithm name, optionally followed by ``+key=value`` config overrides (a labelled variant).
Each run uses one CPU thread; ``--jobs`` runs that many in parallel processes. ``--json`` saves per-run results;
``--reuse`` takes runs from such a file instead of repeating them (only runs with the same settings are reused).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

METHODS = ["fedcp", "fedcp+trainer.lambda_mmd=1", "fedcp+trainer.lambda_mmd=0.1",
           "fedcp+trainer.lambda_mmd=1+participation.random_join_ratio=[0.1,1]",
           "fedavg", "local", "fedper", "fedrep", "ditto"]


def common_config(rounds: int, clients: int, seed: int, lr: float) -> Dict[str, Any]:
    """Shared settings: FedCP's paper defaults except the learning rate and the (short) number of rounds."""
    return {
        "seed": seed, "rounds": rounds, "device": "cpu", "checkpoint": {"every": 0},
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": clients, "alpha": 0.1},
        "split": {"test_ratio": 0.25},
        "participation": {"join_ratio": 1.0},
        "model": {"name": "cnn4"},
        "train": {"optimizer": "sgd", "lr": lr, "momentum": 0.0, "batch_size": 10, "local_epochs": 1},
        "eval": {"every": 1, "final_k": 5},
    }


def split_spec(spec: str) -> Tuple[str, List[str]]:
    """``"fedcp+trainer.lambda_mmd=1"`` -> ``("fedcp", ["trainer.lambda_mmd=1"])``."""
    name, *sets = spec.split("+")
    return name, sets


def run_one(args: Tuple[str, int, int, int, float]) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from pflkit.core import Simulation
    from pflkit.core.config import parse_sets, resolve

    method, seed, rounds, clients, lr = args
    name, sets = split_spec(method)
    cfg = resolve([common_config(rounds, clients, seed, lr), parse_sets(sets)], algorithm=name)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = Simulation(cfg, run_dir=Path(tmp) / "run", tensorboard=False).run()
    return {"method": method, "seed": seed, "final": summary["final"]["uniform"],
            "best": summary["best"]["uniform"], "seconds": time.perf_counter() - start,
            "settings": {"rounds": rounds, "clients": clients, "lr": lr},
            "trainer": dict(cfg.trainer), "aggregator": dict(cfg.aggregator)}


def mean_std(values: List[float]) -> str:
    m = 100 * statistics.mean(values)
    s = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--json", type=Path, default=None, help="write the per-run results here")
    ap.add_argument("--reuse", type=Path, default=None, help="per-run results (from --json) to reuse")
    a = ap.parse_args(argv)

    from pflkit.core.registry import ALGORITHMS

    available = [m for m in a.methods if split_spec(m)[0] in ALGORITHMS]
    missing = [m for m in a.methods if split_spec(m)[0] not in ALGORITHMS]
    settings = {"rounds": a.rounds, "clients": a.clients, "lr": a.lr}
    old = json.loads(a.reuse.read_text()) if a.reuse else []
    reused = {(r["method"], r["seed"]): r for r in old if r.get("settings") == settings}
    results = [reused[(m, s)] for m in available for s in a.seeds if (m, s) in reused]
    jobs = [(m, s, a.rounds, a.clients, a.lr) for m in available for s in a.seeds if (m, s) not in reused]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results += list(pool.map(run_one, jobs))
    wall = time.perf_counter() - start

    lines = [f"Digits (sklearn 8x8, embedded), {a.clients} clients, Dir(0.1), 75/25 split, cnn4, SGD lr {a.lr}, "
             f"batch 10, 1 local epoch, join ratio 1, {a.rounds} rounds, seeds {' '.join(map(str, a.seeds))}. "
             "Accuracy (%) = uniform mean over clients of each client's personalized model on its own test split; "
             "final = mean of the last 5 evaluations, best = best round; mean ± std over seeds.", "",
             "| method | final accuracy | best accuracy | seconds / run |", "|---|---|---|---|"]
    for m in available:
        rs = [r for r in results if r["method"] == m]
        lines.append(f"| {m} | {mean_std([r['final'] for r in rs])} | {mean_std([r['best'] for r in rs])} | "
                     f"{statistics.mean(r['seconds'] for r in rs):.0f} |")
    for m in missing:
        lines.append(f"| {m} | not installed | | |")
    lines += ["", f"({len(jobs)} runs now, {len(results) - len(jobs)} reused, {a.jobs} parallel jobs, "
                  f"{wall:.0f} s wall clock)"]
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.write_text(table + "\n")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
