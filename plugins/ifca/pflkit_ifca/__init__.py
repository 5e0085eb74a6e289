"""IFCA (Ghosh, Chung, Yin, Ramchandran: "An Efficient Framework for Clustered Federated Learning", NeurIPS 2020,
Algorithm 1 with model averaging).

The server keeps k cluster models theta_1..theta_k and sends all k to every selected client. The client estimates
its cluster, j_hat = argmin_j F_i(theta_j) (its mean training loss under each model, ``equations.choose_cluster``),
trains theta_j_hat with local SGD (E epochs, as FedAvg) and uploads it with j_hat. The server averages the uploads
of each cluster (uniformly, as the paper; or by sample counts) and keeps a cluster that got none unchanged
(``equations.cluster_average``). Evaluation sends the k models to every client, which scores the model of its
argmin cluster. With k = 1 this is FedAvg.

The k models start from k different random initialisations (the paper's; it adds random restarts, pflkit runs one
start per seed): theta_1 is the run's common initial model (so k = 1 is FedAvg bit for bit), theta_j (j >= 2) is the
same architecture re-initialised by its layers' ``reset_parameters`` under a seed derived from (seed, j).

Cluster recovery: the server keeps each client's latest cluster index (per-client server state, in the core's
server-side store ``client_store("assignment")``) and, when the dataset declares true clusters (``digits_clusters``: ``meta['true_cluster']``,
seen as ``ServerContext.data_info`` -- for evaluation only), logs the adjusted Rand index of the assignments
against the truth every round (``ifca/ari``).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch

from pflkit.core import (Algorithm, ConfigError, LocalSGDTrainer, Message, Param, ServerAggregator, Space, State,
                         clone_state, derive_seed, evaluate, positive)

from .equations import choose_cluster, cluster_average, recovery

__all__ = ["IFCATrainer", "IFCAAggregator", "ALGORITHM", "choose_cluster", "cluster_average", "recovery"]

log = logging.getLogger(__name__)
WEIGHTINGS = ("uniform", "samples")


class IFCATrainer(LocalSGDTrainer):
    """Picks the received model with the lowest training loss, trains it as FedAvg does, uploads it with its index;
    evaluates the argmin model."""

    protocol = "ifca"
    description = "picks the cluster model with the lowest training loss, trains it, uploads it with its index"
    # every message brings all k models, so a client keeps only the keys the server never sends (none, or the BN
    # statistics with bn_stats=local): clients run pooled and cost no memory of their own
    declares_state = True
    adapts_at_evaluation = True

    def choose(self, models: Sequence[State]) -> tuple:
        """Load the argmin model into ``self.model``; return (j_hat, its training loss or None when k = 1)."""
        if not models:
            raise ValueError("an IFCA message must carry at least one model")
        if len(models) == 1:  # nothing to choose: no extra pass over the data (k = 1 is FedAvg exactly)
            self.receive(models[0])
            return 0, None
        losses = []
        for theta in models:  # F_i(theta_j): mean loss on the training split, model in eval mode
            self.receive(theta)
            losses.append(evaluate(self.model, self.ctx.train, self.ctx.task,
                                   self.ctx.train_cfg.eval_batch_size).loss)
        j = choose_cluster(losses)
        self.receive(models[j])
        return j, losses[j]

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        j, chosen_loss = self.choose(payload["models"])
        loss = self.local_update()
        reply = {"params": self.upload(), "cluster": j, "num_samples": self.ctx.num_train, "train_loss": loss}
        if chosen_loss is not None:
            reply["metrics"] = {"cluster_loss": chosen_loss}
        return reply

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        self.choose(payload["models"])
        return super().on_evaluate({})  # the chosen model is loaded; applies eval.adapt* like any trainer


def _reinitialised(build_model, seed: int) -> State:
    """The model architecture with fresh random weights: every layer's ``reset_parameters`` under ``seed``."""
    model = build_model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class IFCAAggregator(ServerAggregator):
    """Keeps k cluster models; sends all k; averages the uploads per chosen cluster; logs cluster recovery."""

    protocol = "ifca"
    description = "k cluster models; per-cluster average of the uploads; logs cluster recovery (ARI)"
    params = {
        "clusters": Param(4, "number of cluster models k (the paper's rotated MNIST: 4; CIFAR-10: 2; FEMNIST: 3); "
                             "k = 1 is FedAvg", check=positive,
                          space=Space.integer(2, 5, source="around the paper's k of 2-4, the true cluster counts of "
                                                           "its benchmarks; no grid given")),
        "weighting": Param("uniform", "weight of one upload in its cluster's mean: uniform = 1 per client (the "
                                      "paper's Algorithm 1; default), samples = its training-sample count (FedAvg's)",
                           choices=WEIGHTINGS),
    }

    def reply_layout(self, kind: str, field: str):
        """A fit reply's ``params`` are the trained model's shared keys (checked by the core before clustering)."""
        if kind == "fit" and field == "params":
            return self.model_layout("shared")
        return super().reply_layout(kind, field)

    @classmethod
    def delivers_shared_state(cls) -> bool:
        return True  # every fit and evaluate message carries all k models

    def __init__(self, ctx):
        super().__init__(ctx)
        k = int(ctx.hp.clusters)
        if k > ctx.num_clients:
            raise ConfigError(f"aggregator.clusters: {k} cluster models for {ctx.num_clients} clients; at most one "
                              f"per client")
        sd = ctx.build_model().state_dict()
        keys = ctx.shared_keys if ctx.shared_keys is not None else list(sd)
        inits = [{k_: sd[k_].detach().clone() for k_ in keys}]
        for j in range(1, k):
            fresh = _reinitialised(ctx.build_model, derive_seed(ctx.seed, "ifca-init", j))
            inits.append({k_: fresh[k_] for k_ in keys})
        self.models: List[State] = inits
        # client -> its latest cluster index (from its last fit reply): per-client server state, in the core's
        # server-side store (budgeted, checkpointed by the core)
        self.assignment = self.client_store("assignment")
        self.truth = self._true_clusters()

    def _true_clusters(self) -> Optional[List[int]]:
        from pflkit.core import client_clusters

        meta = (self.ctx.data_info or {}).get("meta") or {}
        truth, problem = client_clusters(meta, self.ctx.cfg, self.ctx.num_clients)
        if truth is None and "true_cluster" in meta:
            log.warning("IFCA cluster recovery (ARI) not computed: %s", problem)
        return truth

    def reply_weight(self, reply: Dict[str, Any]) -> float:
        return float(reply["num_samples"]) if self.ctx.hp.get("weighting", "uniform") == "samples" else 1.0

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("fit", {"models": self.models}) for cid in selected}

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        k = len(self.models)
        cids = [c for c in sorted(replies) if _valid_index(replies[c].get("cluster"), k)]
        if len(cids) < len(replies):
            log.warning("IFCA round %d: ignored %d upload(s) without a valid cluster index", rnd,
                        len(replies) - len(cids))
        if cids:
            self.models = cluster_average(self.models, [replies[c]["params"] for c in cids],
                                          [self.reply_weight(replies[c]) for c in cids],
                                          [int(replies[c]["cluster"]) for c in cids])
            for c in cids:
                self.assignment.put(int(c), int(replies[c]["cluster"]))
        self._log_recovery()
        return None

    def _log_recovery(self) -> None:
        logger = self.ctx.logger
        if logger is None or len(self.models) == 1:
            return
        current = self.assignments()
        logger.log_scalar("ifca/clusters_used", float(len(set(current.values()))))
        if self.truth is not None:
            ari = recovery(current, self.truth)
            if ari is not None:
                logger.log_scalar("ifca/ari", ari)
                logger.log_scalar("ifca/assigned_clients", float(len(current)))

    def assignments(self) -> Dict[int, int]:
        """Every client's latest cluster index (clients never selected yet have none)."""
        return {int(c): int(j) for c, j in self.assignment.items()}

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate", {"models": self.models}) for cid in clients}

    def state_dict(self) -> Dict[str, Any]:
        return {"models": self.models}  # the assignments are in the core's server store, checkpointed by the core

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        models = [clone_state(m) for m in state["models"]]
        if len(models) != len(self.models):
            raise ConfigError(f"aggregator.clusters: the checkpoint holds {len(models)} cluster models, the run "
                              f"asks for {len(self.models)}")
        self.models = models


def _valid_index(value: Any, k: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < k


ALGORITHM = Algorithm(
    trainer="ifca", aggregator="ifca",
    description="IFCA: k cluster models; each client trains the one with the lowest loss on its training data; "
                "the server averages per cluster (Ghosh et al., NeurIPS 2020). Defaults: k = 4, uniform mean; model "
                "and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch). Evaluates "
                "each client on its argmin cluster model.",
    paper="Ghosh, Chung, Yin, Ramchandran: An Efficient Framework for Clustered Federated Learning, NeurIPS 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
