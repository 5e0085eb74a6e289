"""Batched evaluation of a round's clients (``clients.batched``): every client's personal model scored in one
vectorised pass, as the fit trains them in one.

It applies where the fit is batched and the evaluation is the core's default one: the trainer keeps
``LocalSGDTrainer``'s ``on_evaluate`` and ``ClientTrainer``'s ``handle`` / ``evaluate_model``, and
``personal_forward`` is ``self.model`` (the model its batched form stacks), no ``eval.adapt*`` applies in the
round, the messages are ``evaluate`` messages with a dict payload, and two clients or more are scored. Then:

1. per client, as the sequential ``on_evaluate`` begins: its state swapped in, the message's shared state received
   (the trainer's own ``receive``, or ``require_shared``), and its model's parameters and buffers copied into one
   row of a stacked copy;
2. one ``torch.func.vmap`` of the model's forward pass (eval mode, each client's tensors substituted) over the
   clients' test rows and, with ``split.val``, validation rows, clients of similar sizes padded to one length;
3. per client the sums ``evaluation_reply`` computes: ``loss_sum`` (the task's loss summed over samples),
   ``metric_sum``, and ``val_loss_sum`` / ``val_metric_sum`` when the client holds a validation split. The
   communicator vets and summarises these replies exactly as the sequential ones.

The sums equal the sequential path's up to float summation order (counts exactly, losses within relative 1e-4).
A pass that raises or outlives its time limit scores its clients one at a time with the states already received
(the trainer's ``evaluate_model``, the sequential numbers exactly) and the run evaluates one client at a time from
then on; a client whose state cannot be swapped in, or whose ``receive`` raises, fails alone.
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..api.client import ClientTrainer, LocalSGDTrainer
from ..api.task import Task
from ..api.training import VAL_PREFIX, TensorData, set_mode
from ..common.calltimer import ClientTimedOut, deadline
from ..common.errors import PflError
from ..common.seeding import seed_everything

log = logging.getLogger("pflkit")

EVALUATE = "evaluate"
# the methods of the default evaluation: a trainer that keeps them scores self.model after receiving the message
EVAL_PATH = {"handle": ClientTrainer, "on_evaluate": LocalSGDTrainer, "evaluate_model": ClientTrainer,
             "personal_forward": LocalSGDTrainer}
# a pass holds at most this many of the sequential evaluation's batches (train.eval_batch_size rows each)
BATCHES_PER_PASS = 4
# clients of one padded group: its padded rows at most twice its real rows, plus this many (a vmap call costs
# about as much as a small model's forward over a few hundred rows on a CPU)
PAD_SLACK_ROWS = 256


# -- which evaluations batch ------------------------------------------------------------------------------------------
def evaluation_reason(trainer_cls: type) -> Optional[str]:
    """None when ``trainer_cls``'s evaluation is the core's default one (it scores ``self.model`` after receiving
    the message), else why not (one phrase)."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, LocalSGDTrainer)):
        return f"{getattr(trainer_cls, '__name__', trainer_cls)} is no LocalSGDTrainer"
    for method, default in EVAL_PATH.items():
        owner = next((k for k in trainer_cls.__mro__ if method in vars(k)), None)
        if owner is not default:
            return f"{owner.__name__} overrides {method}()"
    return None


def evaluate_message(message: Any) -> bool:
    return getattr(message, "kind", None) == EVALUATE and isinstance(getattr(message, "payload", None), dict)


def takes(runner: Any, backend: Any, calls: Dict[int, Any]) -> bool:
    """Whether ``calls`` are scored in one batched pass (see the module's docstring for when)."""
    plan = runner.plan
    if not plan.batched or plan.evaluation is not None or runner.evaluation_refused or len(calls) < 2:
        return False
    if not all(evaluate_message(c.message) for c in calls.values()):
        return False
    for cid, call in calls.items():
        ctx = _context(backend, cid)
        if ctx is None or type(ctx.task) is not Task:  # a task of another kind: its own loss and metric
            return False
        adapt = ctx.adaptation
        if adapt is not None and adapt.applies(call.round):  # eval.adapt: a scratch copy is fine-tuned per client
            return False
    return True


def _context(backend: Any, cid: int) -> Any:
    contexts = getattr(backend, "contexts", None) or {}
    if cid in contexts:
        return contexts[cid]
    trainer = (getattr(backend, "trainers", None) or {}).get(cid)
    return getattr(trainer, "ctx", None)


