"""Fed-MTL (Smith, Chiang, Sanjabi, Talwalkar: "Federated Multi-Task Learning", NeurIPS 2017), in the primal form
the deep-learning papers run: every client has a personal network w_i; W = [w_1 .. w_m] is coupled by
R(W, Omega) = lam tr(W Omega W^T) + lam_fro ||W||_F^2 (an example the paper gives for R in its Eq. 1), each
selected client minimises f_i(w_i) + R with the other columns fixed (client.py), and the server learns Omega by the
paper's closed form Sigma = (W^T W)^{1/2} / tr((W^T W)^{1/2}), Omega = Sigma^{-1} (server.py, equations.py).
MOCHA's dual (SDCA) solver is not implemented: it needs convex losses.
"""
from pflkit.core import Algorithm

from .client import FedMTLTrainer
from .equations import (auto_lambda, client_regulariser, gram, neighbour_sums, omega_code, omega_initial,
                        omega_mean, sigma_and_omega, trace_regulariser)
from .server import FedMTLServer

ALGORITHM = Algorithm(
    trainer="fedmtl", aggregator="fedmtl",
    description="Fed-MTL: personal models coupled by the task-relationship regulariser lam tr(W Omega W^T) + "
                "lam_fro ||W||_F^2; each client trains on its loss plus its share of it, the server learns Omega "
                "in closed form, Sigma = (W^T W)^(1/2) / tr(.), Omega = Sigma^-1 (Smith et al., NeurIPS 2017). "
                "Defaults: lam = lam_fro = 10^-(floor(log10 d) + 2) (the reference code's weight), Omega learned "
                "after every round; model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, "
                "1 local epoch).",
    paper="Smith, Chiang, Sanjabi, Talwalkar: Federated Multi-Task Learning, NeurIPS 2017",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)

__all__ = ["ALGORITHM", "FedMTLServer", "FedMTLTrainer", "auto_lambda", "client_regulariser", "gram",
           "neighbour_sums", "omega_code", "omega_initial", "omega_mean", "sigma_and_omega", "trace_regulariser"]
