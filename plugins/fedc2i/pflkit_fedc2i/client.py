"""FedC2I client (Algorithm 1, LocalUpdate): influence-oriented aggregation on the client, then local training.

Each selected client m receives the latest upload of the other clients (relayed by the server), holds its own
model, and on one random batch B of its training data

1. client-level influence: loss of {theta^{-i}, phi_m} for every i (Eq. 4), lambda_m (Eq. 5);
2. class-level influence: loss of phi_m with row c replaced by the leave-one-out mean of row c, for every (i, c)
   (Eq. 7), Lambda_m (Eq. 8-9), computed from the batch's features of one theta (see ``class_features``);
3. builds theta_bar_m (Eq. 6) and phi_bar_m (Eq. 10), loads them, trains locally (``train.*``: the paper's
   2 epochs, batch 32, Adam lr 1e-3, weight decay 0 are the algorithm's defaults) and uploads {theta_m, phi_m}.

theta = every state entry of the model's ``features`` module; phi = its ``head``, which must be one
``nn.Linear`` (one weight row + one bias entry per class).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import torch
from torch import nn
from torch.func import functional_call

from pflkit.core import (BatchedForm, BatchedPhase, ClientContext, ClientTrainer, ConfigError, Param, PflError,
                         Space, host_copy, load_into, make_optimizer, non_negative, positive, run_sgd,
                         trained_names)

from .equations import (EQ10_READINGS, class_level_losses, classifier_rows, influence_weights,
                        leave_one_out_mean, weighted_state, weighted_sum)

PROTOCOL = "fedc2i"
CLIENT_LEVELS = ("influence", "mean", "local")
CLASS_LEVELS = ("influence", "client", "mean", "local")
CLASS_FEATURES = ("own", "aggregated")


def check_model(model: nn.Module) -> nn.Linear:
    """The classifier phi: the model's ``head``, which must be a single linear layer (ConfigError otherwise)."""
    head = getattr(model, "head", None)
    if getattr(model, "features", None) is None or not isinstance(head, nn.Linear):
        kind = type(head).__name__ if head is not None else "no 'head'"
        raise ConfigError(f"model: fedc2i needs a model split into 'features' (theta) and a linear classifier "
                          f"'head' (phi, one row per class); this model's head is {kind}")
    return head


