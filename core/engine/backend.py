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
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch

from ..common.calltimer import ClientTimedOut, deadline, hard_limit
from ..api.clientstate import ClientStateStore, TrainerPool
from ..api.globalmodel import GLOBAL_EVALUATE, evaluate_global
from ..common.errors import PflError
from ..api.protocol import Message
from ..common.seeding import seed_everything


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


@dataclass
class TrainerFactory:
    """Builds client ``cid``'s trainer: ``trainer_cls(contexts[cid])``. A backend reads ``trainer_cls`` to decide
    between pooled execution (the class declares its state) and one live trainer per client."""

    trainer_cls: type
    contexts: Dict[int, Any]
    pooled: bool = False  # may run pooled (``client.can_pool``): decided by the simulation, which knows the pair

    def __call__(self, cid: int) -> Any:
        return self.trainer_cls(self.contexts[cid])


@dataclass
class StateOptions:
    """Where a backend keeps declared client states: ``budget`` bytes in memory (None: no limit), the rest in
    ``spill_dir``."""

    budget: Optional[int] = None
    spill_dir: Optional[Path] = None


class ExecutionBackend(ABC):
    """Runs client calls and owns every client's state: live trainers, or declared states and a worker pool."""

    client_timeout: Optional[float] = None  # failures.client_timeout: seconds one client call may take
    run_dir: Optional[Path] = None  # named when a hung call stops the process
    batched: Any = None  # a BatchedRunner (core/engine/batched.py): clients.batched chose the batched path

    def use_batched(self, runner: Any) -> None:
        """Called before ``start``: run a round's ``fit`` calls with ``runner`` (clients.batched); a backend that
        cannot batch runs them one at a time, as before."""
        self.batched = runner

    def limit_calls(self, seconds: Optional[float], run_dir: Optional[Path] = None) -> None:
        """Called before ``start``: each client call that runs longer than ``seconds`` fails (None: no limit)."""
        self.client_timeout = None if seconds is None else float(seconds)
        self.run_dir = run_dir

    def assign(self, costs: Mapping[int, float]) -> List[int]:
        """Called before ``start``: the clients whose calls this process runs, the only ones whose data and
        trainers it builds. ``costs``: each client's mini-batches per local epoch (for balancing). A local backend
        runs every client."""
        return sorted(costs)

    @abstractmethod
    def start(self, build_trainer: Callable[[int], Any], client_ids: Iterable[int],
              state_options: Optional[StateOptions] = None) -> None:
        """Prepare the clients' trainers (a ``TrainerFactory`` whose class declares its state may be pooled)."""

    @abstractmethod
    def execute(self, calls: Dict[int, Call], snapshot: bool = False) -> Dict[int, CallResult]:
        """Run each client's call; with ``snapshot`` keep its prior state so ``rollback`` can restore it."""

    def execute_each(self, calls: Dict[int, Call], snapshot: bool = False) -> Iterator[CallResult]:
        """The results of ``execute``, one at a time in client-id order, each as soon as it exists (streaming
        aggregation folds a reply and drops it before the next client runs). A backend that can only run a
        batch yields ``execute``'s results."""
        results = self.execute(calls, snapshot)
        for cid in sorted(results):
            yield results.pop(cid)

    def keep(self, cid: int) -> None:
        """``cid``'s reply was accepted: the snapshot taken for its rollback may go (so a round never holds one
        per client)."""

    @abstractmethod
    def rollback(self, cid: int) -> None:
        """Restore the state saved by the last snapshotting ``execute`` for ``cid``."""

    @abstractmethod
    def get_state(self, cid: int) -> Dict[str, Any]:
        """What a checkpoint stores for ``cid``: its declared state, or its trainer's ``state_dict``."""

    @abstractmethod
    def set_state(self, cid: int, state: Dict[str, Any]) -> None:
        """Restore ``cid``'s state from what ``get_state`` returned (resume from a checkpoint)."""

    def remove_spill_files(self) -> None:
        """The run finished and its checkpoint holds every state: remove the spill files (if this backend has any)."""

    def close(self) -> None:
        """Release what the backend holds (trainers, spill files' handles, processes) at the end of a run."""


