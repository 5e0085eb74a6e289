"""FedCAC vs. baselines on the embedded digits data set: one partition, several seeds, a markdown table.

    python plugins/fedcac/scripts/results_table.py                # the README's table (a few CPU minutes)
    python plugins/fedcac/scripts/results_table.py --seeds 0 1 --rounds 10 --workers 2
    # ablations: NAME+key=value[+key=value...] runs NAME with those --set values
    python plugins/fedcac/scripts/results_table.py --algorithms fedcac+aggregator.collaboration=none

Every algorithm runs on the same data partition (one Dirichlet draw, fixed by --partition-seed, passed to every
run as ready-made client data), with the same model, optimiser, batch size, local epochs and rounds; each keeps its
own method-specific hyperparameters at their defaults (``fl show NAME``). The run seeds (--seeds) change model
initialisation, client sampling and mini-batch order only. Algorithms whose plugin is not installed are listed as
missing rows instead of failing.

Reported: final = mean uniform client accuracy over the last 5 evaluations, best = best uniform accuracy over
rounds (the number the paper reports); mean +- std over seeds.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

ALGORITHMS = ["local", "fedavg", "fedper", "fedrep", "fedbn", "fedcac"]
LABELS = {"local": "Local (Separate)", "fedavg": "FedAvg", "fedper": "FedPer", "fedrep": "FedRep",
          "fedbn": "FedBN", "fedcac": "FedCAC"}


def common_config(args: argparse.Namespace, seed: int) -> Dict[str, Any]:
    model: Dict[str, Any] = {"name": args.model}
    if args.model == "fedbn_cnn":
        model.update({"channels": args.channels, "hidden": args.hidden})
    return {
        "seed": seed, "rounds": args.rounds, "device": "cpu",
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": args.clients, "alpha": args.alpha},
        "model": model,
        "train": {"lr": args.lr, "batch_size": args.batch_size, "local_epochs": args.local_epochs,
                  "momentum": 0.0, "optimizer": "sgd"},
        "eval": {"every": 1, "final_k": 5},
        "checkpoint": {"every": 0},
    }


def run_one(algorithm: str, cfg_layer: Dict[str, Any], sets: List[str], partition_seed: int) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from pflkit.core import Simulation, build_federated_data
    from pflkit.core.config import parse_sets, resolve

    cfg = resolve([cfg_layer, parse_sets(sets)], algorithm=algorithm)
    data = build_federated_data(resolve([{**cfg_layer, "seed": partition_seed}], algorithm=algorithm))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = Simulation(cfg, run_dir=Path(tmp) / "run", data=data, tensorboard=False).run()
    return {"algorithm": algorithm, "seed": cfg.seed, "final": summary["final"]["uniform"],
            "best": summary["best"]["uniform"], "bytes_up": summary["bytes_up_total"],
            "bytes_down": summary["bytes_down_total"], "seconds": time.perf_counter() - start}


def label(spec: str) -> str:
    algo, *extra = spec.split("+")
    name = LABELS.get(algo, algo)
    return f"{name} ({', '.join(e.split('.')[-1] for e in extra)})" if extra else name


def fmt(values: List[float]) -> str:
    arr = 100 * np.asarray(values)
    return f"{arr.mean():.2f} ± {arr.std():.2f}"


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--partition-seed", type=int, default=0, help="seed of the one data partition")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha of the partition")
    p.add_argument("--model", default="fedbn_cnn", help="one model for every algorithm (needs BN for FedBN)")
    p.add_argument("--channels", nargs="+", type=int, default=[8, 8, 16], help="fedbn_cnn conv widths")
    p.add_argument("--hidden", nargs="+", type=int, default=[32], help="fedbn_cnn hidden FC widths")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--beta", type=float, default=10.0, help="FedCAC beta (collaboration ends after round beta)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the raw results as JSON here")
    args = p.parse_args(argv)

    from pflkit.core import registry as reg

    installed = [a for a in args.algorithms if a.split("+")[0] in reg.ALGORITHMS.names()]
    missing = [a for a in args.algorithms if a not in installed]
    jobs = []
    for spec in installed:
        algo, *extra = spec.split("+")
        sets = ([f"aggregator.beta={args.beta}"] if algo == "fedcac" else []) + extra
        for seed in args.seeds:
            jobs.append((algo, common_config(args, seed), sets, args.partition_seed))
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(run_one, *zip(*jobs)))
    for spec, result in zip([spec for spec in installed for _ in args.seeds], results):
        result["spec"] = spec
    wall = time.perf_counter() - start

    widths = f" {args.channels}/{args.hidden}" if args.model == "fedbn_cnn" else ""
    print(f"digits, Dirichlet alpha={args.alpha} (partition seed {args.partition_seed}), {args.clients} clients, "
          f"{args.rounds} rounds, model {args.model}{widths}, SGD lr {args.lr}, batch {args.batch_size}, "
          f"{args.local_epochs} local epochs, FedCAC beta {args.beta}, run seeds {args.seeds}; "
          f"uniform mean client accuracy (%), mean ± std over seeds\n")
    print("| Method | final (last 5 rounds) | best round | uplink MB / run | wall s / run (shared CPU) |")
    print("|---|---|---|---|---|")
    for spec in installed:
        rows = [r for r in results if r["spec"] == spec]
        print(f"| {label(spec)} | {fmt([r['final'] for r in rows])} | {fmt([r['best'] for r in rows])} "
              f"| {np.mean([r['bytes_up'] for r in rows]) / 1e6:.2f} | {np.mean([r['seconds'] for r in rows]):.0f} |")
    for spec in missing:
        print(f"| {label(spec)} | (plugin not installed) | | | |")
    print(f"\n{len(jobs)} runs in {wall:.0f} s wall-clock with {args.workers} workers")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
