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

from .params import Param, ParamSpec
from .protocol import Message
from .state import State, bn_keys, clone_state, load_into, module_keys
from .task import Task
from .training import TensorData, evaluate, make_optimizer, minibatches, run_sgd


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

    @property
    def num_train(self) -> int:
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

    def __init__(self, ctx: ClientContext):
        self.ctx = ctx

    def handle(self, message: Message) -> Dict[str, Any]:
        method = getattr(self, f"on_{message.kind}", None)
        if method is None:
            raise NotImplementedError(f"{type(self).__name__} cannot handle message kind '{message.kind}'")
        reply = method(message.payload)
        return {} if reply is None else reply

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    # helpers for subclasses -------------------------------------------------------------------------------
    def batches(self, epochs: Optional[int] = None, batch_size: Optional[int] = None, drop_last: bool = False):
        """This round's mini-batches of the client's training split (``train.batch_size``/``local_epochs``)."""
        cfg = self.ctx.train_cfg
        return minibatches(self.ctx.train, batch_size or cfg.batch_size, epochs or cfg.local_epochs,
                           generator=self.ctx.generator, drop_last=drop_last)

    def evaluate_model(self, forward, modules=()) -> Dict[str, Any]:
        """Score ``forward`` on the client's test split (``modules`` are switched to eval mode meanwhile)."""
        return evaluate(forward, self.ctx.test, self.ctx.task, self.ctx.train_cfg.eval_batch_size,
                        modules).as_dict()


BN_PARAM = Param("shared", "batch-norm running statistics: shared with the server or kept local",
                 choices=("shared", "local"))


class LocalSGDTrainer(ClientTrainer):
    """The "global-model" protocol: receive shared state, train locally with SGD, upload shared state.

    Subclasses change one thing at a time: ``shared_keys`` (what is federated), ``loss`` (the objective),
    ``local_update`` (the training schedule), ``personal_forward`` (the model that is evaluated).

    Messages: ``fit`` {params} -> {params, num_samples, train_loss}; ``evaluate`` {params?} -> eval sums.
    """

    protocol = "global-model"
    params: ParamSpec = {"bn_stats": BN_PARAM}

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
        if "params" in payload:
            self.receive(payload["params"])
        loss = self.local_update()
        return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": loss}

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        if "params" in payload:
            self.receive(payload["params"])
        return self.evaluate_model(self.personal_forward())

    # extension points -----------------------------------------------------------------------------------
    def receive(self, params: State) -> None:
        load_into(self.model, {k: params[k] for k in self.shared if k in params})

    def upload(self) -> State:
        sd = self.model.state_dict()
        return {k: sd[k].detach().clone() for k in self.shared}

    def data_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The data term of ``model``'s objective on one batch. Every objective of a trainer goes through it
        (``loss`` for ``self.model``; Ditto's personal objective for its personal model), so an algorithm that
        augments another (core/compose.py; PCFL adds Eq. 14's terms) can add terms to exactly the model it needs.
        """
        return self.ctx.task.loss(model(x), y)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.data_loss(self.model, x, y)

    def local_update(self) -> float:
        self.model.train()
        opt = make_optimizer(self.model.parameters(), self.ctx.train_cfg)
        return run_sgd(self.batches(), self.loss, opt)

    def personal_forward(self):
        return self.model

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])


def head_keys(model: nn.Module) -> List[str]:
    return module_keys(model, "head")


def feature_keys(model: nn.Module) -> List[str]:
    return module_keys(model, "features")
