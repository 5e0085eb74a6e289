"""fastText-style text classifier (Joulin et al. 2017), as FedCP/PFLlib use it on AG News."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pflkit.core.api.params import Param, non_negative, positive

from .base import PROJECTION_PARAM, SplitModel, split_model


class BagOfEmbeddings(nn.Module):
    """Mean of the token embeddings of each row of a LongTensor of token ids; id 0 is padding and is ignored."""

    def __init__(self, vocab_size: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean", padding_idx=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens.long())


def fasttext(input_shape: Sequence[int], num_classes: int, vocab_size: int = 98635, embed_dim: int = 32,
             hidden: int = 32, projection_dim: int = 0) -> SplitModel:
    """features = EmbeddingBag(mean over non-padding tokens) [+ Linear(embed_dim, hidden), as PFLlib's fc1, no
    activation]; head = Linear(., num_classes). Inputs: (batch, seq_len) token ids, padded with 0.
    ``hidden=0`` drops the hidden layer (plain fastText: the bag of embeddings feeds the head).
    PFLlib averages over padding positions too; we exclude them (EmbeddingBag with padding_idx)."""
    bag = BagOfEmbeddings(vocab_size, embed_dim)
    if hidden > 0:
        features: nn.Module = nn.Sequential(bag, nn.Linear(embed_dim, hidden))
        dim = hidden
    else:
        features, dim = nn.Sequential(bag), embed_dim
    return split_model(features, dim, num_classes, projection_dim)


fasttext.params = {
    "vocab_size": Param(98635, "vocabulary size incl. padding id 0 (PFLlib's AG News: 98635)", check=positive),
    "embed_dim": Param(32, "embedding dimension", check=positive),
    "hidden": Param(32, "width of the linear layer after the bag (0 = none)", check=non_negative),
    "projection_dim": PROJECTION_PARAM,
}
