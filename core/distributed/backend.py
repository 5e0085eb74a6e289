"""``DistributedBackend``: one process per rank, each running its own clients through an inner local backend.

Every rank runs the whole simulation loop (server strategy included) on the same inputs, so every call reaches
``execute_vetted`` on every rank with the same messages. Each rank executes and vets the calls of the clients it
owns with its inner backend (built like the simulation's default one) and all ranks exchange the accepted results
and every verdict, merged in canonical client order: every rank then holds exactly what the serial backend would have returned, and the replicated server
computes exactly the serial run's aggregates. Client state never leaves its owner, except to rank 0 when a
checkpoint is written (``get_state`` is a collective for that reason).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..engine.backend import Call, CallResult, ExecutionBackend, SerialBackend, StateOptions
from ..common.errors import ConfigError, PflError
from ..api.protocol import payload_nbytes
from ..common.seeding import rng_state, set_rng_state
from ..api.fold import MeanFold, unflatten
from ..api.state import WeightedMean
from ..engine.assign import assign_clients, describe, sgd_steps


class WorkerLost(PflError):
    """A collective failed: another process of the run died, or did not answer within the timeout."""


class _OnDevice:
    """A tensor that lived on an accelerator, sent as a CPU copy and put back on the receiver's own device
    (a pickled CUDA tensor would otherwise be rebuilt on the sender's GPU index)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _rebuild(obj: Any, items: List[Any]) -> Any:
    """``obj`` with new children ``items``; ``obj`` itself when none changed (a state_dict keeps its metadata)."""
    old = list(obj.items()) if isinstance(obj, dict) else list(obj)
    if len(old) == len(items) and all(a is b or (isinstance(a, tuple) and a[0] is b[0] and a[1] is b[1])
                                      for a, b in zip(old, items)):
        return obj
    try:
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuple, or dict/list/tuple
    except TypeError:
        return dict(items) if isinstance(obj, dict) else type(obj).__mro__[-2](items)


def _to_portable(obj: Any) -> Any:
    """``obj`` made safe to pickle and to rebuild identically elsewhere: accelerator tensors travel as CPU copies.
    Only vetted replies (plain data: the privacy check refuses anything else) and client states are sent."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else _OnDevice(obj.detach().cpu())
    if isinstance(obj, dict):
        return _rebuild(obj, [(k, _to_portable(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [_to_portable(v) for v in obj])
    return obj


def _from_portable(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, _OnDevice):
        return obj.tensor.to(device)
    if isinstance(obj, dict):
        return _rebuild(obj, [(k, _from_portable(v, device)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [_from_portable(v, device) for v in obj])
    return obj


def device_collective_backend(requested: str, device: torch.device, nccl_available: Optional[bool] = None) -> str:
    """The torch.distributed backend for the all-reduce of device tensors (``distributed.backend``): "nccl" or
    "gloo". ``auto`` picks NCCL when the run computes on a CUDA GPU and this torch has NCCL, else gloo; ``nccl``
    without both is bad input (ConfigError)."""
    nccl = dist.is_nccl_available() if nccl_available is None else nccl_available
    on_gpu = torch.device(device).type == "cuda"
    if requested == "auto":
        return "nccl" if on_gpu and nccl else "gloo"
    if requested == "nccl":
        if not on_gpu:
            raise ConfigError(f"distributed.backend=nccl needs CUDA GPUs, but the run computes on {device} "
                              f"(no GPU found, or device=cpu); use distributed.backend=gloo or auto")
        if not nccl:
            raise ConfigError("distributed.backend=nccl: this torch build has no NCCL; use distributed.backend=gloo "
                              "or auto")
    return requested


class DistributedBackend(ExecutionBackend):
    """Runs this rank's clients with an inner local backend and shares every result with every rank.

    ``group``: the process group of the run (an initialised default group when None). ``make_inner`` builds the
    local backend (``SerialBackend`` by default, as the simulation's default). ``device``: where tensors received
    from other ranks are placed (CPU tensors stay where they are). Only rank 0 writes the run directory
    (``is_writer``)."""

    def __init__(self, group: Any = None, make_inner: Callable[[], ExecutionBackend] = SerialBackend,
                 device: Optional[torch.device] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedBackend needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.is_writer = self.rank == 0
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._make_inner = make_inner
        self.inner: Optional[ExecutionBackend] = None
        self.assignment: List[List[int]] = []
        self.owner: Dict[int, int] = {}
        self._contexts: Dict[int, Any] = {}  # every client's context (data), when the trainer factory has them
        self.phase = "start-up"  # named in the message when a collective fails
        self.rank_seconds = [0.0] * self.world_size  # client seconds per rank since the last take_rank_seconds
        # the fast path's all-reduce of device tensors: this group (NCCL on GPUs) when set, else ``group`` on the CPU
        self.device_group: Any = None

    # -- ExecutionBackend ------------------------------------------------------------------------------------
    def assign(self, costs: Mapping[int, float]) -> List[int]:
        """Assigns every client to a rank (no collective: every rank computes the same assignment from the same
        costs) and returns this rank's clients, the only ones whose data and trainers this process builds."""
        ids = list(costs)
        if self.world_size > len(ids):
            raise ConfigError(f"workers: {self.world_size} processes for {len(ids)} clients; use at most "
                              f"{len(ids)} (each process runs at least one client)")
        self.assignment = assign_clients(costs, self.world_size)
        self.owner = {cid: r for r, owned in enumerate(self.assignment) for cid in owned}
        return self.owned

    def start(self, build_trainer: Callable[[int], Any], client_ids: Iterable[int],
              state_options: Optional[StateOptions] = None) -> None:
        ids = list(client_ids)
        if not self.assignment:  # a caller that did not assign first: the costs from the factory's contexts
            self.assign({cid: sgd_steps(build_trainer, cid) for cid in ids})
        opts = state_options or StateOptions()
        if opts.spill_dir is not None:  # each rank spills its own clients' states, in its own folder
            opts = StateOptions(opts.budget, Path(opts.spill_dir) / f"rank{self.rank}")
        contexts = getattr(build_trainer, "contexts", None) or {}
        if contexts:  # tensors from other ranks go where this rank's clients compute (its own GPU, say)
            self.device = torch.device(next(iter(contexts.values())).device)
        self.inner = self._make_inner()
        if self.batched is not None:  # clients.batched: each rank batches its own clients
            self.inner.use_batched(self.batched)
        self.inner.limit_calls(self.client_timeout, self.run_dir)  # each rank times its own clients' calls
        self.inner.start(build_trainer, self.owned, opts)  # builds this rank's trainers only

    @property
    def owned(self) -> List[int]:
        """The client ids this rank runs."""
        return list(self.assignment[self.rank]) if self.assignment else []

    @property
    def trainers(self) -> Any:
        """This rank's trainers (the inner backend's), for inspection."""
        return getattr(self.inner, "trainers", {})

    def execute(self, calls: Dict[int, Call], snapshot: bool = False) -> Dict[int, CallResult]:
        """Every reply, unvetted, on every rank (the core's communicator calls ``execute_vetted`` instead; a reply
        here must be picklable)."""
        return self.execute_vetted(calls, snapshot, lambda cid, reply: None)[0]

    def execute_vetted(self, calls: Dict[int, Call], snapshot: bool, vet: Callable[[int, Any], Optional[str]],
                       fields: Sequence[str] = (), weight_of: Optional[Callable[[Dict[str, Any]], float]] = None,
                       layouts: Optional[Dict[str, Any]] = None
                       ) -> Tuple[Dict[int, CallResult], Dict[int, Tuple[Optional[str], int]]]:
        """Runs this rank's clients, vets their replies here and gives every rank every accepted reply.

        Each rank vets its own clients' replies (``vet``: the communicator's privacy and NaN/Inf check): only the
        owner needs the client's data for that, so a rank builds only its own clients' data. A refused reply never
        leaves its owner; its verdict does, so every rank rejects (and rolls back) the same clients. ``fields``:
        reply fields of which the aggregator needs only the ``num_samples``-weighted mean (the fast path): each
        rank sums ``weight * field`` (weight: ``weight_of(reply)``, the aggregator's ``reply_weight``; default
        ``num_samples``) of its accepted replies as one flat float64 vector per field and the ranks
        all-reduce it with the weights, so only the rest of each reply (loss, metrics, num_samples) travels.
        ``layouts``: field -> the keys, shapes and dtypes the server declares for it (``ServerAggregator.reply_layout``,
        the same on every rank): each owner folds only replies that match it, so a malformed reply is refused on its
        own whatever its position, and every rank's sums share one layout.
        Returns the results (accepted replies holding one ``WeightedMean`` per reduced field) and cid -> (refusal
        reason or None, bytes of the whole reply)."""
        if not calls:
            return {}, {}
        mine = {cid: call for cid, call in calls.items() if self.owner[cid] == self.rank}
        fold = MeanFold(fields, weight_of, layouts)  # this rank's clients, folded as each reply arrives (core.api.fold)
        results: Dict[int, CallResult] = {}
        sent: Dict[int, Any] = {}
        for res in (self.inner.execute_each(mine, snapshot) if mine else ()):
            cid = res.cid
            verdict, nbytes, reply, reduced = None, 0, res.reply, []
            if res.error is None:
                verdict = vet(cid, reply)
                if verdict is None:
                    nbytes = payload_nbytes(reply)
                    reduced = [f for f in fields if isinstance(reply, dict) and f in reply]
                    reply, verdict = fold.add(cid, reply)  # a reply that cannot be folded is refused
                if verdict is not None:
                    reply, reduced = None, []  # stays here: it may hold anything (raw data, unpicklable objects)
                else:
                    self.inner.keep(cid)  # accepted: its rollback snapshot may go
            # this rank's own clients keep their own reply objects (the serial backend's replies), folded fields out
            results[cid] = CallResult(cid, reply, res.error, res.detail, res.seconds)
            sent[cid] = (self._portable_result(results[cid]), verdict, nbytes, reduced)
        last = max(calls)
        rng = rng_state() if self.owner[last] == self.rank else None
        firsts = {f: (ff.first_cid, ff.layout, _to_portable(ff.ints)) for f, ff in fold.folds.items()
                  if ff.folded}
        what = f"{self.phase}: calls to clients {_span(sorted(calls))}"
        gathered = self._all_gather((sent, rng, firsts), what)
        merged: Dict[int, Any] = {}
        first_of: Dict[str, Any] = {}
        for part, state, their_firsts in gathered:  # in rank order: the same on every rank
            merged.update(part)
            if state is not None and self.owner[last] != self.rank:
                set_rng_state(state)
            for f, first in their_firsts.items():
                if f in first_of and first[1] != first_of[f][1]:
                    raise PflError(f"distributed.exact false: clients {first[0]} and {first_of[f][0]} upload "
                                   f"'{f}' with other keys, shapes or dtypes; set distributed.exact true")
                if f not in first_of or first[0] < first_of[f][0]:  # integer keys: the lowest client's, as serial
                    first_of[f] = first
        means: Dict[str, WeightedMean] = {}
        for f in fields:  # the same fields in the same order on every rank: one all-reduce each
            if f not in first_of:
                continue
            _, layout, ints = first_of[f]
            size = sum(math.prod(shape) for _, shape, dt in layout if dt.is_floating_point)
            device, group = self._reduce_on()
            mine_f = fold.folds[f]
            local = mine_f.flat().to(device) if mine_f.folded else torch.zeros(size, dtype=torch.float64,
                                                                                device=device)
            buf = torch.cat([local, torch.tensor([mine_f.weight], dtype=torch.float64, device=device)])
            self._guard(lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group), f"{what} (all-reduce)")
            ints = {k: _from_portable(v, self.device) for k, v in ints.items()}
            means[f] = WeightedMean(unflatten(buf[:-1] / buf[-1], layout, ints, self.device), float(buf[-1]))
        for cid, (res, _, _, _) in merged.items():
            self.rank_seconds[self.owner[cid]] += res.seconds
        out: Dict[int, CallResult] = {}
        verdicts: Dict[int, Tuple[Optional[str], int]] = {}
        for cid in sorted(merged):
            res, verdict, nbytes, present = merged[cid]
            res = results[cid] if cid in results else self._local_result(res)
            if present:
                res = CallResult(cid, {k: means[k] if k in present else v for k, v in res.reply.items()},
                                 res.error, res.detail, res.seconds)
            out[cid] = res
            verdicts[cid] = (verdict, nbytes)
        return out, verdicts

    def use_device_group(self, group: Any) -> None:
        """All-reduce the fast path's sums on this rank's device through ``group`` (an NCCL group on GPUs), so they
        never pass through host memory; without it they are reduced on the CPU through the run's gloo group."""
        self.device_group = group

    def _reduce_on(self) -> Tuple[torch.device, Any]:
        if self.device_group is not None:
            return self.device, self.device_group
        return torch.device("cpu"), self.group

    def _portable_result(self, res: CallResult) -> CallResult:
        return CallResult(res.cid, _to_portable(res.reply), res.error, res.detail, res.seconds)

    def _local_result(self, res: CallResult) -> CallResult:
        return CallResult(res.cid, _from_portable(res.reply, self.device), res.error, res.detail, res.seconds)

    def rollback(self, cid: int) -> None:
        # every rank takes the same decision on the same replies; only the owner holds the state to restore
        if self.owner.get(cid) == self.rank:
            self.inner.rollback(cid)

    def get_state(self, cid: int) -> Optional[Dict[str, Any]]:
        """A collective between ``cid``'s owner and rank 0 (every rank calls it, for every client, in the same
        order): the owner returns the state and sends it to rank 0, which returns it; other ranks return None."""
        owner = self.owner[cid]
        if owner == self.rank:
            state = self.inner.get_state(cid)
            if self.rank != 0:
                self._guard(lambda: dist.send_object_list([_to_portable(state)], dst=0, group=self.group),
                            f"{self.phase}: sending client {cid}'s state to rank 0")
            return state
        if self.rank == 0:
            box: List[Any] = [None]
            self._guard(lambda: dist.recv_object_list(box, src=owner, group=self.group),
                        f"{self.phase}: receiving client {cid}'s state from rank {owner}")
            return _from_portable(box[0], self.device)
        return None

    def set_state(self, cid: int, state: Dict[str, Any]) -> None:
        if self.owner.get(cid) == self.rank:
            self.inner.set_state(cid, state)

    def holds(self, cid: int) -> bool:
        """Whether this rank keeps ``cid``'s state (a resume loads only those states from the checkpoint)."""
        return self.owner.get(cid) == self.rank

    def remove_spill_files(self) -> None:
        if self.inner is not None:
            self.inner.remove_spill_files()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    # -- run-level agreement -----------------------------------------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (a Ctrl-C seen by one process stops them all after the
        same round)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._guard(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group), f"{self.phase}: stop check")
        return bool(t.item())

    def take_rank_seconds(self) -> List[float]:
        """Client seconds spent by each rank since the last call (the imbalance of the assignment)."""
        out, self.rank_seconds = self.rank_seconds, [0.0] * self.world_size
        return out

    def describe(self) -> str:
        """One line: how many ranks and which clients each runs."""
        return describe(self.assignment)

    # -- collectives -------------------------------------------------------------------------------------------
    def _all_gather(self, obj: Any, what: str) -> List[Any]:
        box: List[Any] = [None] * self.world_size
        self._guard(lambda: dist.all_gather_object(box, obj, group=self.group), what)
        return box

    def _guard(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError, ConnectionError) as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise WorkerLost(f"rank {self.rank}: lost contact with another process of the run during {what} "
                             f"({first}); a worker died or stopped answering. Clients by rank: "
                             f"{self.describe()}") from None


def _span(ids: List[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}..{ids[-1]} ({len(ids)} clients)"

