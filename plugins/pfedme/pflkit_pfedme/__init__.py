"""pFedMe (T. Dinh, Tran, Nguyen: "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020,
Algorithm 1).

Each client i keeps a personal model theta_i, the proximal point of its loss around its copy w of the global model
(the minimiser inside the Moreau envelope F_i(w) = min_theta f_i(theta) + lambda/2 ||theta - w||^2). A selected
client receives w^t, sets w_{i,0} = w^t and, for each local mini-batch D (r = 0..R-1, R = the batches of
``train.local_epochs`` epochs):

1. approximately solves the personal problem with K gradient steps on D:
   theta <- theta - eta_p [grad f_i(theta; D) + lambda (theta - w_{i,r})]     (``equations.inner_step``)
2. moves its copy of w toward theta: w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta)   (``local_w_step``)

and uploads w_{i,R}. The server mixes: w^{t+1} = (1 - beta) w^t + beta * mean_i w_{i,R}, a *uniform* mean over the
replying clients as in the paper (``beta_mix``; ``aggregator.weighting`` may say otherwise). Evaluation scores the
personal theta_i after the client's last local round (none of the public implementations does: see the README);
a client never selected has no theta_i yet and is scored on the current w^t.
"""
from typing import Any, Dict, List, Optional

import torch

from pflkit.core import (Algorithm, LocalSGDTrainer, Param, Space, clip_gradients, host_copy, load_into,
                         make_optimizer, positive, proximal_term)
from pflkit_fedavg import WEIGHTINGS, FedAvgAggregator

from .equations import beta_mix, inner_step, local_w_step

__all__ = ["PFedMeTrainer", "PFedMeAggregator", "ALGORITHM", "inner_step", "local_w_step", "beta_mix"]


class PFedMeTrainer(LocalSGDTrainer):
    """K inner steps on the personal theta per mini-batch, then one step of the local w toward theta; uploads w,
    evaluates theta."""

    description = ("pFedMe client: per mini-batch, K steps on f(theta) + lambda/2 ||theta - w||^2, then "
                   "w <- w - eta lambda (w - theta); uploads w, evaluates the personal theta")
    params = {
        **LocalSGDTrainer.params,
        "lam": Param(15.0, "lambda: weight of ||theta - w||^2 in the personal problem (default 15: the paper's "
                           "MNIST setting, PFLlib's examples and FL-bench); the local w moves by "
                           "train.lr * lambda * (w - theta) per mini-batch", check=positive,
                     space=Space.real(5.0, 50.0, log=True,
                                      source="around the paper's tuned 15, 20 and 30 on MNIST and Synthetic, "
                                             "per the authors' README; no grid given")),
        "personal_lr": Param(0.05, "eta_p: step size of the K inner steps on theta (default 0.05 = pflkit's "
                                   "train.lr, as PFLlib's examples use lrp = lr; the paper: 0.1 / 0.09 on MNIST)",
                             check=positive,
                             space=Space.real(0.005, 0.1, log=True,
                                              source="around the paper's tuned 0.01-0.1, per the authors' README; "
                                                     "no grid given")),
        "inner_steps": Param(5, "K: gradient steps on theta per mini-batch (default 5: the paper, PFLlib, "
                                "FL-bench)", check=positive,
                             space=Space.integer(1, 10, source="around the paper's K = 5, which its tuned runs "
                                                               "all keep; it studies K's effect but gives no grid")),
        "inner_start": Param("warm", "where each mini-batch's K steps start: warm = the previous mini-batch's theta "
                                     "(theta starts at w^t each round; the authors' code), anchor = the current "
                                     "w_{i,r}", choices=("warm", "anchor")),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        self.personal = ctx.build_model()  # theta_i
        self.has_personal = False  # theta_i exists only after the client's first local round
        self._theta: List[torch.nn.Parameter] = list(self.personal.parameters())
        self._w: List[torch.nn.Parameter] = list(self.model.parameters())  # same architecture: paired by position

    def local_update(self) -> float:
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        lam, eta = float(hp.lam), float(cfg.lr)
        load_into(self.personal, self.model.state_dict())  # theta starts at w_{i,0} = w^t (buffers too)
        anchor = [w.detach() for w in self._w]  # views of w_{i,r}: w changes only between the inner solves
        opt = make_optimizer(self.personal.parameters(), cfg, lr=hp.personal_lr)
        self.personal.train()
        total: Optional[torch.Tensor] = None
        steps = 0
        for x, y in self.batches():
            if hp.inner_start == "anchor" and steps:
                with torch.no_grad():
                    torch._foreach_copy_(self._theta, anchor)
            for _ in range(int(hp.inner_steps)):  # inner_step, through the optimizer (the same SGD step)
                opt.zero_grad(set_to_none=True)
                data = self.data_loss(self.personal, x, y)
                (data + 0.5 * lam * proximal_term(self._theta, anchor)).backward()
                clip_gradients(opt)
                opt.step()
            with torch.no_grad():  # local_w_step
                for w, new in zip(self._w, local_w_step(anchor, [t.detach() for t in self._theta], eta, lam)):
                    w.copy_(new)
            total = data.detach() if total is None else total + data.detach()
            steps += 1
        with torch.no_grad():  # theta's forward passes updated the batch-norm statistics: w carries them
            for (name, b), (_, pb) in zip(self.model.named_buffers(), self.personal.named_buffers()):
                b.copy_(pb)
        self.has_personal = True
        return float(total.item()) / steps if steps else 0.0

    def personal_forward(self):
        return self.personal if self.has_personal else self.model

    def _personal_state(self, copy) -> Dict[str, Any]:
        return copy(self.personal.state_dict()) if self.has_personal else {}

    def _load_personal(self, state: Dict[str, Any]) -> None:
        self.has_personal = bool(state)
        if state:
            load_into(self.personal, state)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "personal": self._personal_state(lambda sd: dict(sd))}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._load_personal(state.get("personal") or {})

    # declared state: theta_i (none before the first local round) and the model keys the server never sends
    declares_state = True

    def client_state(self) -> Dict[str, Any]:
        return {**super().client_state(), "personal": self._personal_state(host_copy)}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        self._load_personal(state.get("personal") or {})


