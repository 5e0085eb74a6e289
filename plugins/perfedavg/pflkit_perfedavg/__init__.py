"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar: "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Algorithm 1 with its first-order and Hessian-free updates).

FedAvg on the MAML objective F(w) = 1/n sum_i f_i(w - alpha grad f_i(w)): the global model is a meta-initialisation,
and a client's personal model is the global model after one gradient step with step size alpha on its own data.

Each round every selected client runs tau local steps from the received w (equations.py has the formulas):

1. D' is the next mini-batch of the client's usual batch stream (``train.batch_size``, ``train.local_epochs``: tau
   is the number of mini-batches FedAvg would take); D and, for HF, D'' are independent batches of the same size
   drawn from the client's training split with a generator derived from the call's (so the stream of D' is
   FedAvg's, whatever alpha);
2. w~ = w - alpha grad f(w; D);
3. FO: w <- w - beta grad f(w~; D');  HF: w <- w - beta [grad f(w~; D') - alpha H(w; D'') grad f(w~; D')], the
   Hessian-vector product by central differences with ``delta``.

The step in 3 goes through the configured optimiser at learning rate beta (plain SGD by default). The server takes the
uniform mean of the uploads (Algorithm 1: w_{k+1} = 1/|A_k| sum_{i in A_k} w^i_{k+1,tau}; ``aggregator.weighting=
uniform``). Evaluation scores the global model after one SGD step with alpha on one training batch of the client (the
core's evaluation-time adaptation, ``eval.adapt=every``, ``eval.adapt_steps=1``; its step size is alpha); the client
keeps nothing of it.

alpha = 0 makes w~ = w, and both updates are the plain SGD step w <- w - beta grad f(w; D'): Per-FedAvg is then
FedAvg with learning rate beta, bit for bit (the inner and Hessian steps are skipped, not multiplied by zero).
"""
from __future__ import annotations

from typing import List

import torch

from pflkit.core import Algorithm, Param, Space, clip_gradients, derive_seed, make_optimizer, non_negative, positive
from pflkit_fedavg import FedAvgTrainer

from .equations import hessian_vector_product, hf_direction, inner_step

__all__ = ["PerFedAvgTrainer", "ALGORITHM", "VARIANTS"]

VARIANTS = ("fo", "hf")


class PerFedAvgTrainer(FedAvgTrainer):
    """Local meta-steps on the MAML objective (FO or HF); uploads the whole model, as FedAvg."""

    description = ("local steps on the MAML objective (first-order or Hessian-free), uploads the whole model; "
                   "evaluated after one adaptation step with alpha")
    declares_state = True  # nothing of its own: every message brings the whole model, as FedAvg's
    # unadapted, it scores the model the evaluate message brings; with its default eval.adapt=every the core sees the
    # adaptation and evaluates the global model separately (core/api/globalmodel.py)
    personal_is_global = True
    params = {
        **FedAvgTrainer.params,
        "variant": Param("fo", "fo = first-order Per-FedAvg (the Hessian term dropped), hf = Hessian-free (its "
                               "Hessian-vector product by central differences of gradients); default fo, as "
                               "FL-bench's (the paper evaluates both)", choices=VARIANTS),
        "alpha": Param(None, "step size of the inner step and of the evaluation-time step (the paper's alpha); "
                             "default: train.lr (alpha = lr, as the pFedMe authors' and PFLlib's implementations); "
                             "0 turns the meta step off (FedAvg)", type=float, check=non_negative,
                       space=Space.real(0.001, 0.1, log=True,
                                        source="around the pFedMe authors' tuned 0.005-0.03 and pflkit's 0.05; no "
                                               "grid given")),
        "beta": Param(None, "step size of the outer (meta) step (the paper's beta); default: train.lr, so that "
                            "alpha = 0 is FedAvg at the same learning rate", type=float, check=positive),
        "delta": Param(1e-3, "finite-difference step of the Hessian-free variant's Hessian-vector product (FL-bench's "
                             "default 1e-3); unused by fo", check=positive),
    }

    # -- hyperparameters ---------------------------------------------------------------------------------------
    def alpha(self) -> float:
        a = self.ctx.hp.get("alpha")
        return float(self.ctx.train_cfg.lr if a is None else a)

    def beta(self) -> float:
        b = self.ctx.hp.get("beta")
        return float(self.ctx.train_cfg.lr if b is None else b)

    def adaptation_lr(self) -> float:
        return self.alpha()  # evaluation: one step with alpha from the global model (the personal model)

    # -- local update ------------------------------------------------------------------------------------------
    def local_update(self) -> float:
        alpha, hf = self.alpha(), self.ctx.hp.get("variant", "fo") == "hf"
        self.model.train()
        params: List[torch.nn.Parameter] = [p for p in self.model.parameters() if p.requires_grad]
        opt = make_optimizer(params, self.ctx.train_cfg, lr=self.beta())
        # D and D'' come from their own generator, seeded from this call's seed, so the D' stream is FedAvg's
        side = torch.Generator().manual_seed(derive_seed(self.ctx.generator.initial_seed(), "perfedavg-side"))
        total, steps = None, 0
        for x, y in self.batches():  # D'
            if alpha == 0:  # w~ = w: the step below is FedAvg's SGD step
                opt.zero_grad(set_to_none=True)
                loss = self.loss(x, y)
                loss.backward()
            else:
                loss = self._meta_gradient(params, x, y, alpha, hf, side)
            clip_gradients(opt)
            opt.step()  # w <- w - beta * (FO or HF direction)
            total = loss.detach() if total is None else total + loss.detach()
            steps += 1
        return float(total.item()) / steps if steps else 0.0

    def _meta_gradient(self, params, x, y, alpha: float, hf: bool, side: torch.Generator) -> torch.Tensor:
        """Leave the parameters at w with the FO or HF direction in their ``.grad``; returns the loss at w~ on D'."""
        w = [p.detach().clone() for p in params]
        grad_d = self._grads_at(w, *self._side_batch(side))  # grad f(w; D)
        self._load(params, inner_step(w, grad_d, alpha))  # w~
        for p in params:
            p.grad = None
        loss = self.loss(x, y)  # f(w~; D')
        outer = list(torch.autograd.grad(loss, params, allow_unused=True))
        outer = [torch.zeros_like(p) if g is None else g for p, g in zip(params, outer)]
        if hf:
            xs, ys = self._side_batch(side)  # D''
            buffers = [b.detach().clone() for b in self.model.buffers()]  # probes must not move BN statistics
            hv = hessian_vector_product(lambda point: self._grads_at(point, xs, ys), w, outer,
                                        float(self.ctx.hp.get("delta", 1e-3)))
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)
            outer = hf_direction(outer, hv, alpha)
        self._load(params, w)
        for p, g in zip(params, outer):
            p.grad = g.detach()
        return loss

    def _side_batch(self, side: torch.Generator):
        """An independent mini-batch (D or D'') of train.batch_size samples of the client's training split."""
        n = len(self.ctx.train)
        idx = torch.randperm(n, generator=side)[: self.ctx.train_cfg.batch_size].to(self.ctx.train.y.device)
        return self.ctx.train.batch(idx)

    def _grads_at(self, point, x, y) -> List[torch.Tensor]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._load(params, point)
        grads = torch.autograd.grad(self.data_loss(self.model, x, y), params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]

    @staticmethod
    @torch.no_grad()
    def _load(params, values) -> None:
        for p, v in zip(params, values):
            p.copy_(v)


ALGORITHM = Algorithm(
    trainer="perfedavg", aggregator="fedavg",
    description="Per-FedAvg: FedAvg on the MAML objective (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): local steps "
                "w <- w - beta grad f(w - alpha grad f(w; D); D') (fo) or its Hessian-free correction (hf), uniform "
                "server mean (aggregator.weighting=uniform, the paper's), evaluation after one step with alpha on "
                "one training batch (eval.adapt=every, eval.adapt_steps=1). Defaults: alpha = beta = train.lr; "
                "model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch).",
    paper="Fallah, Mokhtari, Ozdaglar: Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic "
          "Meta-Learning Approach, NeurIPS 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "aggregator": {"weighting": "uniform"},
              "eval": {"adapt": "every", "adapt_steps": 1, "adapt_params": "all"}},
)
