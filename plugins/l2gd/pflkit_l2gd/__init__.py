"""L2GD (Hanzely, Richtarik: "Federated Learning of a Mixture of Global and Local Models", 2020, Algorithm 1).

Every client keeps its personal model x_i (declared state). One pflkit round is one L2GD iteration: the server's
seeded rng (``ServerContext.rng``, reseeded from (seed, round)) draws xi ~ Bernoulli(p), then (``equations.py``)

    xi = 0: every client takes a local step  x_i <- x_i - alpha / (n (1 - p)) grad f_i(x_i)
    xi = 1: every x_i is pulled toward the mean  x_i <- (1 - c) x_i + c x_bar,  c = alpha lambda / (n p)

with full participation. Communication only where the paper needs it: the first averaging step after a local step
makes the clients upload x_i and the server form x_bar; further averaging steps leave x_bar unchanged, so k of
them are one step of coefficient 1 - (1 - c)^k, which the server sends with the next local step (lazily, keeping
the paper's communication rate) or applies, for scoring only, in an evaluation. A local step is ``local_steps``
mini-batch gradient steps (1: the paper's single stochastic gradient), or by default ``train.local_epochs`` epochs
of the training split (practical, as FedRep's code), each at the paper's step size. With p = 0 it is Local.

``aggregator.variant = fedrep_script`` runs instead what FedRep's ``main_l2gd.py`` computes, the script PCFL's
Table 3 L2GD number came from (with p = 0.9 as that script hard-codes): its averaging step pulls by
c = lr lambda = alpha lambda / (n (1 - p)) instead of the paper's alpha lambda / (n p), and its "average" counts the
round's first client twice, x_bar = (x_first + sum_i x_i) / n (``equations.script_mean``). On two clients that is
c = 2.5 > 1: the models oscillate with growing amplitude, which is why a correct L2GD does not reproduce that number.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from itertools import islice

from pflkit.core import (Algorithm, ConfigError, LocalSGDTrainer, Message, Param, ServerAggregator, Space, State,
                         clone_state, load_into, make_optimizer, non_negative, positive, run_sgd)

from .equations import (averaging_coefficient, local_step_size, pull_toward, repeated_coefficient, script_mean)

__all__ = ["L2GDTrainer", "L2GDAggregator", "ALGORITHM", "local_step_size", "averaging_coefficient",
           "repeated_coefficient", "pull_toward", "script_mean"]


class L2GDTrainer(LocalSGDTrainer):
    """Keeps x_i; takes local gradient steps at the step size the server sends, applies the averaging pulls it
    sends, uploads x_i when the server averages."""

    protocol = "l2gd"
    description = "personal model x_i: local gradient steps and pulls toward the mean x_bar (L2GD)"
    params = {
        **LocalSGDTrainer.params,
        "local_steps": Param(None, "gradient steps (mini-batches of train.batch_size) per local step: 1 = the "
                                   "paper's single stochastic gradient; default null = train.local_epochs epochs "
                                   "of the training split (practical, as FedRep's L2GD code)", type=int,
                             check=positive),
    }
    declares_state = True  # x_i is the whole model, kept by the client
    needs_shared_delivery = False
    adapts_at_evaluation = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scored = None  # a scratch model with a pending pull applied, for an evaluation only

    def client_keys(self):
        return list(self.model.state_dict())  # x_i: nothing is kept by the server

    def pull(self, payload: Dict[str, Any], module) -> None:
        """Apply the averaging steps the message carries (x_bar and their combined coefficient) to ``module``."""
        mean = payload.get("mean")
        if mean is not None:
            load_into(module, pull_toward(self.model.state_dict(), mean, float(payload["coef"])))

    def local_update(self) -> float:
        steps = self.ctx.hp.get("local_steps")
        self.model.train()
        opt = make_optimizer(self.model.parameters(), self.ctx.train_cfg, lr=self._lr)
        # the paper's stochastic gradient steps: the first `steps` mini-batches of a (lazy) reshuffled stream
        batches = self.batches() if steps is None else islice(self.batches(epochs=10 ** 9), int(steps))
        return run_sgd(batches, self.loss, opt)

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        self.pull(payload, self.model)  # the pending averaging steps come first
        self._lr = float(payload["lr"])
        return {"num_samples": self.ctx.num_train, "train_loss": self.local_update()}

    def on_average(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """The first averaging step after a local step: the server needs every x_i to form x_bar (pending pulls
        first: the fedrep_script variant averages again after each pull)."""
        self.pull(payload, self.model)
        return {"params": self.upload(), "num_samples": self.ctx.num_train}

    def on_share(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """fedrep_script variant: the round's first client sends x_i once more (the script counts it twice)."""
        return {"own": self.upload()}

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        if payload.get("mean") is not None:  # score x_i after the pending pulls without keeping them
            self.scored = self.scored or self.ctx.build_model()
            self.scored.load_state_dict(self.model.state_dict())
            self.pull(payload, self.scored)
        try:
            return super().on_evaluate({})
        finally:
            self.scored = None

    def personal_forward(self):
        return self.model if self.scored is None else self.scored


