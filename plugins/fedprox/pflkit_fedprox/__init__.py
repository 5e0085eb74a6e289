"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Each selected client k approximately minimises the proximal local objective (the paper's Eq. 2)

    h_k(w; w^t) = F_k(w) + mu/2 * ||w - w^t||^2

starting from the received global model w^t, with the usual local SGD; the server averages the uploads weighted
by sample count (FedAvg's aggregator). With mu = 0 this is FedAvg exactly.

The proximal term covers the model's trainable parameters that the server sends (with ``bn_stats=local`` the
BN running statistics are buffers and are not part of it anyway). The paper's systems-heterogeneity experiments
(clients doing a variable amount of local work, "stragglers") are not modelled here; every client runs the
configured ``train.local_epochs``.
"""
from typing import Any, Dict, List

import torch

from pflkit.core import Algorithm, LocalSGDTrainer, Param, non_negative, proximal_term

__all__ = ["FedProxTrainer", "ALGORITHM", "proximal_term"]


class FedProxTrainer(LocalSGDTrainer):
    """Local SGD on F_k(w) + mu/2 ||w - w^t||^2 (Eq. 2); uploads the whole model like FedAvg."""

    description = "local SGD on the proximal objective F_k(w) + mu/2 ||w - w^t||^2 (Eq. 2)"
    # as FedAvg: the anchor w^t is set by every 'fit' before it is read, so it is not per-client state
    declares_state = True
    params = {
        **LocalSGDTrainer.params,
        "mu": Param(0.01, "proximal coefficient mu of Eq. 2 (default 0.01; the paper tunes mu per dataset over "
                          "{0.001, 0.01, 0.1, 1}); 0 = FedAvg", check=non_negative),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        shared = set(self.shared)
        # the parameters the proximal term acts on, and a detached copy of their received (global) values
        self._prox_params: List[torch.nn.Parameter] = [p for n, p in self.model.named_parameters() if n in shared]
        self._anchor: List[torch.Tensor] = [p.detach().clone() for p in self._prox_params]

    def receive(self, params) -> None:
        super().receive(params)
        # w^t: the copy must not alias the parameters, which local training is about to change
        self._anchor = [p.detach().clone() for p in self._prox_params]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Eq. 2: h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2
        task_loss = self.ctx.task.loss(self.model(x), y)
        return task_loss + 0.5 * self.ctx.hp.mu * proximal_term(self._prox_params, self._anchor)

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        reply = super().on_fit(payload)
        with torch.no_grad():
            distance = proximal_term(self._prox_params, self._anchor).sqrt()
        reply["metrics"] = {"distance_to_global": float(distance)}
        return reply


ALGORITHM = Algorithm(
    trainer="fedprox", aggregator="fedavg",
    description="FedProx: FedAvg whose clients minimise F_k(w) + mu/2 ||w - w^t||^2 (Li et al., 2020, Eq. 2). "
                "Defaults: mu 0.01 (from the paper's grid {0.001, 0.01, 0.1, 1}); model and local training as "
                "pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch) so the two compare directly.",
    paper="Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith: Federated Optimization in Heterogeneous Networks, "
          "MLSys 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "trainer": {"mu": 0.01}},
)
