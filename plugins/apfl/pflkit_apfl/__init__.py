"""APFL (Deng, Kamani, Mahdavi: "Adaptive Personalized Federated Learning", 2020, Algorithm 1 with the adaptive
alpha of Section 3).

Each client keeps a local model v_i and a mixing weight alpha_i; its personal model mixes the *parameters*
v_bar_i = alpha_i v_i + (1 - alpha_i) w with the global model w. On every local mini-batch xi, at the current
iterates (``equations.py``):

    w       <- w - eta grad f(w; xi)                                       (FedAvg's local step)
    v       <- v - eta alpha grad f(v_bar; xi)                             (v trained *through* the mixture)
    alpha   <- Proj_[0,1](alpha - eta_alpha <v - w, grad f(v_bar; xi)>)    (adaptive variant)

Only w travels; the server averages it as FedAvg does (the ``fedavg`` aggregator). Evaluation scores v_bar_i with
the current global w. v_i starts at w^0 and alpha_i at ``trainer.alpha``; both are declared per-client state.
"""
from typing import Any, Dict, List, Optional

import torch
from torch.func import functional_call

from pflkit.core import (Algorithm, BatchedForm, BatchedPhase, LocalSGDTrainer, Param, Space, clip_gradients,
                         host_copy, load_into, make_optimizer, positive, trained_names, unit_interval)

from .equations import alpha_grad, alpha_step, mix

__all__ = ["APFLTrainer", "ALGORITHM", "mix", "alpha_grad", "alpha_step"]


