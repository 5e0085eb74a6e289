"""FedCAC server (Algorithm 1, server side): overlap -> threshold -> collaborators -> w_bar, u_i -> Eq. (11).

The server keeps no model between rounds: everything it computes comes from the round's uploads, and each
participant gets its own ``w_i^{t+1}`` pushed right after aggregation, so the evaluation that follows the round
scores the new personalised models.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from pflkit.core import (BitMask, Message, Param, PflError, ServerAggregator, ServerContext, Space,
                         log_matrix_figure, non_negative, positive)

from .client import PROTOCOL
from .equations import (OVERLAPS, customized_models, global_model, masked_init, overlap_matrix, threshold,
                        time_varying_collaborators, top_k_collaborators)

COLLABORATIONS = ("time_varying", "top_k", "local")
NON_CRITICAL = ("all", "as_critical")
WEIGHTINGS = ("uniform", "samples")


class FedCACAggregator(ServerAggregator):
    """Builds one download per participating client from the round's uploads (Eq. 7-11).

    Partial participation / drop-out (undefined in the paper; the reference assumes everyone takes part): only
    the clients whose 'fit' reply arrived this round enter it -- their masks form the overlap matrix and the
    threshold (Eq. 7), C_i is drawn from them (Eq. 8), w_bar averages them (Eq. 9). Clients that were not
    selected or dropped out receive nothing and keep their personal model unchanged.
    The round number t of Eq. (7) is the global round, whether or not a client took part in earlier rounds.
    """

    protocol = PROTOCOL
    description = "overlap of critical masks -> time-varying collaborators -> per-client Eq. 11 models"
    params = {
        "beta": Param(100.0, "Eq. 7 schedule length: collaboration on critical parameters ends after round beta "
                      "(paper: 100 on CIFAR-10, 170 on CIFAR-100/Tiny, with 500 rounds)", check=positive,
                      space=Space.integer(5, 250, log=True,
                                          source="covers the digits default 10 and the paper's 100 and 170 (Sec. "
                                                 "4.5, Fig. 6); the paper gives no grid")),
        "overlap": Param("similarity", "overlap of critical masks: similarity = 1 - |Mi-Mj|_1/(2|Mi|) (authors' "
                         "code, default); distance = the paper's printed |Mi-Mj|_1/(2n), used as 1 - distance",
                         choices=OVERLAPS),
        "collaboration": Param("time_varying", "collaborators on critical parameters (Figure 4): time_varying = "
                               "Eq. 7-8 (the method), top_k = the top_k most-overlapping clients, local = none "
                               "(critical parameters stay local)",
                               choices=COLLABORATIONS),
        "top_k": Param(5, "collaborators per client when collaboration=top_k (Figure 4: 1 or 5)", check=positive),
        "non_critical": Param("all", "non-critical parameters (Table 3): all = shared with every participant "
                              "(Eq. 9, the method), as_critical = treated like critical parameters",
                              choices=NON_CRITICAL),
        "global_weighting": Param("uniform", "Eq. 9 weights: uniform = 1/N as printed (default); samples = by "
                                  "client sample count (the reference code)", choices=WEIGHTINGS),
        "log_overlap_every": Param(5, "log the overlap matrix as an image every N rounds (0: never)",
                                   check=non_negative),
    }

    def reply_layout(self, kind: str, field: str):
        """A fit reply's ``params`` are the model's shared keys (checked by the core; its masks are BitMasks)."""
        if kind == "fit" and field == "params":
            return self.model_layout("shared")
        return super().reply_layout(kind, field)

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        model = ctx.build_model()
        if ctx.shared_keys is not None:
            self.keys: List[str] = list(ctx.shared_keys)
        else:  # a trainer that does not declare its keys: all trainable parameters
            self.keys = [k for k, p in model.named_parameters() if p.requires_grad]
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k in self.keys}
        self.last_round: Dict[str, Any] = {}  # what the last aggregation decided (logging and tests)

    # -- round ------------------------------------------------------------------------------------------------
    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("fit") for cid in selected}

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate") for cid in clients}  # each client scores its personal model

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> Optional[Dict[int, Message]]:
        cids = sorted(replies)
        if not cids:
            return None
        hp = self.ctx.hp
        dev = self.ctx.device
        params = {k: torch.stack([replies[c]["params"][k].to(dev) for c in cids]) for k in self.keys}
        masks = {k: torch.stack([self._mask(replies[c], c, k) for c in cids]) for k in self.keys}

        overlap = overlap_matrix(list(masks.values()), hp.overlap)
        collaborators = self.collaborators(rnd, overlap)
        weights = None
        if hp.global_weighting == "samples":
            weights = torch.tensor([float(replies[c]["num_samples"]) for c in cids], dtype=torch.float64)

        next_states: Dict[int, Dict[str, torch.Tensor]] = {c: {} for c in cids}
        for k in self.keys:
            custom = customized_models(params[k], collaborators)  # Eq. (10), [K, ...]
            if hp.non_critical == "as_critical":  # Table 3 ablation: every parameter follows u_i
                nxt = custom
            else:
                nxt = masked_init(custom, global_model(params[k], weights), masks[k])  # Eq. (9), (11)
            for i, c in enumerate(cids):
                next_states[c][k] = nxt[i]

        self._log(rnd, cids, overlap, collaborators)
        return {c: Message("update", {"params": next_states[c]}) for c in cids}

    def collaborators(self, rnd: int, overlap: torch.Tensor) -> torch.Tensor:
        """K x K boolean matrix of who helps whom on critical parameters, per ``collaboration``."""
        mode = self.ctx.hp.collaboration
        if mode == "time_varying":
            return time_varying_collaborators(overlap, rnd, self.ctx.hp.beta)  # Eq. (7)-(8)
        if mode == "top_k":
            return top_k_collaborators(overlap, self.ctx.hp.top_k)
        return torch.zeros_like(overlap, dtype=torch.bool)  # 'local': u_i = w_i

    # -- helpers ----------------------------------------------------------------------------------------------
    def _mask(self, reply: Dict[str, Any], cid: int, key: str) -> torch.Tensor:
        packed = (reply.get("mask") or {}).get(key)
        if not isinstance(packed, BitMask):
            raise PflError(f"client {cid}: fedcac reply has no BitMask for parameter '{key}'")
        if packed.shape != self.shapes[key]:
            raise PflError(f"client {cid}: mask for '{key}' has shape {packed.shape}, expected {self.shapes[key]}")
        return packed.unpack(self.ctx.device)

    def _log(self, rnd: int, cids: List[int], overlap: torch.Tensor, collaborators: torch.Tensor) -> None:
        log = self.ctx.logger
        counts = collaborators.sum(dim=1).cpu().numpy().astype(np.float64)
        thr = threshold(overlap, rnd, self.ctx.hp.beta) if self.ctx.hp.collaboration == "time_varying" else None
        self.last_round = {"round": rnd, "clients": cids, "overlap": overlap.cpu(), "threshold": thr,
                           "collaborators": collaborators.cpu()}
        if log is None:
            return
        log.log_scalar("fedcac/collaborators_mean", float(counts.mean()))
        log.log_histogram("fedcac/collaborators", counts.tolist())
        if len(cids) > 1:
            pairs = overlap[~torch.eye(len(cids), dtype=torch.bool, device=overlap.device)]
            log.log_scalar("fedcac/overlap_mean", float(pairs.mean()))
            log.log_scalar("fedcac/overlap_max", float(pairs.max()))
        if thr is not None:
            log.log_scalar("fedcac/threshold", thr)
        every = self.ctx.hp.log_overlap_every
        if every and (rnd == 1 or rnd % every == 0):
            # rows/columns = this round's participants in client-id order (all clients at full participation)
            log_matrix_figure(log, "fedcac/overlap", overlap.cpu().numpy(), labels=list(cids),
                              title=f"FedCAC overlap of critical-parameter masks, round {rnd}",
                              colorbar_label="overlap ratio of critical locations (Sec. 3.4)", vmin=0.0,
                              vmax=1.0)
