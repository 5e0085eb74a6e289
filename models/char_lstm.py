"""Character-level LSTM for next-character prediction: the Shakespeare model of the FedAvg paper (McMahan et al.,
AISTATS 2017, Sec. 3: "a two-layer LSTM with 256 nodes ... an 8-dimensional embedding") and of LEAF."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pflkit.core.api.params import Param, positive

from .base import PROJECTION_PARAM, split_model


class LastHiddenLSTM(nn.Module):
    """Embedding -> stacked LSTM over the sequence -> the top layer's output at the last position."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(chars.long()))
        return out[:, -1]


def char_lstm(input_shape: Sequence[int], num_classes: int, embed_dim: int = 8, hidden: int = 256,
              layers: int = 2, projection_dim: int = 0):
    """features = Embedding(num_classes, embed_dim) + LSTM(hidden, layers) at the last position; head =
    Linear(hidden, num_classes). Inputs: (batch, seq_len) character indices; the alphabet is the class set."""
    if len(input_shape) != 1:
        raise ValueError(f"char_lstm takes sequences of character indices, shape (seq_len,), not {tuple(input_shape)}")
    return split_model(LastHiddenLSTM(num_classes, embed_dim, hidden, layers), hidden, num_classes, projection_dim)


char_lstm.params = {
    "embed_dim": Param(8, "character embedding width (FedAvg paper, LEAF: 8)", check=positive),
    "hidden": Param(256, "LSTM units per layer (FedAvg paper, LEAF: 256)", check=positive),
    "layers": Param(2, "stacked LSTM layers (FedAvg paper, LEAF: 2)", check=positive),
    "projection_dim": PROJECTION_PARAM,
}