# -- one client's evaluation, prepared ------------------------------------------------------------------------------
@dataclass
class _Client:
    cid: int
    row: int  # its row in the stacked tensors
    test: TensorData
    val: Optional[TensorData]
    seconds: float
    rows: int = field(init=False)  # its test and validation samples

    def __post_init__(self) -> None:
        self.rows = len(self.test) + (len(self.val) if self.val is not None else 0)


def _model_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _receive(trainer: LocalSGDTrainer, payload: Dict[str, Any]) -> None:
    """What ``LocalSGDTrainer.on_evaluate`` does before it scores (the trainer keeps that method: ``takes``)."""
    if "params" in payload:
        trainer.receive(payload["params"])
    else:
        trainer.require_shared()


def _receives_by_copy(backend: Any, trainer: LocalSGDTrainer) -> bool:
    """Whether the message's shared state can go into the stack without ``receive``: a pooled trainer with
    ``LocalSGDTrainer.receive`` (it copies the shared keys into the working model, which the swap-out forgets: the
    client keeps only its other keys), so the stack takes them from the message, with one copy instead of two."""
    return bool(getattr(backend, "pooled", False)) and type(trainer).receive is LocalSGDTrainer.receive


def _shared_part(trainer: LocalSGDTrainer, params: Any) -> Dict[str, torch.Tensor]:
    """What ``LocalSGDTrainer.receive`` loads: the keys of ``trainer.shared`` that ``params`` holds."""
    return {k: params[k] for k in trainer.shared if k in params}


class _Prepared:
    """The clients received so far: their rows of the stacked tensors, the template model, failures."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.clients: List[_Client] = []
        self.failed: Dict[int, Any] = {}
        self.model: Optional[nn.Module] = None
        self.names: List[str] = []
        self._tensors: Dict[str, torch.Tensor] = {}
        self.sources: Optional[Dict[str, torch.Tensor]] = None  # row 0's tensors, while every row took the same
        self.stacked: Dict[str, torch.Tensor] = {}
        self.train_cfg: Any = None
        self.task: Optional[Task] = None

    def add(self, trainer: LocalSGDTrainer, cid: int, started: float,
            received: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Copy ``trainer``'s personal model into the next row of the stack (``received``: tensors of the message
        that take the place of the model's own, for a trainer that did not receive them itself)."""
        model = trainer.personal_forward()
        if model is self.model:  # a pooled trainer: the same modules, loaded in place with each client's values
            tensors = self._tensors
        else:
            tensors = _model_tensors(model)
        if self.model is None:
            self.model, self.names, self._tensors = model, list(tensors), tensors
            self.train_cfg, self.task = trainer.ctx.train_cfg, trainer.ctx.task
            self.stacked = {n: torch.empty((self.count,) + tuple(t.shape), dtype=t.dtype, device=t.device)
                            for n, t in tensors.items()}
        elif tensors is not self._tensors and (list(tensors) != self.names or any(
                self.stacked[n].shape[1:] != t.shape or self.stacked[n].dtype != t.dtype
                for n, t in tensors.items())):
            raise RuntimeError("its model's tensors differ from the other clients' (names, shapes or dtypes)")
        row = len(self.clients)
        received = received or {}
        # the same tensors of one message for every client so far (one model for all: no comparison needed)
        if row == 0:
            self.sources = received if len(received) == len(tensors) else None
        elif self.sources is not None and not (len(received) == len(tensors) and
                                              all(received[n] is self.sources[n] for n in tensors)):
            self.sources = None
        with torch.no_grad():
            for n, t in tensors.items():
                self.stacked[n][row].copy_(received.get(n, t))
        self.clients.append(_Client(cid, row, trainer.ctx.test, trainer.ctx.val, time.perf_counter() - started))


