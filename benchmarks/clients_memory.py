"""Memory and time per round as the number of clients grows (declared client state, pooled working modules).

Every setting runs in a fresh subprocess with one torch thread, so its peak resident memory (VmHWM) is its own.
Clients are tiny (4 training and 2 test samples of CIFAR-shaped synthetic data, batch 4: one local step per
round); 10 clients train per round (join ratio 10 / clients) and every client is evaluated every round. The last
two rows let all 1,000 Ditto clients train every round, so that every client holds a personal model of its own
(3.35 MiB each), once without a limit and once with ``clients.state_memory=1GiB``. It measures memory and
framework overhead, not accuracy. Run by hand (several minutes), not by CI:

    OMP_NUM_THREADS=1 python benchmarks/clients_memory.py            # the full table
    OMP_NUM_THREADS=1 python benchmarks/clients_memory.py --quick    # cnn4 with 10 and 100 clients only
    OMP_NUM_THREADS=1 python benchmarks/clients_memory.py --legacy   # also one trainer per client (the old
                                                                     # way; cnn4 up to 100, resnet18 10 clients)
    OMP_NUM_THREADS=1 python benchmarks/clients_memory.py --breakdown 1000   # what client data costs, by part
    OMP_NUM_THREADS=1 python benchmarks/clients_memory.py --server-store     # 1,000 FedAMP clients: the server
                                                                     # store with and without server.state_memory
    OMP_NUM_THREADS=1 python benchmarks/clients_memory.py --streaming        # every client trains: uploads folded
                                                                     # as they arrive vs all held; --quick:
                                                                     # without the 1,000-client Ditto rows

Columns: clients trained per round, peak RSS, its ratio to the same algorithm and model with 10 clients,
median seconds per round after the first, the bytes of declared state per client, the bytes actually kept for
clients at the end (memory / spilled to disk), and the final checkpoint's size. The "numbers" column compares a
legacy or budget row's metrics.jsonl with the pooled, unlimited run of the same setting, bit for bit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

TRAIN, TEST = 4, 2


def _to_float(x):
    return x.float().div_(255.0)


def synthetic_cifar_uint8(root=None, download=True, n: int = 60):
    """CIFAR-shaped (3x32x32, 10 classes) random images stored as uint8, made float per batch."""
    import torch

    from pflkit.core import DatasetBundle, classification
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (n,), generator=g)
    return DatasetBundle(x=x, y=y, task=classification(10), input_shape=(3, 32, 32), transform=_to_float)


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from pflkit.core import DATASETS, Simulation
    from pflkit.core.engine.backend import SerialBackend
    from pflkit.core.api.clientstate import state_nbytes
    from pflkit.core.engine.config import resolve

    torch.set_num_threads(1)
    n = spec["clients"]
    DATASETS.register("synthetic_cifar_u8", lambda root=None, download=True: synthetic_cifar_uint8(
        n=n * (TRAIN + TEST)), replace=True)
    model = {"name": spec["model"]}
    over: Dict[str, Any] = {
        "dataset": {"name": "synthetic_cifar_u8"}, "partition": {"name": "iid", "num_clients": n},
        "split": {"train_size": TRAIN, "test_size": TEST}, "model": model, "rounds": spec["rounds"],
        "device": "cpu", "participation": {"join_ratio": min(1.0, spec.get("train", 10) / n)},
        "checkpoint": {"every": 0},
        "train": {"batch_size": TRAIN, "local_epochs": 1, "lr": 0.01}, "eval": {"every": 1},
    }
    if spec.get("budget"):
        over["clients"] = {"state_memory": spec["budget"]}
    if spec.get("server_budget"):
        over["server"] = {"state_memory": spec["server_budget"]}
    if spec.get("mlp17"):  # the 17 MB MLP (64-2048-2048-10) on the embedded digits, iid: what streaming is for
        over.update({"dataset": {"name": "digits"}, "split": {"test_ratio": 0.25},
                     "model": {"name": "mlp", "hidden": [2048, 2048]},
                     "train": {"batch_size": 32, "local_epochs": 1, "lr": 0.05}})
    cfg = resolve([over], algorithm=spec["algorithm"])

    backend = None
    if spec.get("legacy"):
        class LegacyBackend(SerialBackend):  # one live trainer per client, as before declared state
            def start(self, build_trainer, client_ids, state_options=None):
                super().start(lambda cid: build_trainer(cid), client_ids)
        backend = LegacyBackend()

    with tempfile.TemporaryDirectory(dir=spec.get("tmp")) as tmp:
        run_dir = Path(tmp) / "run"
        sim = Simulation(cfg, run_dir=run_dir, tensorboard=False, backend=backend)
        if spec.get("all_replies"):  # before streaming aggregation: every upload held until the aggregator combines
            sim.comm.mean_fields = ()
        marks = [time.perf_counter()]
        result = sim.run(on_round=lambda record: marks.append(time.perf_counter()))
        rounds = [b - a for a, b in zip(marks, marks[1:])]
        pool = getattr(sim.backend, "pool", None)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        numbers = [{k: v for k, v in json.loads(ln).items() if "seconds" not in k} for ln in lines]
        out = {
            **spec,
            "peak_rss": peak_rss(),
            "round_seconds": statistics.median(rounds[1:]) if len(rounds) > 1 else rounds[0],
            "declared_bytes": state_nbytes(pool.initial) if pool is not None else None,
            "kept_memory": pool.store.memory_bytes if pool is not None else None,
            "kept_disk": pool.store.spilled * state_nbytes(pool.initial) if pool is not None else None,
            "checkpoint_bytes": result["checkpoint_bytes"],
            # the server's per-client stores (core.api.serverstore): tensor bytes in memory, spill files on disk
            "server_memory": sim.server_stores.memory_bytes,
            "server_entries": sum(len(sim.server_stores.store(n)) for n in sim.server_stores.names()),
            "server_disk": sum(p.stat().st_size for p in (run_dir / "server_state").rglob("*.pt")),
            "final": result["final"]["uniform"],
            "numbers_sha": hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest(),
        }
    return out


def breakdown(n: int) -> None:
    """Resident memory added by each per-client part of a run's set-up, for ``n`` clients of this benchmark."""
    import torch

    from pflkit.core import DATASETS
    from pflkit.core.engine.config import resolve
    from pflkit.core.data.data import build_federated_data
    from pflkit.core.engine.privacy import PrivacyGuard

    torch.set_num_threads(1)
    rss = lambda: int(next(ln for ln in Path("/proc/self/status").read_text().splitlines()
                           if ln.startswith("VmRSS:")).split()[1]) * 1024
    DATASETS.register("synthetic_cifar_u8", lambda root=None, download=True: synthetic_cifar_uint8(
        n=n * (TRAIN + TEST)), replace=True)
    cfg = resolve([{"dataset": {"name": "synthetic_cifar_u8"}, "partition": {"name": "iid", "num_clients": n},
                    "split": {"train_size": TRAIN, "test_size": TEST}, "model": {"name": "cnn4"},
                    "device": "cpu"}], algorithm="fedavg")
    steps = [("before", rss())]
    data = build_federated_data(cfg)
    steps.append(("dataset + partition", rss()))
    tensors = [data.client_tensors(c, torch.device("cpu")) for c in range(n)]
    steps.append(("clients' tensors", rss()))
    guard = PrivacyGuard()
    for c, (train, test) in enumerate(tensors):
        guard.register(c, [train.x, test.x], [train.y, test.y])
    steps.append(("privacy guard fingerprints", rss()))
    print(f"{n} clients, {TRAIN} + {TEST} uint8 CIFAR-shaped samples each: resident memory added by")
    for (_, a), (name, b) in zip(steps, steps[1:]):
        print(f"  {name:28s} {fmt_bytes(b - a)}")


