"""Where the parallel runs of a comparison compute: on a node's GPUs, each worker process pinned to one of them.

``fl compare`` / ``fl reproduce --jobs N`` start N worker processes. When the runs compute on CUDA (``device = cuda``,
or ``auto`` on a machine with a GPU), each worker is pinned to one visible GPU for its whole life through
``CUDA_VISIBLE_DEVICES`` (set before the worker touches CUDA), so a run's ``cuda`` is that GPU; ``runs_per_device``
workers share one GPU (a batched run of a small CNN leaves most of a large GPU idle). Workers are dealt to the GPUs
in turn (two workers on four GPUs use GPUs 0 and 1, not one GPU twice). Each run records its worker's placement in
its ``run_info.json`` (``placement``), and the comparison prints the plan before the first run starts.

The configuration of a run does not name the GPU, so where a run computed never changes whether a finished run is
reused. Runs pinned to a GPU by their own ``device = cuda:i`` keep it: placement applies only to ``cuda`` and ``auto``.
Pinned workers are spawned, never forked: the parent has asked CUDA how many GPUs there are, and a forked child of a
process that initialised CUDA cannot use it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..common.errors import ConfigError
from ..storage.runinfo import ENV_PLACEMENT

PLACED_DEVICES = ("cuda", "auto")


@dataclass(frozen=True)
class Placement:
    """The GPUs the workers are pinned to (``CUDA_VISIBLE_DEVICES`` ids) and how many workers share one."""

    gpus: Tuple[str, ...]
    runs_per_device: int
    workers: int

    def slots(self) -> List[str]:
        """The GPU of each worker, dealt in turn: GPU 0, 1, ..., then a second worker on each."""
        dealt = [gpu for _ in range(self.runs_per_device) for gpu in self.gpus]
        return dealt[: self.workers]

    def describe(self, jobs: int) -> str:
        """The line printed before the runs start."""
        slots = self.slots()
        used = sorted(set(slots), key=self.gpus.index)
        text = (f"placement: {self.workers} worker(s) on GPU(s) {', '.join(used)} (CUDA_VISIBLE_DEVICES ids), "
                f"{self.runs_per_device} run(s) per GPU at most")
        if jobs > self.workers:
            text += (f"; --jobs {jobs} is more than {len(self.gpus)} GPU(s) x {self.runs_per_device}: "
                     f"{self.workers} runs at a time (--runs-per-device packs more runs on each GPU)")
        return text


def visible_gpus() -> List[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` ids: its entries when set, else 0 .. n-1; [] on a
    machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [part.strip() for part in listed.split(",") if part.strip()]
        return ids[:count]
    return [str(i) for i in range(count)]


def plan_placement(devices: Sequence[Any], jobs: int, runs_per_device: Optional[int],
                   gpus: Optional[Callable[[], List[str]]] = None) -> Optional[Placement]:
    """The placement of ``jobs`` workers for runs whose ``device`` settings are ``devices``; None when the runs do
    not compute on GPUs that placement manages (CPU runs, runs pinned with ``cuda:i``, a single job). ``gpus``: the
    visible GPU ids (tests give a stand-in list). A ``runs_per_device`` that cannot apply is a ConfigError."""
    if runs_per_device is not None and (isinstance(runs_per_device, bool) or not isinstance(runs_per_device, int)
                                        or runs_per_device < 1):
        raise ConfigError(f"--runs-per-device must be a positive integer, got {runs_per_device!r}")
    settings = {str(d) for d in devices}
    placed = bool(settings) and settings <= set(PLACED_DEVICES)
    visible = list((gpus or visible_gpus)()) if placed else []
    if "cuda" in settings and placed and not visible:
        raise ConfigError("device = cuda, but this machine has no visible CUDA GPU (torch.cuda.is_available() is "
                          "false); use device = cpu or auto")
    if not visible:
        if runs_per_device is not None:
            where = ", ".join(sorted(settings)) or "none"
            raise ConfigError(f"--runs-per-device applies to runs on CUDA GPUs (device = cuda or auto on a GPU "
                              f"machine); these runs use device {where}" + ("" if placed else
                                                                            " (a cuda:i run keeps its own GPU)"))
        return None
    per = runs_per_device or 1
    workers = min(jobs, len(visible) * per)
    if workers <= 1 and jobs <= 1:
        return None
    return Placement(tuple(visible), per, workers)


def pin_worker(slots: Any) -> None:
    """Worker initializer: take one GPU from the ``slots`` queue and pin this process to it (before CUDA starts)."""
    import torch

    gpu, index, per = slots.get()
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    os.environ[ENV_PLACEMENT] = json.dumps({"gpu": str(gpu), "worker": int(index), "runs_per_device": int(per)})
    torch.set_num_threads(1)
