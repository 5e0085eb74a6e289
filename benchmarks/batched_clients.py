"""Seconds per round, sequential against batched clients (``clients.batched``), side by side in one process.

For each setting two simulations of the same configuration are built, one with ``clients.batched=off`` and one
with ``clients.batched=on``; after one warm-up round each, their training rounds are run interleaved (sequential
round r, batched round r, sequential round r+1, ...), so both see the same machine load, and the median of each
path's ``round_seconds`` (the server's round: every selected client's local update and the aggregation, no
evaluation) is reported with their ratio, and beside it the median of the round's process CPU seconds (on CPU,
one thread: what the round computed, which a machine shared with other jobs stretches far less than wall time). Peak memory: on CUDA the peak device memory allocated by each path's
rounds; on CPU the process's peak resident memory (VmHWM) after the sequential warm-up round and how much the
batched warm-up round added to it.

Settings: the embedded digits with the 64-100-10 MLP (``model.name=mlp model.hidden=[100]``), 20 and 100 clients,
batch 10, one local epoch, for FedAvg, FedRep, Ditto and FedCP (an algorithm whose trainer has no batched form is
reported as such); ``--fmnist`` adds Fashion-MNIST with cnn4 and 20 clients at ``split.fraction`` (default 0.05)
when its files are present (``--data-root``; ``fl data install fmnist``). Run with one torch thread:

    OMP_NUM_THREADS=1 python benchmarks/batched_clients.py                      # digits, CPU (or --device cuda)
    OMP_NUM_THREADS=1 python benchmarks/batched_clients.py --quick              # FedAvg, 20 clients only
    OMP_NUM_THREADS=1 python benchmarks/batched_clients.py --fmnist --data-root DIR
    OMP_NUM_THREADS=1 python benchmarks/batched_clients.py --micro              # one vmap call vs one client step
    OMP_NUM_THREADS=1 python benchmarks/batched_clients.py --breakdown          # where a FedAvg round's time goes
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(algorithm: str, mode: str, out: Path, sets: List[str]) -> Any:
    from pflkit.core.engine.config import parse_sets, resolve
    from pflkit.core.engine.simulation import Simulation

    cfg = resolve([parse_sets(tuple(sets + [f"clients.batched={mode}", "rounds=1000", "eval.every=1000",
                                            "checkpoint.every=0", "checkpoint.final=false"]))],
                  algorithm=algorithm)
    return Simulation(cfg, run_dir=out / f"{algorithm}-{mode}-{time.monotonic_ns()}", tensorboard=False)


def one_round(sim: Any, rnd: int, cuda: bool) -> float:
    return one_round_cpu(sim, rnd, cuda)[0]


def one_round_cpu(sim: Any, rnd: int, cuda: bool) -> tuple:
    """The round's wall seconds (``round_seconds``) and this process's CPU seconds over it."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    cpu = time.process_time()
    record = sim.run_round(rnd)
    if cuda:
        torch.cuda.synchronize()
    return float(record["round_seconds"]), time.process_time() - cpu


def measure(algorithm: str, sets: List[str], rounds: int, out: Path, cuda: bool) -> Dict[str, Any]:
    import torch

    from pflkit.core.common.errors import ConfigError

    try:
        bat = build(algorithm, "on", out, sets)
    except ConfigError as exc:
        return {"error": str(exc).split(": ", 2)[-1]}
    seq = build(algorithm, "off", out, sets)
    mem: Dict[str, float] = {}
    for name, sim in (("seq", seq), ("bat", bat)):  # warm-up round (first-call costs), and its peak memory
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        one_round(sim, 1, cuda)
        mem[name] = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else peak_rss_mib()
    times: Dict[str, List[float]] = {"seq": [], "bat": []}
    cpu: Dict[str, List[float]] = {"seq": [], "bat": []}
    for rnd in range(2, rounds + 2):  # interleaved: both paths see the same load
        for name, sim in (("seq", seq), ("bat", bat)):
            wall, used = one_round_cpu(sim, rnd, cuda)
            times[name].append(wall)
            cpu[name].append(used)
    s, b = statistics.median(times["seq"]), statistics.median(times["bat"])
    cs, cb = statistics.median(cpu["seq"]), statistics.median(cpu["bat"])
    groups = bat.backend.batched.groups_run
    for sim in (seq, bat):
        sim.logger.close()
        sim.rundir.release()
        sim.backend.close()
    return {"seq": s, "bat": b, "ratio": s / b, "mem": mem, "groups": groups, "cpu_seq": cs, "cpu_bat": cb,
            "cpu_ratio": cs / cb if cb else float("nan")}


def micro(repeats: int = 200) -> None:
    """One vmap(grad) call, and one vmapped forward with one backward pass of the summed losses (the batched path's
    way), over K stacked 64-100-10 MLPs on a batch of 10 each, against one sequential SGD step."""
    import torch
    from torch import nn
    from torch.func import functional_call, grad_and_value, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))

    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    step = vmap(grad_and_value(loss), randomness="error")
    forward = vmap(loss, randomness="error")

    def timed(fn) -> float:
        for _ in range(10):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e3

    x1, y1 = torch.randn(10, 64), torch.randint(0, 10, (10,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def sequential_step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x1), y1).backward()
        opt.step()

    print(f"one sequential client step: {timed(sequential_step):.3f} ms")
    for k in (1, 5, 20, 100):
        params = {n: t.detach().unsqueeze(0).repeat(k, *[1] * t.dim()) for n, t in model.named_parameters()}
        x, y = torch.randn(k, 10, 64), torch.randint(0, 10, (k, 10))

        def forward_then_backward():  # what core/engine/batched.py does: vmap the forward, one backward of the sum
            leaves = {n: t.detach().requires_grad_() for n, t in params.items()}
            torch.autograd.grad(forward(leaves, x, y).sum(), list(leaves.values()))

        print(f"{k:3d} clients: one vmap(grad) call {timed(lambda: step(params, x, y)):.3f} ms; "
              f"vmap forward + one backward {timed(forward_then_backward):.3f} ms")


