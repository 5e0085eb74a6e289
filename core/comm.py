"""The server's only way to reach clients: route messages, count bytes, vet replies, isolate failures."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

import torch

from .backend import Call, ExecutionBackend
from .errors import PflError
from .protocol import Message, first_non_finite, iter_tensors, payload_nbytes
from .seeding import derive_seed

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
    a reply with NaN/Inf is rejected, and a reply that hands out the client's raw data tensors is refused
    (privacy boundary). Rejected clients' state is rolled back when ``rollback`` is on.
    """

    def __init__(self, backend: ExecutionBackend, client_ids: Sequence[int], seed: int,
                 private_storages: Dict[int, set], on_client_error: str = "skip", rollback: bool = True):
        self.backend = backend
        self.client_ids = list(client_ids)
        self.seed = seed
        self.on_client_error = on_client_error
        self.rollback_enabled = rollback
        self._private = private_storages  # cid -> data_ptrs of that client's data tensors
        self.round = 0
        self._calls = 0
        self.traffic = RoundTraffic()

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
        results = self.backend.execute(calls, snapshot=accounted and self.rollback_enabled)
        replies: Dict[int, Dict[str, Any]] = {}
        for cid, res in results.items():
            self.traffic.client_seconds[cid] = self.traffic.client_seconds.get(cid, 0.0) + res.seconds
            if res.error is not None:
                if self.on_client_error == "abort":
                    raise ClientAbort(f"client {cid} failed in round {self.round} "
                                      f"('{calls[cid].message.kind}'): {res.error}\n{res.detail}")
                self._reject(cid, calls[cid].message.kind, f"raised {res.error}", res.detail, accounted)
                continue
            bad = first_non_finite(res.reply)
            if bad is not None:
                self._reject(cid, calls[cid].message.kind, f"reply field '{bad}' holds NaN/Inf", "", accounted)
                continue
            if self._leaks_private_data(cid, res.reply):
                self._reject(cid, calls[cid].message.kind,
                             "reply references the client's raw data tensors (privacy boundary)", "", accounted)
                continue
            if accounted:
                self.traffic.bytes_up += payload_nbytes(res.reply)
                if "train_loss" in res.reply:
                    self.traffic.train_replies[cid] = res.reply
            replies[cid] = res.reply
        return replies

    def _reject(self, cid: int, kind: str, reason: str, detail: str, accounted: bool) -> None:
        self.traffic.failures.append({"round": self.round, "client": cid, "kind": kind, "reason": reason})
        log.warning("round %d: client %d '%s' rejected: %s", self.round, cid, kind, reason)
        if detail:
            log.debug(detail)
        if accounted and self.rollback_enabled:
            self.backend.rollback(cid)

    def _leaks_private_data(self, cid: int, reply: Any) -> bool:
        private = self._private.get(cid)
        if not private:
            return False
        for t in iter_tensors(reply):
            try:
                if t.untyped_storage().data_ptr() in private:
                    return True
            except RuntimeError:
                continue
        return False
