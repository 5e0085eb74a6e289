"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary: "Federated Learning with Personalization Layers", 2019).

The model is split into base layers, trained jointly and averaged by the server as in FedAvg, and
personalization layers, which every client keeps and trains on its own data only. In pflkit the split is the
SplitModel one: base = ``features.*`` (federated), personalization = ``head.*`` (local), i.e. the paper's
configuration with one personalization layer. Each round a selected client loads the global base, trains the
whole model (base + its own head) for ``train.local_epochs`` epochs of SGD and uploads the base only; the server
takes the sample-weighted mean of the uploaded bases (FedAvg's aggregator over the shared keys). Evaluation uses
the global base with the client's own head.
"""
from typing import List

from easydict import EasyDict
from torch import nn

from pflkit.core import Algorithm, ConfigError, LocalSGDTrainer, head_keys

__all__ = ["FedPerTrainer", "ALGORITHM", "base_keys"]


def base_keys(model: nn.Module, shared: List[str]) -> List[str]:
    """``shared`` without the head's keys; a clear error when the model has no ``head`` sub-module."""
    head = set(head_keys(model))
    if not head:
        raise ConfigError(f"model {type(model).__name__} has no 'head' sub-module: this algorithm needs a model "
                          f"with a features/head split (every pflkit model has one)")
    return [k for k in shared if k not in head]


class FedPerTrainer(LocalSGDTrainer):
    """Trains base + personal head together; uploads only the base layers (``features.*``)."""

    description = "local SGD on the whole model; uploads only the base layers (features.*), the head stays local"
    declares_state = True  # the client's state: the keys it does not share, i.e. its head

    @classmethod
    def shared_keys(cls, model: nn.Module, hp: EasyDict) -> List[str]:
        return base_keys(model, super().shared_keys(model, hp))


ALGORITHM = Algorithm(
    trainer="fedper", aggregator="fedavg",
    description="FedPer: base layers (features.*) averaged as in FedAvg, personalization layers (head.*) stay on "
                "each client (Arivazhagan et al., 2019). Defaults: one personalization layer (the head); model "
                "and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch).",
    paper="Arivazhagan, Aggarwal, Singh, Choudhary: Federated Learning with Personalization Layers, "
          "arXiv:1912.00818, 2019",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
