"""MOON (Li, He, Song: "Model-Contrastive Federated Learning", CVPR 2021).

FedAvg whose clients add a model-contrastive term to cross-entropy: the representation z = R_w(x) of the model
being trained is pulled toward the received global model's, z_glob, and pushed away from the client's previous
local model's, z_prev (``equations.py``). The server is FedAvg's; the global model is evaluated, as in FedAvg.

In pflkit the representation R is the model's ``features`` (every built-in model is a ``SplitModel``,
``forward = head(features(x))``). MOON's architecture puts a projection head -- Linear(d, d), ReLU,
Linear(d, 256) -- between the features and the classifier and contrasts its output: that is the general model
option ``model.projection_dim``, which appends it to ``features``; MOON's defaults set it to 256 (the paper's
out_dim). With ``model.projection_dim=0`` the plain features are contrasted, as in PFLlib and FL-bench.

Client state: the previous local model, of which only the representation part R is ever used, so only
``features`` is kept (declared, hence pooled and spillable). Before a client's first training it is the initial
model w^0 (the authors' code). The frozen copy of w^t is rewritten from every message before it is read.
"""
from typing import Any, Dict

import torch
from torch import nn

from pflkit.core import (Algorithm, BatchedForm, BatchedPhase, ConfigError, LocalSGDTrainer, Param, Space,
                         host_copy, load_into, non_negative, positive, trained_names)

from .equations import model_contrastive_loss

__all__ = ["MOONTrainer", "ALGORITHM", "model_contrastive_loss"]


def representation(model: nn.Module) -> nn.Module:
    """The module whose output MOON contrasts: ``model.features`` (it must be followed by ``model.head``)."""
    features, head = getattr(model, "features", None), getattr(model, "head", None)
    if not isinstance(features, nn.Module) or not isinstance(head, nn.Module):
        raise ConfigError(f"algorithm moon: MOON contrasts the representation features(x) of a model whose forward is "
                          f"head(features(x)); model {type(model).__name__} has no 'features'/'head' sub-modules")
    return features


class MOONTrainer(LocalSGDTrainer):
    """FedAvg's local update on CE + mu * l_con against the frozen global and previous local representations."""

    description = ("FedAvg's local update on CE + mu * l_con, contrasting features(x) with the received global "
                   "model's (positive) and the client's previous model's (negative)")
    params = {
        **LocalSGDTrainer.params,
        "mu": Param(5.0, "weight mu of the model-contrastive loss (default 5: the paper's for CIFAR-10; 1 for "
                         "CIFAR-100 and Tiny-ImageNet; PFLlib's default -mu 0 switches it off, i.e. FedAvg); 0 = "
                         "FedAvg exactly", check=non_negative,
                    space=Space.choice([0.1, 1.0, 5.0, 10.0],
                                       source="the paper's grid {0.1, 1, 5, 10}; it tunes mu per dataset")),
        "tau": Param(0.5, "temperature tau of l_con (default 0.5: the paper's and FL-bench's; PFLlib's is 1.0, the "
                          "value FedSA states)", check=positive,
                     space=Space.choice([0.1, 0.5, 1.0], source="around the paper's 0.5; PFLlib and FedSA use 1.0; "
                                                                "no grid given")),
        "frozen_mode": Param("eval", "mode of the frozen global and previous models while they embed a batch: eval "
                                     "(default: BatchNorm running statistics, no dropout) or train (batch "
                                     "statistics; the references leave this unsettled)", choices=("eval", "train")),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        representation(self.model)
        # R_{w^t} and R_{w_i^{t-1}}: only the representation part of each model is kept
        self.global_features = ctx.build_model().features.requires_grad_(False)
        self.previous = ctx.build_model().features.requires_grad_(False)  # w^0's before the first training

    def local_update(self) -> float:
        load_into(self.global_features, self.model.features.state_dict())  # the received w^t, frozen
        train_mode = self.ctx.hp.frozen_mode == "train"
        self.global_features.train(train_mode)
        self.previous.train(train_mode)
        self._con_sum = torch.zeros((), device=self.ctx.device)
        self._steps = 0
        loss = super().local_update()
        load_into(self.previous, self.model.features.state_dict())  # w_i^t: the negative of the next round
        return loss

    def objective(self, x: torch.Tensor, y: torch.Tensor):
        """l_sup + mu * l_con, and l_con."""
        z = self.model.features(x)
        with torch.no_grad():
            z_glob, z_prev = self.global_features(x), self.previous(x)
        con = model_contrastive_loss(z, z_glob, z_prev, self.ctx.hp.tau)
        return self.ctx.task.loss(self.model.head(z), y) + self.ctx.hp.mu * con, con  # l_sup + mu * l_con

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss, con = self.objective(x, y)
        self._con_sum = self._con_sum + con.detach()
        self._steps += 1
        return loss

    # clients.batched: FedAvg's local update with R_{w^t} and R_{w_i^{t-1}} stacked per client
    def batched_begin(self, payload: Dict[str, Any]) -> None:
        super().batched_begin(payload)
        load_into(self.global_features, self.model.features.state_dict())  # the received w^t, frozen

    def batched_form(self) -> BatchedForm:
        def batched_loss(x, y):
            loss, con = self.objective(x, y)
            return loss, {"con": con.detach(), "steps": torch.ones((), device=con.device)}

        phase = BatchedPhase(batched_loss, trained_names(self.model, "model"), int(self.ctx.train_cfg.local_epochs),
                             aux=True)

        def reply(losses, start, aux):
            load_into(self.previous, self.model.features.state_dict())  # w_i^t: the negative of the next round
            return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": losses[-1],
                    "metrics": {"contrastive_loss": aux.get("con", 0.0) / max(1.0, aux.get("steps", 0.0))}}

        frozen = () if self.ctx.hp.frozen_mode == "train" else ("global_features", "previous")
        return BatchedForm({"model": self.model, "global_features": self.global_features,
                            "previous": self.previous}, [phase], reply, eval_modules=frozen)

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        reply = super().on_fit(payload)
        reply["metrics"] = {"contrastive_loss": float(self._con_sum) / max(1, self._steps)}
        return reply

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "previous": self.previous.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.previous.load_state_dict(state["previous"])

    # declared state: the previous model's representation part (plus the model keys never sent, if any)
    declares_state = True
    # on_evaluate scores the model the evaluate message brings: the personal numbers are the global model's
    personal_is_global = True

    def client_state(self) -> Dict[str, Any]:
        return {**super().client_state(), "previous": host_copy(self.previous.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        load_into(self.previous, state["previous"])


ALGORITHM = Algorithm(
    trainer="moon", aggregator="fedavg",
    description="MOON: FedAvg whose clients add mu * l_con, a contrastive loss pulling features(x) toward the "
                "global model's and away from the previous local model's (Li et al., 2021). Defaults: mu 5, tau "
                "0.5 (the paper's CIFAR-10 values), cnn4 with the paper's projection head (model.projection_dim "
                "256); local training as pflkit's FedAvg (SGD lr 0.05, batch 32, 1 local epoch).",
    paper="Li, He, Song: Model-Contrastive Federated Learning, CVPR 2021",
    defaults={"model": {"name": "cnn4", "projection_dim": 256},
              "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "trainer": {"mu": 5.0, "tau": 0.5}},
)