def settings(quick: bool, legacy: bool, rounds: int) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    grid = [("cnn4", (10, 100)), ] if quick else [("cnn4", (10, 100, 1000)), ("resnet18", (10, 100))]
    for model, counts in grid:
        for algorithm in ("fedavg", "fedper", "ditto"):
            for n in counts:
                out.append({"model": model, "algorithm": algorithm, "clients": n, "rounds": rounds})
                if legacy and (n <= 100 if model == "cnn4" else n <= 10):
                    out.append({"model": model, "algorithm": algorithm, "clients": n, "rounds": rounds,
                                "legacy": True})
    if not quick:  # every one of 1,000 Ditto clients trains: 3.35 GiB of personal models, then a 1 GiB budget
        everyone = {"model": "cnn4", "algorithm": "ditto", "clients": 1000, "rounds": 2, "train": 1000}
        out += [everyone, {**everyone, "budget": "1GiB"}]
    return out


def server_store_settings(rounds: int) -> List[Dict[str, Any]]:
    """1,000 FedAMP clients, 100 trained per round: the server keeps every uploader's latest cnn4 model (3.35 MiB
    each), without a limit, with ``server.state_memory=256MiB``, and with that and ``clients.state_memory=256MiB``
    (the clients' personal models are the other copy of every model)."""
    amp = {"model": "cnn4", "algorithm": "fedamp", "clients": 1000, "rounds": rounds, "train": 100}
    return [amp, {**amp, "server_budget": "256MiB"}, {**amp, "server_budget": "256MiB", "budget": "256MiB"}]


