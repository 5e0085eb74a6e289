"""What submitting runs as jobs costs (issue 39): a 2 x 2 x 2 table (2 algorithms x 2 settings x 2 seeds = 8 runs)
through ``--launcher submitit-local`` against ``--jobs 2`` on the same runs, and the time from a SIGKILL of a job to
its run's next round after the collect that resubmits it.

    python benchmarks/launcher_overhead.py              # 20 rounds a run
    python benchmarks/launcher_overhead.py --rounds 50

submitit's local executor starts every job of the array at once (Slurm's array parallelism does not apply), so on a
machine with fewer cores than jobs the launcher's wall time also pays for oversubscription; the per-job overhead is
read from the jobs' own logs: the seconds from submission to the job's start (a fresh Python importing pflkit and
torch, unpickling the run) and from the run's end to the job's exit.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pflkit.core.results.compare import run_comparison  # noqa: E402
from pflkit.core.results.launchers import LauncherSettings, read_jobs  # noqa: E402

PLUGINS = ["fedavg", "local"]
SEEDS = [0, 1]


def layers(rounds: int):
    base = {"rounds": rounds, "dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": [32]},
            "partition": {"num_clients": 6, "seed": 0}, "checkpoint": {"every": 1}, "threads": 1}
    return [dict(base, partition=dict(base["partition"], alpha=a)) for a in (0.1, 1.0)]  # the 2 settings


def wait_finished(folders, count, seconds=1800.0):
    deadline = time.monotonic() + seconds
    while sum(len(list((f / "runs").glob("*/verified.json"))) for f in folders) < count:
        if time.monotonic() > deadline:
            raise SystemExit("the jobs did not finish in time")
        time.sleep(0.2)


def log_times(folder: Path):
    """(start, end) wall-clock seconds of each job, from submitit's log lines."""
    out = []
    for log in (folder / "jobs").glob("*_0_log.out"):
        stamps = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                  for m in re.finditer(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\)", log.read_text())]
        if stamps:
            out.append((stamps[0], stamps[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        for i, layer in enumerate(layers(args.rounds)):
            run_comparison(PLUGINS, SEEDS, [layer], tmp / f"jobs2-{i}", jobs=2)
        jobs2 = time.perf_counter() - t0

        local = LauncherSettings("submitit-local", time_min=60)
        folders = [tmp / f"local-{i}" for i in range(2)]
        submitted_at = time.time()
        t0 = time.perf_counter()
        for folder, layer in zip(folders, layers(args.rounds)):
            run_comparison(PLUGINS, SEEDS, [layer], folder, launcher=local)
        submit_s = time.perf_counter() - t0
        wait_finished(folders, 8)
        for folder, layer in zip(folders, layers(args.rounds)):  # the collect
            result = run_comparison(PLUGINS, SEEDS, [layer], folder, launcher=local)
            assert result["complete"] and not result["submitted"], result["not_in_table"]
        launcher = time.perf_counter() - t0
        times = [t for f in folders for t in log_times(f)]
        starts = [s - submitted_at for s, _ in times]
        for a, b in zip(sorted((tmp / "jobs2-0" / "runs").glob("*/summary.json")),
                        sorted((folders[0] / "runs").glob("*/summary.json"))):
            assert json.loads(a.read_text())["final"] == json.loads(b.read_text())["final"], a.parent.name

        # a SIGKILL (no checkpoint() handler runs), then the collect that resubmits: time to the next round
        killed = tmp / "killed"
        long_layer = dict(layers(args.rounds)[0], rounds=100000)
        run_comparison(["fedavg"], [0], [long_layer], killed, launcher=local)
        run = killed / "runs" / "fedavg-seed0"
        while not (run / "checkpoint.pt").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
            time.sleep(0.1)
        pid = read_jobs(killed)["fedavg-seed0"]["pid"]
        task = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        os.kill(task, signal.SIGKILL)
        kill_at = time.perf_counter()
        while True:  # the controller notices and the job ends
            try:
                os.kill(pid, 0)
                os.waitpid(pid, os.WNOHANG)
            except (ProcessLookupError, ChildProcessError):
                break
            time.sleep(0.05)
        run_comparison(["fedavg"], [0], [long_layer], killed, launcher=local)  # the collect resubmits it
        while "resume at round" not in (run / "run.log").read_text():
            time.sleep(0.05)
        resumed = int(re.findall(r"resume at round (\d+)", (run / "run.log").read_text())[-1])

        def last_round() -> int:
            lines = (run / "metrics.jsonl").read_text().splitlines()
            try:
                return int(json.loads(lines[-1])["round"]) if lines else 0
            except ValueError:  # a line being written
                return 0

        while last_round() != resumed + 1:
            time.sleep(0.05)
        kill_to_round = time.perf_counter() - kill_at
        pid = read_jobs(killed)["fedavg-seed0"]["pid"]  # stop the resumed job: its task, then its controller
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    print(f"2 x 2 x 2 table: {PLUGINS} x alpha (0.1, 1.0) x seeds {SEEDS}, digits mlp 64-32-10, 6 clients, "
          f"{args.rounds} rounds a run, one torch thread a run, {os.cpu_count()} CPU(s)")
    print(f"  --jobs 2                     {jobs2:7.1f} s")
    print(f"  --launcher submitit-local    {launcher:7.1f} s  (submit {submit_s:.1f} s, 8 jobs at once, then collect)")
    print(f"  per job: submission to start {statistics.median(starts):5.1f} s median (max {max(starts):.1f} s)")
    print(f"  SIGKILL of a job -> its run's next round after the resubmitting collect: {kill_to_round:.1f} s")
    print("  the numbers of both paths are equal (summary.json finals compared)")


if __name__ == "__main__":
    main()
