"""Batched execution of a round's clients (``clients.batched``): K clients' local updates as one vectorised model.

Each client's parameters and buffers are stacked along a leading client dimension; one ``torch.func.vmap`` of the
loss's forward pass (the client's tensors swapped into the trainer's modules) and one backward pass of the summed
losses compute every stacked client's gradient on its own mini-batch, and one elementwise ``torch._foreach``
optimizer (SGD with momentum and weight decay, or Adam, with per-client step counts and a per-client
``train.max_grad_norm``) updates them all, which equals one optimizer per client. Each client's mini-batch order is
replayed from its own seeded generator exactly as the sequential path draws it (``training.batch_indices``).

Ragged clients: within an epoch every client's full batches come first and its last, smaller batch (if any) last;
the stack runs the epoch's full-batch steps together and then the last batches, one call per distinct size (on CPU
the sizes with too few clients to stack share one step: plain per-client forward passes, one backward pass). A
client with fewer steps sits the remaining steps out: the step runs on the sub-stack of active clients only, so an
inactive client's parameters, buffers, momentum and Adam state are not touched at all (the masked no-op step). The
stack is ordered by step count, most first, so the active clients are a prefix and a step works on views of the
stacked tensors; clients are grouped by step count, at most ``clients.stack`` per group (on CUDA, by default, as
many as half the free device memory holds), to keep the idle slots few.

Which trainers batch: those with a batched form (``batched_begin`` + ``batched_form``, core/api/batching.py) that
covers their fit path. ``LocalSGDTrainer``'s form (one phase on the trainer's own ``loss``) covers every subclass that
changes only ``loss`` / ``data_loss`` / ``shared_keys`` (or freezes parameters in ``__init__``); a class that
overrides ``on_fit``, ``receive``, ``upload``, ``local_update``, ``batches`` or ``batched_begin`` declares its own
form in that class (FedRep's two phases, Ditto's personal and global solves, ...). The loss may read only what is
the same for every client (hyperparameters, the task); per-client constants live as buffers of a module in the
form; per-client inputs of a step beyond its batch (PCFL's synthetic batch, drawn from the client's own generator)
are drawn before the steps (``BatchedPhase.inputs``) and laid out along the stack like the batches. A probe at start
runs every phase's loss under ``vmap`` with random operations refused, so dropout or a loss vmap cannot trace is a
reason not to batch, said once, never a wrong number. A mixin that augments another trainer (``batched_wraps``)
wraps the form of the class below it, and says through ``batched_message`` which messages run it.

Everything around the training stays per client: receiving the server's message, uploading, vetting each reply,
rollback, the state store. A batched group that raises or passes its time limit runs again one client at a time, so
a failing client is isolated as in the sequential path; a client that diverges has NaN in its own slice only and is
rejected alone by the reply vetting.
"""
from __future__ import annotations

import logging
import random
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..api.batching import BatchedForm, StepInputs
from ..api.client import LocalSGDTrainer
from ..api.training import batch_indices
from ..common.calltimer import ClientTimedOut, deadline
from ..common.errors import ConfigError, PflError
from ..common.seeding import seed_everything

log = logging.getLogger("pflkit")

MODES = ("auto", "on", "off")
# the methods of a local update's fit path: a trainer that keeps LocalSGDTrainer's has a derivable functional form
FIT_PATH = ("handle", "on_fit", "receive", "upload", "local_update", "batches", "batched_begin", "batched_message")
SOLO_CLIENTS = 4  # on CPU a step of this many clients or fewer runs plain forward passes (cheaper than a vmap call)
# a step of this many clients or more takes vmap(grad(...)) instead of a vmapped forward and one backward pass: on a
# CPU the former's fixed cost is higher (64-100-10 MLP, batch 10: 0.57 against 0.38 ms), its backward over a large
# stack faster (64 clients: 0.98 against 0.93 ms; 100 clients: 1.36 against 1.97 ms)
GRAD_TRANSFORM_CLIENTS = 80
MEMORY_SHARE = 0.5  # the share of free device memory one stacked group may use (the rest: the data, the allocator)


# -- which trainers batch -------------------------------------------------------------------------------------------
def _definer(cls: type, name: str, skip: Sequence[type] = ()) -> Optional[type]:
    for klass in cls.__mro__:
        if name in vars(klass) and klass not in skip:
            return klass
    return None


def _wrappers(cls: type) -> List[type]:
    """The classes of ``cls``'s MRO whose ``batched_form`` wraps the form of the class below them
    (``batched_wraps = True`` in their own body beside ``batched_form``: an augmenting algorithm's mixin, PCFL's)."""
    return [k for k in cls.__mro__ if vars(k).get("batched_wraps") and "batched_form" in vars(k)]


def form_reason(trainer_cls: type) -> Optional[str]:
    """None when ``trainer_cls`` has a batched form (``batched_form``, core/api/batching.py) that covers its fit path;
    else why not (one phrase). LocalSGDTrainer's form covers a subclass that changes only ``loss``, ``data_loss``,
    ``shared_keys`` or its ``__init__``; a class that overrides a fit-path method must declare its own form in the same
    class or below, so a form is never applied to a local update it was not written for. A wrapper's form (a mixin
    with ``batched_wraps``, which builds on ``super().batched_form()``) covers the methods the wrapper overrides; the
    rest of the class must batch on its own."""
    name = getattr(trainer_cls, "__name__", str(trainer_cls))
    if not isinstance(trainer_cls, type):
        return f"{name} declares no batched form (batched_form, batched_begin)"
    wrappers = _wrappers(trainer_cls)
    form_owner = _definer(trainer_cls, "batched_form", wrappers)
    if form_owner is None or _definer(trainer_cls, "batched_begin", wrappers) is None:
        return f"{name} declares no batched form (batched_form, batched_begin)"
    for method in FIT_PATH:
        owner = _definer(trainer_cls, method, wrappers)
        if owner is not None and not issubclass(form_owner, owner):
            return (f"{owner.__name__} overrides {method}() and declares no batched_form() for it (a LocalSGDTrainer "
                    f"that changes only loss, data_loss or shared_keys batches with no code of its own)")
    for method in LOSS_PATH:  # a loss changed below the class whose form runs it: batched only where declared safe
        owner = _definer(trainer_cls, method, wrappers)
        if owner is not None and owner is not form_owner and issubclass(owner, form_owner) \
                and not loss_declared_safe(owner):
            return (f"{owner.__name__} overrides {method}() without declaring it batch-safe "
                    f"(batched_loss_safe = True in its class body, when the loss reads nothing per client beyond its "
                    f"batch and its modules' tensors: docs/batched-clients.md)")
    return None