def streaming_settings(rounds: int, quick: bool = False) -> List[Dict[str, Any]]:
    """FedAvg with the 17 MB MLP, every client training every round (10 and 100 clients), and the 1,000 all-train
    Ditto clients (cnn4): each with the round's uploads folded as they arrive (streaming) and all held at once."""
    out: List[Dict[str, Any]] = []
    for n in (10, 100):
        for all_replies in (False, True):
            out.append({"model": "mlp 64-2048-2048-10", "algorithm": "fedavg", "clients": n, "rounds": rounds,
                        "train": n, "mlp17": True, "all_replies": all_replies})
    if quick:  # --streaming --quick: the FedAvg rows only
        return out
    everyone = {"model": "cnn4", "algorithm": "ditto", "clients": 1000, "rounds": 2, "train": 1000}
    return out + [everyone, {**everyone, "all_replies": True}]


def streaming_table(rows: List[Dict[str, Any]]) -> str:
    setting = lambda r: (r["model"], r["algorithm"])
    base = {setting(r): r["peak_rss"] for r in rows if r["clients"] == 10 and not r.get("all_replies")}
    whole = {(setting(r), r["clients"]): r for r in rows if r.get("all_replies")}
    head = ["model", "algorithm", "clients (all train)", "aggregation", "peak RSS", "x 10 clients streamed",
            "s/round", "s/round vs all replies", "final accuracy"]
    body = []
    for r in rows:
        b, w = base.get(setting(r)), whole.get((setting(r), r["clients"]))
        body.append([r["model"], r["algorithm"], str(r["clients"]),
                     "all replies" if r.get("all_replies") else "streaming", fmt_bytes(r["peak_rss"]),
                     f"{r['peak_rss'] / b:.2f}" if b else "-", f"{r['round_seconds']:.2f}",
                     "-" if r.get("all_replies") or not w else f"{r['round_seconds'] / w['round_seconds']:.2f}",
                     f"{100 * r['final']:.2f}%"])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def server_table(rows: List[Dict[str, Any]]) -> str:
    ref = {r["numbers_sha"] for r in rows if not r.get("server_budget") and not r.get("budget")}
    head = ["model", "algorithm", "clients", "trained/round", "server.state_memory", "clients.state_memory",
            "peak RSS", "s/round",
            "server entries", "server kept (memory / disk)", "checkpoint", "numbers"]
    body = [[r["model"], r["algorithm"], str(r["clients"]), str(r.get("train", 10)), r.get("server_budget") or "none",
             r.get("budget") or "none", fmt_bytes(r["peak_rss"]), f"{r['round_seconds']:.2f}", str(r["server_entries"]),
             f"{fmt_bytes(r['server_memory'])} / {fmt_bytes(r['server_disk'])}", fmt_bytes(r["checkpoint_bytes"]),
             "-" if not (r.get("server_budget") or r.get("budget")) else
             ("same" if r["numbers_sha"] in ref else "DIFFERENT")]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b} B"


