"""FedRoD (Chen and Chao: "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022), the linear-head variant ("FedRoD (linear)").

The model is decoupled into two predictors on one shared feature extractor ``f(x; theta)`` (``features.*``):

- the **generic** predictor ``g(z; psi)`` (the model's ``head.*``) is trained, together with theta, with a
  class-balanced loss -- Balanced Softmax with each client's own class counts -- and {theta, psi} are averaged by
  the server weighted by sample count (FedAvg, the ``fedavg`` aggregator);
- the **personalized** predictor is ``g(z; psi) + h(z; phi_m)``: a lightweight head phi_m of the same shape as the
  generic one, kept on client m and trained with the ordinary empirical risk (cross-entropy) of the summed
  scores; its features and the generic scores enter detached, so it never changes the shared model.

Each local step updates {theta, psi} on the balanced loss and phi_m on the personalized loss, from the same
mini-batch. Clients are evaluated with the latest global {theta, psi} and their own phi_m
(``trainer.eval_model=generic`` scores the generic model instead: the paper's G-FL accuracy on the client's data).

Readings that are ours (the paper was not at hand; see the README): phi_m starts at zero so that the personalized
model starts as the generic one (``personal_init=generic`` copies the generic head's initial weights, as PFLlib's
clientrod.py does); ``bsm_gamma`` = 1 is Balanced Softmax proper (0 = plain cross-entropy, an ablation).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from pflkit.core import (Algorithm, BatchedForm, BatchedPhase, ClientContext, ConfigError, LocalSGDTrainer, Param,
                         Space, host_copy, load_into, make_optimizer, non_negative, positive, run_sgd, trained_names)

from .equations import balanced_softmax_loss, class_counts, personalized_logits, personalized_loss

__all__ = ["FedRoDTrainer", "ALGORITHM", "balanced_softmax_loss", "class_counts", "personalized_logits",
           "personalized_loss"]

PERSONAL_INITS = ("zeros", "generic")
EVAL_MODELS = ("personal", "generic")


class _Optimizers:
    """Two optimizers stepped together (generic model and personal head: disjoint parameters, own learning rates)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