LOSS_PATH = ("loss", "data_loss")


def loss_declared_safe(owner: type) -> bool:
    """Whether the class that defines a loss (``owner``), or a class of its own package above it, declares the loss
    batch-safe (``batched_loss_safe = True`` in that class's body): it reads nothing per client beyond its batch and
    the modules' tensors, so the batched path may run it with each client's tensors substituted."""
    package = owner.__module__.split(".")[0]
    return any(vars(k).get("batched_loss_safe") is True and k.__module__.split(".")[0] == package
               for k in owner.__mro__)


def trainer_batches(trainer_cls: type) -> Tuple[bool, str]:
    """What ``fl show`` says: whether ``trainer_cls`` batches, and the phrase saying how or why not."""
    reason = form_reason(trainer_cls)
    if reason is None:
        wrappers = _wrappers(trainer_cls)
        owner = _definer(trainer_cls, "batched_form", wrappers)
        if wrappers:
            inner = "the core's derived local update" if owner is LocalSGDTrainer else f"{owner.__name__}'s phases"
            how = f"{', '.join(w.__name__ for w in wrappers)} around {inner}"
        else:
            how = "the core derives its vectorised local update" if owner is LocalSGDTrainer else \
                f"{owner.__name__} declares its phases"
        return True, f"batched ({how})"
    return False, f"sequential ({reason})"


# -- the plan a run follows -----------------------------------------------------------------------------------------
@dataclass
class BatchedPlan:
    """Which path a run's fit calls take, and why (run_info.json, the summary)."""

    mode: str  # clients.batched
    batched: bool
    reason: str
    stack: Optional[int] = None  # clients.stack (None: all of a round's clients on CPU, from free memory on CUDA)
    # which messages the batched form runs (the trainer class's ``batched_message``; None: ``fit`` messages)
    accepts: Optional[Callable[[Any], bool]] = field(default=None, repr=False, compare=False)
    # why the trainer's evaluation is not scored in one batched pass (core/engine/batched_eval.py); None: it is
    evaluation: Optional[str] = field(default="not batched", compare=False)

    def as_dict(self) -> Dict[str, Any]:
        out = {"mode": self.mode, "path": "batched" if self.batched else "sequential", "reason": self.reason,
               "stack": self.stack}
        if self.batched:  # and how their evaluations are scored (core/engine/batched_eval.py)
            out["evaluation"] = "batched" if self.evaluation is None else f"per client: {self.evaluation}"
        return out


def decide(mode: str, trainer_cls: type, trainer_name: str, device: torch.device,
           probe: Callable[[], Optional[str]], stack: Optional[int] = None) -> BatchedPlan:
    """The path for ``mode`` (auto/on/off). ``probe()`` tries the vectorised loss once (None: it works); ``on`` with a
    trainer that cannot batch is a ConfigError naming why."""
    if mode == "off":
        return BatchedPlan(mode, False, "clients.batched=off", stack)
    reason = form_reason(trainer_cls)
    if mode == "auto" and device.type != "cuda":
        # CPU numbers stay as published: auto batches on CUDA only
        return BatchedPlan(mode, False, "auto: one client after another on CPU" + (
            "; clients.batched=on batches them" if reason is None else f"; this trainer cannot batch: {reason}"),
            stack)
    if reason is None:
        reason = probe()
    if reason is not None:
        if mode == "on":
            raise ConfigError(f"clients.batched=on: trainer '{trainer_name}' cannot be batched: {reason}; "
                              f"use clients.batched=auto or off")
        return BatchedPlan(mode, False, reason, stack)
    from .batched_eval import evaluation_reason

    return BatchedPlan(mode, True, "clients.batched=on" if mode == "on" else
                       f"auto: {device.type} device and a trainer with a batched form", stack,
                       getattr(trainer_cls, "batched_message", None), evaluation_reason(trainer_cls))