def table(rows: List[Dict[str, Any]]) -> str:
    base = {(r["model"], r["algorithm"], bool(r.get("legacy"))): r["peak_rss"] for r in rows
            if r["clients"] == 10 and not r.get("budget")}
    setting = lambda r: (r["model"], r["algorithm"], r["clients"], r.get("train", 10))
    ref = {setting(r): r["numbers_sha"] for r in rows if not r.get("budget") and not r.get("legacy")}
    head = ["model", "algorithm", "clients", "trained/round", "mode", "peak RSS", "x 10 clients", "s/round",
            "declared/client", "kept (memory / disk)", "checkpoint", "numbers"]
    body = []
    for r in rows:
        mode = "legacy" if r.get("legacy") else (f"budget {r['budget']}" if r.get("budget") else "pooled")
        b = base.get((r["model"], r["algorithm"], bool(r.get("legacy"))))
        same = ref.get(setting(r))
        numbers = "-" if mode == "pooled" else ("same" if same == r["numbers_sha"] else "DIFFERENT")
        body.append([r["model"], r["algorithm"], str(r["clients"]), str(min(r.get("train", 10), r["clients"])),
                     mode, fmt_bytes(r["peak_rss"]),
                     f"{r['peak_rss'] / b:.2f}" if b else "-", f"{r['round_seconds']:.2f}",
                     fmt_bytes(r["declared_bytes"]),
                     "-" if r["kept_memory"] is None else f"{fmt_bytes(r['kept_memory'])} / {fmt_bytes(r['kept_disk'])}",
                     fmt_bytes(r["checkpoint_bytes"]), numbers])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="cnn4 with 10 and 100 clients only")
    ap.add_argument("--legacy", action="store_true", help="also run one trainer per client (cnn4: up to 100 "
                                                          "clients, resnet18: 10)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    ap.add_argument("--breakdown", type=int, metavar="N", help="only print what N clients' data cost, by part")
    ap.add_argument("--server-store", action="store_true", help="only the server-store rows: 1,000 FedAMP clients "
                                                                    "with and without server.state_memory")
    ap.add_argument("--streaming", action="store_true", help="only the streaming-aggregation rows: FedAvg with a "
                                                                 "17 MB MLP, 10 and 100 clients all training, and "
                                                                 "1,000 all-train Ditto clients, streamed and not")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.breakdown:
        breakdown(args.breakdown)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    rows = []
    if args.streaming:
        specs = streaming_settings(args.rounds, args.quick)
    elif args.server_store:
        specs = server_store_settings(args.rounds)
    else:
        specs = settings(args.quick, args.legacy, args.rounds)
    for spec in specs:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"setting {spec} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  {spec} done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    if args.streaming:
        print(f"torch threads per process: 1; FedAvg rows: the embedded digits, iid, every client trains every round "
              f"(batch 32, one epoch), {args.rounds} rounds; Ditto rows: {TRAIN} train / {TEST} test CIFAR-shaped "
              f"samples per client, 2 rounds; all clients evaluated every round")
    else:
        print(f"torch threads per process: 1; {TRAIN} train / {TEST} test samples per client, one local step; all "
              f"clients evaluated every round; {args.rounds} rounds (the all-train rows: 2)")
    print(streaming_table(rows) if args.streaming else server_table(rows) if args.server_store else table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
