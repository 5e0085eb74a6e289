"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan: "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023, Algorithm 1).

Instead of overwriting its local model theta_i with the received global model Theta, a client initialises it by
adaptive local aggregation (ALA, ``equations.py``): the lower layers take Theta, the top p layers become
theta_hat = theta_i + (Theta - theta_i) * W with element-wise weights W in [0, 1] (ones at first, kept across
rounds), learned by gradient descent on the loss of theta_hat on a random s% of the client's training data. The
first time ALA runs, W is trained until the loss settles (std of the last ``ala_window`` epoch losses below
``ala_threshold``); afterwards one epoch per round. A client's first local round skips ALA (it has no local model
yet: theta_i = Theta). The client then trains theta_hat as its base algorithm does and uploads it; the server is
the base's (FedAvg: the sample-weighted mean). Evaluation scores the client's local model theta_i (a client that has
never trained is scored on the global model).

ALA is a wrapper (core/engine/compose.py): ``fedala`` is ALA on FedAvg, and ``--set trainer.base=fedprox`` (or any base
``fl show fedala`` lists) puts ALA in front of that algorithm's local training, as the paper does for other methods.
Declared per-client state: the whole local model, W, and the two flags (trained before, start phase done).
"""
from typing import Any, Dict, List, Optional

import torch

from pflkit.core import (Algorithm, ClientTrainer, ConfigError, GlobalModelAggregator, LocalSGDTrainer, Param,
                         ServerAggregator, Space, derive_seed, host_copy, load_into, non_negative, positive,
                         state_declared)

from .equations import ala_init, ala_step, converged, layer_groups, top_layer_keys

__all__ = ["FedAlaTrainer", "FedAlaAggregator", "AlaClientMixin", "ALGORITHM", "ala_init", "ala_step",
           "top_layer_keys"]

BASE_PROTOCOL = "global-model"

TRAINER_PARAMS = {
    "ala_eta": Param(1.0, "eta: step size of the ALA weights W (default 1.0: the paper, PFLlib and FL-bench); "
                          "0 keeps W at 1, i.e. the base algorithm exactly", check=non_negative,
                     space=Space.real(0.1, 10.0, log=True,
                                      source="around the paper's 1.0; its study values not checked offline")),
    "ala_percent": Param(80.0, "s: percent of the client's training samples ALA learns W on, drawn at random each "
                               "round (default 80: the paper, PFLlib, FedSA)",
                         check=lambda v: None if 0 < v <= 100 else "must be in (0, 100]",
                         space=Space.real(5.0, 100.0,
                                          source="around the paper's 80, up to all the data; its study values not "
                                                 "checked offline")),
    "ala_layers": Param(1, "p: how many top layers ALA mixes (a layer = one module's parameters, e.g. a Linear's "
                           "weight and bias; default 1: the paper; PFLlib's -p counts tensors, so its -p 2 is this "
                           "1)", check=positive,
                       space=Space.integer(1, 3, source="around the paper's 1; at most 3 so that the default 4-layer "
                                                        "cnn4 keeps a lower layer; its study values not checked "
                                                        "offline")),
    "ala_threshold": Param(0.1, "start phase: W is trained until the std of the last ala_window epoch losses is "
                                "below this (default 0.1: the authors' ALA class and PFLlib)", check=positive),
    "ala_window": Param(10, "start phase: how many recent epoch losses the convergence test looks at (default 10: "
                            "the authors' code)", check=positive),
    "ala_max_epochs": Param(100, "start phase: at most this many epochs of W training (a bound the authors' code "
                                 "lacks: it loops until the test passes)", check=positive),
}


class AlaClientMixin:
    """ALA in front of a global-model trainer's ``receive`` during ``fit``; the local model is evaluated."""

    def __init__(self, ctx):
        super().__init__(ctx)
        hp = ctx.hp
        params = [n for n, _ in self.model.named_parameters() if n in set(self.shared)]
        layers = layer_groups(params)
        if hp.ala_layers > len(layers):
            raise ConfigError(f"trainer.ala_layers: {hp.ala_layers} is invalid: the model shares only "
                              f"{len(layers)} parameter layers with the server")
        self.ala_keys: List[str] = top_layer_keys(params, int(hp.ala_layers))
        self.ala_weights: Dict[str, torch.Tensor] = {}  # W per top-layer key; empty until ALA first runs (ones)
        self.ala_started = False  # W was trained to convergence once (the start phase is over)
        self.has_local = False  # this client trained before, so it holds a local model theta_i of its own
        self._ala_model = ctx.build_model()  # scratch model for learning W (never part of the state)
        self._in_fit = False
        self._ala_epochs = 0

    # protocol ------------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        self._in_fit, self._ala_epochs = True, 0
        try:
            reply = super().on_fit(payload)
        finally:
            self._in_fit = False
        self.has_local = True
        metrics = dict(reply.get("metrics") or {})
        metrics["ala_epochs"] = self._ala_epochs
        if self.ala_weights:
            metrics["ala_weight_mean"] = float(torch.cat([w.reshape(-1) for w in self.ala_weights.values()]).mean())
        reply["metrics"] = metrics
        return reply

    def ala_on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """The composed class's ``on_evaluate`` (set by ``wrap``, which declares evaluation-time adaptation
        exactly when the base's ``on_evaluate`` supports it)."""
        if self.has_local:  # the local model theta_i is the personal one: the global model is not loaded into it
            payload = {k: v for k, v in payload.items() if k != "params"}
        return super().on_evaluate(payload)

    def receive(self, params) -> None:
        if self._in_fit and self.has_local:
            params = self.adaptive_local_aggregation(params)
        super().receive(params)

    # ALA -----------------------------------------------------------------------------------------------------
    def adaptive_local_aggregation(self, received: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The received state with its top-p layers replaced by theta_hat (W learned first unless eta is 0)."""
        hp = self.ctx.hp
        keys = [k for k in self.ala_keys if k in received]
        own = self.model.state_dict()
        local = {k: own[k].detach().clone() for k in keys}  # theta_i
        glob = {k: received[k].to(own[k].device) for k in keys}  # Theta
        if not self.ala_weights:
            self.ala_weights = {k: torch.ones_like(local[k]) for k in keys}
        if hp.ala_eta > 0:
            self._learn_weights(received, keys, local, glob)
        out = dict(received)
        for k in keys:
            out[k] = ala_init(local[k], glob[k], self.ala_weights[k])
        return out

    def _learn_weights(self, received, keys, local, glob) -> None:
        hp, cfg, data = self.ctx.hp, self.ctx.train_cfg, self.ctx.train
        model = self._ala_model
        load_into(model, self.model.state_dict())  # unsent keys stay the client's
        load_into(model, received)  # lower layers: Theta
        named = dict(model.named_parameters())
        for name, p in named.items():
            p.requires_grad_(name in keys)  # only the top layers need gradients
        top = [named[k] for k in keys]
        # s% of the training samples at random, from a generator of its own so ALA leaves the base's batches alone
        gen = torch.Generator().manual_seed(derive_seed(self.ctx.generator.initial_seed(), "ala"))
        n = len(data)
        take = max(1, int(n * hp.ala_percent / 100))
        sample = torch.randperm(n, generator=gen)[:take].to(data.y.device)
        batches = [sample[i:i + cfg.batch_size] for i in range(0, take, cfg.batch_size)]
        weights = self.ala_weights
        model.train()
        losses: List[float] = []
        while True:
            with torch.no_grad():
                for k, p in zip(keys, top):
                    p.copy_(ala_init(local[k], glob[k], weights[k]))
            total = 0.0
            for idx in batches:
                x, y = data.batch(idx)
                loss = self.ctx.task.loss(model(x), y)
                grads = torch.autograd.grad(loss, top)
                with torch.no_grad():
                    for k, p, g in zip(keys, top, grads):
                        weights[k] = ala_step(weights[k], g, local[k], glob[k], float(hp.ala_eta))
                        p.copy_(ala_init(local[k], glob[k], weights[k]))
                total += float(loss.detach()) * len(idx)
            losses.append(total / take)
            self._ala_epochs += 1
            if self.ala_started or converged(losses, int(hp.ala_window), float(hp.ala_threshold)) \
                    or len(losses) >= hp.ala_max_epochs:
                break
        self.ala_started = True

    # state: the whole local model (not only the keys the server never sends), W and the flags ----------------
    def client_keys(self) -> List[str]:
        return list(self.model.state_dict())

    def _ala_state(self, copy) -> Dict[str, Any]:
        return {"weights": copy(self.ala_weights), "started": self.ala_started, "has_local": self.has_local}

    def _load_ala_state(self, state: Dict[str, Any]) -> None:
        device = self.ctx.device
        self.ala_weights = {k: v.to(device).clone() for k, v in state["weights"].items()}
        self.ala_started, self.has_local = bool(state["started"]), bool(state["has_local"])

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "ala": self._ala_state(lambda w: {k: v.clone() for k, v in w.items()})}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._load_ala_state(state["ala"])

    def client_state(self) -> Dict[str, Any]:
        return {**super().client_state(), "ala": self._ala_state(host_copy)}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        self._load_ala_state(state["ala"])


class FedAlaTrainer(ClientTrainer):
    """FedALA's client side around a base algorithm's trainer (a wrapper: see core/engine/compose.py)."""

    description = ("FedALA client: adaptive local aggregation of the received model into the local one (top p "
                   "layers, learned element-wise weights), then the base algorithm's local training")
    params = TRAINER_PARAMS
    default_base = "fedavg"
    wrapper_name = "FedALA"

    @classmethod
    def can_wrap(cls, base: type) -> Optional[str]:
        """Why ALA cannot go in front of trainer class ``base`` (None: it can)."""
        if not (isinstance(base, type) and issubclass(base, LocalSGDTrainer)):
            return "its trainer is not a LocalSGDTrainer (ALA replaces what receive() loads)"
        if getattr(base, "protocol", None) != BASE_PROTOCOL:
            return f"its trainer speaks protocol {getattr(base, 'protocol', None)!r}, not {BASE_PROTOCOL!r}"
        return None

    @classmethod
    def wrap(cls, base: type) -> type:
        evaluator = next(k for k in base.__mro__ if "on_evaluate" in vars(k))
        return type(f"FedALA[{base.__name__}]", (AlaClientMixin, base), {
            "on_evaluate": AlaClientMixin.ala_on_evaluate,  # delegates to the base's (super), adaptation included
            "adapts_at_evaluation": bool(vars(evaluator).get("adapts_at_evaluation", False)),
            # the mixin declares its part (whole model, W, flags); pooled whenever the base declares the rest
            "declares_state": state_declared(base),
            "needs_shared_delivery": False,  # a client keeps its whole model itself
            "params": {**dict(getattr(base, "params", {}) or {}), **TRAINER_PARAMS},
            "description": cls.description,
            "__module__": __name__,
        })


class FedAlaAggregator(ServerAggregator):
    """ALA is client-side only: the server is the base algorithm's aggregator, unchanged."""

    description = "the base algorithm's aggregator, unchanged (ALA runs on the clients)"
    params: Dict[str, Param] = {}
    default_base = "fedavg"
    wrapper_name = "FedALA"

    @classmethod
    def can_wrap(cls, base: type) -> Optional[str]:
        if not (isinstance(base, type) and issubclass(base, GlobalModelAggregator)):
            return "its aggregator is not a GlobalModelAggregator (ALA needs a global model in every fit message)"
        return None

    @classmethod
    def wrap(cls, base: type) -> type:
        return base


ALGORITHM = Algorithm(
    trainer="fedala", aggregator="fedala",
    description="FedALA: each client initialises its local model by adaptive local aggregation of the global "
                "model (element-wise learned weights on the top p layers) before local training; on FedAvg, or on "
                "the base named by trainer.base (Zhang et al., AAAI 2023). Defaults: s 80%, p 1 layer, eta 1.0 "
                "(paper); model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local "
                "epoch). Evaluates the local model.",
    paper="Zhang, Hua, Wang, Song, Xue, Ma, Guan: FedALA: Adaptive Local Aggregation for Personalized Federated "
          "Learning, AAAI 2023",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
