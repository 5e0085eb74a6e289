"""Which rank runs which client: deterministic, balancing SGD steps (largest client first)."""
from __future__ import annotations

import math
from typing import Any, Callable, List, Mapping


def assign_clients(cost: Mapping[int, float], world_size: int) -> List[List[int]]:
    """Greedy longest-processing-time assignment: clients by decreasing cost (ties: smaller id first), each to the
    rank with the least total cost so far (ties: lower rank). Every rank gets a client when there are enough;
    each rank's list is sorted. The same inputs give the same assignment on every process."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    loads = [0.0] * world_size
    ranks: List[List[int]] = [[] for _ in range(world_size)]
    order = sorted(cost, key=lambda cid: (-float(cost[cid]), cid))
    for cid in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        ranks[r].append(cid)
        loads[r] += max(float(cost[cid]), 1e-9)  # a positive cost: an empty rank is always filled first
    return [sorted(r) for r in ranks]


def sgd_steps_per_epoch(num_train: int, batch_size: Any) -> float:
    """A client's mini-batches per local epoch: the cost that dominates a round (local epochs are the same for
    every client)."""
    batch = int(batch_size or 0) or 1
    return float(max(1, math.ceil(num_train / batch)))


def sgd_steps(build_trainer: Callable[[int], Any], cid: int) -> float:
    """``sgd_steps_per_epoch`` from the client's context when the factory exposes one (else 1)."""
    contexts = getattr(build_trainer, "contexts", None)
    ctx = contexts.get(cid) if isinstance(contexts, dict) else None
    if ctx is None:
        return 1.0
    return sgd_steps_per_epoch(ctx.num_train, getattr(ctx.train_cfg, "batch_size", 0))


def describe(assignment: List[List[int]]) -> str:
    """'rank 0: clients 0, 3; rank 1: clients 1, 2' (for messages)."""
    return "; ".join(f"rank {r}: clients {', '.join(map(str, ids)) or 'none'}" for r, ids in enumerate(assignment))