class PooledTrainers(Mapping):
    """``backend.trainers`` of a pooled run: ``trainers[cid]`` builds a stand-alone trainer holding the working
    trainer's current values with ``cid``'s declared state on top -- what that client's own trainer would hold on
    the legacy path. For inspection (tests, notebooks); changing it does not change the run."""

    def __init__(self, backend: "SerialBackend") -> None:
        self._backend = backend

    def __getitem__(self, cid: int) -> Any:
        b = self._backend
        if cid not in b.client_ids:
            raise KeyError(cid)
        trainer = b.factory(cid)
        working = b.pool.trainer
        if working is not None:
            trainer.load_state_dict(working.state_dict())
        trainer.load_client_state(b.pool.state_of(cid))
        return trainer

    def __iter__(self):
        return iter(self._backend.client_ids)

    def __len__(self) -> int:
        return len(self._backend.client_ids)


class SerialBackend(ExecutionBackend):
    """Runs every client in this process, one after another (the default).

    A trainer class that declares its state runs pooled: one working trainer for all clients, declared states in
    a ``ClientStateStore``. Any other trainer class gets one live trainer per client (``self.trainers``).
    """

    def __init__(self) -> None:
        self.trainers: Any = {}
        self.contexts: Dict[int, Any] = {}
        self.client_ids: List[int] = []
        self.factory: Optional[TrainerFactory] = None
        self.pool: Optional[TrainerPool] = None
        self._snapshots: Dict[int, Any] = {}

    def start(self, build_trainer: Callable[[int], Any], client_ids: Iterable[int],
              state_options: Optional[StateOptions] = None) -> None:
        self.client_ids = list(client_ids)
        if isinstance(build_trainer, TrainerFactory) and build_trainer.pooled:
            opts = state_options or StateOptions()
            store = ClientStateStore(opts.budget, opts.spill_dir)
            store.clear()  # spill files of an earlier process are stale: the checkpoint holds the states
            self.factory = build_trainer
            self.contexts = build_trainer.contexts
            self.pool = TrainerPool(build_trainer, build_trainer.contexts.__getitem__, store)
            self.trainers = PooledTrainers(self)
            return
        for cid in self.client_ids:
            self.trainers[cid] = build_trainer(cid)

    @property
    def pooled(self) -> bool:
        """Whether clients run through one pooled trainer, their declared states swapped in and out (else: one live
        trainer per client)."""
        return self.pool is not None

    def execute(self, calls: Dict[int, Call], snapshot: bool = False) -> Dict[int, CallResult]:
        return {res.cid: res for res in self._each(calls, snapshot)}

    def execute_each(self, calls: Dict[int, Call], snapshot: bool = False) -> Iterator[CallResult]:
        if type(self).execute is not SerialBackend.execute and type(self).execute_each is SerialBackend.execute_each:
            return ExecutionBackend.execute_each(self, calls, snapshot)  # a subclass hooking ``execute`` sees every call
        return self._each(calls, snapshot)

    def _each(self, calls: Dict[int, Call], snapshot: bool) -> Iterator[CallResult]:
        self._snapshots = {}
        if self.pool is not None:  # the store keeps each replaced state (under its budget) for a rollback
            self.pool.store.track_previous(snapshot)
        if self.batched is not None and self.batched.takes(calls):  # clients.batched: fit calls as one stack
            yield from self.batched.run(self, calls, snapshot)
            return
        if self.batched is not None and self.batched.scores(self, calls):  # ... and evaluations as one pass
            yield from self.batched.evaluate(self, calls)
            return
        for cid in sorted(calls):
            yield self._run_one(cid, calls[cid], snapshot)

    def _run_one(self, cid: int, call: Call, snapshot: bool) -> CallResult:
        """One client's call, isolated: whatever its code raises (but Ctrl-C) is a failed result."""
        # the core's evaluation of the global model is the core's own code on the client's data, never the plugin's
        # handle() (which could answer it with anything); pooled, no state is swapped in for it
        core_eval = call.message.kind == GLOBAL_EVALUATE
        if core_eval:
            ctx = self.contexts[cid] if self.pool is not None else self.trainers[cid].ctx
            trainer = SimpleNamespace(ctx=ctx, handle=lambda message: evaluate_global(ctx, message.payload))
        elif self.pool is not None:
            try:  # a trainer whose load_client_state() raises is a failed client (failures.*)
                trainer = self.pool.bind(cid)
            except (PflError, KeyboardInterrupt):
                raise  # a spill file that cannot be trusted ends the run with one line
            except Exception as exc:
                return CallResult(cid, error=f"swapping its state in: {type(exc).__name__}: {exc}",
                                  detail=traceback.format_exc())
        else:
            trainer = self.trainers[cid]
            if snapshot:
                self._snapshots[cid] = clone_nested(trainer.state_dict())
        seed_everything(call.seed)
        trainer.ctx.round = call.round
        trainer.ctx.generator.manual_seed(call.seed)
        start = time.perf_counter()
        try:
            with deadline(self.client_timeout, lambda: self._hung_message(cid, call.round)):
                reply = trainer.handle(call.message)
            result = CallResult(cid, reply=reply, seconds=time.perf_counter() - start)
        except KeyboardInterrupt:  # Ctrl-C, wherever it is raised, stops the run
            raise
        except ClientTimedOut:
            result = CallResult(cid, error=f"ClientTimeout: did not finish within {self.client_timeout:g} s "
                                           f"(failures.client_timeout)", seconds=time.perf_counter() - start)
        except SystemExit as exc:  # sys.exit() in trainer code is a failed client, not the end of the run
            result = CallResult(cid, error=f"SystemExit: client code called sys.exit({exc.code!r})",
                                detail=traceback.format_exc(), seconds=time.perf_counter() - start)
        except Exception as exc:  # isolation: one client's bug must not end the run
            result = CallResult(cid, error=f"{type(exc).__name__}: {exc}",
                                detail=traceback.format_exc(), seconds=time.perf_counter() - start)
        if self.pool is not None and not core_eval:
            try:  # a full disk while spilling (PflError) ends the run; client_state() raising fails the client
                self.pool.release(cid)
            except (PflError, KeyboardInterrupt):
                raise
            except Exception as exc:  # its stored state stays the one before this call (as after a rollback)
                result = CallResult(cid, error=f"swapping its state out: {type(exc).__name__}: {exc}",
                                    detail=traceback.format_exc(), seconds=result.seconds)
        return result

    # the batched runner's access to a client's trainer (core/engine/batched.py)
    def batched_bind(self, cid: int, snapshot: bool) -> Any:
        """``cid``'s trainer, ready for a call (pooled: its declared state swapped in; live: snapshotted first when
        asked); raises what ``load_client_state`` raises."""
        if self.pool is not None:
            return self.pool.bind(cid)
        trainer = self.trainers[cid]
        if snapshot:
            self._snapshots[cid] = clone_nested(trainer.state_dict())
        return trainer

    def batched_release(self, cid: int) -> Optional[CallResult]:
        """Store ``cid``'s state after a batched step; a failed result when its trainer cannot give it."""
        if self.pool is None:
            return None
        try:
            self.pool.release(cid)
        except (PflError, KeyboardInterrupt):
            raise
        except Exception as exc:
            return CallResult(cid, error=f"swapping its state out: {type(exc).__name__}: {exc}",
                              detail=traceback.format_exc())
        return None

    def keep(self, cid: int) -> None:
        if self.pool is not None:
            self.pool.store.forget_previous(cid)
        else:
            self._snapshots.pop(cid, None)

    def _hung_message(self, cid: int, rnd: int) -> str:
        """The line a process stopped by a hung call prints (calltimer's watchdog thread calls this)."""
        from ..storage.checkpoint import checkpoint_exists

        if self.run_dir is None:
            then = "the run stopped"
        elif checkpoint_exists(self.run_dir):
            then = f"the run stopped; continue from the last checkpoint with: fl run --resume {self.run_dir}"
        else:
            then = f"the run stopped before its first checkpoint; start it again with: fl run --resume {self.run_dir}"
        return (f"client {cid} did not return within {hard_limit(self.client_timeout or 0):g} s in round {rnd} "
                f"(failures.client_timeout {self.client_timeout:g} s; it is stuck where Python cannot interrupt it, "
                f"or it ignored the timeout); {then}")

    def rollback(self, cid: int) -> None:
        if self.pool is not None:
            self.pool.store.restore_previous(cid)
            return
        snap = self._snapshots.get(cid)
        if snap is not None:
            self.trainers[cid].load_state_dict(snap)

    def get_state(self, cid: int) -> Dict[str, Any]:
        if self.pool is not None:
            return self.pool.state_of(cid)
        return self.trainers[cid].state_dict()

    def set_state(self, cid: int, state: Dict[str, Any]) -> None:
        if self.pool is not None:
            self.pool.set_state(cid, state)
        else:
            self.trainers[cid].load_state_dict(state)

    def remove_spill_files(self) -> None:
        """The run finished and its checkpoint holds every declared state: the spill files go."""
        if self.pool is not None:
            self.pool.store.remove_spill_files()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.store.clear()
