"""One FedAvg run with 1 process and with N processes (torch.distributed, gloo, 1 torch thread each).

Prints seconds per round (median of the timed rounds), the speed-up, the share of a round the processes spend in
the exchange of replies (waiting for the slowest process included), and peak memory per process.

    python benchmarks/scaling.py                        # CIFAR-shaped synthetic data, cnn4, 100 clients
    python benchmarks/scaling.py --dataset digits --clients 20 --model mlp
    python benchmarks/scaling.py --fast                 # distributed.exact=false: the all-reduce fast path
"""
from __future__ import annotations

import argparse
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _config(args: argparse.Namespace):
    from pflkit.core import DATASETS
    from pflkit.core.engine.config import resolve

    if args.dataset == "synthetic_cifar":
        from round_time import synthetic_cifar

        DATASETS.register("synthetic_cifar", synthetic_cifar, replace=True)
    return resolve([{
        "dataset": {"name": args.dataset}, "partition": {"name": "iid", "num_clients": args.clients},
        "model": {"name": args.model}, "rounds": args.rounds + 1, "eval": {"every": 10 ** 6}, "device": "cpu",
        "checkpoint": {"every": 0, "final": False}, "threads": 1,
        "train": {"batch_size": 32, "local_epochs": 1, "lr": 0.01}, "distributed": {"exact": not args.fast},
    }], algorithm="fedavg")


def _measure(args: argparse.Namespace, backend: Any, run_dir: Path) -> Dict[str, Any]:
    """Run the rounds; per timed round: wall seconds and seconds spent inside the exchange."""
    from pflkit.core import Simulation

    exchange = [0.0]
    if backend is not None:
        inner_guard = backend._guard  # every collective (gather of replies, all-reduce) goes through it

        def timed(fn, what):  # the exchange, including the wait for the slowest process
            t = time.perf_counter()
            try:
                return inner_guard(fn, what)
            finally:
                exchange[0] += time.perf_counter() - t

        backend._guard = timed
    sim = Simulation(_config(args), run_dir=run_dir, backend=backend, tensorboard=False)
    walls, shares = [], []
    for rnd in range(1, args.rounds + 2):
        exchange[0] = 0.0
        t = time.perf_counter()
        sim.run_round(rnd)
        wall = time.perf_counter() - t
        if rnd > 1:  # the first round warms up
            walls.append(wall)
            shares.append(exchange[0] / wall)
    return {"wall": statistics.median(walls), "share": statistics.median(shares),
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pflkit.core.distributed import DistributedBackend
    from pflkit.core.distributed.worker import Endpoint, init_group

    init_group(Endpoint(rank, world, rank, "127.0.0.1", port))
    run_dir = Path(args.shared_dir) / "dist"
    if rank != 0:  # the other ranks read the partition rank 0 writes
        while not (run_dir / "partition.json").exists():
            time.sleep(0.05)
        time.sleep(0.2)
    res = _measure(args, DistributedBackend(), run_dir)
    box: List[Any] = [None] * world
    dist.all_gather_object(box, res["peak_mib"])
    if rank == 0:
        out.put({**res, "peaks": box})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="synthetic_cifar", choices=["synthetic_cifar", "digits"])
    ap.add_argument("--model", default="cnn4")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fast", action="store_true", help="distributed.exact=false: all-reduce the weighted sums")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as shared:
        args.shared_dir = shared
        serial = _measure(args, None, Path(shared) / "serial")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_worker, args=(args.workers, port, args, queue), nprocs=args.workers, join=True,
                           start_method="spawn")
        dist_res = queue.get()
    print(f"dataset={args.dataset} model={args.model} clients={args.clients} timed rounds={args.rounds} "
          f"(median), {'fast path' if args.fast else 'exact'}, 1 torch thread per process, host {socket.gethostname()}, {torch.get_num_threads()} thread")
    print(f"1 process:  {serial['wall']:8.2f} s/round   peak memory {serial['peak_mib']:.0f} MiB")
    print(f"{args.workers} processes: {dist_res['wall']:8.2f} s/round   speed-up {serial['wall'] / dist_res['wall']:.2f}x"
          f"   exchange share {100 * dist_res['share']:.1f}% of a round (rank 0, waiting included)   peak memory "
          f"per process {', '.join(f'{p:.0f}' for p in dist_res['peaks'])} MiB")


if __name__ == "__main__":
    main()
