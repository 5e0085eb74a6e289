"""Ditto (Li, Hu, Beirami, Smith: "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021, Algorithm 1).

Two models per client: the global model w, trained exactly as in FedAvg, and a personal model v_k that solves
the client's regularised problem (the paper's Eq. 2)

    min_v  h_k(v; w*) = F_k(v) + lambda/2 * ||v - w*||^2.

Each round a selected client k receives w^t and

1. updates v_k for ``personal_epochs`` epochs of SGD on F_k(v) + lambda/2 ||v - w^t||^2
   (Algorithm 1: v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t))), with w^t the global model it received;
2. runs FedAvg's local update on w^t for ``train.local_epochs`` epochs and uploads the result;

the server averages the uploaded global models with sample weights (the ``fedavg`` aggregator). Evaluation scores
the personal model v_k. v_k starts from w^0 (Algorithm 1's initialisation) and lives on the client.

The reference implementation interleaves the two updates batch by batch on the same mini-batches; the paper's
Algorithm 1 does the personal steps and the global steps as separate solves, which is what this trainer does.
"""
from typing import Any, Dict

import torch

from pflkit.core import (Algorithm, BatchedForm, BatchedPhase, LocalSGDTrainer, Param, Space, host_copy, load_into,
                         make_optimizer, non_negative, positive, proximal_term, run_sgd, trained_names)

__all__ = ["DittoTrainer", "ALGORITHM"]


class DittoTrainer(LocalSGDTrainer):
    """FedAvg local update of the global model + a personal model pulled toward w^t; evaluates the personal one."""

    description = ("trains the global model as FedAvg and a personal model on F_k(v) + lambda/2 ||v - w^t||^2; "
                   "uploads the global model, evaluates the personal one")
    params = {
        **LocalSGDTrainer.params,
        "lam": Param(0.1, "lambda of Eq. 2: pull of the personal model toward the global one (default 0.1: from "
                          "the authors' candidate set {0.1, 1, 2}; their clean-data run scripts use 1, but on the "
                          "embedded digits 0.1 is better, final uniform accuracy 0.852/0.884 vs 0.805/0.842 over "
                          "seeds 0/1); 0 = local training of v", check=non_negative,
                     space=Space.choice([0.1, 1.0, 2.0],
                                        source="the authors' candidate set {0.1, 1, 2} (their code's per-device "
                                               "lambda selection); the paper's own grid not checked offline")),
        "personal_epochs": Param(None, "local epochs of the personal model per round (default: "
                                       "train.local_epochs, the same work as the global update, as in the "
                                       "authors' code)", type=int, check=positive),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        self.personal = ctx.build_model()  # v_k^0 = w^0 (every build returns the same initial weights)
        self._shared_set = set(self.shared)  # the parameters of the proximal term (matched by name)

    def _pairs(self):
        """(v, w) of the proximal term, matched by name and looked up in the modules at each call, so the batched
        path's substituted tensors are the ones used (the lists built in __init__ name the same tensors)."""
        global_params = dict(self.model.named_parameters())
        pairs = [(p, global_params[n]) for n, p in self.personal.named_parameters() if n in self._shared_set]
        return [v for v, _ in pairs], [w.detach() for _, w in pairs]

    def personal_objective(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Eq. 2, h_k(v; w^t), while self.model holds w^t (the global model is trained only after this update)."""
        v, anchors = self._pairs()
        return self.data_loss(self.personal, x, y) + 0.5 * self.ctx.hp.lam * proximal_term(v, anchors)

    def personal_epochs(self) -> int:
        hp = self.ctx.hp
        return int(hp.personal_epochs if hp.get("personal_epochs") is not None else self.ctx.train_cfg.local_epochs)

    def personal_update(self) -> Dict[str, float]:
        """Algorithm 1's personal solver: SGD on F_k(v) + lambda/2 ||v - w^t||^2 with w^t = the received model."""
        self.personal.train()
        loss = run_sgd(self.batches(epochs=self.personal_epochs()), self.personal_objective,
                       make_optimizer(self.personal.parameters(), self.ctx.train_cfg))
        with torch.no_grad():
            distance = float(proximal_term(*self._pairs()).sqrt())
        return {"personal_loss": loss, "personal_to_global": distance}

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        if "params" in payload:
            self.receive(payload["params"])
        else:
            self.require_shared()
        personal = self.personal_update()  # first, while self.model still holds w^t
        loss = self.local_update()  # FedAvg's local solver on the global model
        return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": loss,
                "metrics": personal}

    def batched_form(self) -> BatchedForm:
        """on_fit's two solves for clients.batched: the personal model (the global one constant: w^t), then FedAvg's
        local update of the global model."""
        phases = [BatchedPhase(self.personal_objective, trained_names(self.personal, "personal"),
                               self.personal_epochs()),
                  BatchedPhase(self.loss, trained_names(self.model, "model"), int(self.ctx.train_cfg.local_epochs))]

        def reply(losses, start, aux):
            with torch.no_grad():  # the distance to w^t, the global model as it arrived
                v = dict(self.personal.named_parameters())
                pairs = [(v[n], start[f"model.{n}"]) for n in v if n in self._shared_set]
                distance = float(proximal_term([a for a, _ in pairs], [b for _, b in pairs]).sqrt())
            return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": losses[1],
                    "metrics": {"personal_loss": losses[0], "personal_to_global": distance}}

        return BatchedForm({"model": self.model, "personal": self.personal}, phases, reply)

    def personal_forward(self):
        return self.personal

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "personal": self.personal.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.personal.load_state_dict(state["personal"])

    # declared state: the personal model v_k (plus the global model's unshared keys, if any); w^t arrives with
    # every message, and the parameter lists built in __init__ point into the pooled modules, which stay put
    declares_state = True

    def client_state(self) -> Dict[str, Any]:
        return {**super().client_state(), "personal": host_copy(self.personal.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        load_into(self.personal, state["personal"])


ALGORITHM = Algorithm(
    trainer="ditto", aggregator="fedavg",
    description="Ditto: the global model is trained as in FedAvg; each client also keeps a personal model "
                "trained on F_k(v) + lambda/2 ||v - w^t||^2 and evaluated (Li et al., 2021, Algorithm 1). "
                "Defaults: lam 0.1 (from the authors' candidate set {0.1, 1, 2}, best on digits), personal_epochs = "
                "train.local_epochs; model and local "
                "training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch).",
    paper="Li, Hu, Beirami, Smith: Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "trainer": {"lam": 0.1}},
)
