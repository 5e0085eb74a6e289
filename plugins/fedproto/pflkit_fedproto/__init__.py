"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang: "FedProto: Federated Prototype Learning across Heterogeneous
Clients", AAAI 2022).

Clients and server exchange class prototypes only -- never model weights. Each round every participating client

1. trains its own model for E local epochs on ``CE + lambda * L_R``, where L_R is the squared distance between each
   training embedding ``f(x)`` (``model.features``) and the global prototype of its label (no L_R before the
   first global prototypes exist),
2. computes its local prototypes (class means of its embeddings) and uploads them with its per-class counts;

the server averages each class's local prototypes over the clients holding it, weighted by their counts of that
class, and sends the global prototypes back. A client predicts with the nearest global prototype of the embedding
(``trainer.inference=classifier``: its own head instead).

Defaults and readings (see the README): prototype aggregation weighted by class counts (the paper;
``aggregator.weighting=uniform`` is the authors' code); the distance in L_R and at inference averaged over the
embedding dimensions, as the authors' ``nn.MSELoss`` (``trainer.proto_distance=sum`` for the plain squared norm);
local prototypes from the trained model (``trainer.prototypes_from=last_epoch``: from the last epoch's training
steps, as the authors' code). Partial participation: only the round's repliers are aggregated; absent classes keep
their last global prototype.
"""
from pflkit.core import Algorithm

from .client import FedProtoTrainer
from .equations import aggregate_prototypes, local_prototypes, prototype_loss, prototype_scores
from .server import FedProtoAggregator

ALGORITHM = Algorithm(
    trainer="fedproto", aggregator="fedproto",
    description="FedProto: clients train with CE + lambda * ||f(x) - global prototype of y||^2 and exchange only "
                "class prototypes, aggregated per class weighted by class counts; prediction by the nearest global "
                "prototype (Tan et al., AAAI 2022). Defaults: lambda 1, SGD lr 0.01 momentum 0.5, batch 4, "
                "1 local epoch (the authors' published settings for MNIST/FEMNIST); model cnn4.",
    paper="Tan, Long, Liu, Zhou, Lu, Jiang, Zhang: FedProto: Federated Prototype Learning across Heterogeneous "
          "Clients, AAAI 2022",
    defaults={
        "model": {"name": "cnn4"},
        "train": {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "batch_size": 4, "local_epochs": 1},
        "trainer": {"lambda_proto": 1.0},
    },
)

__all__ = ["ALGORITHM", "FedProtoTrainer", "FedProtoAggregator", "aggregate_prototypes", "local_prototypes",
           "prototype_loss", "prototype_scores"]
