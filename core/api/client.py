"""Client side of the protocol: the context a client's code runs in, and trainer base classes.

The privacy boundary: a ``ClientContext`` holds that client's data and is handed only to that client's trainer;
the server never receives it. Everything that leaves a client does so as a reply payload, which the core
inspects (``comm.Communicator``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from easydict import EasyDict
from torch import nn

from .adaptation import AdaptationHooks, AdaptationSettings, evaluate_adapted
from .batching import BatchedForm, BatchedPhase, trained_names
from .globalmodel import GLOBAL_EVALUATE, evaluate_global
from .params import Param, ParamSpec
from .protocol import Message
from .state import State, bn_keys, load_into, module_keys
from .task import Task
from .training import TensorData, evaluate, evaluation_reply, make_optimizer, minibatches, run_sgd


@dataclass
class ClientContext:
    """Everything client ``cid``'s code may use. Never given to the server."""

    cid: int
    train: TensorData
    test: TensorData
    task: Task
    device: torch.device
    hp: EasyDict  # this trainer's hyperparameters (config section ``trainer``)
    train_cfg: EasyDict  # shared local-training settings (config section ``train``)
    build_model: Callable[[], nn.Module]  # same initial weights on every client and the server
    num_clients: int
    seed: int
    round: int = 0  # set by the backend before each call
    generator: torch.Generator = field(default_factory=torch.Generator)  # reseeded before each call
    adaptation: Optional[AdaptationSettings] = None  # eval.adapt* (core/api/adaptation.py); None: scores unadapted
    val: Optional[TensorData] = None  # the validation split (split.val), scored beside test; None: none held out

    @property
    def num_train(self) -> int:
        """The number of this client's training samples."""
        return len(self.train)


class ClientTrainer:
    """Handles the messages addressed to one client.

    A message of kind ``k`` is answered by method ``on_<k>(payload) -> reply``. ``state_dict`` /
    ``load_state_dict`` must capture everything the client keeps across rounds (checkpoints use them).
    ``protocol`` names the message contract; a trainer pairs only with aggregators of the same protocol.
    """

    protocol: str = ""
    params: ParamSpec = {}
    description: str = ""
    #: True in a trainer's own class body (not inherited): ``on_evaluate`` scores exactly the model state the
    #: evaluate message brings, so its numbers are the global model's and the core does not evaluate that model a
    #: second time (core/api/globalmodel.py)
    personal_is_global: bool = False

    def __init__(self, ctx: ClientContext):
        self.ctx = ctx

    def handle(self, message: Message) -> Dict[str, Any]:
        """Dispatch ``message`` to ``on_<kind>(payload)`` and return its reply (``{}`` for None)."""
        if message.kind == GLOBAL_EVALUATE:  # the core's plain evaluation of the global model, whatever the trainer
            return evaluate_global(self.ctx, message.payload)
        method = getattr(self, f"on_{message.kind}", None)
        if method is None:
            raise NotImplementedError(f"{type(self).__name__} cannot handle message kind '{message.kind}'")
        reply = method(message.payload)
        return {} if reply is None else reply

    def state_dict(self) -> Dict[str, Any]:
        """Everything this object keeps across rounds, for checkpoints (tensors, numbers, lists, dicts)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (resume from a checkpoint)."""

    # declared per-client state (pooled execution) --------------------------------------------------------
    #: Set ``declares_state = True`` in a trainer's own class body to promise that ``client_state`` holds
    #: everything a client keeps between calls; anything else the trainer holds is either client-independent
    #: (built in ``__init__`` from the model factory and hyperparameters only) or rewritten by every message
    #: before it is read. The core then runs all clients through one pooled trainer per worker, swapping each
    #: client's declared state in before a call and out after it. The flag is not inherited (``state_declared``
    #: reads the class's own body), so a subclass that adds state of its own stays on the legacy path -- one
    #: live trainer per client, ``state_dict`` in checkpoints -- until it declares that state too.
    declares_state: bool = False

    def client_state(self) -> Dict[str, Any]:
        """The declared per-client state: a sub-dict of ``state_dict``'s structure (tensors are copied)."""
        return {}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        """Restore what ``client_state`` returned (or the matching part of a full ``state_dict``)."""

    def swapped_in(self) -> None:
        """Called by the core after it bound this pooled trainer to another client and loaded its state."""

    # helpers for subclasses -------------------------------------------------------------------------------
    def batches(self, epochs: Optional[int] = None, batch_size: Optional[int] = None, drop_last: bool = False):
        """This round's mini-batches of the client's training split (``train.batch_size``/``local_epochs``/
        ``drop_last``); ``drop_last=True`` drops the last incomplete batch even when ``train.drop_last`` is off (a
        trainer's own need, e.g. BatchNorm on a batch of one)."""
        cfg = self.ctx.train_cfg
        return minibatches(self.ctx.train, batch_size or cfg.batch_size, epochs or cfg.local_epochs,
                           generator=self.ctx.generator, drop_last=drop_last or bool(cfg.get("drop_last", False)))

    def evaluate_model(self, forward, modules=()) -> Dict[str, Any]:
        """Score ``forward`` on the client's test split, and on its validation split when it holds one (``modules``
        are switched to eval mode meanwhile). A trainer that scores its own way must reply with the same sums."""
        return evaluation_reply(forward, self.ctx.test, self.ctx.val, self.ctx.task,
                                self.ctx.train_cfg.eval_batch_size, modules)


