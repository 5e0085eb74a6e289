"""MOON's model-contrastive loss as a small pure function.

Li, He, Song: "Model-Contrastive Federated Learning", CVPR 2021, Section 3 (local learning). For a sample x, with
z = R_w(x) the representation of the model being trained, z_glob = R_{w^t}(x) that of the received global model
and z_prev = R_{w_i^{t-1}}(x) that of the client's previous local model (both frozen):

    l_con = -log[ exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) ]

with sim the cosine similarity; the local objective is l_sup + mu * l_con (l_sup: cross-entropy). Equation numbers
are not cited: this was written without a copy of the paper at hand. The authors' code
(github.com/QinbinLi/MOON, ``train_net_fedcon``) computes l_con as the cross-entropy of the logits
[sim(z, z_glob), sim(z, z_prev)] / tau with label 0 and averages it over the batch; so does this function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Batch mean of l_con; representations are flattened per sample, ``z_glob`` and ``z_prev`` get no gradient."""
    z = z.reshape(z.shape[0], -1)
    positive = F.cosine_similarity(z, z_glob.detach().reshape(z.shape[0], -1), dim=1)
    negative = F.cosine_similarity(z, z_prev.detach().reshape(z.shape[0], -1), dim=1)
    logits = torch.stack([positive, negative], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))
