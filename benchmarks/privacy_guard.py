"""What the privacy guard costs per reply: vetting a client's full model upload against its fingerprinted rows.

One torch thread; each setting vets the same reply (cnn4's or resnet18's state dict, as FedAvg uploads it) for a
client of 600 + 150 random samples; the median CPU time (time.process_time, so that other load on the machine counts less) of 15 runs after one warm-up. Also reports the time to fingerprint
that client's rows at start-up. Run by hand, not by CI:

    OMP_NUM_THREADS=1 python benchmarks/privacy_guard.py
"""
from __future__ import annotations

import statistics
import time

import torch

from pflkit.core.engine.privacy import PrivacyGuard
from pflkit.models.cnn import cnn4
from pflkit.models.resnet import resnet18

SETTINGS = [  # model, its builder, input shape of one sample
    ("cnn4", cnn4, (1, 28, 28)),
    ("cnn4", cnn4, (3, 32, 32)),
    ("resnet18", resnet18, (3, 32, 32)),
]


def measure(builder, shape, train: int = 600, test: int = 150, repeats: int = 15):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.rand((n, *shape), generator=gen) for n in (train, test)]
    ys = [torch.randint(0, 10, (n,), generator=gen) for n in (train, test)]
    guard = PrivacyGuard()
    start = time.process_time()
    guard.register(0, xs, ys)
    register = time.process_time() - start
    model = builder(shape, 10)
    reply = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "num_samples": train,
             "train_loss": 0.5}
    assert guard.violation(0, reply) is None
    times = []
    for _ in range(repeats):
        start = time.process_time()
        guard.violation(0, reply)
        times.append(time.process_time() - start)
    values = sum(v.numel() for v in reply["params"].values())
    return values, register, statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, CPU {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'model':10s} {'input':12s} {'values':>10s} {'fingerprint':>12s} {'vet':>9s} {'ns/value':>9s}")
    for name, builder, shape in SETTINGS:
        values, register, vet = measure(builder, shape)
        print(f"{name:10s} {'x'.join(map(str, shape)):12s} {values:10,d} {register * 1e3:10.1f}ms "
              f"{vet * 1e3:7.1f}ms {vet / values * 1e9:9.1f}")


if __name__ == "__main__":
    main()