class PFedMeAggregator(FedAvgAggregator):
    """The mean of the uploaded w_{i,R} (uniform by default, as in the paper), mixed with w^t by beta."""

    description = "pFedMe server: w <- (1 - beta) w + beta * mean of the uploads (uniform mean by default)"
    params = {
        "weighting": Param("uniform", "weight of one upload in the mean: uniform = 1 per replying client (the "
                                      "paper's 1/S sum; default), samples = its sample count (FedAvg's)",
                           choices=WEIGHTINGS),
        "beta": Param(1.0, "beta of the server update w <- (1 - beta) w + beta * mean (default 1: the paper's "
                           "main setting, PFLlib and FL-bench; the paper also uses 2); 1 = the plain mean",
                      check=positive,
                      space=Space.choice([1.0, 2.0], source="the paper's 1 for its main runs and 2 for its tuned runs, "
                                                           "per the authors' README")),
    }
    mean_fields = ("params",)  # the mean is all it needs before mixing: a distributed run may all-reduce it
    sends_params_always = True  # aggregate_fit only mixes: every message still carries the global model

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        previous = dict(self.global_state)  # w^t (the update below replaces tensors, never writes into them)
        super().aggregate_fit(rnd, replies)  # global_state <- the mean of the uploads
        beta = float(self.ctx.hp.get("beta", 1.0))
        for k, mean in self.global_state.items():
            if mean.is_floating_point():
                self.global_state[k] = beta_mix(previous[k], mean, beta)
        return None


ALGORITHM = Algorithm(
    trainer="pfedme", aggregator="pfedme",
    description="pFedMe: personal models as Moreau-envelope proximal points of the global model, K inner steps "
                "per mini-batch, beta-mixing server with a uniform mean (T. Dinh et al., 2020, Algorithm 1). "
                "Defaults: lambda 15, K 5, beta 1 (paper); personal_lr 0.05; model and local training as "
                "pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch). Evaluates the personal theta.",
    paper="T. Dinh, Tran, Nguyen: Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
