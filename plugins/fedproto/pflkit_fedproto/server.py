"""FedProto server: aggregates the uploaded class prototypes into global ones and sends them back. No weights."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from pflkit.core import ConfigError, Message, Param, PflError, ServerAggregator, ServerContext

from .client import PROTOCOL
from .equations import WEIGHTINGS, aggregate_prototypes, dense_prototypes

ABSENT = ("keep", "drop")


class FedProtoAggregator(ServerAggregator):
    """Holds the global prototypes C-bar^(j); every round rebuilds them from the participants' local prototypes.

    Partial participation / drop-out (the paper has every client in every round): only this round's repliers'
    prototypes enter the aggregation. A class that none of them holds keeps its previous global prototype
    (``absent_classes=keep``, default) or loses it (``drop``: the global set is rebuilt from this round's uploads
    only, as the authors' code does -- identical when everyone takes part).
    Round 1's fit messages carry nothing: no global prototype exists before the first uploads.
    """

    protocol = PROTOCOL
    description = "per-class (sample-weighted) mean of the clients' prototypes; sends only prototypes"
    params = {
        "weighting": Param("samples", "weights of a class's local prototypes: samples = the clients' counts of "
                                      "that class (the paper), uniform = plain mean over the clients holding it "
                                      "(the authors' code)", choices=WEIGHTINGS),
        "absent_classes": Param("keep", "a class no participant of the round holds: keep its last global "
                                        "prototype, or drop it (the authors' code rebuilds the set every round)",
                                choices=ABSENT),
    }

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        model = ctx.build_model()
        dim = getattr(model, "feature_dim", None)
        if dim is None:
            raise ConfigError(f"model: FedProto needs a feature-extractor / head split with a known embedding size "
                              f"(feature_dim); {type(model).__name__} has none")
        self.num_classes = int(ctx.task.output_dim)
        self.dim = int(dim)
        self.prototypes = torch.zeros(self.num_classes, self.dim, device=ctx.device)  # C-bar, rows where present
        self.present = torch.zeros(self.num_classes, dtype=torch.bool, device=ctx.device)
        self.last_round: Dict[str, Any] = {}

    # round ----------------------------------------------------------------------------------------------------
    def payload(self) -> Dict[str, Any]:
        """The defined global prototypes on the wire: (k, d) rows and their k class ids; empty before round 1."""
        if not bool(self.present.any()):
            return {}
        held = torch.nonzero(self.present).reshape(-1)
        return {"prototypes": self.prototypes[held].clone(), "classes": held.cpu()}

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        payload = self.payload()
        return {cid: Message("fit", payload) for cid in selected}

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        payload = self.payload()
        return {cid: Message("evaluate", payload) for cid in clients}

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> Optional[Dict[int, Message]]:
        cids = sorted(replies)  # sums over clients in sorted order: the result does not depend on reply order
        if not cids:
            return None
        protos: List[torch.Tensor] = []
        counts: List[torch.Tensor] = []
        for cid in cids:
            p, n = self._unpack(cid, replies[cid])
            protos.append(p)
            counts.append(n)
        glob, present = aggregate_prototypes(protos, counts, self.ctx.hp.weighting)
        if self.ctx.hp.absent_classes == "drop":
            self.prototypes = torch.where(present.unsqueeze(1), glob, torch.zeros_like(glob))
            self.present = present.clone()
        else:
            self.prototypes = torch.where(present.unsqueeze(1), glob, self.prototypes)
            self.present = self.present | present
        self._log(rnd, cids, protos, counts)
        return None

    # helpers --------------------------------------------------------------------------------------------------
    def _unpack(self, cid: int, reply: Dict[str, Any]):
        rows, classes, n = reply.get("prototypes"), reply.get("classes"), reply.get("class_counts")
        if not all(isinstance(t, torch.Tensor) for t in (rows, classes, n)):
            raise PflError(f"client {cid}: fedproto reply lacks 'prototypes', 'classes' or 'class_counts' tensors")
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise PflError(f"client {cid}: prototypes of shape {tuple(rows.shape)}, expected (k, {self.dim})")
        if n.numel() != classes.numel() or bool((n <= 0).any()):
            raise PflError(f"client {cid}: class_counts must hold one positive count per class id")
        try:
            return dense_prototypes(classes, rows.to(self.ctx.device).to(torch.float32), self.num_classes, n)
        except ValueError as exc:
            raise PflError(f"client {cid}: {exc}") from exc

    def _log(self, rnd: int, cids: List[int], protos: List[torch.Tensor], counts: List[torch.Tensor]) -> None:
        # spread = mean distance of a client's local prototype to the global one (over the (client, class) pairs
        # uploaded this round): how far the clients' embedding spaces are from agreeing
        dists = [torch.linalg.vector_norm(p - self.prototypes, dim=1)[n > 0] for p, n in zip(protos, counts)]
        dists = torch.cat(dists)
        spread = float(dists.mean()) if dists.numel() else 0.0
        self.last_round = {"round": rnd, "clients": cids, "classes": int(self.present.sum()), "spread": spread}
        log = self.ctx.logger
        if log is None:
            return
        log.log_scalar("fedproto/global_classes", float(self.present.sum()))
        log.log_scalar("fedproto/prototype_spread", spread)

    def state_dict(self) -> Dict[str, Any]:
        return {"prototypes": self.prototypes.clone(), "present": self.present.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.prototypes = state["prototypes"].to(self.ctx.device).clone()
        self.present = state["present"].to(self.ctx.device).clone()
