"""FedC2I (Tan, Long, Jiang, Zhang: "Influence-Oriented Personalized Federated Learning"; FedC^2I).

Aggregation happens on the clients. Each round the server relays the latest upload of every client to every
selected client; client m measures, on one random batch of its data, how much its loss grows when client i is
left out of the mean feature extractor (client-level influence, Eq. 4-5) and when client i's row c is left out of
the mean classifier row (class-level influence, Eq. 7-9), builds its own model from all uploads with these
weights (Eq. 6, 10), trains it locally and uploads it.

Defaults and readings (see the plugin README):
- Eq. 10 as printed reduces to phi_{m,c}; the default ``trainer.eq10 = weighted`` mixes the clients' rows
  (``sum_i Lambda^{i,c} phi_{i,c}``), ``printed`` keeps the literal form.
- Class-level losses use the client's own theta_m by default (``trainer.class_features``); the batch's features
  are computed once and reused for all M x C leave-one-out classifiers.
- Partial participation: ``aggregator.relay`` (server.py).
"""
from pflkit.core import Algorithm

from .client import FedC2ITrainer
from .server import FedC2IRelay

ALGORITHM = Algorithm(
    trainer="fedc2i", aggregator="fedc2i",
    description="FedC2I: client-side aggregation weighted by leave-one-out client- and class-level influence "
                "(Tan et al.)",
    paper="Influence-Oriented Personalized Federated Learning (Tan, Long, Jiang, Zhang)",
    # The paper's setting on the embedded feature-shift data: one domain per client, the LeNet of Table 7,
    # 2 local epochs of Adam (lr 1e-3, weight decay 0) with batch 32, 20 rounds (Digit-5), gamma 5; half of every
    # client's samples are its test split (the paper trains on a small part of each domain and tests on more).
    defaults={
        "rounds": 20,
        "dataset": {"name": "digits_domains"},
        "partition": {"name": "by_group", "num_clients": 6},
        "split": {"test_ratio": 0.5},
        "model": {"name": "lenet"},
        "train": {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.0, "batch_size": 32, "local_epochs": 2},
    },
)

__all__ = ["ALGORITHM", "FedC2IRelay", "FedC2ITrainer"]
