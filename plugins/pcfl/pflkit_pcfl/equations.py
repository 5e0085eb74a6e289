"""PCFL's equations that are neither the flow (flow.py) nor hull geometry (hull.py): the overlaps D^{i,k} a client
holds (Eq. 10), rejection sampling in the unshared region (Eq. 12), the server's per-owner average of the overlap
term (Eq. 11 / Algorithm 2 line 13), and the paper's per-dataset manifold dimensions (appendix E.3).

Equation numbers are those of "Precision Collaboration for Federated Learning" (PCFL).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .hull import Region, in_unshared

# Appendix E.3: "d' = 256 for CIFAR10 and CelebA, d' = 12 for FEMNIST, d' = 32 for Adult and eICU"; section 5.1 and
# E.4: d' = 2 for the synthetic task (z = (x, 0, y)). Keys are pflkit dataset names (FEMNIST = emnist).
PAPER_LATENT_DIMS: Dict[str, int] = {"pcfl_sine": 2, "emnist": 12, "adult": 32, "cifar10": 256}
# Any other dataset: the smallest manifold, where exact hulls stay informative (README, "hull vs box").
FALLBACK_LATENT_DIM = 2

AVERAGES = ("all", "contributing")


def default_latent_dim(dataset: str, data_dim: int) -> int:
    """The paper's d' for ``dataset``, else ``FALLBACK_LATENT_DIM`` (never above d - 1)."""
    return max(1, min(PAPER_LATENT_DIMS.get(dataset, FALLBACK_LATENT_DIM), data_dim - 1))


def overlap_indices(region: Region, codes: np.ndarray, labels: Optional[np.ndarray] = None,
                    method: str = "lp") -> torch.Tensor:
    """Eq. 10 from client k's side: indices of k's samples whose codes u' lie in client i's ``region``.

    ``labels``: the samples' class labels (classification: a sample can only fall in a part of its own label).
    Returns a sorted int64 tensor (possibly empty): D^{i,k} as positions in k's training split.
    """
    if len(codes) == 0:
        return torch.zeros(0, dtype=torch.long)
    inside = region.contains(codes, labels, method=method)
    return torch.from_numpy(np.flatnonzero(inside).astype(np.int64))


def sample_unshared(sample_base, own: Region, others: Sequence[Region], wanted: int, max_draws: int,
                    generator: torch.Generator, label: Optional[int] = None, batch: int = 4096,
                    method: str = "lp") -> Tuple[torch.Tensor, int]:
    """Eq. 12 by rejection: draw u' ~ N(0, I_d') (the inner flow's base, ``sample_base(n, generator)``), keep the
    draws inside ``own`` and inside none of ``others`` (for ``label``'s parts when labelled), until ``wanted``
    are kept or ``max_draws`` were drawn.

    The accepted u' are distributed as the flow's density restricted to the unshared region, which is Proposition
    1's p^i_z (Eq. 13) pushed to latent space: decoding them samples the client's unshared manifold region at its
    estimated density. Returns (accepted codes (<= wanted, d'), number of draws).
    """
    kept: List[torch.Tensor] = []
    n_kept, draws = 0, 0
    while n_kept < wanted and draws < max_draws:
        m = int(min(max(batch, 4 * (wanted - n_kept)), max_draws - draws))
        u = sample_base(m, generator)
        labels = None if label is None else np.full(m, label)
        inside = in_unshared(u.detach().cpu().numpy().astype(np.float64), own, list(others), labels, method=method)
        draws += m
        if inside.any():
            acc = u[torch.from_numpy(inside).to(u.device)]
            kept.append(acc)
            n_kept += len(acc)
    if not kept:
        return sample_base(0, generator), draws
    return torch.cat(kept)[:wanted], draws


def average_overlap_terms(parts: Sequence[Mapping[str, torch.Tensor]], num_clients: int,
                          average: str = "all") -> Dict[str, torch.Tensor]:
    """Algorithm 2 line 13 / Eq. 11: combine client i's overlap-term contributions from the clients k != i.

    ``average='all'`` is Eq. 11 as printed: (1 / (N - 1)) * sum over k != i, where a client holding no sample of
    D^{i,k} contributes 0 (it sends nothing). ``'contributing'``: the mean over the clients that did contribute.
    ``parts`` must be given in sorted client order (sums over clients are taken in that order).
    """
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    if not parts:
        return {}
    denom = (num_clients - 1) if average == "all" else len(parts)
    keys = list(parts[0])
    acc = {k: parts[0][k].detach().to(torch.float64).clone() for k in keys}
    for p in parts[1:]:
        for k in keys:
            acc[k] += p[k].detach().to(torch.float64)
    return {k: (acc[k] / max(denom, 1)).to(parts[0][k].dtype) for k in keys}
