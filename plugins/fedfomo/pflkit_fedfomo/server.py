"""FedFomo server: keeps every client's latest model (the core's server-side per-client store) and the affinity
matrix P, and sends each selected client M of the stored models chosen epsilon-greedily over its row of P.

There is no global model. Round t, for each selected client i (ascending ids, draws from the round's seeded
``ServerContext.rng``): the pool is every client other than i whose model the server holds (the clients that have
uploaded at least once, each with its latest upload); ``choose_candidates`` picks M of them with exploration rate
``epsilon_at(epsilon, decay, t)``. In round 1 nobody has uploaded yet, so every client trains alone first (as the
official code's round 0). After the round, each reply's model replaces that client's entry and P[i, n] += w_n.

Downlink: every candidate model travels whole in client i's payload (M models per selected client; the core
counts the payload's bytes). Evaluation messages are empty: each client scores the model it holds.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from pflkit.core import (ConfigError, Message, Param, PflError, ServerAggregator, ServerContext, Space,
                         non_negative, unit_interval)

from .client import PROTOCOL
from .equations import choose_candidates, epsilon_at, update_affinity


class FedFomoServer(ServerAggregator):
    """Stores the clients' latest models, sends M per selected client, accumulates the affinity matrix P."""

    protocol = PROTOCOL
    description = "stores every client's latest model; sends each client M of them, epsilon-greedy over P"
    params = {
        "candidates": Param(5, "M: how many stored models each selected client downloads per round (default 5: "
                               "PFLlib's and FL-bench's, the M FedCP ran; the official code's README uses 4 or 9 "
                               "with 15 clients); 0 = local training on the train part", check=non_negative,
                            space=Space.integer(1, 10, source="around PFLlib's 5 and the official README's 4 and 9; "
                                                              "no grid at hand")),
        "epsilon": Param(0.3, "initial exploration rate epsilon of the epsilon-greedy choice (default 0.3: the "
                              "official code's README)", check=unit_interval,
                          space=Space.real(0.0, 0.5, source="around the official README's 0.3; no grid at hand")),
        "epsilon_decay": Param(0.05, "decrease of epsilon per round, epsilon_t = max(0, epsilon - decay (t - 1)) "
                                     "(default 0.05: the official code's README)", check=non_negative),
    }

    def reply_layout(self, kind: str, field: str):
        """A fit reply's ``params`` are the client's whole model state (checked by the core)."""
        if kind == "fit" and field == "params":
            return self.model_layout("state")
        return super().reply_layout(kind, field)

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        hp = ctx.hp
        trainer = getattr(ctx.cfg, "trainer", None) or {}
        if int(hp.get("candidates", 5)) > 0 and float(trainer.get("val_ratio", 0.2)) == 0:
            raise ConfigError("trainer.val_ratio: 0 leaves no validation split to weigh the candidates on; "
                              "use a ratio in (0, 1) or aggregator.candidates=0")
        self.models = self.client_store("models")  # cid -> latest uploaded model state
        n = ctx.num_clients
        self.affinity = torch.zeros(n, n, dtype=torch.float64)  # P[i, n]: summed weights client i gave n
        self.sent: Dict[int, list] = {}  # this round's candidates per client (read back with the replies)

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        hp = self.ctx.hp
        m = int(hp.get("candidates", 5))
        eps = epsilon_at(float(hp.get("epsilon", 0.3)), float(hp.get("epsilon_decay", 0.05)), rnd)
        stored = self.models.ids()
        row = self.affinity.numpy()
        self.sent = {}
        messages: Dict[int, Message] = {}
        for cid in sorted(selected):
            pool = [c for c in stored if c != cid]
            chosen = choose_candidates(row[cid], pool, m, eps, self.ctx.rng)
            self.sent[cid] = chosen
            # each candidate is a whole model in this client's payload (the stored tensors, not copies)
            messages[cid] = Message("fit", {"candidates": {c: self.models.get(c) for c in chosen}})
        return messages

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        for cid in sorted(replies):
            reply = replies[cid]
            params = reply.get("params")
            weights, weighed = reply.get("weights"), reply.get("weighed")
            if not isinstance(params, dict) or not isinstance(weights, torch.Tensor) or \
                    not isinstance(weighed, list) or len(weighed) != weights.numel() or \
                    sorted(weighed) != sorted(self.sent.get(cid, [])):
                raise PflError(f"client {cid}: fedfomo reply does not carry its model and one weight per candidate")
            self.models.put(cid, {k: v.detach().cpu() for k, v in params.items()})
            update_affinity(self.affinity, cid, weighed, weights.double())
        self._log(rnd)
        return None

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate") for cid in clients}  # each client scores the model it holds

    def _log(self, rnd: int) -> None:
        logger = self.ctx.logger
        if logger is not None:
            eps = epsilon_at(float(self.ctx.hp.get("epsilon", 0.3)), float(self.ctx.hp.get("epsilon_decay", 0.05)),
                             rnd)
            logger.log_scalar("fedfomo/epsilon", eps)

    # P is N x N numbers; the models are in the core's store, which checkpoints them itself
    def state_dict(self) -> Dict[str, Any]:
        return {"affinity": self.affinity.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        affinity = state["affinity"]
        n = self.ctx.num_clients
        if not isinstance(affinity, torch.Tensor) or tuple(affinity.shape) != (n, n):
            raise PflError(f"fedfomo: the checkpoint's affinity matrix is not {n} x {n}")
        self.affinity = affinity.to(torch.float64).clone()
