"""FedProto's mathematics as small pure functions.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang: "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI 2022. Client i embeds a sample with its feature extractor ``f_i(phi_i; x)`` (pflkit: ``model.features``);
``D_{i,j}`` are its training samples of class j and ``N_j`` the clients that hold class j.

    local_prototypes      local prototype of class j: C_i^(j) = 1/|D_{i,j}| sum_{(x,y) in D_{i,j}} f_i(phi_i; x)
    aggregate_prototypes  global prototype of class j over the clients in N_j, weighted by |D_{i,j}| (the paper's
                          aggregation) or uniformly (the authors' code, ``proto_aggregation``)
    prototype_loss        the regulariser L_R: distance between each embedding f_i(x) and the global prototype
                          C-bar^(y) of its label; the local objective is CE + lambda * L_R
    prototype_scores      inference by the nearest global prototype: score_j = -d(f_i(x), C-bar^(j))

Prototypes are held densely as a (num_classes, d) tensor plus a boolean ``present`` vector saying which rows are
defined. Equation numbers are not cited: this implementation was written without a copy of the paper at hand (see
the plugin README, "Provenance"); where the authors' published code fixes a detail, the docstring says so.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

WEIGHTINGS = ("samples", "uniform")
DISTANCES = ("mean", "sum")


def local_prototypes(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Class means of ``embeddings`` (n, d): returns prototypes (num_classes, d) and counts |D_{i,j}| (long).

    Rows of classes without samples are zero; their count is 0.
    """
    labels = labels.reshape(-1).long()
    d = embeddings.shape[1]
    sums = torch.zeros(num_classes, d, dtype=embeddings.dtype, device=embeddings.device)
    sums.index_add_(0, labels, embeddings)
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes]
    protos = sums / counts.clamp_min(1).to(embeddings.dtype).unsqueeze(1)
    return protos, counts


def aggregate_prototypes(prototypes: Sequence[torch.Tensor], counts: Sequence[torch.Tensor],
                         weighting: str = "samples") -> Tuple[torch.Tensor, torch.Tensor]:
    """Global prototypes from the clients' local ones (both dense, in sorted client order).

    weighting='samples' (the paper): C-bar^(j) = sum_{i in N_j} |D_{i,j}| C_i^(j) / sum_{i in N_j} |D_{i,j}|.
    weighting='uniform' (the authors' code): the plain mean of C_i^(j) over the clients i in N_j.
    Returns (num_classes, d) prototypes and the boolean vector of classes some client holds (N_j non-empty).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown prototype weighting {weighting!r} (choose from {', '.join(WEIGHTINGS)})")
    if not prototypes:
        raise ValueError("aggregate_prototypes of no clients")
    stacked = torch.stack([p.to(torch.float64) for p in prototypes])  # (K, C, d); float64: order-stable sums
    n = torch.stack([c.to(torch.float64) for c in counts])  # (K, C)
    w = n if weighting == "samples" else (n > 0).to(torch.float64)
    total = w.sum(dim=0)  # (C,)
    present = total > 0
    out = (w.unsqueeze(2) * stacked).sum(dim=0) / total.clamp_min(1.0).unsqueeze(1)
    return out.to(prototypes[0].dtype), present


def prototype_loss(embeddings: torch.Tensor, labels: torch.Tensor, global_prototypes: torch.Tensor,
                   present: torch.Tensor, distance: str = "mean") -> torch.Tensor:
    """L_R on a batch: mean over the batch of the squared L2 distance ||f(x_b) - C-bar^(y_b)||^2.

    distance='mean' divides each squared distance by the embedding size d -- the authors' code computes it with
    ``nn.MSELoss`` and tuned lambda (1 on MNIST/FEMNIST) with that normalisation; 'sum' keeps the plain squared
    norm. A sample whose class has no global prototype contributes 0 but still counts in the batch mean (as in the
    authors' code, where such a sample is compared with itself).
    """
    if distance not in DISTANCES:
        raise ValueError(f"unknown prototype distance {distance!r} (choose from {', '.join(DISTANCES)})")
    labels = labels.reshape(-1).long()
    has = present[labels]
    target = global_prototypes[labels]
    sq = ((embeddings - target) ** 2).sum(dim=1) * has.to(embeddings.dtype)
    if distance == "mean":
        sq = sq / embeddings.shape[1]
    return sq.mean()


def prototype_scores(embeddings: torch.Tensor, global_prototypes: torch.Tensor, present: torch.Tensor,
                     distance: str = "mean") -> torch.Tensor:
    """Nearest-prototype inference as class scores: ``-d(f(x), C-bar^(j))`` (argmax = nearest prototype).

    Classes without a global prototype cannot be predicted: they get a score 1 below the sample's lowest defined
    score, which keeps them out of the argmax while leaving the cross-entropy of the scores finite.
    """
    protos = global_prototypes.to(embeddings.dtype)
    # exact pairwise distances (no ||a||^2 + ||b||^2 - 2ab shortcut, which cancels badly for near points)
    sq = torch.cdist(embeddings, protos, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    if distance == "mean":
        sq = sq / embeddings.shape[1]
    scores = -sq
    if bool(present.all()):
        return scores
    floor = scores.masked_fill(~present.unsqueeze(0), float("inf")).min(dim=1, keepdim=True).values - 1.0
    return torch.where(present.unsqueeze(0), scores, floor)


def dense_prototypes(classes: torch.Tensor, rows: torch.Tensor, num_classes: int,
                     counts: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The wire format (the defined rows and their class ids) back to dense (num_classes, d) + per-class counts.

    Returns (prototypes, counts) where counts is ``counts`` scattered to all classes (ones for the given classes
    when ``counts`` is None; 0 = row undefined).
    """
    classes = classes.reshape(-1).long()
    if classes.numel() and (int(classes.min()) < 0 or int(classes.max()) >= num_classes):
        raise ValueError(f"prototype class ids must lie in 0..{num_classes - 1}, got {classes.tolist()}")
    if len(set(classes.tolist())) != classes.numel():
        raise ValueError(f"prototype class ids repeat: {classes.tolist()}")
    if rows.ndim != 2 or rows.shape[0] != classes.numel():
        raise ValueError(f"{rows.shape[0] if rows.ndim else 0} prototype rows for {classes.numel()} class ids")
    dense = torch.zeros(num_classes, rows.shape[1], dtype=rows.dtype, device=rows.device)
    dense[classes.to(rows.device)] = rows
    full = torch.zeros(num_classes, dtype=torch.long, device=rows.device)
    vals = torch.ones_like(classes) if counts is None else counts.reshape(-1).long()
    full[classes.to(rows.device)] = vals.to(rows.device)
    return dense, full