BN_PARAM = Param("shared", "batch-norm running statistics: shared with the server or kept local",
                 choices=("shared", "local"))


class LocalSGDTrainer(AdaptationHooks, ClientTrainer):
    """The "global-model" protocol: receive shared state, train locally with SGD, upload shared state.

    Subclasses change one thing at a time: ``shared_keys`` (what is federated), ``loss`` (the objective),
    ``local_update`` (the training schedule), ``personal_forward`` (the model that is evaluated).

    Messages: ``fit`` {params} -> {params, num_samples, train_loss}; ``evaluate`` {params?} -> eval sums.
    """

    protocol = "global-model"
    params: ParamSpec = {"bn_stats": BN_PARAM}
    # pooled, a client keeps only ``client_keys``: the rest must come with every message (see ``can_pool``)
    needs_shared_delivery = True
    adapts_at_evaluation = True  # on_evaluate applies eval.adapt (core/api/adaptation.py checks the defining class)

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        self.model = ctx.build_model()
        self.shared = self.shared_keys(self.model, ctx.hp)

    @classmethod
    def shared_keys(cls, model: nn.Module, hp: EasyDict) -> List[str]:
        """State keys that travel to and from the server (all, minus BN statistics when they are local)."""
        keys = list(model.state_dict())
        if hp.get("bn_stats", "shared") == "local":
            local = set(bn_keys(model))
            keys = [k for k in keys if k not in local]
        return keys

    # protocol -------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Answer a ``fit`` message: take the server's shared state (``receive``), train (``local_update``), reply
        ``{"params": upload(), "num_samples": ..., "train_loss": ...}``. The core vets the reply (keys, shapes,
        dtypes, finite values, ``num_samples`` within the client's training split) before the server sees it.
        Override only to change the message contract; to change the training, override ``loss`` or
        ``local_update``."""
        if "params" in payload:
            self.receive(payload["params"])
        else:
            self.require_shared()
        loss = self.local_update()
        return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": loss}

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Answer an ``evaluate`` message: take the shared state it brings, then score ``personal_forward()`` on the
        client's test split (after ``eval.adapt*`` fine-tuning of a scratch copy where that applies). The reply holds
        evaluation sums (``loss_sum``, ``metric_sum``, ``n``), which the core checks and averages over clients."""
        if "params" in payload:
            self.receive(payload["params"])
        else:
            self.require_shared()
        adapt = self.ctx.adaptation
        if adapt is not None and adapt.applies(self.ctx.round):  # a scratch copy is adapted, scored, discarded
            return evaluate_adapted(self, adapt)
        return self.evaluate_model(self.personal_forward())

    # extension points -----------------------------------------------------------------------------------
    def receive(self, params: State) -> None:
        """Load the server's shared state into ``self.model``: the keys of ``self.shared`` that ``params`` holds
        (a personal part, e.g. FedPer's head, stays the client's own). Override to merge instead of overwrite
        (FedALA's adaptive local aggregation, APFL's mixture)."""
        load_into(self.model, {k: params[k] for k in self.shared if k in params})
        self._shared_stale = False

    def upload(self) -> State:
        """What this client sends back after ``local_update``: detached copies of ``self.shared`` (the core checks
        them against the server's expected layout, ``ServerAggregator.reply_layout``)."""
        sd = self.model.state_dict()
        return {k: sd[k].detach().clone() for k in self.shared}

    def data_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The data term of ``model``'s objective on one batch. Every objective of a trainer goes through it
        (``loss`` for ``self.model``; Ditto's personal objective for its personal model), so an algorithm that
        augments another (core/engine/compose.py; PCFL adds Eq. 14's terms) can add terms to exactly the model it needs.
        """
        return self.ctx.task.loss(model(x), y)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The objective of one mini-batch ``(x, y)`` that ``local_update`` minimises: ``data_loss`` of
        ``self.model`` here; FedProx adds its proximal term, MOON its contrastive term. Under ``clients.batched`` the
        core runs this same method under ``torch.func.vmap`` (docs/batched-clients.md says what it may read)."""
        return self.data_loss(self.model, x, y)

    def local_update(self) -> float:
        """This round's local training: ``train.local_epochs`` epochs of SGD (``make_optimizer``: ``train.*``
        settings) over the client's own mini-batches on ``loss``; returns the last epoch's mean training loss.
        Override to change the schedule (FedRep's head-then-body epochs, Ditto's two solves)."""
        self.model.train()
        opt = make_optimizer(self.model.parameters(), self.ctx.train_cfg)
        return run_sgd(self.batches(), self.loss, opt)

    def personal_forward(self):
        """The model that ``on_evaluate`` scores as this client's personal model (a callable ``x -> output``):
        ``self.model`` here; e.g. Ditto's personal model or APFL's mixture in their trainers."""
        return self.model

    def batched_form(self) -> Optional[BatchedForm]:
        """The functional form of ``on_fit``'s local update (core/api/batching.py), for ``clients.batched``: one phase
        of ``train.local_epochs`` epochs on ``self.loss`` over the trainable parameters. A trainer that overrides the
        fit path (``on_fit``, ``receive``, ``upload``, ``local_update``, ``batches``) declares its own form in the same
        class (or returns None: its clients then run one after another)."""
        phase = BatchedPhase(self.loss, trained_names(self.model, "model"), int(self.ctx.train_cfg.local_epochs))
        return BatchedForm({"model": self.model}, [phase], lambda losses, start, aux: {
            "params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": losses[-1]})

    @classmethod
    def batched_message(cls, message: Any) -> bool:
        """Whether ``message`` is one this trainer's batched form runs (clients.batched): ``batched_begin`` gets its
        payload. A ``fit``; a trainer that wraps its fit in a message of its own (PCFL's ``pcfl_fit``) says so here."""
        return message.kind == "fit" and isinstance(message.payload, dict)

    def batched_begin(self, payload: Dict[str, Any]) -> None:
        """What ``on_fit`` does before its local update, for clients.batched."""
        if "params" in payload:
            self.receive(payload["params"])
        else:
            self.require_shared()

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])

    # declared state: the model keys the server never sends (FedAvg: none; FedPer: the head; FedBN: BN layers)
    def client_keys(self) -> List[str]:
        """Model keys this client keeps between calls: those not in ``self.shared`` (every message brings those)."""
        # found once per model and shared list (a pooled trainer swaps clients several times a round, and
        # state_dict() walks every module): the keys of a built model do not change
        cached = self.__dict__.get("_client_keys_of")
        if cached is None or cached[0] is not self.model or cached[1] is not self.shared:
            shared = set(self.shared)
            cached = self._client_keys_of = (self.model, self.shared,
                                             [k for k in self.model.state_dict() if k not in shared])
        return list(cached[2])

    def client_state(self) -> Dict[str, Any]:
        keys = self.client_keys()
        return {"model": host_copy(self.model.state_dict(), keys) if keys else {}}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        saved = state["model"]
        keys = self.client_keys()
        if keys:
            load_into(self.model, {k: saved[k] for k in keys})

    def swapped_in(self) -> None:
        # the shared keys still hold the previous client's values until this client's message brings the server's
        self._shared_stale = bool(set(self.shared) - set(self.client_keys()))

    def require_shared(self) -> None:
        """Refuse to use a pooled model whose shared part was never delivered to this client (a message of an
        aggregator that does not send ``params``): its values would be another client's."""
        if getattr(self, "_shared_stale", False):
            raise RuntimeError(f"{type(self).__name__} keeps only its declared state between calls, so every "
                               f"message must carry 'params'; this aggregator sent none")


def state_declared(trainer_cls: type) -> bool:
    """True when ``trainer_cls`` itself (not a base class) declares its per-client state (``declares_state``)."""
    return bool(vars(trainer_cls).get("declares_state", False))


def can_pool(trainer_cls: type, aggregator_cls: type) -> bool:
    """Whether clients of ``trainer_cls`` may run pooled against ``aggregator_cls``: the trainer declares its state,
    and when it relies on the server to deliver its shared part, the aggregator does so in every message."""
    return client_state_backend(trainer_cls, aggregator_cls)["path"] == POOLED


POOLED, ONE_PER_CLIENT = "pooled", "one trainer per client"


def client_state_backend(trainer_cls: type, aggregator_cls: type) -> Dict[str, str]:
    """How a run of this pair keeps its clients' state, and why: ``{"path": "pooled" | "one trainer per client",
    "reason": ...}`` (``fl show``, the run summary and run_info.json say it)."""
    name = getattr(trainer_cls, "__name__", str(trainer_cls))
    if not state_declared(trainer_cls):
        return {"path": ONE_PER_CLIENT, "reason": f"trainer {name} does not declare its per-client state "
                                                  f"(declares_state in its own class body)"}
    if getattr(trainer_cls, "needs_shared_delivery", False):
        check = getattr(aggregator_cls, "delivers_shared_state", None)
        if not (bool(check()) if callable(check) else False):
            return {"path": ONE_PER_CLIENT,
                    "reason": f"aggregator {getattr(aggregator_cls, '__name__', aggregator_cls)} does not send the "
                              f"shared state in every message, which trainer {name} needs to keep only its own part"}
    return {"path": POOLED, "reason": f"trainer {name} declares its per-client state; one working trainer swaps "
                                      f"each client's state in and out"}


def host_copy(state: Dict[str, torch.Tensor], keys: Optional[List[str]] = None) -> State:
    """Detached copies of ``state``'s tensors (all, or ``keys``) in host memory, where declared states are kept."""
    keys = list(state) if keys is None else keys
    return {k: state[k].detach().to("cpu", copy=True) for k in keys}


def head_keys(model: nn.Module) -> List[str]:
    """The ``state_dict`` keys of ``model.head`` (a ``SplitModel``'s classifier), e.g. FedPer's personal layers."""
    return module_keys(model, "head")


def feature_keys(model: nn.Module) -> List[str]:
    """The ``state_dict`` keys of ``model.features`` (a ``SplitModel``'s body), e.g. FedRep's shared representation."""
    return module_keys(model, "features")