# -- memory bound ---------------------------------------------------------------------------------------------------
def free_device_memory(device: torch.device) -> Optional[int]:
    """Free bytes on ``device`` (None off CUDA). Module level, so tests can stand in for a GPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def per_client_bytes(form: BatchedForm, x: torch.Tensor, y: torch.Tensor, slots: int) -> int:
    """Bytes one stacked client needs: its tensors, a gradient, ``slots`` optimizer states and a working copy of its
    parameters, and the activations of every phase's loss on one batch ``x, y`` (measured with forward hooks, twice
    for the backward)."""
    params = sum(p.numel() * p.element_size() for m in form.modules.values() for p in m.parameters())
    buffers = sum(b.numel() * b.element_size() for m in form.modules.values() for b in m.buffers())
    acts = [0]

    def hook(_m, _i, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                acts[0] += t.numel() * t.element_size()

    handles = [sub.register_forward_hook(hook) for m in form.modules.values() for sub in m.modules()]
    saved = {n: t.detach().clone() for n, t in form_tensors(form).items()}  # BatchNorm statistics stay as they were
    most = 0
    try:
        with torch.no_grad():
            for phase in form.phases:
                acts[0] = 0
                phase.loss(x, y)
                most = max(most, acts[0])
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, t in form_tensors(form).items():
                t.copy_(saved[n])
    return params * (3 + slots) + 2 * buffers + 2 * most + x.numel() * x.element_size()


def stack_bound(stack: Optional[int], device: torch.device, need: Callable[[], int],
                free: Callable[[torch.device], Optional[int]] = None) -> Optional[int]:
    """How many clients one group stacks: ``clients.stack`` when set; on CUDA the clients that fit in half the
    free memory (``need()``: bytes per client); elsewhere no bound (None)."""
    if stack is not None:
        return int(stack)
    free_bytes = (free or free_device_memory)(device)
    if free_bytes is None:
        return None
    return max(1, int(free_bytes * MEMORY_SHARE) // max(1, int(need())))


def group_by_steps(steps: Dict[int, int], bound: Optional[int]) -> List[List[int]]:
    """Clients sorted by step count (then id), cut into groups of at most ``bound``: a group's clients have similar
    step counts, so few of its slots are idle."""
    order = sorted(steps, key=lambda c: (steps[c], c))
    size = len(order) if not bound else max(1, int(bound))
    return [sorted(order[i:i + size]) for i in range(0, len(order), size)]


# -- the functional local update ------------------------------------------------------------------------------------
class _Modules(nn.Module):
    """The form's modules under their names; ``_Swap`` substitutes a stacked client's tensors into them for the
    duration of one call of a phase's loss."""

    def __init__(self, modules: Dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


class _Swap:
    """Calls a phase's loss with given tensors in place of the modules' own (``"<module>.<name>"`` keys, in a fixed
    order): what ``torch.func.functional_call`` does, without its per-call name parsing and untying, which on a CPU
    costs more than a small model's forward. A tensor the modules hold under two names (tied weights) is replaced
    under both."""

    def __init__(self, holder: _Modules, keys: Sequence[str], loss: Callable) -> None:
        self.loss = loss
        self.keys = list(keys)
        index = {k: i for i, k in enumerate(self.keys)}
        owned = dict(holder.named_parameters(remove_duplicate=False))
        owned.update(holder.named_buffers(remove_duplicate=False))
        by_id = {id(owned[k]): i for k, i in index.items() if k in owned}
        self.slots: List[Tuple[Dict[str, Any], str, int]] = []
        for name, tensor in owned.items():
            i = index.get(name, by_id.get(id(tensor)))
            if i is None:
                continue
            path, _, attr = name.rpartition(".")
            sub = holder.get_submodule(path)
            store = sub._parameters if attr in sub._parameters else sub._buffers
            self.slots.append((store, attr, i))

    def __call__(self, tensors: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 extra: Sequence[torch.Tensor] = ()) -> Any:
        slots = self.slots
        old = [store[attr] for store, attr, _ in slots]
        try:
            for store, attr, i in slots:
                store[attr] = tensors[i]
            return self.loss(x, y, *extra)
        finally:
            for (store, attr, _), t in zip(slots, old):
                store[attr] = t


class _Grads:
    """Per stacked client, the gradients of a phase's loss with respect to its trained tensors and the loss (with
    ``aux``, also the loss's dict of scalars), for all clients at once: one ``vmap`` of the forward pass over the
    stacked tensors, then one ordinary backward pass of the sum of the clients' losses (the clients share nothing, so
    each client's gradient is its own loss's). On CPU a few clients run one plain forward pass each and share one
    backward pass instead: a vmap call has a fixed cost of a few sequential steps. ``es``: the step's inputs beyond
    the batch (``BatchedPhase.inputs``), a tuple of stacked tensors (or, with ``xs`` a list, one tuple per client)."""

    def __init__(self, holder: _Modules, loss: Callable, trains: Sequence[str], consts: Sequence[str],
                 aux: bool = False) -> None:
        from torch.func import grad_and_value, vmap

        self.n_train = len(trains)
        self.swap = _Swap(holder, list(trains) + list(consts), loss)
        self.aux = aux
        self.forward = vmap(self._one, randomness="error")
        self.transformed = vmap(grad_and_value(self._one, has_aux=aux), randomness="error")

    def _one(self, params: Tuple[torch.Tensor, ...], consts: Tuple[torch.Tensor, ...], x, y, extra=()):
        return self.swap(params + consts, x, y, extra)

    def _backward(self, value, leaves):
        loss, extra = value if self.aux else (value, None)
        got = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, got)]
        loss = loss.detach()
        if self.aux:
            return grads, (loss, {n: v.detach() for n, v in extra.items()})
        return grads, loss

    def vmapped(self, params: Sequence[torch.Tensor], consts: Sequence[torch.Tensor], xs, ys, es=()):
        if len(xs) >= GRAD_TRANSFORM_CLIENTS:  # a large stack: vmap(grad), whose backward is the faster one there
            grads, value = self.transformed(tuple(params), tuple(consts), xs, ys, tuple(es))
            return list(grads), value
        leaves = tuple(p.detach().requires_grad_() for p in params)
        with torch.enable_grad():
            value = self.forward(leaves, tuple(consts), xs, ys, tuple(es))
        return self._backward(value, leaves)

    def solo(self, params: Sequence[torch.Tensor], consts: Sequence[torch.Tensor], xs, ys, es=()):
        """``xs``, ``ys``: stacked, or one batch per client (of any sizes). One plain forward pass per client, then
        one backward pass of the summed losses (the autograd engine runs once per step, not once per client)."""
        per_leaves, losses, extras = [], [], []
        with torch.enable_grad():
            for i in range(len(xs)):
                leaves = tuple(p[i].detach().requires_grad_() for p in params)
                extra = es[i] if isinstance(es, list) else tuple(e[i] for e in es)
                value = self.swap(leaves + tuple(c[i] for c in consts), xs[i], ys[i], extra)
                if self.aux:
                    value, extra = value
                    extras.append({n: v.detach() for n, v in extra.items()})
                per_leaves.append(leaves)
                losses.append(value)
            loss = torch.stack(losses)
        flat = [t for leaves in per_leaves for t in leaves]
        got = torch.autograd.grad(loss.sum(), flat, allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(flat, got)]
        n = len(params)
        grads = [torch.stack(got[j::n]) for j in range(n)]
        loss = loss.detach()
        if self.aux:
            return grads, (loss, {name: torch.stack([e[name] for e in extras]) for name in extras[0]})
        return grads, loss


def form_tensors(form: BatchedForm) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of the form's modules, by ``module.name``."""
    out: Dict[str, torch.Tensor] = {}
    for m, module in form.modules.items():
        out.update({f"{m}.{n}": t for n, t in module.named_parameters()})
        out.update({f"{m}.{n}": t for n, t in module.named_buffers()})
    return out


