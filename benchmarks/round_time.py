"""Framework overhead of a FedAvg round versus a bare PyTorch loop doing the same work.

Both sides run, interleaved in one process, the same local SGD steps (same model, same client tensors, same
mini-batch order) for every client and the same sample-weighted averaging. The framework side is a full
``Simulation.run_round`` (message routing, byte accounting, NaN/privacy checks, state snapshots for rollback,
logging) with evaluation switched off. Prints per-round medians and the ratio framework / bare.

    python benchmarks/round_time.py                    # CIFAR-shaped synthetic data, 4-layer CNN
    python benchmarks/round_time.py --dataset digits   # the embedded dataset (tiny rounds: worst case)
    python benchmarks/round_time.py --dataset digits --rounds 7   # as in the README: "median of 7"
    python benchmarks/round_time.py --dataset fmnist --root DIR   # real Fashion-MNIST (fl data install fmnist)

``--rounds N`` sets the timed rounds per side (default 5); the medians printed say "median of N".
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pflkit.core import DATASETS, DatasetBundle, Simulation, classification
from pflkit.core.engine.config import resolve
from pflkit.core.common.seeding import derive_seed, seed_everything
from pflkit.core.api.state import weighted_average
from pflkit.core.api.training import make_optimizer, minibatches, run_sgd


def synthetic_cifar(root=None, download=True, n: int = 10000) -> DatasetBundle:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DatasetBundle(x=x, y=y, task=classification(10), input_shape=(3, 32, 32))


def bare_round(sim: Simulation, global_state, rnd: int, phase: int = 1):
    """What a hand-written FedAvg round does: load global, local SGD, weighted average."""
    model = sim.build_model()
    states, weights = [], []
    for cid in sim.client_ids:
        ctx = sim.contexts[cid]
        seed = derive_seed(sim.cfg.seed, "client", cid, rnd, phase)
        seed_everything(seed)
        ctx.generator.manual_seed(seed)
        model.load_state_dict(global_state)
        model.train()
        opt = make_optimizer(model.parameters(), sim.cfg.train)
        batches = minibatches(ctx.train, sim.cfg.train.batch_size, sim.cfg.train.local_epochs,
                              generator=ctx.generator)
        run_sgd(batches, lambda x, y: ctx.task.loss(model(x), y), opt)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        weights.append(len(ctx.train))
    return weighted_average(states, weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="synthetic_cifar", choices=["synthetic_cifar", "digits", "fmnist"])
    ap.add_argument("--root", default=None, help="dataset.root of a real dataset (default: $PFLKIT_DATA or ./data)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.dataset == "synthetic_cifar":
        DATASETS.register("synthetic_cifar", synthetic_cifar, replace=True)
    cfg = resolve([{
        "dataset": {"name": args.dataset, **({"root": args.root} if args.root else {})}, "partition": {"name": "iid", "num_clients": args.clients},
        "model": {"name": "cnn4"}, "rounds": 10 ** 6, "eval": {"every": 10 ** 6}, "device": args.device,
        "checkpoint": {"every": 0}, "train": {"batch_size": 32, "local_epochs": args.epochs, "lr": 0.01},
    }], algorithm="fedavg")
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, run_dir=Path(tmp) / "run", tensorboard=False)
        global_state = {k: v.clone() for k, v in sim.server.global_state.items()}
        sync = torch.cuda.synchronize if sim.device.type == "cuda" else (lambda: None)
        # warm-up both sides once
        sim.run_round(1)
        bare_round(sim, global_state, 1)
        fw, bare = [], []
        for r in range(2, args.rounds + 2):
            sync(); t = time.perf_counter(); sim.run_round(r); sync(); fw.append(time.perf_counter() - t)
            sync(); t = time.perf_counter(); bare_round(sim, global_state, r); sync(); bare.append(time.perf_counter() - t)
    steps = sum(-(-len(c.train) // cfg.train.batch_size) for c in sim.contexts.values()) * args.epochs
    f, b = statistics.median(fw), statistics.median(bare)
    print(f"dataset={args.dataset} clients={args.clients} model=cnn4 device={args.device} "
          f"SGD steps/round={steps} torch threads={torch.get_num_threads()}")
    print(f"framework round (median of {args.rounds}): {f * 1000:9.1f} ms")
    print(f"bare PyTorch round (median of {args.rounds}): {b * 1000:9.1f} ms")
    print(f"overhead ratio framework / bare: {f / b:.3f}  (target <= 1.15)")


if __name__ == "__main__":
    main()