class APFLTrainer(LocalSGDTrainer):
    """FedAvg's local update of w plus a local v trained through v_bar = alpha v + (1 - alpha) w and a learned alpha;
    uploads w, evaluates v_bar."""

    description = ("APFL client: trains w as FedAvg and v through v_bar = alpha v + (1 - alpha) w, learns alpha; "
                   "uploads w, evaluates v_bar")
    params = {
        **LocalSGDTrainer.params,
        "alpha": Param(0.5, "initial mixing weight alpha of the local model (default 0.5: the middle of the "
                            "paper's {0.25, 0.5, 0.75}, FL-bench's; PFLlib's 1.0 is the purely local model); "
                            "0 with adaptive=false = FedAvg's global model", check=unit_interval,
                       space=Space.choice([0.25, 0.5, 0.75], source="the paper's alpha values {0.25, 0.5, 0.75}")),
        "adaptive": Param(True, "learn alpha by projected gradient descent (the paper's adaptive APFL; default); "
                                "false keeps it fixed"),
        "alpha_lr": Param(None, "step size eta_alpha of the alpha update (default: train.lr, the step size of "
                                "the model updates)", type=float, check=positive),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        self.local = ctx.build_model()  # v_i^0 = w^0 (every build returns the same initial weights)
        self.mixed = ctx.build_model()  # scratch module holding v_bar for evaluation
        self.alpha = float(ctx.hp.alpha)
        self._names: List[str] = [n for n, _ in self.local.named_parameters()]
        self._w = [p for _, p in self.model.named_parameters()]
        self._v = [p for _, p in self.local.named_parameters()]

    def local_update(self) -> float:
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        adaptive = bool(hp.adaptive)
        alpha_lr = float(hp.alpha_lr) if hp.get("alpha_lr") is not None else float(cfg.lr)
        self.model.train()
        self.local.train()
        opt_w = make_optimizer(self.model.parameters(), cfg)
        opt_v = make_optimizer(self.local.parameters(), cfg)
        total: Optional[torch.Tensor] = None
        mixed_total: Optional[torch.Tensor] = None
        steps = 0
        for x, y in self.batches():
            opt_w.zero_grad(set_to_none=True)
            opt_v.zero_grad(set_to_none=True)
            # both gradients at the current iterates, then all three updates (Algorithm 1)
            loss = self.loss(x, y)
            loss.backward()
            alpha = torch.tensor(self.alpha, device=self.ctx.device, requires_grad=adaptive)
            w_now = [w.detach() for w in self._w]
            v_bar = {n: mix(v, w, alpha) for n, v, w in zip(self._names, self._v, w_now)}
            mixed_loss = self.ctx.task.loss(functional_call(self.local, v_bar, (x,)), y)
            mixed_loss.backward()  # v.grad = alpha grad f(v_bar); alpha.grad = <v - w, grad f(v_bar)>
            clip_gradients(opt_w)
            clip_gradients(opt_v)
            opt_w.step()
            opt_v.step()
            if adaptive:
                self.alpha = alpha_step(self.alpha, float(alpha.grad), alpha_lr)
            # summed as run_sgd sums (one sync at the end): FedAvg's training loss, bit for bit
            total = loss.detach() if total is None else total + loss.detach()
            mixed_total = mixed_loss.detach() if mixed_total is None else mixed_total + mixed_loss.detach()
            steps += 1
        self._mixed_loss = float(mixed_total.item()) / steps if steps else 0.0
        return float(total.item()) / steps if steps else 0.0

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        reply = super().on_fit(payload)
        reply["metrics"] = {"alpha": self.alpha, "mixed_loss": self._mixed_loss}
        return reply

    # clients.batched: one phase over w, v and alpha (alpha by its projected step, not train.optimizer); the loss is
    # the sum of FedAvg's loss on w and the mixture's loss (w detached in it), so each gets its own gradient
    def _alpha_module(self) -> torch.nn.Module:
        if getattr(self, "_alpha_holder", None) is None:
            self._alpha_holder = torch.nn.Module()
            self._alpha_holder.alpha = torch.nn.Parameter(
                torch.tensor(self.alpha, dtype=torch.float64, device=self.ctx.device))
        return self._alpha_holder

    def batched_begin(self, payload: Dict[str, Any]) -> None:
        super().batched_begin(payload)
        with torch.no_grad():
            self._alpha_module().alpha.fill_(self.alpha)

    def _batched_loss(self, x: torch.Tensor, y: torch.Tensor):
        loss = self.loss(x, y)
        alpha = self._alpha_module().alpha.to(torch.get_default_dtype())
        w_now = [w.detach() for w in self.model.parameters()]
        v_bar = {n: mix(v, w, alpha) for (n, v), w in zip(self.local.named_parameters(), w_now)}
        mixed_loss = self.ctx.task.loss(functional_call(self.local, v_bar, (x,)), y)
        return loss + mixed_loss, {"w_loss": loss.detach(), "mixed_loss": mixed_loss.detach(),
                                   "steps": torch.ones_like(loss.detach())}

    def batched_form(self) -> Optional[BatchedForm]:
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        if cfg.get("max_grad_norm"):
            return None  # the sequential update clips w and v separately (two optimizers); the batched one would not
        trains = trained_names(self.model, "model") + trained_names(self.local, "local")
        projected = None
        if bool(hp.adaptive):
            alpha_lr = float(hp.alpha_lr) if hp.get("alpha_lr") is not None else float(cfg.lr)
            trains.append("apfl.alpha")
            projected = {"apfl.alpha": (alpha_lr, 0.0, 1.0)}
        phase = BatchedPhase(self._batched_loss, trains, int(cfg.local_epochs), aux=True, projected=projected)

        def reply(losses, start, aux):
            steps = aux.get("steps", 0.0)
            self.alpha = float(self._alpha_module().alpha)
            self._mixed_loss = aux["mixed_loss"] / steps if steps else 0.0
            return {"params": self.upload(), "num_samples": self.ctx.num_train,
                    "train_loss": aux["w_loss"] / steps if steps else 0.0,
                    "metrics": {"alpha": self.alpha, "mixed_loss": self._mixed_loss}}

        return BatchedForm({"model": self.model, "local": self.local, "apfl": self._alpha_module()}, [phase], reply)

    def personal_forward(self):
        """v_bar = alpha v + (1 - alpha) w with the current w; batch-norm statistics (if any) are v's, which the
        mixture's forward passes in training keep."""
        with torch.no_grad():
            load_into(self.mixed, {n: mix(v, w, self.alpha) for n, v, w in zip(self._names, self._v, self._w)})
            load_into(self.mixed, dict(self.local.named_buffers()))
        return self.mixed

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "local": self.local.state_dict(), "alpha": self.alpha}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.local.load_state_dict(state["local"])
        self.alpha = float(state["alpha"])

    # declared state: v_i, alpha_i and the model keys the server never sends; w arrives with every message
    declares_state = True

    def client_state(self) -> Dict[str, Any]:
        return {**super().client_state(), "local": host_copy(self.local.state_dict()), "alpha": self.alpha}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        load_into(self.local, state["local"])
        self.alpha = float(state["alpha"])


ALGORITHM = Algorithm(
    trainer="apfl", aggregator="fedavg",
    description="APFL: each client mixes the parameters of a local model v and the global model w, "
                "v_bar = alpha v + (1 - alpha) w, trains v through the mixture and learns alpha; w is trained and "
                "averaged as in FedAvg (Deng et al., 2020). Defaults: alpha 0.5, adaptive; model and local "
                "training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch). Evaluates v_bar.",
    paper="Deng, Kamani, Mahdavi: Adaptive Personalized Federated Learning, arXiv:2003.13461, 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