class FedC2ITrainer(ClientTrainer):
    """Aggregates its own model from every relayed upload with leave-one-out influence weights, then trains.

    Messages (protocol 'fedc2i'):
      ``fit`` {uploads: {cid: state}} -> {params, num_samples, train_loss, influence, influence_clients, metrics}
      ``evaluate`` {} -> eval sums of the personal model

    ``uploads`` holds the other clients' latest models; the client's own entry, if present, is ignored: its own
    model is the one it holds (and last uploaded). ``influence`` is lambda_m over ``influence_clients`` (sorted
    client ids, itself included), returned for logging (Figure 3); it does not change the server's relay.
    """

    protocol = PROTOCOL
    declares_state = True  # runs pooled: one working trainer; each client's model is its declared state
    description = "aggregates its own model from all uploads with leave-one-out influence (Eq. 4-10), then trains"
    params = {
        "gamma": Param(5.0, "influence sensitivity gamma of Eq. 5 and 9 (paper default 5, grid 0.5..10); "
                            "0 = uniform averaging", check=non_negative,
                       space=Space.choice([0.5, 1.0, 2.0, 5.0, 10.0],
                                          source="the paper's grid: Implementation Details, Table 4, appendix "
                                                 "search space")),
        "client_level": Param("influence", "how theta_bar is built (Table 3): influence = Eq. 4-6 (the method); "
                                           "mean = plain mean of theta over the clients (FedC2I-Lambda/g); "
                                           "local = own theta (FedC2I-Lambda/l)", choices=CLIENT_LEVELS),
        "class_level": Param("influence", "how phi_bar is built (Table 3): influence = Eq. 7-10 (the method); "
                                          "client = rows mixed with the client-level lambda, i.e. the whole model "
                                          "by Eq. 6 (FedC2I-lambda); mean = plain mean; local = own phi",
                             choices=CLASS_LEVELS),
        "eq10": Param("weighted", "Eq. 10 reading: weighted = sum_i Lambda^{i,c} phi_{i,c} (default); "
                                  "printed = sum_i Lambda^{i,c} phi_{m,c}, which is phi_{m,c} itself",
                      choices=EQ10_READINGS),
        "class_features": Param("own", "features the class-level losses (Eq. 7) are computed from: own = the "
                                       "client's current theta_m (its model {theta_m, phi_m} with one row replaced, "
                                       "as written); aggregated = theta_bar_m of Eq. 6", choices=CLASS_FEATURES),
        "influence_batch": Param(None, "size of the random batch B the influence losses use (default: "
                                       "train.batch_size, the paper's 'a random batch')", type=int, check=positive),
    }

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        self.model = ctx.build_model()
        check_model(self.model)
        if ctx.hp.get("class_level", "influence") == "influence" and ctx.task.kind != "classification":
            raise ConfigError("trainer.class_level: 'influence' needs a classification task (one classifier row "
                              "per class); use client, mean or local for this task")
        sd = self.model.state_dict()
        self.theta_keys = [k for k in sd if k.startswith("features.")]
        self.has_bias = self.model.head.bias is not None
        self.last: Dict[str, Any] = {}  # the last fit's influence (inspection and tests; not persistent state)

    # -- protocol ---------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        cids, lam, class_lam = self._aggregate(payload)
        self.model.train()
        opt = make_optimizer(self.model.parameters(), self.ctx.train_cfg)
        loss = run_sgd(self.batches(), self._train_loss, opt)
        return self._fit_reply(cids, lam, class_lam, loss)

    def _aggregate(self, payload: Dict[str, Any]) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
        uploads = payload.get("uploads", {})
        if not isinstance(uploads, Mapping):
            raise PflError("fedc2i 'fit' message: 'uploads' must map client ids to model states")
        cids, states = self._relay_set(uploads)
        lam, class_lam = self.influence_aggregate(cids, states)
        return cids, lam, class_lam

    def _train_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.ctx.task.loss(self.model(x), y)

    # clients.batched: the influence step runs per client (batched_begin), the local training is batched
    def batched_begin(self, payload: Dict[str, Any]) -> None:
        self._influence = self._aggregate(payload)

    def batched_form(self) -> BatchedForm:
        phase = BatchedPhase(self._train_loss, trained_names(self.model, "model"),
                             int(self.ctx.train_cfg.local_epochs))
        influence = getattr(self, "_influence", None)  # this client's, computed by its batched_begin

        def reply(losses, start, aux):
            return self._fit_reply(*influence, losses[-1])

        return BatchedForm({"model": self.model}, [phase], reply)

    def _fit_reply(self, cids: List[int], lam: torch.Tensor, class_lam: torch.Tensor, loss: float
                   ) -> Dict[str, Any]:
        own = cids.index(self.ctx.cid)
        metrics = {"self_influence": float(lam[own])}
        if self.ctx.hp.get("class_level", "influence") == "influence":  # Lambda is measured only then
            metrics["class_self_influence"] = float(class_lam[own].mean())
        return {
            "params": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "num_samples": self.ctx.num_train,
            "train_loss": loss,
            "influence": lam.to(torch.float32),
            "influence_clients": list(cids),
            "metrics": metrics,
        }

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        return self.evaluate_model(self.model)

    def client_state(self) -> Dict[str, Any]:
        # the whole model: a client's own model is where every relayed upload is mixed in (``last`` is inspection)
        return {"model": host_copy(self.model.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        load_into(self.model, state["model"])

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])

    # -- influence-oriented aggregation (LocalUpdate lines 1-4) -------------------------------------------------
    def _relay_set(self, uploads: Mapping[int, Mapping[str, torch.Tensor]]) -> Tuple[List[int], List[Mapping]]:
        """Sorted client ids and their states: the relayed uploads plus this client's own current model."""
        own_sd = self.model.state_dict()
        expected = set(own_sd)
        for cid, state in uploads.items():
            if not isinstance(state, Mapping) or set(state) != expected:
                raise PflError(f"fedc2i: the relayed upload of client {cid} does not match this client's model")
        cids = sorted({int(c) for c in uploads} | {self.ctx.cid})
        by_cid = {int(c): s for c, s in uploads.items()}
        dev = self.ctx.device
        states = [own_sd if c == self.ctx.cid else {k: v.to(dev) for k, v in by_cid[c].items()} for c in cids]
        return cids, states

    def _influence_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """One random batch B of the client's training data (Algorithm 1, LocalUpdate line 1)."""
        n = self.ctx.num_train
        size = min(n, self.ctx.hp.get("influence_batch") or self.ctx.train_cfg.batch_size)
        idx = torch.randperm(n, generator=self.ctx.generator)[:size].to(self.ctx.train.y.device)
        return self.ctx.train.batch(idx)

    def _features(self, theta: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Features of ``x`` under the feature-layer state ``theta`` (keys 'features.*'), model untouched."""
        local = {k[len("features."):]: v for k, v in theta.items()}
        return functional_call(self.model.features, local, (x,))

    def _head(self, state: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        w = state["head.weight"]
        b = state["head.bias"] if self.has_bias else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        return w, b

    @torch.no_grad()
    def influence_aggregate(self, cids: List[int], states: List[Mapping[str, torch.Tensor]]
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Compute lambda_m (Eq. 4-5) and Lambda_m (Eq. 7-9), build {theta_bar_m, phi_bar_m} (Eq. 6, 10) and load
        it into the model. Returns (lambda_m [M], Lambda_m [M, C]) in float64, clients in ``cids`` order."""
        hp, task = self.ctx.hp, self.ctx.task
        gamma = float(hp.get("gamma", 5.0))
        own = cids.index(self.ctx.cid)
        m = len(cids)
        self.model.eval()  # influence is measured, not trained: no dropout, no batch-norm statistic updates
        x, y = self._influence_batch()
        own_state = states[own]
        w_own, b_own = self._head(own_state)
        theta_own = {k: own_state[k] for k in self.theta_keys}
        float_theta = [k for k in self.theta_keys if own_state[k].is_floating_point()]
        stacked = {k: torch.stack([s[k] for s in states]) for k in float_theta}

        # client-level influence, Eq. (4)-(5)
        if m >= 2:
            loo = {k: leave_one_out_mean(v) for k, v in stacked.items()}
            losses = torch.empty(m, dtype=torch.float64)
            for i in range(m):
                theta_i = {**theta_own, **{k: loo[k][i] for k in float_theta}}  # integer buffers stay own
                logits = self._features(theta_i, x) @ w_own.T + b_own
                losses[i] = float(task.loss(logits, y))
            lam = influence_weights(losses, gamma)
        else:  # alone in the relay set: nothing to leave out
            losses = torch.zeros(1, dtype=torch.float64)
            lam = torch.ones(1, dtype=torch.float64)

        # theta_bar, Eq. (6) or the Table 3 alternatives
        mode = hp.get("client_level", "influence")
        if mode == "influence":
            theta_bar = weighted_state(states, lam, theta_own)
        elif mode == "mean":
            theta_bar = weighted_state(states, torch.full((m,), 1.0 / m, dtype=torch.float64), theta_own)
        else:  # local
            theta_bar = {k: v.clone() for k, v in theta_own.items()}

        # class-level influence, Eq. (7)-(9): features of B computed once, reused for all M x C classifiers
        heads = [self._head(s) for s in states]
        w_all = torch.stack([h[0] for h in heads])  # [M, C, d]
        b_all = torch.stack([h[1] for h in heads])  # [M, C]
        c = w_all.shape[1]
        cmode = hp.get("class_level", "influence")
        class_losses = torch.zeros(m, c, dtype=torch.float64)
        if cmode == "influence" and m >= 2:
            feats = self._features(theta_own if hp.get("class_features", "own") == "own" else theta_bar, x)
            class_losses = class_level_losses(feats, y, w_own, b_own, leave_one_out_mean(w_all),
                                              leave_one_out_mean(b_all), task.loss).to(torch.float64)
            class_lam = influence_weights(class_losses, gamma, dim=0)
        elif cmode == "influence":
            class_lam = torch.ones(1, c, dtype=torch.float64)
        else:
            class_lam = torch.full((m, c), float("nan"), dtype=torch.float64)  # not measured

        # phi_bar, Eq. (10) or the Table 3 alternatives
        if cmode == "influence":
            w_bar, b_bar = classifier_rows(w_all, b_all, class_lam, own, hp.get("eq10", "weighted"))
        elif cmode == "client":
            w_bar, b_bar = weighted_sum(w_all, lam), weighted_sum(b_all, lam)
        elif cmode == "mean":
            uniform = torch.full((m,), 1.0 / m, dtype=torch.float64)
            w_bar, b_bar = weighted_sum(w_all, uniform), weighted_sum(b_all, uniform)
        else:  # local
            w_bar, b_bar = w_own.clone(), b_own.clone()

        new_state = dict(theta_bar)
        new_state["head.weight"] = w_bar
        if self.has_bias:
            new_state["head.bias"] = b_bar
        load_into(self.model, new_state)
        self.last = {"clients": list(cids), "losses": losses, "lambda": lam, "class_losses": class_losses,
                     "class_lambda": class_lam}
        return lam, class_lam