def breakdown(partition: str, rounds: int = 20) -> None:
    """Where a round's time goes, FedAvg, digits MLP, 20 clients, batch 10, per path: the stacked training
    (``train_stacked``), the reply vetting (``Communicator.vet``: privacy guard, NaN/Inf, layout), the pooled
    client-state swaps (``TrainerPool.bind`` / ``release``) and the rest (receiving, uploading, aggregating). The paths
    run one after the other, ``rounds`` rounds each after a warm-up round, the timers wrapped around those calls."""
    import functools
    from collections import Counter

    from pflkit.core.api import clientstate
    from pflkit.core.engine import batched, comm

    spent: Counter = Counter()

    def timed(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(batched, "train_stacked", "stacked training")
    timed(comm.Communicator, "vet", "reply vetting")
    timed(clientstate.TrainerPool, "bind", "state swap in")
    timed(clientstate.TrainerPool, "release", "state swap out")
    sets = ["device=cpu", "train.batch_size=10", "train.local_epochs=1", f"partition.name={partition}",
            "dataset.name=digits", "model.name=mlp", "model.hidden=[100]", "partition.num_clients=20"]
    print(f"FedAvg, digits mlp 64-100-10, 20 clients, partition {partition}: ms per round (mean of {rounds})")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("off", "on"):
            sim = build("fedavg", mode, Path(tmp), sets)
            one_round(sim, 1, False)
            spent.clear()
            start = time.perf_counter()
            for rnd in range(2, rounds + 2):
                one_round(sim, rnd, False)
            total = (time.perf_counter() - start) / rounds * 1e3
            parts = {k: v / rounds * 1e3 for k, v in spent.items()}
            rest = total - sum(parts.values())
            print(f"  {'batched' if mode == 'on' else 'sequential':10} round {total:6.2f}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in parts.items()) + f", the rest {rest:.2f}")
            sim.logger.close()
            sim.rundir.release()
            sim.backend.close()


def main(argv: Optional[List[str]] = None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per path (after one warm-up round each)")
    ap.add_argument("--quick", action="store_true", help="FedAvg with 20 clients only")
    ap.add_argument("--fmnist", action="store_true", help="also Fashion-MNIST cnn4, 20 clients")
    ap.add_argument("--fraction", type=float, default=0.05, help="split.fraction of the Fashion-MNIST rows")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--algorithms", default="fedavg,fedrep,ditto,fedcp")
    ap.add_argument("--micro", action="store_true", help="only the cost of one vmap call against one client step")
    ap.add_argument("--breakdown", action="store_true", help="only where a FedAvg round's time goes, per path")
    ap.add_argument("--partition", default="dirichlet",
                    help="partition.name (dirichlet: the default, alpha 0.1, very unequal client sizes; iid: equal)")
    args = ap.parse_args(argv)
    if args.micro:
        micro()
        return
    if args.breakdown:
        breakdown(args.partition)
        return
    cuda = args.device.startswith("cuda")
    common = [f"device={args.device}", "train.batch_size=10", "train.local_epochs=1", f"partition.name={args.partition}"]
    settings = []
    algos = ["fedavg"] if args.quick else args.algorithms.split(",")
    for clients in ([20] if args.quick else [20, 100]):
        for algo in algos:
            settings.append((f"digits mlp 64-100-10, {clients} clients", algo,
                             common + ["dataset.name=digits", "model.name=mlp", "model.hidden=[100]",
                                       f"partition.num_clients={clients}"]))
    if args.fmnist:
        root = [f"dataset.root={args.data_root}"] if args.data_root else []
        for algo in algos:
            settings.append((f"fashion_mnist cnn4, 20 clients, split.fraction {args.fraction}", algo,
                             common + root + ["dataset.name=fashion_mnist", "dataset.download=false",
                                              "model.name=cnn4", "partition.num_clients=20",
                                              f"split.fraction={args.fraction}"]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), device {args.device}"
          + (f" ({torch.cuda.get_device_name(args.device)})" if cuda else "")
          + f"; partition {args.partition}; median of {args.rounds} interleaved rounds after one warm-up round each")
    mem_head = "peak MiB seq / bat" if cuda else "peak RSS MiB after seq / +bat"
    print(f"{'setting':48} {'algorithm':9} {'seq s/round':>11} {'batched':>9} {'speed-up':>8}  "
          f"{'CPU s seq':>9} {'batched':>9} {'speed-up':>8}  {mem_head}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, algo, sets in settings:
            try:
                r = measure(algo, sets, args.rounds, Path(tmp), cuda)
            except Exception as exc:  # e.g. Fashion-MNIST files absent: say so, go on
                print(f"{name:48} {algo:9} not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            if "error" in r:
                print(f"{name:48} {algo:9} sequential only: {r['error']}")
                continue
            mem = (f"{r['mem']['seq']:.0f} / {r['mem']['bat']:.0f}" if cuda else
                   f"{r['mem']['seq']:.0f} / +{max(0.0, r['mem']['bat'] - r['mem']['seq']):.0f}")
            print(f"{name:48} {algo:9} {r['seq']:11.4f} {r['bat']:9.4f} {r['ratio']:7.2f}x  "
                  f"{r['cpu_seq']:9.4f} {r['cpu_bat']:9.4f} {r['cpu_ratio']:7.2f}x  {mem}", flush=True)


if __name__ == "__main__":
    main()