class L2GDAggregator(ServerAggregator):
    """Flips the coin each round (server rng) and drives the local or the (lazy) averaging step."""

    protocol = "l2gd"
    description = "L2GD: a local step with probability 1 - p, else an averaging step toward the mean"
    params = {
        "p": Param(0.1, "probability p of an averaging step (pflkit's default 0.1: the local step size "
                        "alpha/(n(1-p)) is then 0.056 at alpha 1 and 20 clients, pflkit's FedAvg lr 0.05; FedRep's "
                        "code hard-codes 0.9); p = 0 is Local; must be < 1", check=lambda v: None if 0 <= v < 1
                   else "must be in [0, 1)",
                   space=Space.real(0.05, 0.5, source="around pflkit's 0.1; FedRep's code uses 0.9; the paper varies "
                                                      "p but gives no grid for neural models")),
        "alpha": Param(1.0, "step size alpha of Algorithm 1 (FedRep's code: 1); local steps use alpha/(n(1-p))",
                       check=positive,
                       space=Space.real(0.25, 2.0, log=True,
                                        source="around FedRep's 1; it is L2GD's step size, train.lr does not "
                                               "train it; no grid given")),
        "lam": Param(0.5, "lambda, the weight of the pull toward the mean (FedRep's code: 0.5); an averaging step "
                          "moves x_i by c = alpha lambda/(n p) of the way to x_bar (c must be <= 1)",
                     check=non_negative,
                     space=Space.real(0.05, 1.0, log=True,
                                      source="around FedRep's 0.5; the paper varies lambda but gives no grid for "
                                             "neural models")),
        "variant": Param("paper", "paper: Algorithm 1; fedrep_script: what FedRep's main_l2gd.py computes (pull "
                                  "c = alpha lambda/(n (1 - p)), the first client counted twice in the mean; no "
                                  "c <= 1 check, so it can diverge), for comparing with numbers made by that script",
                         choices=("paper", "fedrep_script")),
    }
    mean_fields = ("params",)  # x_bar is the plain mean of the uploads: folded as they arrive (core/api/fold.py)

    def reply_weight(self, reply: Dict[str, Any]) -> float:
        return 1.0  # x_bar = (1/n) sum_i x_i, Algorithm 1: every client counts once

    def reply_layout(self, kind: str, field: str):
        if field == "own":  # the fedrep_script variant's second upload of x_first: the whole model
            return self.model_layout("state")
        return super().reply_layout(kind, field)

    def __init__(self, ctx):
        super().__init__(ctx)
        hp, n = ctx.hp, ctx.num_clients
        part = ctx.cfg.participation
        if float(part.join_ratio) != 1.0 or part.get("random_join_ratio") is not None:
            raise ConfigError("participation.join_ratio: L2GD needs full participation (every client takes every "
                              "step); set join_ratio=1 and random_join_ratio=null")
        self.p, self.lr = float(hp.p), local_step_size(float(hp.alpha), n, float(hp.p))
        self.script = hp.get("variant", "paper") == "fedrep_script"
        if self.script:  # the script's pull: lr * lambda, with its lr = alpha / (n (1 - p))
            self.c = self.lr * float(hp.lam) if self.p > 0 else 0.0
        else:
            self.c = averaging_coefficient(float(hp.alpha), float(hp.lam), n, self.p) if self.p > 0 else 0.0
        if self.c > 1 and not self.script:
            raise ConfigError(f"aggregator.lam: the averaging coefficient alpha*lam/(n*p) = {self.c:.4g} exceeds 1 "
                              f"(alpha {hp.alpha}, lam {hp.lam}, n {n}, p {hp.p}); lower alpha or lam or raise p")
        self.mean: Optional[State] = None  # x_bar of the last averaging block
        self.pending = 0  # averaging steps taken since x_bar was formed and not yet sent
        self.moved = False  # a local step since the last averaging (before any, all x_i are x^0)

    def _pull(self) -> Dict[str, Any]:
        if not self.pending:
            return {}
        return {"mean": self.mean, "coef": repeated_coefficient(self.c, self.pending)}

    def run_round(self, rnd: int, selected: Sequence[int], comm) -> None:
        averaging = self.p > 0 and self.ctx.rng.random() < self.p  # xi ~ Bernoulli(p)
        logger = self.ctx.logger
        if logger is not None:
            logger.log_scalar("l2gd/averaging_step", float(averaging))
        if not averaging:
            message = {"lr": self.lr, **self._pull()}
            comm.send({cid: Message("fit", message) for cid in selected})
            self.pending, self.moved = 0, True
            return
        if self.script:  # the script's mean moves with every pull: every averaging step collects every x_i again
            self._script_average(selected, comm)
            return
        if self.moved:  # x_bar changed: collect every x_i (one upload per averaging block)
            replies = comm.send({cid: Message("average") for cid in selected})
            if replies:
                self.mean = clone_state(self.mean_of(replies))
                self.pending, self.moved = 1, False
            return
        if self.mean is not None:
            self.pending += 1  # x_bar unchanged: a further averaging step costs no communication

    def _script_average(self, selected: Sequence[int], comm) -> None:
        """fedrep_script: x_i pulled by the pending step, then x_bar = (x_first + sum_i x_i) / n, the round's first
        client drawn at random (the script's random client order)."""
        replies = comm.send({cid: Message("average", self._pull()) for cid in selected})
        if not replies:
            return
        first = int(self.ctx.rng.choice(sorted(replies)))
        shared = comm.send({first: Message("share")})
        if first not in shared:
            return
        self.mean = script_mean(self.mean_of(replies), shared[first]["own"], len(replies))
        self.pending, self.moved = 1, False

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate", self._pull()) for cid in clients}

    def state_dict(self) -> Dict[str, Any]:
        return {"mean": self.mean, "pending": self.pending, "moved": self.moved}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.mean = None if state["mean"] is None else clone_state(state["mean"])
        self.pending, self.moved = int(state["pending"]), bool(state["moved"])


ALGORITHM = Algorithm(
    trainer="l2gd", aggregator="l2gd",
    description="L2GD: personal models x_i, each round a local gradient step (probability 1 - p) or a pull toward "
                "the mean (probability p), Hanzely and Richtarik, 2020. Defaults: p 0.1, alpha 1, lambda 0.5, full "
                "participation; model cnn4, batch 32, a local step = 1 epoch at the paper's step size "
                "alpha/(n(1-p)). Evaluates x_i.",
    paper="Hanzely, Richtarik: Federated Learning of a Mixture of Global and Local Models, arXiv:2002.05516, 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "participation": {"join_ratio": 1.0}},
    searches={"train.lr": None},  # its step size is alpha / (n (1 - p)) (aggregator.alpha): train.lr is unused
)