def probe(trainer: LocalSGDTrainer) -> Optional[str]:
    """Run each phase's loss vectorised over two copies of the trainer's tensors on two samples of its client's data;
    None when that works, else why not (random operations such as dropout, code vmap cannot trace)."""
    data = trainer.ctx.train
    try:
        form = trainer.batched_form()
    except Exception as exc:
        return f"its batched_form() raised {type(exc).__name__}: {exc}"
    if form is None:
        return f"{type(trainer).__name__}.batched_form() returns None"
    if not isinstance(form, BatchedForm):
        return f"{type(trainer).__name__}.batched_form() returns {type(form).__name__}, not a BatchedForm"
    if len(data) == 0:
        return None
    tensors = form_tensors(form)
    with torch.no_grad():
        saved = {n: t.detach().clone() for n, t in tensors.items()}
    holder = _Modules(form.modules)
    try:
        for name, module in form.modules.items():
            module.train(name not in form.eval_modules)
        x, y = data.batch(torch.arange(min(2, len(data)), device=data.y.device))
        for phase in form.phases:
            trains = set(phase.trains)
            unknown = trains - set(tensors)
            if unknown:
                return f"its batched form trains {sorted(unknown)[0]!r}, which none of its modules holds"
            two = {n: t.detach().unsqueeze(0).repeat(2, *[1] * t.dim()).clone() for n, t in tensors.items()}
            names = [n for n in tensors if n in trains]
            consts = [n for n in tensors if n not in trains]
            step_inputs = phase.inputs(1) if phase.inputs is not None else None
            extra = step_inputs.source.batch(step_inputs.index[0]) if step_inputs is not None and \
                len(step_inputs.index) else ()
            _Grads(holder, phase.loss, names, consts, phase.aux).vmapped(
                [two[n] for n in names], [two[n] for n in consts], torch.stack([x, x]), torch.stack([y, y]),
                tuple(torch.stack([e, e]) for e in extra))
    except Exception as exc:  # the loss cannot be vectorised: say why, run sequentially
        msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        if "random" in msg.lower():
            return "its training draws random numbers (dropout or similar), which the batched path does not replay"
        return f"its loss cannot be vectorised ({type(exc).__name__}: {msg})"
    finally:
        with torch.no_grad():
            for n, t in tensors.items():
                t.copy_(saved[n])
    return None


@dataclass
class ClientPlan:
    """One stacked client's phase: its mini-batch indices (full batches, then the last smaller one) per epoch."""

    full: List[List[torch.Tensor]]  # per epoch, the full batches' indices
    last: List[Optional[torch.Tensor]]  # per epoch, the smaller last batch (None: none)

    @property
    def steps(self) -> int:
        return sum(len(f) for f in self.full) + sum(t is not None for t in self.last)


def client_plan(trainer: Any, epochs: Optional[int] = None, batch_size: Optional[int] = None,
                drop_last: bool = False) -> ClientPlan:
    """Replay ``trainer.batches(epochs, batch_size)``'s draws (same generator, same order) as index lists, split per
    epoch."""
    cfg = trainer.ctx.train_cfg
    n = len(trainer.ctx.train)
    b = int(batch_size or cfg.batch_size)
    epochs = int(epochs or cfg.local_epochs)
    idx = list(batch_indices(n, b, epochs, generator=trainer.ctx.generator,
                             drop_last=drop_last or bool(cfg.get("drop_last", False)),
                             device=trainer.ctx.train.y.device))
    per_epoch = len(idx) // epochs if epochs and idx else 0
    full, last = [], []
    for e in range(epochs if idx else 0):
        chunk = idx[e * per_epoch:(e + 1) * per_epoch]
        small = chunk[-1] if chunk and (len(chunk[-1]) != b) else None
        full.append(chunk[:-1] if small is not None else chunk)
        last.append(small)
    return ClientPlan(full, last)


