"""What a FedAvg round costs beyond its arithmetic (issue 40): the framework's round against a bare PyTorch loop.

The setting of issue 40: the embedded digits, an MLP 64-100-10, a fixed Dir(0.1) split, batch 10, lr 0.05, one local
epoch, one torch thread. A round is the fit of every client and the evaluation of every client on its test split.

The bare loop (``bare_round``, below) is the reference every ratio divides by: for each client a new SGD optimizer,
one ``randperm`` per client and epoch, the local steps, then the sample-weighted average of the uploads, then the
global model scored once on every client's test split (per-client correct counts). No seeding, no messages, no checks.

Three sides, timed interleaved in one process (rounds 2..N+1; round 1 is timed on its own):
  sequential  ``Simulation.run_round`` with clients.batched=off (the CPU default)
  batched     ``Simulation.run_round`` with clients.batched=on (one vectorised step for all clients)
  bare        ``bare_round``

    python benchmarks/round_overhead.py                       # 20 clients
    python benchmarks/round_overhead.py --clients 20,100,500  # the issue's three sizes (digits tiled x5, x25: the
                                                              # same samples per client as at 20 clients)
    python benchmarks/round_overhead.py --rounds 10

Targets (issue 40): sequential <= 1.3x bare, batched <= 0.8x bare, round 1 within 1.5x of round 2.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from pflkit.core import DATASETS, DatasetBundle, Simulation  # noqa: E402
from pflkit.core.engine.config import resolve  # noqa: E402

TARGETS = {"sequential": 1.3, "batched": 0.8}
ROUND_ONE_TARGET = 1.5


DIGITS = 1797
PER_CLIENT = 1797 // 20  # the samples a client holds on average in the 20-client setting


def tiled_digits(copies: int):
    """The digits ``copies`` times over (exact copies): 100 or 500 clients then hold as many samples each as 20
    clients of the plain digits do, so a larger run measures more messages, not smaller ones."""
    def load(root=None, download=False) -> DatasetBundle:
        b = DATASETS.get("digits")(root=root, download=download)
        return DatasetBundle(x=b.x.repeat(copies, 1, 1, 1), y=b.y.repeat(copies), task=b.task,
                             input_shape=b.input_shape, class_names=b.class_names, meta=dict(b.meta, copies=copies))
    return load


def config(clients: int, batched: str):
    copies = max(1, -(-clients * PER_CLIENT // DIGITS))
    name = "digits"
    if copies > 1:
        name = f"digits_x{copies}"
        DATASETS.register(name, tiled_digits(copies), replace=True)
    return resolve([{
        "dataset": {"name": name},
        "partition": {"name": "dirichlet", "alpha": 0.1, "num_clients": clients, "seed": 0},
        "model": {"name": "mlp", "hidden": [100]},
        "train": {"batch_size": 10, "lr": 0.05, "local_epochs": 1},
        "clients": {"batched": batched},
        "rounds": 10 ** 6, "eval": {"every": 1}, "checkpoint": {"every": 0, "final": False}, "device": "cpu",
        "threads": 1,
    }], algorithm="fedavg")


def bare_round(sim: Simulation, model: torch.nn.Module, global_state: Dict[str, torch.Tensor],
               generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """FedAvg written by hand on the same client tensors: local SGD, weighted average, every client scored."""
    lr, batch = sim.cfg.train.lr, sim.cfg.train.batch_size
    total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
    weight_sum = 0
    for cid in sim.client_ids:
        x, y = sim.contexts[cid].train.x, sim.contexts[cid].train.y
        model.load_state_dict(global_state)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        perm = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch):
            idx = perm[start:start + batch]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        n = len(y)
        weight_sum += n
        with torch.no_grad():
            for k, v in model.state_dict().items():
                total[k] += v.float() * n
    new_state = {k: (v / weight_sum).to(global_state[k].dtype) for k, v in total.items()}
    model.load_state_dict(new_state)
    model.eval()
    with torch.no_grad():
        for cid in sim.client_ids:  # every client's test split once: per-client correct counts
            test = sim.contexts[cid].test
            if len(test.y):
                (model(test.x).argmax(1) == test.y).sum().item()
    return new_state


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(clients: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # round 1 first, in a process that has built no optimizer yet (what a fresh `fl run` sees)
        seq = Simulation(config(clients, "off"), run_dir=Path(tmp) / "seq", tensorboard=False)
        first = timed(lambda: seq.run_round(1))
        second = timed(lambda: seq.run_round(2))
        bat = Simulation(config(clients, "on"), run_dir=Path(tmp) / "bat", tensorboard=False)
        assert bat.batched_plan.batched, bat.batched_plan
        bat.run_round(1)
        model = seq.build_model()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        generator = torch.Generator().manual_seed(0)
        bare_round(seq, model, state, generator)  # warm-up
        times: Dict[str, List[float]] = {"sequential": [], "batched": [], "bare": []}
        for r in range(3, rounds + 3):
            times["sequential"].append(timed(lambda: seq.run_round(r)))
            times["batched"].append(timed(lambda: bat.run_round(r - 1)))
            times["bare"].append(timed(lambda: bare_round(seq, model, state, generator)))
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = sum(-(-len(seq.contexts[c].train) // 10) for c in seq.client_ids)
    print(f"clients={clients} {seq.cfg.dataset.name} mlp 64-100-10 Dir(0.1) batch 10 lr 0.05 1 epoch, SGD steps/round={steps}, "
          f"torch threads={torch.get_num_threads()}, median of {rounds} rounds")
    for side in ("bare", "sequential", "batched"):
        ratio = med[side] / med["bare"]
        target = f"  (target <= {TARGETS[side]})" if side in TARGETS else "  (the reference)"
        print(f"  {side:<10} {med[side] * 1000:9.1f} ms  {ratio:5.2f}x bare{target}")
    print(f"  round 1 / round 2 (sequential): {first * 1000:.1f} / {second * 1000:.1f} ms = {first / second:.2f}x"
          f"  (target <= {ROUND_ONE_TARGET})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="20", help="comma-separated client counts (e.g. 20,100,500)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per side")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for n in (int(c) for c in args.clients.split(",")):
        measure(n, args.rounds)


if __name__ == "__main__":
    main()
