#!/usr/bin/env python
"""FedSA's aggregation time against one round of local training: ResNet-18, 20 clients, 1 local epoch.

Runs, in one process and on the same device:
  1. one round of local training: every client (FedAvg's trainer, i.e. pflkit's one training loop) trains one
     epoch from the global model on its own small synthetic, label-skewed image set (3x32x32, 10 classes);
  2. FedSA's ``combine`` on the 20 models those clients uploaded (median of ``--repeats`` runs), and FedAvg's
     weighted mean on the same uploads for reference;
and prints them side by side with FedSA's share of the round.

To stay runnable by hand in a few minutes on 2 CPU cores, the per-client sample count is reduced (default 16,
against ~2,250 CIFAR-10 training samples per client in the paper's 20-client setting), never the model size.
Local training time grows linearly with the sample count while aggregation time does not depend on it, so the
measured share is an upper bound; the script also prints the share extrapolated to the paper's sample count.

    python benchmarks/fedsa_aggregation.py                 # defaults: resnet18, 20 clients, 16 samples each
    python benchmarks/fedsa_aggregation.py --samples 128 --device cuda
    python benchmarks/fedsa_aggregation.py --threads 1     # on a machine shared with other jobs

The default FedSA configuration is timed, plus ``cv_norm=rank`` (about 80% of the entries high-dispersion), the
expensive end of the range.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
from easydict import EasyDict
from torch import nn

from pflkit.core import ClientContext, ServerContext, TensorData, classification
from pflkit.core.api.state import weighted_average
from pflkit_fedavg import FedAvgTrainer
from pflkit_fedsa import FedSAAggregator

PAPER_SAMPLES_PER_CLIENT = 2250  # CIFAR-10: 60,000 images, 75/25 split, 20 clients


def model_factory(name: str, seed: int) -> Tuple[Callable[[], nn.Module], str]:
    """pflkit's ResNet-18 (``pflkit.models``) when installed, else torchvision's ResNet-18 (no weights)."""
    try:
        from pflkit.core import MODELS
        builder = MODELS.get(name)
        source = f"pflkit.models '{name}'"

        def build() -> nn.Module:
            torch.manual_seed(seed)
            return builder(input_shape=(3, 32, 32), num_classes=10)
    except Exception:  # model not available: fall back to a ResNet-18-sized torchvision model
        import torchvision
        source = "torchvision.models.resnet18(num_classes=10) (pflkit model not available)"

        def build() -> nn.Module:
            torch.manual_seed(seed)
            return torchvision.models.resnet18(num_classes=10)
    return build, source


def synthetic_clients(num_clients: int, samples: int, device: torch.device, seed: int) -> List[TensorData]:
    """Label-skewed synthetic images: client k holds classes {2k mod 10, 2k+1 mod 10} (pathological split)."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 3, 32, 32, generator=g)
    out = []
    for k in range(num_clients):
        y = torch.tensor([(2 * k + i % 2) % 10 for i in range(samples)])
        x = prototypes[y] + 0.5 * torch.randn(samples, 3, 32, 32, generator=g)
        out.append(TensorData(x.to(device), y.to(device)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=16, help="training samples per client (reduced from ~2,250)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="aggregation timings (median reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    build, source = model_factory(args.model, args.seed)
    n_params = sum(p.numel() for p in build().parameters())
    print(f"model: {source}, {n_params / 1e6:.2f} M parameters; {args.clients} clients x {args.samples} samples "
          f"(reduced from ~{PAPER_SAMPLES_PER_CLIENT} per client in the paper), batch {args.batch_size}, "
          f"1 local epoch; device {device}, {torch.get_num_threads()} CPU threads")

    train_cfg = EasyDict(optimizer="sgd", lr=0.05, momentum=0.0, weight_decay=0.0, batch_size=args.batch_size,
                         local_epochs=1, eval_batch_size=256)
    data = synthetic_clients(args.clients, args.samples, device, args.seed)
    server_hp = EasyDict({name: p.default for name, p in FedSAAggregator.params.items()})
    server = FedSAAggregator(ServerContext(
        hp=server_hp, cfg=None, task=classification(10), num_clients=args.clients, build_model=build,
        shared_keys=None, device=device, seed=args.seed, logger=None, rng=np.random.default_rng(args.seed)))
    global_state = server.global_state

    # 1. one round of local training (serial, as pflkit's serial backend runs it)
    states: List[Dict[str, torch.Tensor]] = []
    weights: List[float] = []
    trainer = None
    train_seconds = train_cpu = 0.0
    for k in range(args.clients):
        ctx = ClientContext(cid=k, train=data[k], test=data[k], task=classification(10), device=device,
                            hp=EasyDict(bn_stats="shared"), train_cfg=train_cfg, build_model=build,
                            num_clients=args.clients, seed=args.seed)
        ctx.generator.manual_seed(args.seed * 1000 + k)
        trainer = FedAvgTrainer(ctx)  # model construction is set-up, not training: kept out of the timing
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        reply = trainer.on_fit({"params": global_state})
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds += time.perf_counter() - start
        train_cpu += time.process_time() - cpu_start
        states.append(reply["params"])
        weights.append(float(reply["num_samples"]))
        del trainer

    # 2. aggregation of the same uploads
    def timed(fn) -> Tuple[float, float]:
        """Median wall-clock and median CPU (process) seconds of ``--repeats`` calls."""
        walls, cpus = [], []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu_start)
        return statistics.median(walls), statistics.median(cpus)

    cids = list(range(args.clients))
    fedsa_seconds, fedsa_cpu = timed(lambda: server.combine(states, weights, cids))
    report = server.last_report
    fedavg_seconds, fedavg_cpu = timed(lambda: weighted_average(states, weights))
    # the costly end of the range: cv_norm=rank classes ~(1 - cv_t) = 80% of the entries as high-dispersion
    server.ctx.hp.cv_norm = "rank"
    rank_seconds, rank_cpu = timed(lambda: server.combine(states, weights, cids))
    rank_report = server.last_report

    scale = PAPER_SAMPLES_PER_CLIENT / args.samples  # local training time is linear in the sample count
    print()
    print("CPU time (process time over all threads) is the robust figure on a shared machine; wall-clock time")
    print("also counts waiting for cores that other processes hold.")
    print(f"{'':<52}{'wall [s]':>10}{'CPU [s]':>10}")
    rows = [(f"local training, one round ({args.clients} clients x 1 epoch)", train_seconds, train_cpu),
            (f"FedSA aggregation (combine), median of {args.repeats}", fedsa_seconds, fedsa_cpu),
            ("FedSA with cv_norm=rank (~80% high-dispersion)", rank_seconds, rank_cpu),
            ("FedAvg aggregation (weighted mean), for reference", fedavg_seconds, fedavg_cpu)]
    for label, wall, cpu in rows:
        print(f"{label:<52}{wall:>10.3f}{cpu:>10.3f}")
    print(f"{'FedSA aggregation / local training':<52}{fedsa_seconds / train_seconds:>10.1%}"
          f"{fedsa_cpu / train_cpu:>10.1%}")
    print(f"{'FedSA share of the round: agg / (train + agg)':<52}"
          f"{fedsa_seconds / (train_seconds + fedsa_seconds):>10.1%}{fedsa_cpu / (train_cpu + fedsa_cpu):>10.1%}"
          f"   (target < 10%)")
    print(f"{'  same, extrapolated to ' + str(PAPER_SAMPLES_PER_CLIENT) + ' samples/client':<52}"
          f"{fedsa_seconds / (scale * train_seconds + fedsa_seconds):>10.2%}"
          f"{fedsa_cpu / (scale * train_cpu + fedsa_cpu):>10.2%}")
    print(f"{'  cv_norm=rank: share of the round':<52}"
          f"{rank_seconds / (train_seconds + rank_seconds):>10.1%}{rank_cpu / (train_cpu + rank_cpu):>10.1%}")
    for label, rep in (("FedSA (default, cv_norm=minmax)", report), ("FedSA (cv_norm=rank)", rank_report)):
        n_clusters = len(rep.clustering.clusters) if rep.clustering else 0
        n_uncl = len(rep.clustering.unclustered) if rep.clustering else 0
        print(f"{label}: {rep.num_high / max(1, rep.num_entries):.2%} of {rep.num_entries} entries "
              f"high-dispersion, {n_clusters} Macro-Classes, {n_uncl} unclustered clients")


if __name__ == "__main__":
    main()