class StackedOptimizer:
    """``train.optimizer`` over stacked tensors: elementwise, so it equals one optimizer per client. Steps act on a
    subset of clients (``rows``: None = all, a ``slice`` of the stack = views updated in place, or an index tensor =
    gathered and written back); the others' parameters and state are left as they are."""

    def __init__(self, params: Dict[str, torch.Tensor], train_cfg: Any, lr: Optional[float] = None,
                 lrs: Optional[Dict[str, float]] = None) -> None:
        self.kind = train_cfg.optimizer
        self.lr = float(train_cfg.lr if lr is None else lr)
        self.lr_of = [float((lrs or {}).get(n, self.lr)) for n in params]  # per tensor (BatchedPhase.lrs)
        self.one_lr = all(v == self.lr for v in self.lr_of)
        self.momentum = float(train_cfg.get("momentum", 0.0) or 0.0)
        self.wd = float(train_cfg.get("weight_decay", 0.0) or 0.0)
        limit = train_cfg.get("max_grad_norm")
        self.max_norm = float(limit) if limit else None
        self.params = params
        self.names = list(params)
        k = next(iter(params.values())).shape[0] if params else 0
        device = next(iter(params.values())).device if params else torch.device("cpu")
        self.steps = torch.zeros(k, dtype=torch.float64, device=device)  # per client (Adam's bias correction)
        self.projected: List[Tuple[int, torch.Tensor, tuple]] = []  # (index in the step's grads, tensor, spec)
        self.m = {n: torch.zeros_like(p) for n, p in params.items()} if (self.kind == "adam" or self.momentum) else {}
        self.v = {n: torch.zeros_like(p) for n, p in params.items()} if self.kind == "adam" else {}

    def clip(self, grads: List[torch.Tensor]) -> None:
        """torch.nn.utils.clip_grad_norm_ per client: scale its gradients to total 2-norm ``max_norm``."""
        if not self.max_norm or not grads:
            return
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads], dim=1)  # [K, tensors]
        total = norms.norm(dim=1)
        coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *[1] * (g.dim() - 1)))

    def step(self, grads: Any, rows: Any = None) -> None:
        """One step for the clients in ``rows``; ``grads`` (a list in ``params``' order, or a dict) hold those
        clients' gradients only."""
        if isinstance(grads, dict):
            grads = [grads[n] for n in self.names]
        if self.projected:  # plain projected steps (BatchedPhase.projected), outside train.optimizer
            grads = list(grads)
            with torch.no_grad():
                for i, t, (lr, low, high) in self.projected:
                    view = t if rows is None or isinstance(rows, slice) else None
                    g = grads[i]
                    if view is None:
                        t.index_copy_(0, rows, (t[rows] - lr * g).clamp_(low, high))
                    else:
                        view = t if rows is None else t[rows]
                        view.sub_(g, alpha=lr).clamp_(low, high)
            drop = {i for i, _, _ in self.projected}
            grads = [g for i, g in enumerate(grads) if i not in drop]
        self.clip(grads)
        gathered = isinstance(rows, torch.Tensor)
        if gathered:
            steps = self.steps[rows] + 1
            self.steps.index_copy_(0, rows, steps)
        else:
            view = self.steps if rows is None else self.steps[rows]
            view += 1
            steps = view

        def get(store: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
            if rows is None:
                return [store[n] for n in self.names]
            return [store[n][rows] for n in self.names]  # a view (slice) or a copy (index tensor)

        def put(store: Dict[str, torch.Tensor], values: List[torch.Tensor]) -> None:
            if gathered:
                for n, t in zip(self.names, values):
                    store[n].index_copy_(0, rows, t)

        with torch.no_grad():
            ps = get(self.params)
            if self.wd:
                grads = torch._foreach_add(grads, ps, alpha=self.wd)
            if self.kind == "adam":
                ms, vs = get(self.m), get(self.v)
                self._adam(ps, grads, ms, vs, steps)
                put(self.m, ms)
                put(self.v, vs)
            else:
                if self.momentum:
                    ms = get(self.m)
                    torch._foreach_mul_(ms, self.momentum)
                    torch._foreach_add_(ms, grads)
                    put(self.m, ms)
                    grads = ms
                if self.one_lr:
                    torch._foreach_add_(ps, grads, alpha=-self.lr)
                else:
                    for p, g, lr in zip(ps, grads, self.lr_of):
                        p.add_(g, alpha=-lr)
            put(self.params, ps)

    def _adam(self, ps, grads, ms, vs, steps, betas=(0.9, 0.999), eps=1e-8) -> None:
        b1, b2 = betas
        bc1 = 1 - b1 ** steps
        bc2_sqrt = (1 - b2 ** steps).sqrt()
        for p, g, m, v, lr in zip(ps, grads, ms, vs, self.lr_of):
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            shape = (-1,) + (1,) * (p.dim() - 1)
            step_size = (lr / bc1).to(p.dtype).view(shape)
            denom = (v.sqrt() / bc2_sqrt.to(p.dtype).view(shape)).add_(eps)
            p.addcdiv_(m * step_size, denom, value=-1.0)


def train_stacked(form: BatchedForm, train_cfg: Any, states: List[Dict[str, torch.Tensor]],
                  plans: List[List[ClientPlan]], data: List[Any],
                  inputs: Optional[List[List[Optional[StepInputs]]]] = None
                  ) -> Tuple[List[Dict[str, torch.Tensor]], List[List[float]], List[Dict[str, float]]]:
    """Run the stacked clients' local updates, phase by phase. ``form``: any client's form (its losses and modules
    are used with each client's tensors substituted); ``states``: each client's ``form_tensors`` after receiving the
    round's message; ``plans``: per client, one ``ClientPlan`` per phase; ``data``: each client's ``TensorData``;
    ``inputs``: per client, per phase, its ``StepInputs`` (``BatchedPhase.inputs``) or None.
    Returns each client's tensors after training, its mean training loss per phase (as ``run_sgd`` computes it) and
    the sums of its ``aux`` phases' values.

    The stack is ordered by the clients' numbers of full batches, most first (FedJAX's recipe for ragged clients), so
    the clients still stepping are a prefix of the stack: a step runs on views of it, gathering and scattering
    nothing; where an order fits no phase (or for the last, smaller batches) a step gathers its rows."""
    k = len(states)
    order = sorted(range(k), key=lambda i: [-len(f) for p in plans[i] for f in p.full] + [i])
    back = {pos: i for i, pos in enumerate(order)}
    states = [states[i] for i in order]
    plans = [plans[i] for i in order]
    data = [data[i] for i in order]
    inputs = [inputs[i] for i in order] if inputs is not None else [[None] * len(form.phases) for _ in range(k)]
    names = list(states[0])
    T = {n: torch.stack([s[n] for s in states]) for n in names}
    device = next(iter(T.values())).device
    holder = _Modules(form.modules)
    for name, module in form.modules.items():
        module.train(name not in form.eval_modules)
    losses: List[List[float]] = [[] for _ in range(k)]
    aux_sums: Dict[str, torch.Tensor] = {}
    for ph, phase in enumerate(form.phases):
        chosen = set(phase.trains)
        trains = [n for n in names if n in chosen]
        consts = [n for n in names if n not in chosen]
        projected = {n: spec for n, spec in (phase.projected or {}).items() if n in chosen}
        opt = StackedOptimizer({n: T[n] for n in trains if n not in projected}, train_cfg, phase.lr, phase.lrs)
        opt.projected = [(trains.index(n), T[n], spec) for n, spec in projected.items()]
        grads = _Grads(holder, phase.loss, trains, consts, phase.aux)
        loss_sum = torch.zeros(k, device=device)
        phase_plans = [p[ph] for p in plans]
        phase_inputs = [p[ph] for p in inputs]
        _run_phase(grads, [T[n] for n in trains], [T[n] for n in consts], opt, loss_sum, phase_plans, data, k,
                   device, aux_sums if phase.aux else None,
                   phase_inputs if any(st is not None for st in phase_inputs) else None)
        steps = [p.steps for p in phase_plans]
        for i, total in enumerate(loss_sum.double().tolist()):
            losses[i].append(total / steps[i] if steps[i] else 0.0)
    out = [{n: T[n][i] for n in names} for i in range(k)]
    aux = [{name: float(v) for name, v in zip(aux_sums, vals)} for vals in
           zip(*[t.double().tolist() for t in aux_sums.values()])] if aux_sums else [{} for _ in range(k)]
    return ([out[back[i]] for i in range(k)], [losses[back[i]] for i in range(k)],
            [aux[back[i]] for i in range(k)])


def _run_phase(grads: _Grads, P: List[torch.Tensor], C: List[torch.Tensor], opt: StackedOptimizer,
               loss_sum: torch.Tensor, plans: List[ClientPlan], data, k: int, device,
               aux_sums: Optional[Dict[str, torch.Tensor]] = None,
               inputs: Optional[List[Optional[StepInputs]]] = None) -> None:
    solo_ok = device.type == "cpu"
    # where each client's epochs start in its step order (the index of its per-step inputs)
    starts = [[sum(len(p.full[j]) + (p.last[j] is not None) for j in range(e)) for e in range(len(p.full))]
              for p in plans] if inputs is not None else None

    def extra(i: int, e: int, first: int, count: int) -> Tuple[torch.Tensor, ...]:
        """Client ``i``'s inputs of steps ``first .. first + count - 1`` of epoch ``e``, each [count, ...]."""
        st = inputs[i]
        if st is None or not count:
            return ()
        at = starts[i][e] + first
        got = st.source.batch(st.index[at:at + count].reshape(-1))
        return tuple(t.view(count, -1, *t.shape[1:]) for t in got)

    def step(rows: Any, count: int, xs: torch.Tensor, ys: torch.Tensor, es: Any = ()) -> None:
        """One step of ``count`` clients: ``rows`` None (all), a slice of the stack, or an index tensor."""
        grad_fn = grads.solo if (solo_ok and count <= SOLO_CLIENTS) or isinstance(xs, list) else grads.vmapped
        gathered = isinstance(rows, torch.Tensor)
        if rows is None:
            p, c = P, C
        else:
            p = [t[rows] for t in P]
            c = [t[rows] for t in C]
        g, loss = grad_fn(p, c, xs, ys, es)  # BatchNorm statistics update c in place (views: the stack itself)
        if gathered:
            for t, sub in zip(C, c):
                t.index_copy_(0, rows, sub)
        opt.step(g, rows)
        if aux_sums is not None:
            loss, extra = loss
            for name, v in extra.items():
                if name not in aux_sums:
                    aux_sums[name] = torch.zeros(k, dtype=torch.float64, device=device)
                add(aux_sums[name], rows, v.double())
        add(loss_sum, rows, loss)

    def add(store: torch.Tensor, rows: Any, values: torch.Tensor) -> None:
        if isinstance(rows, torch.Tensor):
            store.index_add_(0, rows, values)
        elif rows is None:
            store.add_(values)
        else:
            store[rows] += values

    epochs = max((len(p.full) for p in plans), default=0)
    for e in range(epochs):
        # full batches: per client one gather of this epoch's samples; steps along the first dimension
        counts = [len(p.full[e]) if e < len(p.full) else 0 for p in plans]
        width = max(counts, default=0)
        if width:
            present = [i for i in range(k) if counts[i]]
            xs_all, ys_all, es_all = [], [], []
            for i in present:
                x, y = data[i].batch(torch.cat(plans[i].full[e]))
                x = x.view(counts[i], -1, *x.shape[1:])
                y = y.view(counts[i], -1, *y.shape[1:])
                ex = extra(i, e, 0, counts[i]) if inputs is not None else ()
                if counts[i] < width:  # idle slots: never computed (the step runs on the active rows only)
                    x = torch.cat([x, x[:1].expand(width - counts[i], *x.shape[1:])])
                    y = torch.cat([y, y[:1].expand(width - counts[i], *y.shape[1:])])
                    ex = tuple(torch.cat([t, t[:1].expand(width - counts[i], *t.shape[1:])]) for t in ex)
                xs_all.append(x)
                ys_all.append(y)
                es_all.append(ex)
            X = torch.stack(xs_all, dim=1)  # [width, clients with batches, batch, ...]: X[t][:m] is contiguous
            Y = torch.stack(ys_all, dim=1)
            E = tuple(torch.stack(parts, dim=1) for parts in zip(*es_all))  # the per-step inputs, laid out as X
            del xs_all, ys_all, es_all
            prefix = all(counts[i] >= counts[i + 1] for i in range(k - 1))
            for t in range(width):
                if prefix:
                    m = sum(1 for c in counts if c > t)
                    step(None if m == k else slice(0, m), m, X[t][:m], Y[t][:m], tuple(t_[t][:m] for t_ in E))
                else:
                    active = [j for j, i in enumerate(present) if counts[i] > t]
                    if len(active) == k:
                        step(None, k, X[t], Y[t], tuple(t_[t] for t_ in E))
                    else:
                        sel = torch.tensor(active, device=X.device)
                        rows = torch.tensor([present[j] for j in active], device=device)
                        step(rows, len(active), X[t][sel], Y[t][sel], tuple(t_[t][sel] for t_ in E))
            del X, Y, E
        # last (smaller) batches: one step per distinct size
        sizes: Dict[int, List[int]] = {}
        for i, p in enumerate(plans):
            if e < len(p.last) and p.last[e] is not None:
                sizes.setdefault(len(p.last[e]), []).append(i)
        alone: List[int] = []  # clients of sizes too few to stack (CPU): one plain pass each, in one step
        for size in sorted(sizes):
            members = sizes[size]
            if solo_ok and len(members) <= SOLO_CLIENTS:
                alone.extend(members)
                continue
            batches = [data[i].batch(plans[i].last[e]) for i in members]
            xs = torch.stack([b[0] for b in batches])
            ys = torch.stack([b[1] for b in batches])
            es: Any = ()
            if inputs is not None:
                es = tuple(torch.cat(parts) for parts in zip(*[extra(i, e, len(plans[i].full[e]), 1)
                                                               for i in members]))
            step(_rows(members, k, device), len(members), xs, ys, es)
        if alone:
            alone.sort()
            batches = [data[i].batch(plans[i].last[e]) for i in alone]
            es = [tuple(t[0] for t in extra(i, e, len(plans[i].full[e]), 1)) for i in alone] \
                if inputs is not None else ()
            step(_rows(alone, k, device), len(alone), [b[0] for b in batches], [b[1] for b in batches], es)


def _rows(members: List[int], k: int, device) -> Any:
    """``members`` (sorted stack positions) as a step's rows: None (all), a slice, or an index tensor."""
    if len(members) == k:
        return None
    if members == list(range(members[0], members[-1] + 1)):
        return slice(members[0], members[-1] + 1)
    return torch.tensor(members, device=device)


def _seed_host(seed: int) -> None:
    """``seed_everything(seed)`` for code that runs before a batched group: python, numpy and torch's CPU generator
    (CUDA generators are seeded through seed_everything once per round)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.default_generator.manual_seed(seed)


# -- the backend's side ---------------------------------------------------------------------------------------------
def _fit_message(message: Any) -> bool:
    return message.kind == "fit" and isinstance(message.payload, dict)


def _inputs_key(inputs: Optional[StepInputs]) -> Any:
    """What stacked clients' per-step inputs must share: the indices per step and the tensors' shapes and dtypes."""
    if inputs is None:
        return None
    sample = inputs.source.batch(inputs.index[:1].reshape(-1))
    return (tuple(inputs.index.shape[1:]), tuple((tuple(t.shape[1:]), t.dtype) for t in sample))


@dataclass
class BatchedRunner:
    """Runs a round's ``fit`` calls batched inside a serial backend (each rank's, in a distributed run)."""

    plan: BatchedPlan
    device: torch.device
    free: Optional[Callable[[torch.device], Optional[int]]] = None  # free device memory (tests stand in for a GPU)
    groups_run: int = 0  # batched groups trained so far (tests and the benchmark read these)
    fallbacks: int = 0  # groups that raised or timed out and ran again client by client
    verified: bool = False  # the stack was checked against one client at a time (once per process: start, resume)
    evaluations_run: int = 0  # evaluations scored in one batched pass (core/engine/batched_eval.py)
    evaluation_fallbacks: int = 0  # batched evaluation passes that raised or timed out (scored one at a time)
    evaluation_refused: bool = False  # a pass failed: this run evaluates one client at a time from then on
    eval_rows: Any = field(default=None, repr=False)  # the last batched evaluation's rows, laid out (a RowCache)
    _bound: Optional[int] = field(default=None, repr=False)
    _bound_known: bool = field(default=False, repr=False)

    def takes(self, calls: Dict[int, Any]) -> bool:
        """Whether these calls run batched: two or more, every one a message the trainer's batched form runs (a
        ``fit``, unless the trainer's ``batched_message`` says otherwise)."""
        accepts = self.plan.accepts or _fit_message
        return self.plan.batched and len(calls) > 1 and all(accepts(c.message) for c in calls.values())

    def scores(self, backend: Any, calls: Dict[int, Any]) -> bool:
        """Whether these calls are evaluations scored in one batched pass (core/engine/batched_eval.py)."""
        from . import batched_eval

        return batched_eval.takes(self, backend, calls)

    def evaluate(self, backend: Any, calls: Dict[int, Any]) -> Iterator[Any]:
        """The results of evaluate ``calls`` that ``scores`` accepted, in client order."""
        from . import batched_eval

        if self.eval_rows is None:
            self.eval_rows = batched_eval.RowCache()
        return batched_eval.run(self, backend, calls)

    def bound(self, trainer: LocalSGDTrainer, form: BatchedForm) -> Optional[int]:
        if not self._bound_known:
            def need() -> int:
                data = trainer.ctx.train
                b = int(trainer.ctx.train_cfg.batch_size)
                x, y = data.batch(torch.arange(min(b, len(data)), device=data.y.device))
                slots = 2 if trainer.ctx.train_cfg.optimizer == "adam" else 1
                return per_client_bytes(form, x, y, slots)
            self._bound = stack_bound(self.plan.stack, self.device, need, self.free)
            self._bound_known = True
        return self._bound

    def run(self, backend: Any, calls: Dict[int, Any], snapshot: bool) -> Iterator[Any]:
        from .backend import CallResult

        prepared: Dict[int, Tuple[Dict[str, torch.Tensor], List[ClientPlan], Any, tuple]] = {}
        spent: Dict[int, float] = {}
        failed: List[Any] = []
        trainer = form = None
        for cid in sorted(calls):  # receive the message, replay the batch order: per client, as sequentially
            start = time.perf_counter()
            call = calls[cid]
            try:
                trainer = backend.batched_bind(cid, snapshot)
            except (PflError, KeyboardInterrupt):
                raise
            except Exception as exc:
                failed.append(CallResult(cid, error=f"swapping its state in: {type(exc).__name__}: {exc}",
                                         detail=traceback.format_exc()))
                continue
            try:
                _seed_host(call.seed)  # as seed_everything, without its per-call CUDA bookkeeping (below)
                trainer.ctx.round = call.round
                trainer.ctx.generator.manual_seed(call.seed)
                trainer.batched_begin(call.message.payload)
                form = trainer.batched_form()
                if not isinstance(form, BatchedForm):
                    raise TypeError(f"{type(trainer).__name__}.batched_form() returned {type(form).__name__}, not "
                                    f"a BatchedForm")
                state = {n: t.detach().clone() for n, t in form_tensors(form).items()}
                plans = [client_plan(trainer, ph.epochs, ph.batch_size, ph.drop_last) for ph in form.phases]
                # per-step inputs beyond the batch, drawn on the client's own trainer, phase after phase
                inputs = [None if ph.inputs is None else ph.inputs(p.steps) for ph, p in zip(form.phases, plans)]
                # clients stack only with clients whose phases are alike
                shape = tuple((tuple(ph.trains), ph.epochs, ph.batch_size, ph.lr, ph.drop_last, ph.aux,
                               tuple(sorted((ph.lrs or {}).items())), _inputs_key(st))
                              for ph, st in zip(form.phases, inputs))
                prepared[cid] = (state, plans, trainer.ctx, shape, form, inputs)
            except (KeyboardInterrupt, ClientTimedOut):
                raise
            except Exception as exc:
                failed.append(CallResult(cid, error=f"{type(exc).__name__}: {exc}", detail=traceback.format_exc()))
            spent[cid] = time.perf_counter() - start
            err = backend.batched_release(cid)
            if err is not None:
                prepared.pop(cid, None)
                failed.append(err)
        # the process RNGs end the round as after the sequential path's last call (the batched steps draw nothing)
        seed_everything(calls[max(calls)].seed)
        for res in failed:
            yield res
        if not prepared:
            return
        bound = self.bound(trainer, form)
        shapes: Dict[tuple, Dict[int, int]] = {}
        for cid, (_, plans, _, shape, _, _) in prepared.items():
            shapes.setdefault(shape, {})[cid] = sum(p.steps for p in plans)
        for steps in shapes.values():
            for group in group_by_steps(steps, bound):
                yield from self._run_group(backend, group, calls, prepared, spent)

    def _run_group(self, backend: Any, group: List[int], calls: Dict[int, Any], prepared: Dict[int, Any],
                   spent: Dict[int, float]) -> Iterator[Any]:
        from .backend import CallResult

        if not self.plan.batched:  # refused by the self-check earlier in this round
            for cid in group:
                yield backend._run_one(cid, calls[cid], False)
            return
        if not self.verified and len(group) > 1:
            mismatch = verify_stack(backend, group, prepared)
            if mismatch is None:
                self.verified = True
            else:
                self._refuse(mismatch)
                for cid in group:  # as the fallback below: each client's message again, one at a time
                    yield backend._run_one(cid, calls[cid], False)
                return
        start = time.perf_counter()
        limit = backend.client_timeout
        try:
            with deadline(None if limit is None else limit * len(group),
                          lambda: backend._hung_message(group[0], calls[group[0]].round)):
                form, train_cfg = prepared[group[0]][4], prepared[group[0]][2].train_cfg  # any client's form
                states, losses, aux = train_stacked(form, train_cfg, [prepared[c][0] for c in group],
                                                    [prepared[c][1] for c in group],
                                                    [prepared[c][2].train for c in group],
                                                    [prepared[c][5] for c in group])
        except (KeyboardInterrupt, PflError):
            raise
        except (Exception, ClientTimedOut) as exc:  # find the client: run the group again one client at a time
            self.fallbacks += 1
            log.debug("batched group %s failed (%s: %s); running its clients one at a time", group,
                      type(exc).__name__, exc)
            for cid in group:  # a live trainer's rollback snapshot was taken before it received the message
                yield backend._run_one(cid, calls[cid], False)
            return
        self.groups_run += 1
        share = (time.perf_counter() - start) / len(group)
        for cid, state, loss, extra in zip(group, states, losses, aux):
            t0 = time.perf_counter()
            try:
                tr = backend.batched_bind(cid, False)
            except (PflError, KeyboardInterrupt):
                raise
            except Exception as exc:
                yield CallResult(cid, error=f"swapping its state in: {type(exc).__name__}: {exc}",
                                 detail=traceback.format_exc())
                continue
            try:
                # its trained tensors into the modules of the form its trainer built right after its batched_begin
                # (the trainer's own modules, as bound now: no second batched_form() per client), whose reply may
                # hold what batched_begin computed
                own = prepared[cid][4]
                with torch.no_grad():
                    for n, t in form_tensors(own).items():
                        t.copy_(state[n])
                result = CallResult(cid, reply=own.reply(loss, prepared[cid][0], extra))
            except (KeyboardInterrupt, ClientTimedOut):
                raise
            except Exception as exc:
                result = CallResult(cid, error=f"{type(exc).__name__}: {exc}", detail=traceback.format_exc())
            err = backend.batched_release(cid)
            result.seconds = spent.get(cid, 0.0) + share + time.perf_counter() - t0
            yield result if err is None else err


    def _refuse(self, mismatch: str) -> None:
        """The stack computed other numbers than one client at a time: ``on`` stops the run with one line; ``auto``
        trains one client after another from here on, and says so once."""
        if self.plan.mode == "on":
            raise ConfigError(f"clients.batched=on: {mismatch}; batching would change this trainer's numbers, so "
                              f"it is refused (use clients.batched=auto or off)")
        self.plan.batched = False
        self.plan.reason = f"auto: batching refused by its self-check ({mismatch})"
        log.warning("clients.batched=auto: %s; training one client after another from here on", mismatch)


