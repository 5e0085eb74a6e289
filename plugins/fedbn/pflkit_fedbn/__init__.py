"""FedBN (Li, Jiang, Zhang, Kamp, Dou: "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021, Algorithm 1).

Identical to FedAvg except that every BatchNorm layer stays on its client: its affine parameters (gamma, beta)
and its running statistics (mean, variance, batch counter) are neither uploaded nor overwritten by the server.
All other parameters are averaged with sample weights (Algorithm 1's aggregation, which the paper writes for the
non-BN layers only). A client is evaluated with the shared non-BN layers and its own BN layers.

On a model without BatchNorm layers nothing is kept local and FedBN *is* FedAvg; the trainer logs a warning
saying so. The default model is the paper's digit-CNN design (``fedbn_cnn``, BN after every layer; registered by
this package) at cnn4's widths, since the paper's widths (convs 64/64/128, FC 2048/512) are sized for 28x28 inputs
and cost 13x the communication on the 8x8 digits; ``model.channels`` / ``model.hidden`` restore them.
"""
import logging
from typing import List

from easydict import EasyDict
from torch import nn

from pflkit.core import Algorithm, LocalSGDTrainer, bn_keys

__all__ = ["FedBNTrainer", "ALGORITHM", "local_bn_keys"]

log = logging.getLogger("pflkit")
_warned_models: set = set()


def local_bn_keys(model: nn.Module) -> List[str]:
    """Every BatchNorm state key: affine weight/bias and running mean/var/batch counter."""
    return bn_keys(model, include_affine=True)


class FedBNTrainer(LocalSGDTrainer):
    """Local SGD from the global non-BN layers; uploads everything except the BatchNorm layers."""

    description = "local SGD; uploads all layers except BatchNorm (affine and statistics stay local)"
    params = {}  # BN handling is the algorithm itself: the core's bn_stats option does not apply
    declares_state = True  # the client's state: its BatchNorm layers (the keys it does not share)

    @classmethod
    def shared_keys(cls, model: nn.Module, hp: EasyDict) -> List[str]:
        local = set(local_bn_keys(model))
        if not local and type(model).__name__ not in _warned_models:
            _warned_models.add(type(model).__name__)
            log.warning("fedbn: the model has no BatchNorm layer, so nothing stays local and FedBN equals FedAvg")
        return [k for k in model.state_dict() if k not in local]


ALGORITHM = Algorithm(
    trainer="fedbn", aggregator="fedavg",
    description="FedBN: FedAvg in which every BatchNorm layer (affine parameters and running statistics) stays "
                "local (Li et al., 2021); on a model without BatchNorm it equals FedAvg. Defaults: the paper's "
                "digit-CNN design (model fedbn_cnn: BN after every conv and hidden FC layer) at cnn4's widths "
                "(convs 32, 64; FC 512) for the 8x8 digits, batch 32 and 1 local epoch as in the paper, SGD lr 0.05 "
                "(paper: 0.01, slower on digits: 20 rounds gave final uniform accuracy 0.578 vs 0.645).",
    paper="Li, Jiang, Zhang, Kamp, Dou: FedBN: Federated Learning on Non-IID Features via Local Batch "
          "Normalization, ICLR 2021",
    defaults={"model": {"name": "fedbn_cnn", "channels": [32, 64], "hidden": [512]},
              "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
