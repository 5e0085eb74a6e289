"""FedGen (Zhu, Hong, Zhou: "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021).

FedAvg plus a lightweight generator G(y, eps) -> z of feature vectors (the input of the model's ``head``). Each
round the server trains G so that the clients' uploaded heads -- the teachers, each weighted per label by its share
of that label's count -- classify G(y, eps) as y, with a diversity term (``equations.py``); then it averages the
models as FedAvg does. G goes down with the global model, and a client adds to its cross-entropy the classifier
regulariser on generated features and the latent KL term. The global model is evaluated, as in FedAvg.

What leaves a client: the model (as FedAvg) and its per-label counts of the samples it trained on this round
(``label_counts``: one number per class, the statistic the paper's server needs for its per-label teacher weights).
Client state: as FedAvg's (declared, pooled); the generator is the server's and is rewritten by every message that
uses it. Server state (checkpointed): G, its Adam optimiser, the labels it was trained on and its round count.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pflkit.core import (Algorithm, ConfigError, LocalSGDTrainer, Message, Param, ServerContext, Space, State,
                         fold_mean, non_negative, positive, unit_interval)
from pflkit_fedavg import FedAvgAggregator

from .equations import (FeatureGenerator, client_regulariser, decayed, diversity_loss, ensemble_logits,
                        label_weights, teacher_loss)

__all__ = ["FedGenTrainer", "FedGenAggregator", "ALGORITHM", "FeatureGenerator"]

NAME = "algorithm fedgen"


def check_split(model: nn.Module, task) -> int:
    """FedGen generates inputs of the classifier: a classification model with a features/head split is required.
    Returns the feature width d."""
    if task.kind != "classification":
        raise ConfigError(f"{NAME}: FedGen's generator is trained with the clients' classifiers and needs a "
                          f"classification task, not {task.kind}")
    dim = getattr(model, "feature_dim", None)
    if dim is None or not isinstance(getattr(model, "head", None), nn.Module):
        raise ConfigError(f"{NAME}: FedGen generates the input of the classifier of a model whose forward is "
                          f"head(features(x)); model {type(model).__name__} has no 'features'/'head' split "
                          f"(feature_dim)")
    return int(dim)


def generator_from_state(state: State, num_classes: int) -> FeatureGenerator:
    """A generator shaped after ``state`` (hidden width, noise width, feature width read from its weights)."""
    hidden, fan_in = state["hidden.0.weight"].shape
    dim = state["out.weight"].shape[0]
    return FeatureGenerator(num_classes, int(dim), int(hidden), int(fan_in) - num_classes)


def positive_int(v: Any) -> Optional[str]:
    return None if isinstance(v, int) and not isinstance(v, bool) and v > 0 else "must be an integer > 0"


class FedGenTrainer(LocalSGDTrainer):
    """FedAvg's local SGD on CE + (B_gen / B) alpha_t CE(head(G(y^)), y^) + beta_t KL(head(G(y)) || model(x))."""

    description = ("FedAvg's local update plus FedGen's regulariser: the head classifies generated features of "
                   "sampled labels, and the prediction on real data follows the head's on G(y); uploads label counts")
    params = {
        **LocalSGDTrainer.params,
        "alpha": Param(10.0, "generative alpha: weight of CE(head(G(y^)), y^) on generated features, decayed x0.98 "
                             "per round (default 10: the authors' and FL-bench's; PFLlib uses 1 without decay); "
                             "alpha = beta = 0: FedAvg exactly", check=non_negative,
                       space=Space.real(1.0, 100.0, log=True,
                                        source="around the authors' 10 (PFLlib 1); no grid at hand")),
        "beta": Param(10.0, "generative beta: weight of KL(softmax(head(G(y))) || softmax(model(x))) on real batches, "
                            "decayed x0.98 per round (default 10: the authors' and FL-bench's; PFLlib has no such "
                            "term)", check=non_negative,
                      space=Space.real(1.0, 100.0, log=True, source="around the authors' 10; no grid at hand")),
        "gen_batch_size": Param(32, "generated samples per local step, B_gen; the term is scaled by B_gen / B "
                                    "(default 32: the authors')", check=positive_int),
        "decay": Param(0.98, "per-round decay of alpha and beta, alpha_t = max(1e-4, alpha decay^t) (default 0.98: "
                             "the authors')", check=unit_interval),
        "early_stop": Param(20, "regularise only in the first N local epochs of a round (default 20: the authors'; "
                                "with pflkit's 1 local epoch always on)", check=positive_int),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        check_split(self.model, ctx.task)
        self.generator: Optional[FeatureGenerator] = None  # the server's, rebuilt from every message that uses it

    # protocol ------------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        self._setup_regulariser(payload)
        self._counts = torch.zeros(self.ctx.task.output_dim, dtype=torch.int64, device=self.ctx.device)
        self._sums = {"teacher": 0.0, "latent": 0.0}
        self._step = 0
        reply = super().on_fit(payload)
        # the authors' counts: labels of the batches trained on this round, each label starting at 1
        reply["label_counts"] = (self._counts + 1).cpu()
        if self._reg is not None:
            steps = max(1, self._reg["steps"])
            reply["metrics"] = {f"{k}_loss": v / steps for k, v in self._sums.items()}
        return reply

    def _setup_regulariser(self, payload: Dict[str, Any]) -> None:
        hp = self.ctx.hp
        self._reg = None
        if "generator" not in payload or (float(hp.alpha) == 0.0 and float(hp.beta) == 0.0):
            return  # round 1 (no generator yet) or the regulariser switched off: FedAvg's objective
        state = payload["generator"]
        if self.generator is None or any(state[k].shape != v.shape for k, v in self.generator.state_dict().items()):
            self.generator = generator_from_state(state, self.ctx.task.output_dim).to(self.ctx.device)
        self.generator.load_state_dict(state)
        self.generator.eval().requires_grad_(False)  # eval mode at the client, as the authors
        t = int(payload["round_index"])
        labels = torch.as_tensor(list(payload["labels"]), dtype=torch.long, device=self.ctx.device)
        cfg = self.ctx.train_cfg
        n = self.ctx.num_train
        per_epoch = math.ceil((n - n % cfg.batch_size if cfg.get("drop_last") and n >= cfg.batch_size else n)
                              / cfg.batch_size)
        # a stream of its own (seeded from this call's seed), so the batches are FedAvg's
        rng = torch.Generator(device=self.ctx.device)
        rng.manual_seed((self.ctx.generator.initial_seed() * 1_000_003 + 12_345) % (2 ** 63))
        self._reg = {"alpha": decayed(float(hp.alpha), t, float(hp.decay)),
                     "beta": decayed(float(hp.beta), t, float(hp.decay)),
                     "labels": labels, "rng": rng, "ratio": int(hp.gen_batch_size) / cfg.batch_size,
                     "until": per_epoch * int(hp.early_stop), "steps": 0}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._counts += torch.bincount(y, minlength=self.ctx.task.output_dim)
        reg = self._reg
        self._step += 1
        if reg is None or self._step > reg["until"] or len(reg["labels"]) == 0:
            return self.data_loss(self.model, x, y)
        logits = self.model(x)
        g, rng = self.generator, reg["rng"]
        with torch.no_grad():
            z_real = g(y, g.noise(len(y), rng, x.device))
            y_hat = reg["labels"][torch.randint(len(reg["labels"]), (int(self.ctx.hp.gen_batch_size),),
                                                generator=rng, device=x.device)]
            z_hat = g(y_hat, g.noise(len(y_hat), rng, x.device))
        terms = client_regulariser(self.model.head, logits, z_real, z_hat, y_hat, reg["alpha"], reg["beta"],
                                   reg["ratio"])
        for k, v in terms.items():
            self._sums[k] += float(v.detach())
        reg["steps"] += 1
        return self.ctx.task.loss(logits, y) + terms["teacher"] + terms["latent"]

    # declared state: FedAvg's (the model keys never sent, if any); the generator comes with every message
    declares_state = True
    # on_evaluate scores the model the evaluate message brings: the personal numbers are the global model's
    personal_is_global = True


class FedGenAggregator(FedAvgAggregator):
    """FedAvg's mean of the uploads, after training the generator on the uploaded heads (the teachers)."""

    description = ("trains the feature generator on the uploaded heads (per-label weighted teacher ensemble plus "
                   "diversity), then FedAvg's sample-weighted mean; sends the generator with the global model")
    params = {
        **FedAvgAggregator.params,
        "generator_lr": Param(0.005, "Adam step size of the generator (default 0.005: PFLlib's, as FedSA Appendix B "
                                     "states; the authors' is 3e-4)", check=positive,
                              space=Space.real(1e-4, 0.01, log=True,
                                               source="spans the authors' 3e-4 and PFLlib's / FedSA's 0.005; no grid "
                                                      "at hand")),
        "generator_hidden": Param(512, "hidden width of the generator (default 512: FedSA Appendix B / PFLlib; the "
                                       "authors' 512 for CIFAR, 256 for MNIST)", check=positive_int),
        "generator_noise": Param(512, "noise width of the generator (default 512: FedSA Appendix B / PFLlib; the "
                                      "authors' 64 for CIFAR, 32 for MNIST)", check=positive_int),
        "generator_steps": Param(50, "generator steps per round (default 50: the authors' ensemble_epochs; PFLlib "
                                     "uses 1000, FL-bench 5)", check=positive_int),
        "generator_batch": Param(32, "labels sampled per generator step (default 32: the authors' batch size)",
                                 check=positive_int),
        "ensemble_alpha": Param(1.0, "weight of the teachers' cross-entropy in the generator loss (default 1: "
                                     "the authors')", check=non_negative),
        "ensemble_beta": Param(0.0, "weight of the (subtracted) KL between the global head and the teacher "
                                    "ensemble on generated features (default 0: the authors')", check=non_negative),
        "ensemble_eta": Param(1.0, "weight of the diversity loss (default 1: the authors'; FL-bench's 0 drops "
                                   "it)", check=non_negative),
        "generator_weight_decay": Param(0.01, "Adam weight decay of the generator (default 1e-2: the authors')",
                                        check=non_negative),
        "generator_lr_decay": Param(0.98, "per-round decay of the generator's step size (default 0.98: the "
                                          "authors' ExponentialLR)", check=unit_interval),
    }
    sends_params_always = True  # every fit message still carries the global model
    # no mean_fields: the generator needs every upload's head, not only their mean

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        model = ctx.build_model()
        dim = check_split(model, ctx.task)
        if not any(k.startswith("head.") for k in self.global_state):
            raise ConfigError(f"{NAME}: the clients' heads must be uploaded (they are the generator's teachers)")
        hp = ctx.hp
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            self.generator = FeatureGenerator(ctx.task.output_dim, dim, int(hp.generator_hidden),
                                              int(hp.generator_noise)).to(ctx.device)
        self.head = model.head.to(ctx.device).eval().requires_grad_(False)  # the teachers' architecture
        self.optimizer = torch.optim.Adam(self.generator.parameters(), lr=float(hp.generator_lr),
                                          weight_decay=float(hp.generator_weight_decay))
        self.labels: List[int] = []  # the labels the generator was last trained on
        self.generator_rounds = 0

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        payload: Dict[str, Any] = {"params": self.global_state}
        if self.generator_rounds > 0:  # from the second round on (the authors' glob_iter > 0)
            payload.update(generator={k: v.detach().clone() for k, v in self.generator.state_dict().items()},
                           labels=list(self.labels), round_index=rnd - 1)
        return {cid: Message("fit", payload) for cid in selected}

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        if replies:
            self.train_generator(replies)
        return super().aggregate_fit(rnd, replies)  # FedAvg's mean of the uploads

    def combine(self, states: List[State], weights: List[float], cids: List[int]) -> State:
        # FedAvg's mean with the arithmetic of FedAvg's streamed one (core.api.fold): alpha = beta = 0 is FedAvg bit for
        # bit, although FedGen needs every upload at once (its generator learns from every head)
        return fold_mean(states, weights)

    def _teacher_params(self, params: State) -> Dict[str, torch.Tensor]:
        return {k[len("head."):]: v.to(self.ctx.device) for k, v in params.items() if k.startswith("head.")}

    def train_generator(self, replies: Dict[int, Dict[str, Any]]) -> None:
        """The generator's steps of one round against the replying clients' heads (the authors' train_generator)."""
        hp, device = self.ctx.hp, self.ctx.device
        cids = sorted(replies)
        counts = torch.stack([torch.as_tensor(replies[c]["label_counts"]).reshape(-1) for c in cids])
        if counts.shape[1] != self.ctx.task.output_dim:
            raise ValueError(f"label_counts of {counts.shape[1]} classes, the task has {self.ctx.task.output_dim}")
        alpha, qualified = label_weights(counts)
        self.labels = qualified
        if not qualified:
            return
        alpha = alpha.to(device)
        teachers = [self._teacher_params(replies[c]["params"]) for c in cids]
        student = self._teacher_params(self.global_state)  # the global head before this round's mean
        labels = torch.tensor(qualified, dtype=torch.long, device=device)
        rng = torch.Generator(device=device)
        rng.manual_seed(int(self.ctx.rng.integers(2 ** 62)))
        for group in self.optimizer.param_groups:  # ExponentialLR, one step per round
            group["lr"] = float(hp.generator_lr) * float(hp.generator_lr_decay) ** self.generator_rounds
        g = self.generator.train()
        sums = {"teacher": 0.0, "diversity": 0.0, "student": 0.0}
        steps = int(hp.generator_steps)
        for _ in range(steps):
            y = labels[torch.randint(len(labels), (int(hp.generator_batch),), generator=rng, device=device)]
            eps = g.noise(len(y), rng, device)
            z = g(y, eps)
            logits = [functional_call(self.head, t, (z,)) for t in teachers]
            t_loss = teacher_loss(logits, y, alpha)
            div = diversity_loss(eps, z)
            loss = float(hp.ensemble_alpha) * t_loss + float(hp.ensemble_eta) * div
            if float(hp.ensemble_beta) > 0:
                target = F.softmax(ensemble_logits(logits, y, alpha), dim=1)
                s_loss = F.kl_div(F.log_softmax(functional_call(self.head, student, (z,)), dim=1), target,
                                  reduction="batchmean")
                loss = loss - float(hp.ensemble_beta) * s_loss
                sums["student"] += float(s_loss.detach())
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            sums["teacher"] += float(t_loss.detach())
            sums["diversity"] += float(div.detach())
        self.generator_rounds += 1
        for k, v in sums.items():
            self.ctx.logger.log_scalar(f"fedgen/generator_{k}_loss", v / steps)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "generator": self.generator.state_dict(),
                "generator_optimizer": self.optimizer.state_dict(), "generator_labels": list(self.labels),
                "generator_rounds": self.generator_rounds}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.load_state_dict(state["generator"])
        self.optimizer.load_state_dict(state["generator_optimizer"])
        self.labels = [int(y) for y in state["generator_labels"]]
        self.generator_rounds = int(state["generator_rounds"])


ALGORITHM = Algorithm(
    trainer="fedgen", aggregator="fedgen",
    description="FedGen: FedAvg plus a server-trained generator of classifier-input features; the uploaded heads, "
                "weighted per label by the clients' label counts, teach it, and clients regularise their head with "
                "its features (Zhu, Hong, Zhou, 2021). Defaults: generator lr 0.005, hidden 512, noise 512 (FedSA "
                "Appendix B, i.e. PFLlib's), 50 generator steps per round, alpha = beta = 10 decayed x0.98, diversity "
                "weight 1 (the authors'); model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, "
                "1 local epoch).",
    paper="Zhu, Hong, Zhou: Data-Free Knowledge Distillation for Heterogeneous Federated Learning, ICML 2021",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
