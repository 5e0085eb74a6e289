"""The server's only way to reach clients: route messages, count bytes, vet replies, isolate failures."""
from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .backend import Call, CallResult, ExecutionBackend
from ..api.fold import MeanFold
from ..common.errors import PflError
from .privacy import PrivacyGuard
from ..api.protocol import Message, first_non_finite, payload_nbytes
from ..api.globalmodel import GLOBAL_EVALUATE
from .replies import EVALUATION_KINDS, VAL_COUNT, ReplyChecks
from ..common.seeding import derive_seed

log = logging.getLogger("pflkit")


class ClientAbort(PflError):
    """A client raised and ``failures.on_client_error`` is 'abort'."""


@dataclass
class RoundTraffic:
    bytes_down: int = 0
    bytes_up: int = 0
    failures: List[Dict[str, Any]] = field(default_factory=list)
    client_seconds: Dict[int, float] = field(default_factory=dict)
    train_replies: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # replies carrying a train_loss


class Communicator:
    """Sends server messages to clients through an execution backend.

    Every reply is checked before the server sees it: a client whose code raised is skipped (or aborts the run),
    a reply that is not plain data, carries non-scalar metrics or raw samples is refused (``privacy``), a
    reply with NaN/Inf is rejected, and so is one that differs from what the core expects (``checks``,
    core/engine/replies.py: the layout the server declares for an upload, a sample count the client can have, evaluation
    sums over its own test split). Rejected clients' state is rolled back when ``rollback`` is on.
    Server strategies never get this object: they get its ``channel()``, which can only send.
    """

    def __init__(self, backend: ExecutionBackend, client_ids: Sequence[int], seed: int,
                 guard: PrivacyGuard, on_client_error: str = "skip", rollback: bool = True,
                 mean_fields: Sequence[str] = (), reply_weight: Optional[Callable[[Dict[str, Any]], float]] = None,
                 reduce_across_ranks: bool = False, checks: Optional[ReplyChecks] = None):
        self.backend = backend
        self.checks = checks  # None: only the privacy and NaN/Inf checks (a communicator built outside a run)
        # a backend that runs clients elsewhere vets each reply where its client's data is (``execute_vetted``), and
        # may average reply fields there too (``mean_fields``: the distributed fast path)
        self._owner_vets = callable(getattr(backend, "execute_vetted", None))
        # the aggregator's mean fields are folded as replies arrive (core.api.fold: streaming aggregation); with
        # ``reduce_across_ranks`` the owners fold their clients and the ranks all-reduce the sums, otherwise every
        # rank folds all replies in client order (a distributed run's exact mode: the serial run's numbers)
        self.mean_fields = tuple(mean_fields)
        self.rank_fields = self.mean_fields if self._owner_vets and reduce_across_ranks else ()
        self.reply_weight = reply_weight  # the aggregator's weight of one reply in those means (None: num_samples)
        self.client_ids = list(client_ids)
        self.seed = seed
        self.on_client_error = on_client_error
        self.rollback_enabled = rollback
        self._guard = guard
        self.round = 0
        self._calls = 0
        self.traffic = RoundTraffic()
        self._token = _register(self)

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def begin_round(self, rnd: int) -> None:
        self.round = rnd
        self._calls = 0
        self.traffic = RoundTraffic()

    def send(self, messages: Dict[int, Message], accounted: bool = True) -> Dict[int, Dict[str, Any]]:
        """Deliver ``messages`` (cid -> Message); returns cid -> reply for the clients that succeeded.

        ``accounted=False`` marks instrumentation traffic (evaluation) that is not part of the algorithm's
        communication cost.
        """
        self._calls += 1
        phase = self._calls
        calls = {}
        for cid, msg in messages.items():
            if cid not in self.client_ids:
                raise ValueError(f"message addressed to unknown client {cid}")
            calls[cid] = Call(msg, derive_seed(self.seed, "client", cid, self.round, phase), self.round)
            if accounted:
                self.traffic.bytes_down += payload_nbytes(msg.payload)
        snapshot = accounted and self.rollback_enabled
        kinds = {cid: msg.kind for cid, msg in messages.items()}
        # the core's own evaluation of the global model: its replies are sums, never the strategy's streamed fields
        core_eval = bool(kinds) and all(k == GLOBAL_EVALUATE for k in kinds.values())
        mean_fields, rank_fields = ((), ()) if core_eval else (self.mean_fields, self.rank_fields)
        layouts = {} if core_eval else self._streamed_layouts(kinds)

        def vet(cid: int, reply: Any) -> Optional[str]:
            return self.vet(cid, reply, kinds[cid])

        vetted: Optional[Dict[int, Tuple[Optional[str], int]]] = None
        if self._owner_vets:  # each owner vets its clients' replies (before their fields enter any sum)
            results, vetted = self.backend.execute_vetted(calls, snapshot, vet, rank_fields,
                                                          weight_of=self.reply_weight, layouts=layouts)
            arriving: Iterable[CallResult] = (results.pop(cid) for cid in sorted(results))
        else:  # one client at a time: each reply is vetted and folded before the next client runs
            arriving = self.backend.execute_each(calls, snapshot)
        fold = MeanFold(() if rank_fields else mean_fields, self.reply_weight, layouts)
        folded: Dict[int, List[str]] = {}
        replies: Dict[int, Dict[str, Any]] = {}
        for res in arriving:
            cid = res.cid
            self.traffic.client_seconds[cid] = self.traffic.client_seconds.get(cid, 0.0) + res.seconds
            if res.error is not None:
                if self.on_client_error == "abort":
                    raise ClientAbort(f"client {cid} failed in round {self.round} "
                                      f"('{calls[cid].message.kind}'): {res.error}\n{res.detail}")
                self._reject(cid, calls[cid].message.kind, f"raised {res.error}", res.detail, accounted)
                continue
            reason, nbytes = vetted[cid] if vetted is not None else (vet(cid, res.reply), None)
            reply = res.reply
            if reason is None and fold:
                fields = [f for f in fold.fields if isinstance(reply, dict) and f in reply]
                reply, reason = fold.add(cid, reply)
            if reason is not None:
                self._reject(cid, calls[cid].message.kind, reason, "", accounted)
                continue
            if accounted:  # a reduced reply was counted whole by its owner
                self.traffic.bytes_up += nbytes if nbytes is not None else payload_nbytes(res.reply)
            del res  # the upload is folded: nothing holds it any more
            if not self._owner_vets:
                self.backend.keep(cid)  # accepted: its rollback snapshot may go
            if fold and fields:
                folded[cid] = fields
            if kinds[cid] in EVALUATION_KINDS and self.checks is not None and isinstance(reply, dict):
                reply["num_samples"] = self.checks.test_size(cid)  # the count is the core's own
                if self.checks.val_size(cid):
                    reply[VAL_COUNT] = self.checks.val_size(cid)
            if accounted and "train_loss" in reply:
                self.traffic.train_replies[cid] = reply
            replies[cid] = reply
        if folded:  # every folded reply holds the same WeightedMean, as on the distributed fast path
            MeanFold.restore(replies, folded, fold.means(_device_of(fold)))
        return replies

    def vet(self, cid: int, reply: Any, kind: str = "") -> Optional[str]:
        """Why ``cid``'s reply to a ``kind`` message is refused (privacy boundary, NaN/Inf, then what the core
        expects of it), or None when it is accepted."""
        leak = self._guard.violation(cid, reply)
        if leak is not None:
            return leak
        bad = first_non_finite(reply)
        if bad is not None:
            return f"reply field '{bad}' holds NaN/Inf"
        return self.checks.problem(cid, kind, reply) if self.checks is not None else None

    def _streamed_layouts(self, kinds: Dict[int, str]) -> Dict[str, Any]:
        """field -> the layout the server declares for each streamed field of this exchange's replies (the fold
        checks every reply against it, never against another reply)."""
        if self.checks is None:
            return {}
        self.checks.begin()
        fields = self.mean_fields
        if not fields or not kinds:
            return {}
        return self.checks.streamed_layouts(list(kinds.values()), fields)

    def _reject(self, cid: int, kind: str, reason: str, detail: str, accounted: bool) -> None:
        self.traffic.failures.append({"round": self.round, "client": cid, "kind": kind, "reason": reason})
        log.warning("round %d: client %d '%s' rejected: %s", self.round, cid, kind, reason)
        if detail:
            log.debug(detail)
        if accounted and self.rollback_enabled:
            self.backend.rollback(cid)

    def channel(self) -> "ServerChannel":
        return ServerChannel(self._token, self.client_ids)


