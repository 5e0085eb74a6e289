"""FedRep (Collins, Hassani, Mokhtari, Shakkottai: "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021, Algorithm 1).

Model = shared representation phi (``features.*``, the "body") + local head h_i (``head.*``). Each round every
selected client i

1. loads the global body phi^t,
2. updates its head for ``head_epochs`` epochs of SGD with the body frozen
   (Algorithm 1: h_i^{t,s} = GRD(f_i(h_i^{t,s-1}, phi^t), h_i^{t,s-1}, alpha), s = 1..tau),
3. updates the body for ``body_epochs`` epochs of SGD with its new head frozen
   (phi_i^{t,s} = GRD(f_i(h_i^{t,tau}, phi_i^{t,s-1}), phi_i^{t,s-1}, alpha)),
4. uploads the body only; the server averages the bodies weighted by sample count
   (the paper's phi^{t+1} = 1/n sum_i phi_i^{t,tau}; pflkit's FedAvg aggregator weights by n_i).

Frozen means "not optimised": the frozen part's parameters do not change in that phase. BatchNorm running
statistics, where the model has any, keep being updated by forward passes in both phases (as in the reference
implementations, which keep the whole model in training mode).
"""
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from pflkit.core import (Algorithm, BatchedForm, BatchedPhase, ConfigError, Param, Space, make_optimizer, positive,
                         run_sgd, trained_names)
from pflkit_fedper import FedPerTrainer

__all__ = ["FedRepTrainer", "ALGORITHM", "frozen"]


@contextmanager
def frozen(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Turn off gradients for ``params`` (no gradient is even computed for them), restoring the flags after."""
    params = list(params)
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


class FedRepTrainer(FedPerTrainer):
    """Head first (body frozen), then body (head frozen); uploads only the body (``features.*``)."""

    description = "trains the local head (body frozen), then the body (head frozen); uploads only the body"
    declares_state = True  # the head (head_loss/body_loss are set and read within one 'fit')
    params = {
        **FedPerTrainer.params,
        "head_epochs": Param(10, "local epochs of head-only training per round (default 10, the paper's; on the "
                                 "embedded digits, 20 clients, 20 rounds it beat 5 and 1: final uniform accuracy "
                                 "0.942 vs 0.936 vs 0.863)", check=positive,
                             space=Space.integer(1, 15, source="around the paper's 10; no grid at hand")),
        "body_epochs": Param(None, "local epochs of body-only training per round (default: train.local_epochs, "
                                   "whose default 1 is the paper's)", type=int, check=positive),
    }

    @classmethod
    def shared_keys(cls, model, hp):
        # checked at start: a model whose body has no parameters (an MLP without hidden layers) leaves FedRep's body
        # step nothing to train, and FedRep would be Local (the PCFL paper says so of its one-layer Adult MLP)
        if not any(p.requires_grad for p in model.features.parameters()):
            raise ConfigError(f"model: FedRep needs a body (features.*) with parameters; {type(model).__name__}'s "
                              f"has none (an mlp with hidden=[]?): FedRep would be Local, run local instead")
        return super().shared_keys(model, hp)

    def local_update(self) -> float:
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        head = list(self.model.head.parameters())
        body = list(self.model.features.parameters())
        self.model.train()
        with frozen(body):  # Algorithm 1, head update: tau_h steps on h_i with phi^t fixed
            self.head_loss = run_sgd(self.batches(epochs=hp.head_epochs), self.loss, make_optimizer(head, cfg))
        body_epochs = hp.body_epochs if hp.get("body_epochs") is not None else cfg.local_epochs
        with frozen(head):  # Algorithm 1, representation update: steps on phi with the new h_i fixed
            self.body_loss = run_sgd(self.batches(epochs=body_epochs), self.loss, make_optimizer(body, cfg))
        return self.body_loss

    def on_fit(self, payload):
        reply = super().on_fit(payload)
        reply["metrics"] = {"head_loss": self.head_loss, "body_loss": self.body_loss}
        return reply

    def batched_form(self) -> BatchedForm:
        """local_update's two phases for clients.batched: the head with the body constant, then the body with the
        new head constant (BatchNorm statistics update in both, as above)."""
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        body_epochs = hp.body_epochs if hp.get("body_epochs") is not None else cfg.local_epochs
        phases = [BatchedPhase(self.loss, trained_names(self.model, "model", under="head"), int(hp.head_epochs)),
                  BatchedPhase(self.loss, trained_names(self.model, "model", under="features"), int(body_epochs))]

        def reply(losses, start, aux):
            self.head_loss, self.body_loss = losses
            return {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": self.body_loss,
                    "metrics": {"head_loss": self.head_loss, "body_loss": self.body_loss}}

        return BatchedForm({"model": self.model}, phases, reply)


ALGORITHM = Algorithm(
    trainer="fedrep", aggregator="fedavg",
    description="FedRep: each round train the local head with the shared body frozen, then the body with the "
                "head frozen; only the body (features.*) is averaged (Collins et al., 2021, Algorithm 1). "
                "Defaults: head_epochs 10 (paper), body_epochs = "
                "train.local_epochs = 1 (paper: 1); model and optimiser as pflkit's FedAvg (cnn4, SGD lr 0.05, "
                "batch 32).",
    paper="Collins, Hassani, Mokhtari, Shakkottai: Exploiting Shared Representations for Personalized Federated "
          "Learning, ICML 2021",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "trainer": {"head_epochs": 10}},
)
