"""FedAvg (McMahan et al., AISTATS 2017, Algorithm 1).

Clients run E local epochs of mini-batch SGD from the global model; the server replaces the global model by the
average of the uploads weighted by client sample counts (n_k / n). Personal model = the global model.
"""
from pflkit.core import Algorithm, GlobalModelAggregator, LocalSGDTrainer


class FedAvgTrainer(LocalSGDTrainer):
    """Local SGD from the received global model; uploads the whole model."""

    description = "local SGD from the global model, uploads the whole model"
    # every message brings the whole shared model, so a client keeps only the keys the server never sends
    # (none, or the BN statistics with bn_stats=local): clients run pooled and cost no memory of their own
    declares_state = True


class FedAvgAggregator(GlobalModelAggregator):
    """Sample-weighted mean of the uploaded models (Algorithm 1, line 'w <- sum_k n_k/n w_k')."""

    description = "sample-weighted average of uploads"
    mean_fields = ("params",)  # only the weighted mean of the uploads is needed: a distributed run may all-reduce it


ALGORITHM = Algorithm(
    trainer="fedavg", aggregator="fedavg",
    description="FedAvg: sample-weighted averaging of locally trained models (McMahan et al., 2017)",
    paper="Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