def _prepare(backend: Any, calls: Dict[int, Any]) -> _Prepared:
    """Swap each client in, receive its message's state as ``on_evaluate`` would, copy its model into the stack."""
    from .backend import CallResult

    prepared = _Prepared(len(calls))
    reseed: Optional[bool] = None
    direct: Optional[bool] = None
    known: Optional[set] = None  # the names of the personal model's tensors
    seeded: Optional[int] = None
    for cid in sorted(calls):
        call, started = calls[cid], time.perf_counter()
        try:
            trainer = backend.batched_bind(cid, False)
        except (PflError, KeyboardInterrupt):
            raise
        except Exception as exc:
            prepared.failed[cid] = CallResult(cid, error=f"swapping its state in: {type(exc).__name__}: {exc}",
                                              detail=traceback.format_exc())
            continue
        try:
            if reseed is None:  # LocalSGDTrainer's receive draws nothing: only another one needs the call's seed
                reseed = type(trainer).receive is not LocalSGDTrainer.receive
            if reseed:  # as the sequential path seeds before each call
                seed_everything(call.seed)
            seeded = call.seed
            trainer.ctx.round = call.round
            trainer.ctx.generator.manual_seed(call.seed)
            if direct is None:
                direct = _receives_by_copy(backend, trainer)
            received = None
            if direct and "params" in call.message.payload:
                if known is None:
                    known = set(_model_tensors(trainer.personal_forward()))
                received = _shared_part(trainer, call.message.payload["params"])
                if not received.keys() <= known:  # a key the model's tensors do not name: receive() copies it
                    received = None
            if received is None:
                _receive(trainer, call.message.payload)
            prepared.add(trainer, cid, started, received)
        except (KeyboardInterrupt, ClientTimedOut):
            raise
        except Exception as exc:
            prepared.failed[cid] = CallResult(cid, error=f"{type(exc).__name__}: {exc}",
                                              detail=traceback.format_exc(), seconds=time.perf_counter() - started)
        err = backend.batched_release(cid)
        if err is not None:
            if prepared.clients and prepared.clients[-1].cid == cid:
                prepared.clients.pop()
            prepared.failed[cid] = err
    # the process RNGs end as after the sequential path's last call: seeded for the last client swapped in (its
    # receive, when another one draws, already drew after that seeding; scoring draws nothing)
    if seeded is not None and not reseed:
        seed_everything(seeded)
    return prepared


