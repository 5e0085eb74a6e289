"""Server side of the protocol: the strategy that drives each round, and the global-model base.

Round protocol (``ServerAggregator.run_round``), modelled on Flower's Strategy:

    configure_fit(rnd, selected)      -> {cid: Message}      one message per selected client
    comm.send(...)                    -> {cid: reply}        failed / rejected clients are absent
    aggregate_fit(rnd, replies)       -> {cid: Message}|None optional push delivered to clients right away
    configure_evaluate(rnd, clients)  -> {cid: Message}      the runner then evaluates *all* clients

Strategies with more phases (pre-training, cross-client work) override ``setup`` or ``run_round`` and call
``comm.send`` as often as they need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from easydict import EasyDict
from torch import nn

from .artifacts import SharedArtifacts
from .params import ParamSpec
from .protocol import Message
from .serverstore import ServerClientStore, ServerStores
from .fold import Layout, fold_mean, layout_of
from .state import State, WeightedMean, clone_state, weighted_average
from .task import Task


class SetupStep(NamedTuple):
    """What a ``setup_steps`` generator may yield after each resumable step: a line for the run's log and console
    (e.g. a block of pre-training steps and its losses) and, when known, how far set-up has come (``done`` of
    ``total`` units), which moves the progress bar. A plain string yielded instead is logged as the line."""

    text: str
    done: Optional[int] = None
    total: Optional[int] = None


@dataclass
class ServerContext:
    """What the server may use: configuration, model factory and metadata -- never client data."""

    hp: EasyDict  # this aggregator's hyperparameters (config section ``aggregator``)
    cfg: EasyDict  # the whole resolved configuration (read-only by convention)
    task: Task
    num_clients: int
    build_model: Callable[[], nn.Module]
    shared_keys: Optional[List[str]]  # what global-model trainers upload, when the trainer declares it
    device: torch.device
    seed: int
    logger: Any  # monitor.RunLogger: log_scalar / log_histogram / log_image / log_text
    rng: np.random.Generator = None  # reseeded from (seed, round) before every round
    # what the experimenter knows about the dataset, never client data: its name, input shape and the loader's
    # ``meta`` (e.g. a synthetic task's ground truth, for evaluating an algorithm, never for training it)
    data_info: Dict[str, Any] = field(default_factory=dict)
    # the server's per-client stores (core.api.serverstore; the run sets their budget, spill folder and checkpointing);
    # an aggregator reaches them with ``ServerAggregator.client_store(name)``
    stores: ServerStores = field(default_factory=ServerStores)
    # set-up results runs may share (core.api.artifacts): PCFL's flow trained once for every seed; by default none
    artifacts: SharedArtifacts = field(default_factory=SharedArtifacts)


class ServerAggregator:
    """Base of every server strategy. Subclasses set ``protocol`` and implement the hooks they need."""

    protocol: str = ""
    params: ParamSpec = {}
    description: str = ""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # reply fields of which this strategy only needs the weighted mean (weights: ``reply_weight`` of each reply,
    # ``num_samples`` unless overridden) over the replying clients: streaming aggregation (core/api/fold.py). The
    # communicator folds each accepted reply's field into a running sum as it arrives and drops the upload;
    # every accepted reply then holds one shared ``state.WeightedMean`` in that field (``mean_of`` reads it). With
    # ``distributed.exact: false`` each rank folds its own clients and the ranks all-reduce the sums. Read from the
    # class that declares it only (``reduced_fields``).
    mean_fields: Tuple[str, ...] = ()

    def reply_weight(self, reply: Dict[str, Any]) -> float:
        """The weight of one accepted reply in this strategy's means (``mean_fields`` and ``combine``): its
        ``num_samples`` by default. A distributed run weighs each reply with this same method on the rank that
        owns the client, so an override (e.g. FedAvg's ``weighting: uniform``: 1 per reply) holds on every path."""
        return float(reply["num_samples"])

    def reply_layout(self, kind: str, field: str) -> Optional[Layout]:
        """The keys, shapes and dtypes (``core.api.fold.layout_of``) that ``field`` of a reply to a ``kind`` message must
        hold, or None where the core does not check it (the strategy then gets the field as the client sent it).

        The core refuses a reply whose field differs (an upload in float64, an extra or a missing key) as it refuses
        a reply with NaN, and blames that client alone: replies are checked against what the server expects, never
        against another reply. Default: the ``params`` of a strategy that streams them (``mean_fields``) hold the
        model's shared state (``model_layout``). A strategy that streams another field, or whose clients upload
        something else (a subset of the keys, other modules), overrides this; one that streams a field must declare
        its layout (the fold has nothing else to check it against)."""
        if field == "params" and field in type(self).reduced_fields():
            return self.model_layout()
        return None

    def model_layout(self, which: str = "shared") -> Layout:
        """The layout of a model state clients upload, with the server model's shapes and dtypes (built once):
        ``shared`` the keys global-model trainers upload (the trainer's declared ``shared_keys``, else all),
        ``state`` the whole ``state_dict``, ``parameters`` its ``named_parameters`` (no buffers)."""
        cache = self.__dict__.setdefault("_model_layouts", {})
        if which not in cache:
            model = self.ctx.build_model()
            sd = model.state_dict()
            if which == "shared":
                keys = self.ctx.shared_keys if self.ctx.shared_keys is not None else list(sd)
            elif which == "state":
                keys = list(sd)
            elif which == "parameters":
                keys = [k for k, _ in model.named_parameters()]
            else:
                raise ValueError(f"model_layout: which={which!r}, expected shared, state or parameters")
            cache[which] = layout_of({k: sd[k] for k in keys})
        return cache[which]

    def reply_sample_limit(self, num_train: int) -> int:
        """The largest ``num_samples`` a client with ``num_train`` training samples may report (the core refuses a
        reply outside 1..this). Its training split by default; an algorithm whose clients legitimately count more
        (samples they synthesise, say) declares how many more here."""
        return num_train

    def mean_of(self, replies: Dict[int, Dict[str, Any]], field: str = "params") -> Optional[State]:
        """The weighted mean (``reply_weight``) of ``field`` over ``replies``: the streamed mean when the field is
        one of ``mean_fields`` (every reply then holds the same ``WeightedMean``, core/api/fold.py), else computed here
        from the uploads in client order with the same arithmetic (``fold_mean``), so both paths give the same
        bits. None without replies."""
        if not replies:
            return None
        cids = sorted(replies)
        first = replies[cids[0]][field]
        if isinstance(first, WeightedMean):
            return first.state
        return fold_mean([replies[c][field] for c in cids], [self.reply_weight(replies[c]) for c in cids])

    @classmethod
    def reduced_fields(cls) -> Tuple[str, ...]:
        """``mean_fields`` declared by this very class: a subclass that changes the aggregation must not inherit
        a promise its parent made."""
        return tuple(vars(cls).get("mean_fields", ()))

    @classmethod
    def delivers_shared_state(cls) -> bool:
        """True when every message this strategy sends carries the shared state (``params``), so a client that
        declares its state need not keep the shared part between calls (ClientTrainer.declares_state)."""
        return False

    def client_store(self, name: str) -> ServerClientStore:
        """The run's server-side per-client store ``name`` (cid -> entry), created on first use: held under
        ``server.state_memory``, spilled to disk past it, checkpointed and restored by the core (core.api.serverstore;
        docs: Writing a plugin)."""
        return self.ctx.stores.store(name)

    def global_model(self) -> Optional[State]:
        """This strategy's global model, or None when it has none (the default here): a state holding every key of
        the model's ``state_dict`` (the server's ``build_model``). At each evaluation the core scores it with its
        plain evaluation on every client's test split, beside the personal models (``global_<metric>/...`` in
        metrics.jsonl, the ``global`` section of summary.json; core/engine/globaleval.py). Read after the round's
        evaluate messages are built; the state is sent as is, never changed."""
        return None

    def setup(self, comm) -> None:
        """Called once before round 1 (e.g. to pre-train a shared generative model), unless the strategy overrides
        ``setup_steps``. ``comm`` sends messages like ``run_round``'s; a failure here fails the start."""

    def setup_steps(self, comm) -> Iterator[Union[SetupStep, str]]:
        """A resumable set-up before round 1: a generator that yields after each unit of work (a ``SetupStep(text,
        done, total)`` or a line of text for the log and console), keeping its progress in ``state_dict``.

        The core checkpoints after each yielded step (``checkpoint.every`` > 0, and always before a pause); Ctrl-C
        stops between two steps, and a resumed run calls ``setup_steps`` again, which must continue from the saved
        progress (PCFL trains its flow this way: docs/augmenting.md). Set-up messages keep their seeds across a
        resume. The default calls ``setup`` once and yields nothing: a strategy overrides one or the other."""
        self.setup(comm)
        yield from ()

    def run_round(self, rnd: int, selected: Sequence[int], comm) -> None:
        """One round: send ``configure_fit``'s messages, pass the vetted replies to ``aggregate_fit``, and send
        the messages it returns, if any (a second exchange in the same round). ``comm.send({cid: Message})``
        returns ``{cid: reply}`` for the clients whose replies the core accepted; rejected or failed clients are
        missing (and recorded). Override for a round of another shape (L2GD's probabilistic
        local or aggregation step), keeping every exchange behind ``comm``."""
        replies = comm.send(self.configure_fit(rnd, selected))
        push = self.aggregate_fit(rnd, replies)
        if push:
            comm.send(push)

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        """The round's training messages: ``{cid: Message("fit", payload)}`` for the ``selected`` clients (those of
        ``clients.join_ratio``, drawn by the core from the run's seed)."""
        return {cid: Message("fit") for cid in selected}

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> Optional[Dict[int, Message]]:
        """Fold the accepted fit replies (``{cid: reply}``, in client order; a field of ``mean_fields`` arrives as
        one shared ``WeightedMean``) into the strategy's state. Return messages to send in the same round (e.g.
        personalised models back to clients) or None."""
        return None

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        """The evaluation messages for ``clients`` (every client, at each ``eval.every`` round and the last):
        ``{cid: Message("evaluate", payload)}``; the replies are evaluation sums the core checks and averages."""
        return {cid: Message("evaluate") for cid in clients}

    def state_dict(self) -> Dict[str, Any]:
        """Everything this object keeps across rounds, for checkpoints (tensors, numbers, lists, dicts)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (resume from a checkpoint)."""


class GlobalModelAggregator(ServerAggregator):
    """The "global-model" protocol: broadcast shared state, combine uploads into the next global state.

    ``combine`` is the only thing most aggregators change (FedAvg: sample-weighted mean; FedSA: its own rule).
    Evaluation sends the current global state, so every client is scored on the latest model (personal parts,
    where the trainer keeps any, stay the client's own).
    """

    protocol = "global-model"
    #: the global state is the global model the core scores (``global_model``) when it covers the whole model; a
    #: strategy whose global state is no model to score (e.g. a sum of updates, not weights) sets this False
    reports_global_model: bool = True

    @classmethod
    def delivers_shared_state(cls) -> bool:
        # this class's messages all carry params; a subclass that changes what it sends says so itself
        sending = ("setup", "run_round", "configure_fit", "aggregate_fit", "configure_evaluate")
        if all(getattr(cls, m) is getattr(GlobalModelAggregator, m) for m in sending):
            return True
        return bool(vars(cls).get("sends_params_always", False))

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        sd = ctx.build_model().state_dict()
        keys = ctx.shared_keys if ctx.shared_keys is not None else list(sd)
        self.global_state: State = {k: sd[k].detach().clone() for k in keys}

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("fit", {"params": self.global_state}) for cid in selected}

    def reply_layout(self, kind: str, field: str) -> Optional[Layout]:
        """Uploaded ``params`` hold the global state's keys, shapes and dtypes (the server's model: its shared keys),
        whatever the strategy does with them (streamed or combined from every upload)."""
        if field != "params":
            return super().reply_layout(kind, field)
        cached = self.__dict__.get("_global_layout")
        if cached is None:
            cached = self.__dict__["_global_layout"] = layout_of(self.global_state)
        return cached

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        if not replies:
            return None
        cids = sorted(replies)
        states = [replies[c]["params"] for c in cids]
        if isinstance(states[0], WeightedMean):  # already averaged across ranks (mean_fields, distributed fast path)
            self.global_state.update(states[0].state)
            return None
        weights = [self.reply_weight(replies[c]) for c in cids]
        combined = self.combine(states, weights, cids)
        self.global_state.update(combined)
        return None

    def combine(self, states: List[State], weights: List[float], cids: List[int]) -> State:
        """The next global state from the uploads ``states`` of clients ``cids`` (client order) with their
        ``reply_weight``s: the weighted average here (FedAvg). Override for another rule (FedSA's, FedGen's);
        the result must hold the global state's keys, shapes and dtypes."""
        return weighted_average(states, weights)

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate", {"params": self.global_state}) for cid in clients}

    def global_model(self) -> Optional[State]:
        """The global state, when it holds every key of the model (trainers that share only a part, e.g. FedPer's
        body or FedBN's layers without BatchNorm, leave no whole global model to score) and the strategy does not
        opt out (``reports_global_model = False``)."""
        if not self.reports_global_model:
            return None
        whole = {key for key, _, _ in self.model_layout("state")}
        return self.global_state if whole == set(self.global_state) else None

    def state_dict(self) -> Dict[str, Any]:
        return {"global_state": self.global_state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.global_state = clone_state(state["global_state"])
