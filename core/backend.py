"""Execution backends: where client handlers run.

The interface is message-in / reply-out plus state get/set, so a multi-process or multi-GPU backend can be added
without touching plugins: trainers are built in the backend from a picklable factory, and every call is seeded
from (run seed, round, client, call) so results do not depend on which worker ran it or in what order.
"""
from __future__ import annotations

import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional

import torch

from .protocol import Message
from .seeding import seed_everything


@dataclass
class CallResult:
    cid: int
    reply: Optional[Dict[str, Any]] = None
    error: Optional[str] = None  # "ExcType: message"
    detail: str = ""  # traceback text, for the log
    seconds: float = 0.0


@dataclass
class Call:
    message: Message
    seed: int
    round: int


def clone_nested(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_nested(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_nested(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_nested(v) for v in obj)
    return obj


class ExecutionBackend(ABC):
    @abstractmethod
    def start(self, build_trainer: Callable[[int], Any], client_ids: Iterable[int]) -> None:
        """Create one trainer per client."""

    @abstractmethod
    def execute(self, calls: Dict[int, Call], snapshot: bool = False) -> Dict[int, CallResult]:
        """Run each client's call; with ``snapshot`` keep its prior state so ``rollback`` can restore it."""

    @abstractmethod
    def rollback(self, cid: int) -> None:
        """Restore the state saved by the last snapshotting ``execute`` for ``cid``."""

    @abstractmethod
    def get_state(self, cid: int) -> Dict[str, Any]: ...

    @abstractmethod
    def set_state(self, cid: int, state: Dict[str, Any]) -> None: ...

    def close(self) -> None:
        pass


class SerialBackend(ExecutionBackend):
    """Runs every client in this process, one after another (the default)."""

    def __init__(self) -> None:
        self.trainers: Dict[int, Any] = {}
        self.contexts: Dict[int, Any] = {}
        self._snapshots: Dict[int, Dict[str, Any]] = {}

    def start(self, build_trainer: Callable[[int], Any], client_ids: Iterable[int]) -> None:
        for cid in client_ids:
            self.trainers[cid] = build_trainer(cid)

    def execute(self, calls: Dict[int, Call], snapshot: bool = False) -> Dict[int, CallResult]:
        results: Dict[int, CallResult] = {}
        self._snapshots = {}
        for cid in sorted(calls):
            call = calls[cid]
            trainer = self.trainers[cid]
            if snapshot:
                self._snapshots[cid] = clone_nested(trainer.state_dict())
            seed_everything(call.seed)
            trainer.ctx.round = call.round
            trainer.ctx.generator.manual_seed(call.seed)
            start = time.perf_counter()
            try:
                reply = trainer.handle(call.message)
                results[cid] = CallResult(cid, reply=reply, seconds=time.perf_counter() - start)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # isolation: one client's bug must not end the run
                results[cid] = CallResult(cid, error=f"{type(exc).__name__}: {exc}",
                                          detail=traceback.format_exc(), seconds=time.perf_counter() - start)
        return results

    def rollback(self, cid: int) -> None:
        snap = self._snapshots.get(cid)
        if snap is not None:
            self.trainers[cid].load_state_dict(snap)

    def get_state(self, cid: int) -> Dict[str, Any]:
        return self.trainers[cid].state_dict()

    def set_state(self, cid: int, state: Dict[str, Any]) -> None:
        self.trainers[cid].load_state_dict(state)
