"""FedCAC (Wu et al., "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through
Cautiously Aggressive Collaboration", ICCV 2023).

Each round every participating client trains its personal model for E epochs, scores each parameter by
Eq. (5) ``|delta theta * theta|``, marks the top-tau fraction of every tensor critical (Eq. 6) and uploads model +
1-bit mask. The server measures how much clients' critical locations overlap, raises a threshold over the rounds
(Eq. 7), lets each client share its critical parameters only with clients above the threshold (Eq. 8, 10) and its
non-critical ones with everybody (Eq. 9), and sends each client ``u_i * M_i + w_bar * (1 - M_i)`` (Eq. 11).

Defaults and readings (each explained in the plugin README, "Readings and deviations"):
- overlap = 'similarity' (the authors' code, ``1 - |Mi - Mj|_1 / (2|Mi|)``) is the default, as the threshold
  schedule is designed for it; the paper's printed normalised distance is ``aggregator.overlap=distance``.
- Eq. (9) averages uniformly as printed; ``aggregator.global_weighting=samples`` weights by sample count as the
  reference code does.
- BN running statistics (all buffers) never leave a client.
- Partial participation / drop-out: only this round's repliers enter the round; others keep their model.
"""
from pflkit.core import Algorithm

from .client import FedCACTrainer
from .server import FedCACAggregator

ALGORITHM = Algorithm(
    trainer="fedcac", aggregator="fedcac",
    description="FedCAC: sensitivity-based critical parameters with time-varying collaboration "
                "(Wu et al., ICCV 2023)",
    paper="Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through Cautiously "
          "Aggressive Collaboration, ICCV 2023",
    # Sized for the embedded digits data set (1,797 8x8 images; ~90 samples per client with the core's 20
    # clients, 30 rounds). The optimiser settings are the paper's (SGD lr 0.1, 5 local epochs, batch 100 --
    # i.e. full-batch here, since a client holds fewer than 100 training samples); the model is the core's cnn4
    # (the paper's ResNet-8 is model.name=resnet8); tau is the paper's 0.5; beta is scaled to the shorter run so
    # that collaboration on critical parameters ends after a third of it (the paper: round 100 of 500).
    defaults={
        "model": {"name": "cnn4"},
        "train": {"lr": 0.1, "batch_size": 100, "local_epochs": 5},
        "aggregator": {"beta": 10.0},
    },
)

__all__ = ["ALGORITHM", "FedCACAggregator", "FedCACTrainer"]
