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
from torch import nn

from pflkit.core import (Algorithm, BatchedForm, BatchedPhase, LocalSGDTrainer, Param, Space, non_negative,
                         proximal_term, trained_names)

__all__ = ["FedProxTrainer", "ALGORITHM", "proximal_term"]


class FedProxTrainer(LocalSGDTrainer):
    """Local SGD on F_k(w) + mu/2 ||w - w^t||^2 (Eq. 2); uploads the whole model like FedAvg."""

    description = "local SGD on the proximal objective F_k(w) + mu/2 ||w - w^t||^2 (Eq. 2)"
    # as FedAvg: the anchor w^t is set by every 'fit' before it is read, so it is not per-client state
    declares_state = True
    # on_evaluate scores the model the evaluate message brings: the personal numbers are the global model's
    personal_is_global = True
    params = {
        **LocalSGDTrainer.params,
        "mu": Param(0.01, "proximal coefficient mu of Eq. 2 (default 0.01; the paper tunes mu per dataset over "
                          "{0.001, 0.01, 0.1, 1}); 0 = FedAvg", check=non_negative,
                    space=Space.choice([0.001, 0.01, 0.1, 1.0],
                                       source="the paper's grid; it tunes mu per dataset")),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        shared = set(self.shared)
        # the parameters the proximal term acts on (by name), and their received (global) values w^t as buffers of a
        # module: clients.batched stacks each client's w^t with its model
        self._prox_names: List[str] = [n for n, _ in self.model.named_parameters() if n in shared]
        self.anchor = _Anchor([p for n, p in self.model.named_parameters() if n in shared])

    @property
    def _prox_params(self) -> List[torch.Tensor]:
        named = dict(self.model.named_parameters())  # looked up at each call (the batched path substitutes them)
        return [named[n] for n in self._prox_names]

    @property
    def _anchor(self) -> List[torch.Tensor]:
        return self.anchor.tensors()

    def receive(self, params) -> None:
        super().receive(params)
        # w^t: a copy, not an alias of the parameters, which local training is about to change
        with torch.no_grad():
            for a, p in zip(self._anchor, self._prox_params):
                a.copy_(p)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Eq. 2: h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2
        task_loss = self.ctx.task.loss(self.model(x), y)
        return task_loss + 0.5 * self.ctx.hp.mu * proximal_term(self._prox_params, self._anchor)

    def distance(self) -> float:
        with torch.no_grad():
            return float(proximal_term(self._prox_params, self._anchor).sqrt())

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        reply = super().on_fit(payload)
        reply["metrics"] = {"distance_to_global": self.distance()}
        return reply

    def batched_form(self) -> BatchedForm:
        """The local update for clients.batched: FedAvg's, on the proximal loss, with w^t stacked per client."""
        phase = BatchedPhase(self.loss, trained_names(self.model, "model"), int(self.ctx.train_cfg.local_epochs))

        def reply(losses, start, aux):
            return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": losses[-1],
                    "metrics": {"distance_to_global": self.distance()}}

        return BatchedForm({"model": self.model, "anchor": self.anchor}, [phase], reply)


class _Anchor(nn.Module):
    """w^t as buffers, one per parameter of the proximal term."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        super().__init__()
        self.count = len(params)
        for i, p in enumerate(params):
            self.register_buffer(f"w{i}", p.detach().clone())

    def tensors(self) -> List[torch.Tensor]:
        return [getattr(self, f"w{i}") for i in range(self.count)]

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
