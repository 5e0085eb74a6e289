"""FedAvg (McMahan et al., AISTATS 2017, Algorithm 1).

Clients run E local epochs of mini-batch SGD from the global model; the server replaces the global model by the
average of the uploads weighted by client sample counts (n_k / n). Personal model = the global model.
"""
from typing import Any, Dict

from pflkit.core import Algorithm, GlobalModelAggregator, LocalSGDTrainer, Param

WEIGHTINGS = ("samples", "uniform")


def reply_weight(reply: Dict[str, Any], weighting: str) -> float:
    """The weight of one upload in the server's mean: n_k (``samples``) or 1 (``uniform``)."""
    return float(reply["num_samples"]) if weighting == "samples" else 1.0


class FedAvgTrainer(LocalSGDTrainer):
    """Local SGD from the received global model; uploads the whole model."""

    description = "local SGD from the global model, uploads the whole model"
    # every message brings the whole shared model, so a client keeps only the keys the server never sends
    # (none, or the BN statistics with bn_stats=local): clients run pooled and cost no memory of their own
    declares_state = True
    # on_evaluate scores the model the evaluate message brings: the personal numbers are the global model's
    personal_is_global = True


class FedAvgAggregator(GlobalModelAggregator):
    """Weighted mean of the uploaded models: by sample counts (Algorithm 1, line 'w <- sum_k n_k/n w_k'), or
    uniform (each replying client weighs 1) where a paper averages so (pFedMe, Per-FedAvg, IFCA)."""

    description = "sample-weighted (or uniform: aggregator.weighting) average of uploads"
    params = {
        "weighting": Param("samples", "weight of one client's upload in the mean: samples = its training-sample "
                           "count n_k (FedAvg, Algorithm 1; default), uniform = 1 per replying client (the plain "
                           "mean of pFedMe, Per-FedAvg and IFCA)", choices=WEIGHTINGS),
    }
    mean_fields = ("params",)  # only the weighted mean of the uploads is needed: a distributed run may all-reduce it

    def reply_weight(self, reply: Dict[str, Any]) -> float:
        # one reply's weight, used alike by the serial combine and by each rank's sum on the distributed fast path
        return reply_weight(reply, self.ctx.hp.get("weighting", "samples"))


ALGORITHM = Algorithm(
    trainer="fedavg", aggregator="fedavg",
    description="FedAvg: sample-weighted averaging of locally trained models (McMahan et al., 2017)",
    paper="Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
