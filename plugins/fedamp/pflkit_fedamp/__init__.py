"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang: "Personalized Cross-Silo Federated Learning on Non-IID Data",
AAAI 2021): attentive message passing.

Every client owns a full personal model w_i. The server keeps every client's latest upload in a server-side
per-client store (``ServerAggregator.client_store``: under ``server.state_memory``, spilled to disk past it,
checkpointed one model at a time) and, for each selected client, builds its personal cloud model

    u_i = xi_ii w_i + sum_{j != i} xi_ij w_j

with attention weights that grow with the similarity of w_i and w_j (``equations``): FedAMP's
xi_ij = (alpha_k / sigma) exp(-||w_i - w_j||^2 / sigma) (``attention=exp``), or HeurFedAMP's
xi_ij = (1 - xi_ii) softmax_j(sigma cos(w_i, w_j)) with a fixed self weight xi_ii (``attention=cosine``, the
paper's variant for deep networks; the default). The client then approximately solves

    w_i = argmin_w F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2

with local SGD on cross-entropy plus that proximal term -- a term with a gradient (PFLlib's client has built it
from detached ``p.data`` with an unsquared norm since 2023-03-01, so there it does nothing: see the README) -- and
uploads w_i. Evaluation scores w_i. What travels per selected client: down u_i, up w_i (FedAvg's volume).

Which clients count as peers: every client's latest upload, stale ones included (``peers=latest``, the default for
partial participation, which the paper leaves open), or only this round's selected clients that have uploaded
before (``peers=round``). A client that has not uploaded yet holds the shared initial model, which the server
knows; it is not a peer until its first upload.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import torch

from pflkit.core import (Algorithm, ConfigError, LocalSGDTrainer, Message, Param, ServerAggregator, Space,
                         load_into, non_negative, proximal_term)

from .equations import (add_to_cloud, cloud_model, cosine_attention, cosine_from, dot, exp_attention,
                        prox_coefficient, self_weight, squared_distance, start_cloud)

__all__ = ["FedAMPTrainer", "FedAMPAggregator", "ALGORITHM", "exp_attention", "cosine_attention", "self_weight",
           "cloud_model", "prox_coefficient"]

PROTOCOL = "fedamp"
STORE = "models"  # the server store of every client's latest upload


def _unit_interval(v: float):
    return None if 0.0 <= v <= 1.0 else "must lie in [0, 1]"


class FedAMPTrainer(LocalSGDTrainer):
    """Local SGD on F_i(w) + c ||w - u_i||^2 (c = lambda / (2 alpha_k), sent by the server with u_i); uploads and
    evaluates the personal model w_i, which is all it keeps between rounds."""

    protocol = PROTOCOL
    description = ("FedAMP client: local SGD on cross-entropy + lambda/(2 alpha_k) ||w - u_i||^2 toward its cloud "
                   "model u_i; uploads and evaluates its personal model w_i")
    params = {
        "start": Param("cloud", "where the local solve starts: cloud = the cloud model u_i (BASELINES.md's reading "
                                "of the paper, which does not say), own = the client's previous w_i (PFLlib)",
                       choices=("cloud", "own")),
    }
    needs_shared_delivery = False  # the whole model is the client's own; the server sends u_i, never a part of w_i
    declares_state = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self._params: List[torch.nn.Parameter] = [p for _, p in self.model.named_parameters()]
        self._param_keys = [k for k, _ in self.model.named_parameters()]
        self._anchor: List[torch.Tensor] = []
        self._coef = 0.0

    def client_keys(self) -> List[str]:
        return list(self.model.state_dict())  # w_i whole: nothing of it comes from the server

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        cloud, coef = payload["cloud"], float(payload["prox"])
        if not math.isfinite(coef) or coef < 0:
            raise ValueError(f"proximal weight {coef} is not a finite number >= 0")
        if self.ctx.hp.get("start", "cloud") == "cloud":
            load_into(self.model, cloud)
        device = self._params[0].device if self._params else torch.device("cpu")
        self._anchor = [cloud[k].detach().to(device) for k in self._param_keys]
        self._coef = coef
        try:
            loss = self.local_update()
        finally:
            self._anchor, self._coef = [], 0.0
        sd = self.model.state_dict()
        return {"params": {k: v.detach().clone() for k, v in sd.items()}, "num_samples": self.ctx.num_train,
                "train_loss": loss}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        data = self.data_loss(self.model, x, y)
        if self._coef == 0.0:
            return data
        return data + self._coef * proximal_term(self._params, self._anchor)  # lambda/(2 alpha_k) ||w - u_i||^2


class FedAMPAggregator(ServerAggregator):
    """Keeps every client's latest model in the server store and sends each selected client its cloud model u_i."""

    protocol = PROTOCOL
    description = ("FedAMP server: stores every client's latest model; sends client i its cloud model "
                   "u_i = sum_j xi_ij w_j with attention weights from model similarity")
    params = {
        "attention": Param("cosine", "attention weights: cosine = HeurFedAMP's (1 - self_weight) * softmax(sigma * "
                                     "cos(w_i, w_j)), the paper's variant for deep networks (default); exp = FedAMP's "
                                     "(alpha_k / sigma) exp(-||w_i - w_j||^2 / sigma), self weight 1 - their sum",
                           choices=("cosine", "exp")),
        "alpha_k": Param(1.0, "alpha_k: step of the message-passing gradient step (scales exp attention) and "
                              "divides lambda in the client's proximal weight lambda / (2 alpha_k) (default 1: "
                              "PFLlib's default; the paper's value could not be checked offline)",
                         type=float, check=non_negative),
        "lam": Param(1.0, "lambda: weight of the attention term; the client's proximal weight is lambda / (2 "
                          "alpha_k) (default 1: PFLlib's default and its 2021 scripts); 0 = no pull toward u_i",
                     type=float, check=non_negative,
                     space=Space.real(0.1, 10.0, log=True,
                                      source="around PFLlib's 1; the paper's grid not available offline")),
        "sigma": Param(1.0, "sigma: scale of the attention (exp: distance scale, > 0; cosine: softmax "
                            "temperature inverse, 0 = uniform over the peers) (default 1: PFLlib's default)",
                       type=float, check=non_negative,
                       space=Space.real(0.01, 10.0, log=True,
                                        source="spans PFLlib's 1, 0.1 and 0.01; the paper's grid not available "
                                               "offline")),
        "self_weight": Param(0.1, "xi_ii of cosine attention: the weight of the client's own model in u_i "
                                  "(default 0.1: PFLlib's 2021 HeurFedAMP script); unused by exp attention",
                             type=float, check=_unit_interval,
                             space=Space.real(0.05, 0.9, source="around PFLlib's 0.1; the paper's grid not "
                                                                "available offline")),
        "peers": Param("latest", "whose models enter u_i: latest = every client's latest upload, stale ones "
                                 "included (the paper leaves partial participation open), round = this round's "
                                 "selected clients only", choices=("latest", "round")),
    }

    def reply_layout(self, kind: str, field: str):
        """A fit reply's ``params`` are the client's whole model state w_i (checked by the core)."""
        if kind == "fit" and field == "params":
            return self.model_layout("state")
        return super().reply_layout(kind, field)

    def __init__(self, ctx):
        super().__init__(ctx)
        hp = ctx.hp
        if float(hp.alpha_k) == 0.0 and float(hp.lam) > 0.0:
            raise ConfigError(f"aggregator.alpha_k: 0 with aggregator.lam {float(hp.lam):g} makes the client's "
                              f"proximal weight lambda / (2 alpha_k) infinite (the paper's update would never move "
                              f"w_i); set aggregator.lam=0 too (then FedAMP is local training) or alpha_k > 0")
        if hp.attention == "exp" and float(hp.sigma) == 0.0:
            raise ConfigError("aggregator.sigma: 0 is invalid with attention exp: exp(-d / sigma) needs sigma > 0")
        model = ctx.build_model()
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}  # every client's w_i at start
        self.param_keys = [k for k, _ in model.named_parameters()]  # the similarity is measured on these
        self.models = self.client_store(STORE)

    def _tensors(self, state) -> List[torch.Tensor]:
        return [state[k].detach() for k in self.param_keys]

    def attention(self, selected: Sequence[int], peers: Sequence[int]) -> Dict[int, Dict[int, float]]:
        """xi_ij of every selected client i over its peers j != i. Each peer's stored model is read once and
        compared tensor by tensor, so no flattened copy of any model is held (memory: the models themselves)."""
        hp = self.ctx.hp
        exp = hp.attention == "exp"
        own = {i: self._tensors(self.models.get(i, self.initial)) for i in selected}
        norms = {i: math.sqrt(dot(own[i], own[i])) for i in selected} if not exp else {}
        sims: Dict[int, Dict[int, float]] = {i: {} for i in selected}
        for j in peers:
            wj = self._tensors(self.models.get(j))
            norm_j = math.sqrt(dot(wj, wj)) if not exp else 0.0
            for i in selected:
                if i != j:
                    sims[i][j] = (squared_distance(own[i], wj) if exp else
                                  cosine_from(dot(own[i], wj), norms[i], norm_j))
        weights: Dict[int, Dict[int, float]] = {}
        for i in selected:
            js = list(sims[i])
            values = torch.tensor([sims[i][j] for j in js], dtype=torch.float64)
            if exp:
                xi = exp_attention(values, float(hp.alpha_k), float(hp.sigma))
            else:
                xi = cosine_attention(values, float(hp.sigma), float(hp.self_weight))
            weights[i] = {j: float(x) for j, x in zip(js, xi)}
        return weights

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        hp = self.ctx.hp
        stored = self.models.ids()
        peers = stored if hp.peers == "latest" else sorted(set(stored) & set(selected))
        xi = self.attention(selected, peers)
        clouds, self_weights = {}, []
        for i in selected:
            own_weight = self_weight(torch.tensor(list(xi[i].values()), dtype=torch.float64))
            self_weights.append(own_weight)
            clouds[i] = start_cloud(self.models.get(i, self.initial), own_weight)
        for j in peers:  # u_i = xi_ii w_i + sum_j xi_ij w_j, each stored model read once
            wj = None
            for i in selected:
                w = xi[i].get(j, 0.0)
                if w != 0.0:
                    wj = self.models.get(j) if wj is None else wj
                    add_to_cloud(clouds[i], wj, w)
        if self_weights:  # exp attention can drive xi_ii negative (BASELINES.md 3.1): watch it
            self.ctx.logger.log_scalar("fedamp/self_weight_min", min(self_weights))
            self.ctx.logger.log_scalar("fedamp/self_weight_mean", sum(self_weights) / len(self_weights))
        coef = prox_coefficient(float(hp.lam), float(hp.alpha_k))
        return {i: Message("fit", {"cloud": clouds[i], "prox": coef}) for i in selected}

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        for cid in sorted(replies):
            self.models.put(cid, replies[cid]["params"])  # the latest w_i replaces the previous one
        return None

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate") for cid in clients}  # each client scores its own w_i


ALGORITHM = Algorithm(
    trainer="fedamp", aggregator="fedamp",
    description="FedAMP: attentive message passing -- the server keeps every client's latest model and sends each "
                "a personal cloud model u_i weighted by model similarity; clients train with a proximal pull "
                "lambda/(2 alpha_k) ||w - u_i||^2 (Huang et al., 2021). Defaults: HeurFedAMP's cosine attention, "
                "alpha_k 1, lambda 1, sigma 1, self weight 0.1; model and local training as pflkit's FedAvg (cnn4, "
                "SGD lr 0.05, batch 32, 1 local epoch). Evaluates the personal w_i.",
    paper="Huang, Chu, Zhou, Wang, Liu, Pei, Zhang: Personalized Cross-Silo Federated Learning on Non-IID Data, "
          "AAAI 2021",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
