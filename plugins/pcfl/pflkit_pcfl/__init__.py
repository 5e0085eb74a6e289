"""PCFL: "Precision Collaboration for Federated Learning" (appendix Algorithms 1-2, Eq. 7-14).

A manifold flow (Eq. 7-8, flow.py) is trained federatedly (Algorithm 1); each client's projected local manifold is
the convex hull of its latent codes (Eq. 9, hull.py); client k holds the overlap D^{i,k} = its samples inside
client i's hull (Eq. 10) and computes the overlap term of client i's model on it, so that only updates travel
(Algorithm 2); each client also trains on synthetic samples of its unshared region (Eq. 12-13). Client i's
objective (Eq. 14):

    l(f_i; D^i) + alpha * 1/(N-1) sum_{k != i} E_{D^{i,k}} l(f_i) + beta * E_{p^i_z on the unshared region} l(f_i)

PCFL augments a base algorithm (``trainer.base``: local, fedavg, fedrep, ditto, ...; Tables 8-9) through the
core's composition mechanism (core/engine/compose.py): ``PcflTrainer`` and ``PcflAggregator`` are wrappers.
"""
from pflkit.core import Algorithm

from .aggregator import AGGREGATOR_PARAMS, PcflAggregator, PcflServerMixin
from .trainer import TRAINER_PARAMS, PcflClientMixin, PcflTrainer

__all__ = ["PcflTrainer", "PcflAggregator", "PcflClientMixin", "PcflServerMixin", "ALGORITHM", "TRAINER_PARAMS",
           "AGGREGATOR_PARAMS"]

ALGORITHM = Algorithm(
    trainer="pcfl", aggregator="pcfl",
    description="PCFL: a federated manifold flow identifies, for each client i, the samples of other clients "
                "inside i's convex hull in latent space (D^{i,k}, used where they live: only updates travel) and "
                "samples i's unshared region; Eq. 14 adds both to the objective of a base algorithm's personal "
                "model (trainer.base: local (default, the authors' synthetic run), fedavg, fedrep, ditto, ...). "
                "Defaults: the paper's synthetic task (section 5.1: pcfl_sine, 96 clients, four-layer MLP, d' = 2) "
                "with its hyperparameters (alpha = beta = 0.5, 10% of clients per round, 15 local epochs of SGD), "
                "in 50 rounds evaluated every 5th (minutes on 2 CPU cores, README); the paper's 200 rounds: "
                "plugins/pcfl/configs/sine.toml, beside CIFAR-10, FEMNIST and Adult.",
    paper="Precision Collaboration for Federated Learning (PCFL), under review at ICLR 2023",
    # = configs/sine.toml but in 50 rounds instead of the paper's 200, so that a first run takes about 10 minutes on
    # a shared 2-core machine (README): `fl run --plugin pcfl` is section 5.1's experiment, offline
    defaults={"rounds": 50,
              "eval": {"every": 5, "final_k": 3},
              "dataset": {"name": "pcfl_sine", "num_clients": 96, "samples_per_client": 100},
              "partition": {"name": "by_group", "num_clients": 96},
              "model": {"name": "mlp", "hidden": [32, 32, 32]},
              "participation": {"join_ratio": 0.1},
              "train": {"optimizer": "sgd", "lr": 0.1, "batch_size": 75, "local_epochs": 15},
              "trainer": {"alpha": 0.5, "beta": 0.5, "clusters": 2},
              "aggregator": {"flow_lr": 0.01, "flow_hidden": 32}},
)
