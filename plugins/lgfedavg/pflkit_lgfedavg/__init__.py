"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency: "Think Locally, Act Globally:
Federated Learning with Local and Global Representations", arXiv:2001.01523, 2020).

Each client keeps its own *local representation* layers -- the lower layers, which turn its raw data into a
representation -- and shares the *global* top layers, which every client trains on its representations and the
server averages. Each round a selected client loads the global top layers, trains its whole model on cross-
entropy for ``train.local_epochs`` epochs and uploads the top layers only; the server averages them (FedAvg's
aggregator over the shared keys). Clients are evaluated with their own model (their local layers + the global
top layers).

``global_layers`` counts layers from the output (``layers.model_layers``: a convolution or linear layer with its
normalisation). The default 2 is the authors' setting for their CIFAR-10 CNN (``num_layers_keep 2`` in
``scripts/main_lg_cifar10.sh``; the FedRep authors' re-implementation shares that CNN's fc2 + fc3); on cnn4 it
shares the 512-wide feature layer and the head and keeps both convolutions local. 1 shares the head only, as
PFLlib does; a count equal to the model's number of layers shares everything, which is FedAvg.
"""
from typing import List

from easydict import EasyDict
from torch import nn

from pflkit.core import Algorithm, ConfigError, LocalSGDTrainer, Param, Space, positive

from .layers import model_layers

__all__ = ["LGFedAvgTrainer", "ALGORITHM", "model_layers", "top_layer_keys"]

DEFAULT_GLOBAL_LAYERS = 2


def top_layer_keys(model: nn.Module, count: int) -> List[str]:
    """State keys of the ``count`` layers nearest the output; one clear error when the model has fewer."""
    layers = model_layers(model)
    if count > len(layers):
        raise ConfigError(f"trainer.global_layers: {count} is more than the {len(layers)} layers of model "
                          f"{type(model).__name__} (use {len(layers)} to share every layer, i.e. FedAvg)")
    return [k for layer in layers[len(layers) - count:] for k in layer]


class LGFedAvgTrainer(LocalSGDTrainer):
    """Trains the whole model; uploads only the top ``global_layers`` layers, the lower ones stay local."""

    description = ("local SGD on the whole model; uploads only the top trainer.global_layers layers (global), the "
                   "lower layers (local representation) stay on the client")
    params = {
        **LocalSGDTrainer.params,
        "global_layers": Param(DEFAULT_GLOBAL_LAYERS,
                               "how many layers, counted from the output, are global (shared and averaged); the "
                               "others stay local (default 2: the authors' CIFAR-10 setting num_layers_keep 2; "
                               "1 = the head only, as PFLlib; the model's layer count = FedAvg)", check=positive,
                               space=Space.integer(1, 3, source="around the authors' 2 for CIFAR-10 and 3 for "
                                                                "MNIST; 1 is PFLlib's head only; no grid given")),
    }
    declares_state = True  # the local layers: the model keys it does not share

    @classmethod
    def shared_keys(cls, model: nn.Module, hp: EasyDict) -> List[str]:
        top = set(top_layer_keys(model, hp.get("global_layers", DEFAULT_GLOBAL_LAYERS)))
        return [k for k in super().shared_keys(model, hp) if k in top]  # bn_stats=local keeps BN statistics here


ALGORITHM = Algorithm(
    trainer="lgfedavg", aggregator="fedavg",
    description="LG-FedAvg: each client keeps its lower layers (local representation) and shares the top "
                "trainer.global_layers layers, which the server averages (Liang et al., 2020). Defaults: 2 global "
                "layers (the authors' CIFAR-10 setting); model and local training as pflkit's FedAvg (cnn4, SGD "
                "lr 0.05, batch 32, 1 local epoch); no warm start from a FedAvg model.",
    paper="Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency: Think Locally, Act Globally: "
          "Federated Learning with Local and Global Representations, arXiv:2001.01523, 2020",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "trainer": {"global_layers": DEFAULT_GLOBAL_LAYERS}},
)