class FedRoDTrainer(LocalSGDTrainer):
    """Shared body + generic head trained with Balanced Softmax (uploaded); personal head trained locally.

    Messages (protocol 'global-model'): ``fit`` {params} -> {params, num_samples, train_loss,
    metrics: {bsm_loss, personal_loss}}; ``evaluate`` {params} -> eval sums of the personalized (or generic) model.
    Persistent client state: the model (its shared part is overwritten by every download) and the personal head.
    """

    declares_state = True  # runs pooled: one working trainer, each client's personal head kept as its state
    description = ("body + generic head trained with Balanced Softmax and averaged; a local personal head adds "
                   "its scores to the generic ones")
    params = {
        **LocalSGDTrainer.params,
        "bsm_gamma": Param(1.0, "power of the class counts in the balanced loss -log(N_y^g e^{g_y} / sum_c "
                                "N_c^g e^{g_c}): 1 = Balanced Softmax (FedRoD's BSM), 0 = plain cross-entropy "
                                "(ablation: no balanced risk)", check=non_negative),
        "personal_init": Param("zeros", "initial personal head: zeros (the personalized model starts as the "
                                        "generic one) or generic (a copy of the generic head's initial weights, "
                                        "as PFLlib)", choices=PERSONAL_INITS),
        "personal_lr": Param(None, "learning rate of the personal head (default: train.lr)", type=float,
                             check=positive,
                             space=Space.real(0.001, 0.5, log=True,
                                              source="train.lr's range; no grid at hand")),
        "eval_model": Param("personal", "model scored on each client's test split: personal (generic + personal "
                                        "head, the P-FL accuracy) or generic (the shared model, G-FL accuracy)",
                            choices=EVAL_MODELS),
    }

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        if ctx.task.kind != "classification":
            raise ConfigError(f"algorithm fedrod: FedRoD needs a classification task (balanced softmax over class "
                              f"counts); this dataset is {ctx.task.kind}")
        head = getattr(self.model, "head", None)
        if not isinstance(getattr(self.model, "features", None), nn.Module) or not isinstance(head, nn.Module):
            raise ConfigError(f"model: FedRoD needs a feature-extractor / head split (model.features, model.head); "
                              f"{type(self.model).__name__} has none")
        # phi_m: same architecture as the generic head psi; never part of the model's state, so it never travels
        self.personal_head = copy.deepcopy(head)
        if ctx.hp.get("personal_init", "zeros") == "zeros":
            with torch.no_grad():
                for p in self.personal_head.parameters():
                    p.zero_()

    # training ---------------------------------------------------------------------------------------------------
    def local_update(self) -> float:
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        counts = class_counts(self.ctx.train.y, self.ctx.task.output_dim)  # N_{m,c}: local, never sent
        gamma = float(hp.get("bsm_gamma", 1.0))
        self.model.train()
        self.personal_head.train()
        opt = _Optimizers(make_optimizer(self.model.parameters(), cfg),
                          make_optimizer(self.personal_head.parameters(), cfg, lr=hp.get("personal_lr")))
        parts: List[torch.Tensor] = []

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = self.model.features(x)
            generic = self.model.head(z)
            l_bsm = balanced_softmax_loss(generic, y, counts, gamma)  # trains theta, psi
            l_personal = personalized_loss(generic, self.personal_head(z.detach()), y)  # trains phi_m only
            parts.append(torch.stack([l_bsm.detach(), l_personal.detach()]))
            return l_bsm + l_personal  # disjoint parameters: the sum's gradient is each loss's own

        total = run_sgd(self.batches(), loss, opt)
        means = torch.stack(parts).mean(dim=0).tolist() if parts else [0.0, 0.0]
        self.last_losses = {"bsm_loss": float(means[0]), "personal_loss": float(means[1])}
        return total

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        reply = super().on_fit(payload)
        reply["metrics"] = dict(self.last_losses)
        return reply

    # clients.batched: the same local update as one phase over the model and the personal head (its own lr); the
    # client's class counts N_{m,c} are a per-client buffer of the form
    def batched_begin(self, payload: Dict[str, Any]) -> None:
        super().batched_begin(payload)
        self._counts_module().counts = class_counts(self.ctx.train.y, self.ctx.task.output_dim)

    def _counts_module(self) -> nn.Module:
        if getattr(self, "_counts", None) is None:
            self._counts = nn.Module()
            self._counts.register_buffer("counts", class_counts(self.ctx.train.y, self.ctx.task.output_dim))
        return self._counts

    def _batched_loss(self, x: torch.Tensor, y: torch.Tensor):
        z = self.model.features(x)
        generic = self.model.head(z)
        gamma = float(self.ctx.hp.get("bsm_gamma", 1.0))
        l_bsm = balanced_softmax_loss(generic, y, self._counts_module().counts, gamma)
        l_personal = personalized_loss(generic, self.personal_head(z.detach()), y)
        one = torch.ones_like(l_bsm.detach())
        return l_bsm + l_personal, {"bsm_loss": l_bsm.detach(), "personal_loss": l_personal.detach(), "steps": one}

    def batched_form(self) -> Optional[BatchedForm]:
        if self.ctx.train_cfg.get("max_grad_norm"):
            return None  # the sequential update steps its two optimizers unclipped; the batched one would clip
        personal = trained_names(self.personal_head, "personal_head")
        lr = self.ctx.hp.get("personal_lr")
        phase = BatchedPhase(self._batched_loss, trained_names(self.model, "model") + personal,
                             int(self.ctx.train_cfg.local_epochs), aux=True,
                             lrs=None if lr is None else {n: float(lr) for n in personal})

        def reply(losses, start, aux):
            steps = aux.get("steps", 0.0)
            self.last_losses = {k: aux[k] / steps if steps else 0.0 for k in ("bsm_loss", "personal_loss")}
            return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": losses[-1],
                    "metrics": dict(self.last_losses)}

        return BatchedForm({"model": self.model, "personal_head": self.personal_head,
                            "counts": self._counts_module()}, [phase], reply)

    # evaluation -------------------------------------------------------------------------------------------------
    def personal_forward(self):
        if self.ctx.hp.get("eval_model", "personal") == "generic":
            return self.model

        def forward(x: torch.Tensor) -> torch.Tensor:
            z = self.model.features(x)
            return personalized_logits(self.model.head(z), self.personal_head(z))

        return forward

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        if "params" in payload:
            self.receive(payload["params"])
        return self.evaluate_model(self.personal_forward(), modules=(self.model, self.personal_head))

    # state ------------------------------------------------------------------------------------------------------
    def client_state(self) -> Dict[str, Any]:
        # the model's unshared keys (none unless BN statistics stay local) and phi_m; last_losses is set and read
        # within one 'fit'
        return {**super().client_state(), "personal_head": host_copy(self.personal_head.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        load_into(self.personal_head, state["personal_head"])

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "personal_head": self.personal_head.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.personal_head.load_state_dict(state["personal_head"])


ALGORITHM = Algorithm(
    trainer="fedrod", aggregator="fedavg",
    description="FedRoD (linear): shared body + generic head trained with Balanced Softmax on each client's class "
                "counts and averaged as in FedAvg; a local personal head, trained with cross-entropy on detached "
                "features, adds its scores to the generic ones (Chen and Chao, ICLR 2022). Defaults: bsm_gamma 1 "
                "(Balanced Softmax), personal head initialised at zero; model and optimiser as pflkit's FedAvg "
                "(cnn4, SGD lr 0.05, batch 32, 1 local epoch).",
    paper="Chen, Chao: On Bridging Generic and Personalized Federated Learning for Image Classification, ICLR 2022",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "trainer": {"bsm_gamma": 1.0}},
)
