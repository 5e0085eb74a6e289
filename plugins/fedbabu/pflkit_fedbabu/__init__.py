"""FedBABU (Oh, Kim, Yun: "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022).

Federated training updates and shares the body only; the head stays at its random initialisation -- the same on
every client, since every client builds the same seeded initial model -- and is never trained during federation
(the paper's Algorithm 1: the head's learning rate is 0). Personalisation happens at evaluation: each client
fine-tunes a copy of the received model (body and head) on its own training split for tau_f epochs and is scored
on that copy (the paper's evaluation protocol, Section 3: "fine-tuned for tau_f epochs").

In pflkit:

* body = ``features.*`` (shared, averaged by the FedAvg aggregator weighted by sample counts, as the paper's
  FedAvg), head = ``head.*`` (``requires_grad=False`` and in no optimiser, so neither weight decay nor momentum
  can move it: exactly frozen);
* the fine-tuning is the core's evaluation-time adaptation (``eval.adapt*``, core/api/adaptation.py): a scratch copy is
  fine-tuned and scored, the client keeps nothing of it. The defaults below set the paper's protocol.
"""
from typing import List

from easydict import EasyDict
from torch import nn

from pflkit.core import Algorithm
from pflkit_fedper import FedPerTrainer, base_keys

__all__ = ["FedBABUTrainer", "ALGORITHM", "FINE_TUNE_EPOCHS"]

FINE_TUNE_EPOCHS = 5  # tau_f of the authors' code (utils/options.py ft_ep); PFLlib and FedSA use 10


class FedBABUTrainer(FedPerTrainer):
    """Trains and uploads the body (``features.*``); the head stays at its random initialisation."""

    description = ("trains and uploads the body only (features.*); the head keeps its random initialisation "
                   "(frozen); personalised by fine-tuning a copy at evaluation (eval.adapt*)")
    # the declared state is the unshared keys, i.e. the frozen head: equal to the initial state on every client,
    # so the pooled store never holds a copy
    declares_state = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        for p in self.model.head.parameters():  # Algorithm 1: the head's learning rate is 0 during federation
            p.requires_grad_(False)

    @classmethod
    def shared_keys(cls, model: nn.Module, hp: EasyDict) -> List[str]:
        return base_keys(model, super().shared_keys(model, hp))  # the body; a model without a head is refused

    # local_update is LocalSGDTrainer's: make_optimizer keeps only parameters with requires_grad, i.e. the body


ALGORITHM = Algorithm(
    trainer="fedbabu", aggregator="fedavg",
    description="FedBABU: FedAvg on the body only (features.*) with the head frozen at its random initialisation; "
                "at evaluation each client fine-tunes a copy of the whole model on its training split "
                f"(eval.adapt=every, eval.adapt_epochs={FINE_TUNE_EPOCHS}: the authors' tau_f) and is scored on it "
                "(Oh, Kim, Yun, ICLR 2022). Model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch "
                "32, 1 local epoch); fine-tuning at train.lr.",
    paper="Oh, Kim, Yun: FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
              "eval": {"adapt": "every", "adapt_epochs": FINE_TUNE_EPOCHS, "adapt_params": "all"}},
)
