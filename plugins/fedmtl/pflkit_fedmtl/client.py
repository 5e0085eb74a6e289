"""Fed-MTL client: trains its personal model w_i on f_i(w_i) + its part of R(W, Omega) (``equations.py``), the
other clients' columns of W fixed at what the server last received.

Messages (protocol 'fedmtl'):
  ``fit`` {omega_ii, neighbours: b_i}                 (aggregator.relay=combined: the server sums sum_j Omega_ij w_j)
       or {omega_ii, omega_row, models: {j: w_j}}      (aggregator.relay=models: the client sums them itself)
       -> {params: w_i (the model's parameters), num_samples, train_loss, metrics}
  ``evaluate`` {} -> eval sums of the client's own model

W's columns are the models' parameters (``named_parameters``); buffers (batch-norm statistics) stay local and
are not regularised.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from pflkit.core import (ClientContext, ClientTrainer, Param, PflError, Space, host_copy, load_into, make_optimizer,
                         non_negative, run_sgd)

from .equations import auto_lambda, client_regulariser, neighbour_sums

PROTOCOL = "fedmtl"


def regulariser_weights(hp, num_params: int) -> tuple:
    """(lam, lam_fro): the configured values, or the code's c = 10^-(floor(log10 d) + 2) where null."""
    c = auto_lambda(num_params)
    lam = hp.get("lam")
    lam_fro = hp.get("lam_fro")
    return (c if lam is None else float(lam)), (c if lam_fro is None else float(lam_fro))


class FedMTLTrainer(ClientTrainer):
    """Minimises the data loss plus lam (Omega_ii ||w_i||^2 + 2 <w_i, b_i>) + lam_fro ||w_i||^2; uploads w_i."""

    protocol = PROTOCOL
    declares_state = True  # runs pooled: a client keeps only its own model between calls
    description = "trains its own model on its loss plus its part of lam tr(W Omega W^T) + lam_fro ||W||_F^2"
    params = {
        "lam": Param(None, "weight lam of tr(W Omega W^T) (default null: c = 10^-(floor(log10 d) + 2) for a model "
                           "of d parameters, the weight LG-FedAvg's and FedRep's Fed-MTL code use, the likely source "
                           "of PCFL's Fed-MTL; the paper tunes it per data set); 0 with lam_fro=0 = Local", type=float,
                     check=non_negative,
                     space=Space.real(1e-7, 1e-2, log=True,
                                      source="from the reference code's c (1e-7 for cnn4) to 1e-2; the paper tunes "
                                             "it per data set, no grid at hand")),
        "lam_fro": Param(None, "weight lam_fro of ||W||_F^2 (default null: the same c)", type=float,
                         check=non_negative),
    }

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        self.model = ctx.build_model()
        self.param_keys = [k for k, _ in self.model.named_parameters()]
        num = sum(p.numel() for p in self.model.parameters())
        self.lam, self.lam_fro = regulariser_weights(ctx.hp, num)

    # -- protocol ---------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        omega_ii, neighbours = self.regulariser_terms(payload)
        params = dict(self.model.named_parameters())
        lam, lam_fro = self.lam, self.lam_fro
        regularised = lam > 0 or lam_fro > 0

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            data = self.ctx.task.loss(self.model(x), y)
            if not regularised:
                return data  # lam = lam_fro = 0: Local's objective, bit for bit
            return data + client_regulariser(params, omega_ii, neighbours, lam, lam_fro)

        self.model.train()
        opt = make_optimizer(self.model.parameters(), self.ctx.train_cfg)
        train_loss = run_sgd(self.batches(), loss, opt)
        with torch.no_grad():
            reg = float(client_regulariser(params, omega_ii, neighbours, lam, lam_fro)) if regularised else 0.0
        return {
            "params": {k: p.detach().clone() for k, p in params.items()},
            "num_samples": self.ctx.num_train,
            "train_loss": train_loss,
            "metrics": {"own_regulariser": reg},
        }

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        return self.evaluate_model(self.model)

    def regulariser_terms(self, payload: Mapping[str, Any]):
        """(Omega_ii, b_i on this client's device) from a fit message of either relay."""
        omega_ii = payload.get("omega_ii")
        if not isinstance(omega_ii, (int, float)) or isinstance(omega_ii, bool):
            raise PflError("fedmtl 'fit' message: 'omega_ii' must be a number")
        dev = self.ctx.device
        if "neighbours" in payload:
            b = payload["neighbours"]
        elif "models" in payload:
            models, row = payload["models"], payload.get("omega_row")
            if not isinstance(models, Mapping) or not isinstance(row, torch.Tensor):
                raise PflError("fedmtl 'fit' message: 'models' must map client ids to models, with 'omega_row'")
            cid = self.ctx.cid
            b = neighbour_sums({cid: row.tolist()}, ((j, models[j]) for j in sorted(models)), self.param_keys)[cid]
        else:
            raise PflError("fedmtl 'fit' message carries neither 'neighbours' nor 'models'")
        if not isinstance(b, Mapping) or (b and set(b) != set(self.param_keys)):
            raise PflError("fedmtl: the relayed b_i does not match this client's parameters")
        return float(omega_ii), {k: v.to(dev) for k, v in b.items()}

    # -- declared state: the client's own model ----------------------------------------------------------------
    def client_state(self) -> Dict[str, Any]:
        return {"model": host_copy(self.model.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        load_into(self.model, state["model"])

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