# -- the rows scored ------------------------------------------------------------------------------------------------
def _split_rows(data: Optional[TensorData]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    if data is None or len(data) == 0:
        return None
    return data.all()


def _client_rows(c: _Client, at: int) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """Client ``c``'s test rows, then its validation rows, and per row its sum's slot: ``2 * at`` (test) or
    ``2 * at + 1`` (validation)."""
    xs, ys, segs = [], [], []
    for split, data in enumerate((c.test, c.val)):
        rows = _split_rows(data)
        if rows is not None:
            xs.append(rows[0])
            ys.append(rows[1])
            segs.append(torch.full((len(rows[1]),), 2 * at + split, dtype=torch.long, device=rows[1].device))
    return xs, ys, segs


def _one_pass_rows(clients: Sequence[_Client]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every client's rows, one after another: x, y and each row's sum slot (clients scored by one model)."""
    xs, ys, segs = [], [], []
    for at, c in enumerate(clients):
        x, y, seg = _client_rows(c, at)
        xs += x
        ys += y
        segs += seg
    return torch.cat(xs), torch.cat(ys), torch.cat(segs)


def _groups(clients: Sequence[_Client], rows_per_pass: int) -> List[List[int]]:
    """Positions of ``clients`` by size, largest first, cut into groups padded to their largest client's rows with
    little waste (a group's padded rows at most twice its real ones plus ``PAD_SLACK_ROWS``)."""
    order = sorted(range(len(clients)), key=lambda i: (-clients[i].rows, clients[i].cid))
    groups: List[List[int]] = []
    width = real = 0
    for i in order:
        n = clients[i].rows
        if groups and width * (len(groups[-1]) + 1) <= min(2 * (real + n) + PAD_SLACK_ROWS, max(rows_per_pass, width)):
            groups[-1].append(i)
            real += n
            continue
        groups.append([i])
        width, real = n, n
    return groups


def _padded_rows(clients: Sequence[_Client], group: List[int], empty_slot: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's rows as [clients, width, ...]: each client's rows, then its first row repeated (padding, summed
    into ``empty_slot``, which is never read)."""
    width = max(1, clients[group[0]].rows)
    any_rows = next(_client_rows(clients[i], 0) for i in group if clients[i].rows)
    xs, ys, segs = [], [], []
    for i in group:
        x, y, seg = _client_rows(clients[i], i)
        x, y, seg = (torch.cat(x), torch.cat(y), torch.cat(seg)) if x else \
            (any_rows[0][0][:1], any_rows[1][0][:1], torch.full((1,), empty_slot, dtype=torch.long,
                                                                 device=any_rows[1][0].device))
        pad = width - len(y)
        if pad:
            x = torch.cat([x, x[:1].expand(pad, *x.shape[1:])])
            y = torch.cat([y, y[:1].expand(pad, *y.shape[1:])])
            seg = torch.cat([seg, seg.new_full((pad,), empty_slot)])
        xs.append(x)
        ys.append(y)
        segs.append(seg)
    return torch.stack(xs), torch.stack(ys), torch.stack(segs)


class RowCache:
    """The last evaluation's rows, laid out, kept for the next one: the same clients' splits are the same tensors
    every round (a split with an input transform is laid out afresh each time, as ``evaluate`` applies it)."""

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.value: Any = None

    def get(self, kind: str, clients: Sequence[_Client], build: Any) -> Any:
        key = (kind,) + tuple((c.cid, c.test, c.val) for c in clients)
        cacheable = all(d is None or d.transform is None for c in clients for d in (c.test, c.val))
        if cacheable and self.key is not None and len(self.key) == len(key) and self.key[0] == kind and \
                all(a[0] == b[0] and a[1] is b[1] and a[2] is b[2] for a, b in zip(self.key[1:], key[1:])):
            return self.value
        value = build()
        self.key, self.value = (key, value) if cacheable else (None, None)
        return value


# -- the vectorised pass --------------------------------------------------------------------------------------------
def per_sample_sums(task: Task, out: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each sample's loss and metric as ``evaluate`` sums them (``_loss_sum``, ``Task.metric_sum``): ``out`` and
    ``y`` flattened to [samples, ...]."""
    if task.kind == "classification":
        loss = torch.nn.functional.cross_entropy(out, y, reduction="none")
        return loss, (out.argmax(dim=1) == y)
    per = max(1, y[0].numel()) if len(y) else 1
    err = torch.nn.functional.mse_loss(out.reshape(y.shape), y, reduction="none").reshape(len(y), -1).sum(1) / per
    return err, err


def _one_model(stacked: Dict[str, torch.Tensor], names: Sequence[str]) -> bool:
    """Whether every stacked client holds the same tensors (every client received one model and keeps nothing of
    its own, FedAvg's evaluation): then one plain forward pass scores them all."""
    return all(torch.equal(stacked[n][1:], stacked[n][:1].expand_as(stacked[n][1:])) for n in names)


def score_stacked(prepared: _Prepared, cache: Optional[RowCache] = None) -> Dict[int, Dict[str, Any]]:
    """cid -> its evaluate reply: the clients' rows through their stacked models (vmap over groups of similar-sized
    clients), or one plain pass when all hold the same model; per-client sums by ``index_add_`` into slots."""
    from torch.func import vmap

    from .batched import _Modules, _Swap

    model, task, names, clients = prepared.model, prepared.task, prepared.names, prepared.clients
    cache = cache or RowCache()
    k = len(clients)
    swap = _Swap(_Modules({"m": model}), [f"m.{n}" for n in names], lambda x, _y: model(x))
    rows_per_pass = max(1, int(prepared.train_cfg.eval_batch_size) * BATCHES_PER_PASS)
    device = next(iter(prepared.stacked.values())).device
    loss_sums = torch.zeros(2 * k + 1, device=device)  # float32, as evaluate's accumulators; slot 2k: padding
    metric_sums = torch.zeros(2 * k + 1, device=device)
    if [c.row for c in clients] == list(range(k)):  # no client failed: the stack as it is
        stacked = {n: prepared.stacked[n][:k] for n in names}
    else:
        rows_at = torch.tensor([c.row for c in clients], device=device)
        stacked = {n: prepared.stacked[n].index_select(0, rows_at) for n in names}

    def add(out: torch.Tensor, y: torch.Tensor, seg: torch.Tensor) -> None:
        loss, metric = per_sample_sums(task, out, y)
        loss_sums.index_add_(0, seg, loss.to(loss_sums.dtype))
        metric_sums.index_add_(0, seg, metric.to(metric_sums.dtype))

    was_training = model.training
    set_mode(model, False)
    try:
        with torch.no_grad():
            if not any(c.rows for c in clients):
                pass
            elif prepared.sources is not None or _one_model(stacked, names):
                x, y, seg = cache.get("one", clients, lambda: _one_pass_rows(clients))
                own = tuple(stacked[n][0] for n in names)
                for first in range(0, len(y), rows_per_pass):
                    end = first + rows_per_pass
                    add(swap(own, x[first:end], None), y[first:end], seg[first:end])
            else:
                forward = vmap(lambda tensors, x: swap(tensors, x, None), randomness="error")
                groups = cache.get("stacked", clients, lambda: [
                    (torch.tensor(g, device=device),) + _padded_rows(clients, g, 2 * k)
                    for g in _groups(clients, rows_per_pass) if clients[g[0]].rows])
                for at, X, Y, S in groups:
                    tensors = tuple(stacked[n].index_select(0, at) for n in names)
                    step = max(1, rows_per_pass // len(at))
                    for first in range(0, X.shape[1], step):
                        out = forward(tensors, X[:, first:first + step])
                        y, seg = Y[:, first:first + step], S[:, first:first + step]
                        add(out.reshape(-1, *out.shape[2:]), y.reshape(-1, *y.shape[2:]), seg.reshape(-1))
    finally:
        set_mode(model, was_training)
    losses, metrics = loss_sums.tolist(), metric_sums.tolist()
    replies: Dict[int, Dict[str, Any]] = {}
    for i, c in enumerate(clients):
        reply = {"num_samples": len(c.test), "loss_sum": float(losses[2 * i]), "metric_sum": float(metrics[2 * i])}
        if c.val is not None:
            reply[f"{VAL_PREFIX}loss_sum"] = float(losses[2 * i + 1])
            reply[f"{VAL_PREFIX}metric_sum"] = float(metrics[2 * i + 1])
        replies[c.cid] = reply
    return replies


# -- the runner's side ----------------------------------------------------------------------------------------------
def run(runner: Any, backend: Any, calls: Dict[int, Any]) -> Iterator[Any]:
    """The results of ``calls`` (evaluate messages ``takes`` accepted), in client order."""
    from .backend import CallResult

    prepared = _prepare(backend, calls)
    results: Dict[int, Any] = dict(prepared.failed)
    if prepared.clients:
        start = time.perf_counter()
        limit = backend.client_timeout
        first = prepared.clients[0].cid
        try:
            with deadline(None if limit is None else limit * len(prepared.clients),
                          lambda: backend._hung_message(first, calls[first].round)):
                replies = score_stacked(prepared, runner.eval_rows)
        except (KeyboardInterrupt, PflError):
            raise
        except (Exception, ClientTimedOut) as exc:  # score them one at a time, from the states received
            runner.evaluation_fallbacks += 1
            runner.evaluation_refused = True
            log.info("batched evaluation failed (%s: %s); evaluating one client at a time from here on",
                     type(exc).__name__, str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "")
            for c in prepared.clients:
                results[c.cid] = _score_one(backend, c, prepared, calls[c.cid].round)
        else:
            runner.evaluations_run += 1
            share = (time.perf_counter() - start) / len(prepared.clients)
            for c in prepared.clients:
                results[c.cid] = CallResult(c.cid, reply=replies[c.cid], seconds=c.seconds + share)
    for cid in sorted(results):
        yield results[cid]


def _score_one(backend: Any, client: _Client, prepared: _Prepared, rnd: int) -> Any:
    """``client`` scored by its own trainer's ``evaluate_model``, its received state loaded back: the sequential
    path's numbers."""
    from .backend import CallResult

    start = time.perf_counter()
    try:
        trainer = backend.batched_bind(client.cid, False)
    except (PflError, KeyboardInterrupt):
        raise
    except Exception as exc:
        return CallResult(client.cid, error=f"swapping its state in: {type(exc).__name__}: {exc}",
                          detail=traceback.format_exc())
    try:
        model = trainer.personal_forward()
        with torch.no_grad():
            for n, t in _model_tensors(model).items():
                t.copy_(prepared.stacked[n][client.row])
        with deadline(backend.client_timeout, lambda: backend._hung_message(client.cid, rnd)):
            reply = trainer.evaluate_model(model)
        result = CallResult(client.cid, reply=reply, seconds=client.seconds + time.perf_counter() - start)
    except KeyboardInterrupt:
        raise
    except ClientTimedOut:
        result = CallResult(client.cid, error=f"ClientTimeout: did not finish within {backend.client_timeout:g} s "
                                              f"(failures.client_timeout)", seconds=time.perf_counter() - start)
    except Exception as exc:
        result = CallResult(client.cid, error=f"{type(exc).__name__}: {exc}", detail=traceback.format_exc(),
                            seconds=time.perf_counter() - start)
    err = backend.batched_release(client.cid)
    return result if err is None else err

