"""What ``fl tune`` costs per trial against a plain run of the same configuration (issue 38): N trials of a study
whose range holds one value (every trial is the same run, so the difference is the tuner's own work: the study's
SQLite writes, the TPE ask, each round's report and pruning check, the per-trial files), measured in the same process
right after N plain ``Simulation`` runs of that configuration.

    python benchmarks/tune_overhead.py                 # 8 trials of 20 rounds
    python benchmarks/tune_overhead.py --trials 20 --rounds 50

Prints the seconds of a plain run and of a trial's run (medians) and their ratio, and the whole study's seconds per
trial (with creating the study, the dataset check, trials.csv, best.toml and the plots), with the machine line.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from pflkit.core.engine.config import resolve  # noqa: E402
from pflkit.core.engine.simulation import Simulation  # noqa: E402
from pflkit.core.results import tuning  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = {"rounds": args.rounds, "partition": {"num_clients": 10, "seed": 0}, "model": {"name": "mlp", "hidden": [64]},
            "split": {"val": 0.15}, "checkpoint": {"every": 5}}
    work = Path(tempfile.mkdtemp(prefix="tune-bench-"))
    plain = []
    # a one-value range: every trial runs the plain configuration; the pruner off so that every trial runs in full
    req = tuning.TuneRequest(plugin="fedavg", layers=[base], trials=0, out_dir=work / "study",
                             spaces={"train.lr": "choice:0.05", "train.local_epochs": "off"}, pruner="none")
    for i in range(1, args.trials + 1):
        start = time.perf_counter()
        Simulation(resolve([base, {"output_dir": str(work / "plain"), "run_name": f"r{i}"}], algorithm="fedavg"),
                   tensorboard=False).run()
        plain.append(time.perf_counter() - start)
    req.trials = args.trials
    start = time.perf_counter()
    tuning.tune(req, echo=lambda line: None)
    whole = time.perf_counter() - start
    rows = (work / "study" / "trials.csv").read_text().splitlines()[1:]
    per_trial = [float(r.split(",")[-3]) for r in rows]  # each trial's run as the tuner timed it (with reports)
    med = statistics.median
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"one torch thread; fedavg on digits, 10 clients, mlp [64], split.val 0.15, {args.rounds} rounds; "
          f"{args.trials} trials")
    print(f"plain run: {med(plain):.2f} s (median of {len(plain)})")
    print(f"a trial's run (with its reports and pruning checks): {med(per_trial):.2f} s, "
          f"{med(per_trial) / med(plain):.2f}x the plain run")
    print(f"the study as a whole: {whole / args.trials:.2f} s a trial, {whole / args.trials / med(plain):.2f}x the "
          f"plain run (with the dataset check, the study's SQLite writes, ask/tell, trials.csv, best.toml, plots)")


if __name__ == "__main__":
    main()