VERIFY_RTOL, VERIFY_ATOL = 1e-3, 1e-5  # float rounding between a vectorised and a plain pass is far below these


def verify_stack(backend: Any, group: List[int], prepared: Dict[int, Any]) -> Optional[str]:
    """One step of two clients of ``group``, stacked (the batched path's own computation: the group's form, each
    client's tensors substituted) and one at a time (each client's own trainer and form, as the sequential path runs
    it), from the same state and mini-batch: None when the losses and gradients agree within float tolerance, else
    what differs. Catches a loss that reads per-client state the stack does not substitute (one client's for every
    client) or reaches parameters outside its modules (a term the stack drops). Changes no state and draws no
    random numbers: each trainer's tensors are put back as they were."""
    pair = group[:2]
    form = prepared[group[0]][4]  # the form train_stacked runs for the whole group
    phase_at = next((i for i, _ in enumerate(form.phases)
                     if all(_first_batch(prepared[c][1][i]) is not None for c in pair)), None)
    if phase_at is None:
        return None  # no step to compare (empty clients)
    phase = form.phases[phase_at]
    names = list(prepared[pair[0]][0])
    trains = [n for n in names if n in set(phase.trains)]
    consts = [n for n in names if n not in set(phase.trains)]
    batches = []
    for c in pair:
        idx = _first_batch(prepared[c][1][phase_at])
        x, y = prepared[c][2].train.batch(idx)
        st = prepared[c][5][phase_at]
        extra = tuple(st.source.batch(st.index[0])) if st is not None and len(st.index) else ()
        batches.append((x, y, extra))
    # stacked: the batched path's computation for both clients at once
    holder = _Modules(form.modules)
    for name, module in form.modules.items():
        module.train(name not in form.eval_modules)
    grads = _Grads(holder, phase.loss, trains, consts, phase.aux)
    P = [torch.stack([prepared[c][0][n] for c in pair]) for n in trains]
    C = [torch.stack([prepared[c][0][n] for c in pair]) for n in consts]
    stacked_grads, value = grads.solo(P, C, [b[0] for b in batches], [b[1] for b in batches],
                                      [b[2] for b in batches])
    stacked_loss = value[0] if phase.aux else value
    for i, c in enumerate(pair):
        trainer = backend.batched_bind(c, False)
        try:
            own = prepared[c][4]
            tensors = form_tensors(own)
            with torch.no_grad():
                for n, t in tensors.items():
                    t.copy_(prepared[c][0][n])
            for name, module in own.modules.items():
                module.train(name not in own.eval_modules)
            x, y, extra = batches[i]
            with torch.enable_grad():
                out = own.phases[phase_at].loss(x, y, *extra)
                loss = out[0] if phase.aux else out
                leaves = [tensors[n] for n in trains]
                got = torch.autograd.grad(loss, leaves, allow_unused=True)
            what = type(trainer).__name__
            if not torch.allclose(loss.detach().reshape(()), stacked_loss[i].detach().reshape(()),
                                  rtol=VERIFY_RTOL, atol=VERIFY_ATOL):
                return (f"trainer {what}: client {c}'s loss is {float(loss.detach()):.6g} one client at a time but "
                        f"{float(stacked_loss[i]):.6g} stacked (a loss that reads per-client state)")
            for n, g, s in zip(trains, got, stacked_grads):
                g = torch.zeros_like(s[i]) if g is None else g
                if not torch.allclose(g, s[i], rtol=VERIFY_RTOL, atol=VERIFY_ATOL):
                    return (f"trainer {what}: client {c}'s gradient of {n} differs stacked from one client at a "
                            f"time (max {float((g - s[i]).abs().max()):.3g}: a loss that reads per-client state or "
                            f"reaches parameters outside its modules)")
        finally:
            with torch.no_grad():
                for n, t in form_tensors(prepared[c][4]).items():
                    t.copy_(prepared[c][0][n])
            backend.batched_release(c)
    return None


def _first_batch(plan: ClientPlan) -> Optional[torch.Tensor]:
    for epoch, full in enumerate(plan.full):
        if full:
            return full[0]
        if plan.last[epoch] is not None:
            return plan.last[epoch]
    return None


def plan_from_config(cfg: Any, trainer_cls: type, device: torch.device, make_trainer: Callable[[], Any]
                     ) -> BatchedPlan:
    """The run's plan: ``clients.batched`` and ``clients.stack`` (``.get``: a run saved before the keys existed
    runs sequentially, as it did)."""
    clients = cfg.get("clients", {}) or {}
    mode = clients.get("batched", "off") or "off"
    stack = clients.get("stack")
    return decide(mode, trainer_cls, cfg.trainer.name, device, lambda: probe(make_trainer()), stack)

