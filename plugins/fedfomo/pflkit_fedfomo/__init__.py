"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez: "Personalized Federated Learning with First Order Model
Optimization", ICLR 2021).

No global model: the server stores every client's latest model and an affinity matrix P. Each round it sends each
selected client M stored models, chosen epsilon-greedily over the client's row of P (server.py). The client weighs
each candidate theta_n by its validation-loss improvement per unit distance from its own model,
w_n = max(0, (L_val(theta_i^{t-1}) - L_val(theta_n)) / ||theta_n - theta_i^{t-1}||), moves to the w-weighted
combination of the improving candidates (keeps its model when none improves), trains locally on the rest of its
training split, and uploads its model and w; the server adds w_n to P[i, n] (equations.py).
"""
from pflkit.core import Algorithm

from .client import FedFomoTrainer, validation_split
from .equations import (choose_candidates, epsilon_at, fomo_update, fomo_weights, normalised, state_distance,
                        update_affinity)
from .server import FedFomoServer

ALGORITHM = Algorithm(
    trainer="fedfomo", aggregator="fedfomo",
    description="FedFomo: each client downloads M other clients' models (epsilon-greedy over an affinity matrix), "
                "moves toward those that lower its validation loss, weighted by the loss improvement per unit "
                "parameter distance, then trains locally (Zhang et al., ICLR 2021). Defaults: M 5, epsilon 0.3 "
                "decaying by 0.05 per round, 20% of each client's training split held out for validation; model and "
                "local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 local epoch).",
    paper="Zhang, Sapra, Fidler, Yeung, Alvarez: Personalized Federated Learning with First Order Model "
          "Optimization, ICLR 2021",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)

__all__ = ["ALGORITHM", "FedFomoServer", "FedFomoTrainer", "choose_candidates", "epsilon_at", "fomo_update",
           "fomo_weights", "normalised", "state_distance", "update_affinity", "validation_split"]