def _device_of(fold: MeanFold) -> Any:
    """Where the folded replies' tensors were: their mean goes back there."""
    for ff in fold.folds.values():
        if ff.acc:
            return ff.acc[0].device
    return "cpu"


# The one path from a channel to its communicator: a token looked up here, in this module's globals, which any
# code in the process can import anyway (this is a guard for honest code, not a sandbox). Weak values: a finished
# run's communicator is freed with its simulation; a channel outliving it says so.
_COMMUNICATORS: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


def _register(comm: Communicator) -> int:
    token = next(_TOKENS)
    _COMMUNICATORS[token] = comm
    return token


def _route(token: int) -> Communicator:
    comm = _COMMUNICATORS.get(token)
    if comm is None:
        raise RuntimeError("this server channel's run has ended")
    return comm


class ServerChannel:
    """What server code gets instead of the Communicator: ``send``, the client ids and the round.

    The channel holds plain data only (an int token and the client ids): no attribute, closure, bound method or
    referent of it leads to the communicator, the backend, its trainers or their contexts (tests/test_privacy.py
    walks them). ``send`` finds the communicator through this module's private registry."""

    __slots__ = ("_token", "_client_ids")

    def __init__(self, token: int, client_ids: Sequence[int]):
        object.__setattr__(self, "_token", int(token))
        object.__setattr__(self, "_client_ids", tuple(int(c) for c in client_ids))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the server channel is read-only")

    def send(self, messages: Dict[int, Message], accounted: bool = True) -> Dict[int, Dict[str, Any]]:
        """Deliver ``messages`` (cid -> Message); returns cid -> reply for the clients that succeeded."""
        return _route(self._token).send(messages, accounted)

    @property
    def client_ids(self) -> List[int]:
        return list(self._client_ids)

    @property
    def num_clients(self) -> int:
        return len(self._client_ids)

    @property
    def round(self) -> int:
        return _route(self._token).round
