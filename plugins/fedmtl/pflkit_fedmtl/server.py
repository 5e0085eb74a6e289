"""Fed-MTL server: keeps W (every client's latest parameters, in the core's server-side per-client store; a client
that never uploaded is the common initial model w^0) and Omega (m x m over all m clients), sends each selected
client what its part of the regulariser needs, and updates Omega.

What a selected client i receives (``aggregator.relay``):

- ``combined`` (default): Omega_ii and b_i = sum_{j != i} Omega_ij w_j, one model-sized vector -- all the gradient
  of R(W, Omega) with respect to w_i needs (``equations.py``), so the downlink is one model per client;
- ``models``: Omega's row i and the m - 1 other clients' parameters, from which the client computes b_i itself (what
  LG-FedAvg's, FedRep's and PFLlib's code send: m - 1 models per client). Same numbers, bit for bit.

Omega (``aggregator.omega``): ``learned`` (default, the paper) starts at m I (Sigma = I / m) and is replaced by the
closed form Sigma = (W^T W)^{1/2} / tr(.), Omega = Sigma^{-1} after every ``omega_every``-th round, from all m
columns of W; ``mean`` keeps I - 11^T / m; ``code`` keeps the constant (1 - 1/m)^2 11^T of the reference code.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Sequence, Tuple

import torch

from pflkit.core import Message, Param, PflError, ServerAggregator, ServerContext, positive

from .client import PROTOCOL
from .equations import gram, neighbour_sums, omega_code, omega_initial, omega_mean, sigma_and_omega

OMEGAS = ("learned", "mean", "code")
RELAYS = ("combined", "models")


class FedMTLServer(ServerAggregator):
    """Stores W, relays b_i (or the other columns), learns Omega in closed form."""

    protocol = PROTOCOL
    description = "stores every client's parameters (W); relays each client's share of tr(W Omega W^T); learns Omega"
    params = {
        "omega": Param("learned", "task-relationship matrix: learned = the paper's alternating closed form "
                                  "Sigma = (W^T W)^(1/2) / tr(.), Omega = Sigma^-1 (default); mean = the fixed "
                                  "I - 11^T/m (mean-regularised MTL); code = the constant (1 - 1/m)^2 11^T that "
                                  "LG-FedAvg's and FedRep's code build", choices=OMEGAS),
        "omega_every": Param(1, "learned Omega: recompute it after every N-th round (default 1: one pass of W "
                                "updates per Omega update)", check=positive),
        "relay": Param("combined", "what a client downloads: combined = Omega_ii and b_i = sum_j Omega_ij w_j, one "
                                   "model (default); models = Omega's row and the other m - 1 clients' parameters "
                                   "(as the reference code; same numbers)", choices=RELAYS),
    }

    def reply_layout(self, kind: str, field: str):
        """A fit reply's ``params`` are the model's parameters w_i, no buffers (checked by the core)."""
        if kind == "fit" and field == "params":
            return self.model_layout("parameters")
        return super().reply_layout(kind, field)

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        model = ctx.build_model()
        self.keys = [k for k, _ in model.named_parameters()]
        self.initial = {k: p.detach().clone() for k, p in model.named_parameters()}  # w^0 of every client
        self.models = self.client_store("models")  # cid -> latest uploaded parameters
        m = ctx.num_clients
        mode = ctx.hp.get("omega", "learned")
        self.omega = {"learned": omega_initial, "mean": omega_mean, "code": omega_code}[mode](m)

    def columns(self) -> Iterator[Tuple[int, Mapping[str, torch.Tensor]]]:
        """(j, w_j) for every client in ascending j: its latest upload, or w^0."""
        for j in range(self.ctx.num_clients):
            yield j, self.models.get(j, self.initial)

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        selected = sorted(selected)
        if self.ctx.hp.get("relay", "combined") == "models":
            return {i: Message("fit", {"omega_ii": float(self.omega[i, i]), "omega_row": self.omega[i].clone(),
                                       "models": {j: w for j, w in self.columns() if j != i}})
                    for i in selected}
        sums = neighbour_sums({i: self.omega[i].tolist() for i in selected}, self.columns(), self.keys)
        return {i: Message("fit", {"omega_ii": float(self.omega[i, i]), "neighbours": sums[i]}) for i in selected}

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        keys = set(self.keys)
        for cid in sorted(replies):
            params = replies[cid].get("params")
            if not isinstance(params, dict) or set(params) != keys:
                raise PflError(f"client {cid}: fedmtl reply does not carry the model's parameters")
            self.models.put(cid, {k: v.detach().cpu() for k, v in params.items()})
        hp = self.ctx.hp
        g = None
        if hp.get("omega", "learned") == "learned" and rnd % int(hp.get("omega_every", 1)) == 0:
            g = gram([w for _, w in self.columns()], self.keys)
            _, self.omega = sigma_and_omega(g)
        self._log(g)
        return None

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate") for cid in clients}  # each client scores the model it holds

    def _log(self, g) -> None:
        logger = self.ctx.logger
        if logger is None:
            return
        if g is None:
            g = gram([w for _, w in self.columns()], self.keys)
        logger.log_scalar("fedmtl/trace_W_Omega_Wt", float(torch.trace(self.omega @ g)))  # tr(W Omega W^T)
        off = self.omega - torch.diag(torch.diag(self.omega))
        logger.log_scalar("fedmtl/omega_offdiag_mean", float(off.sum()) / max(1, off.numel() - off.shape[0]))

    # Omega is m x m numbers; W is in the core's store, which checkpoints it itself
    def state_dict(self) -> Dict[str, Any]:
        return {"omega": self.omega.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        omega = state["omega"]
        m = self.ctx.num_clients
        if not isinstance(omega, torch.Tensor) or tuple(omega.shape) != (m, m):
            raise PflError(f"fedmtl: the checkpoint's Omega is not {m} x {m}")
        self.omega = omega.to(torch.float64).clone()
