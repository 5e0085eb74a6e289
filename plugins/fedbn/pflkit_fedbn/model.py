"""The digit-classification CNN of the FedBN paper (Li et al., ICLR 2021, appendix model table), with BatchNorm
after every convolution and every hidden fully connected layer:

    conv5x5(64)-BN-ReLU-maxpool2, conv5x5(64)-BN-ReLU-maxpool2, conv5x5(128)-BN-ReLU,
    FC(2048)-BN-ReLU, FC(512)-BN-ReLU | head FC(num_classes)

Convolutions use padding 2 (as in the paper), so the 8x8 embedded digits shrink only through the two poolings.
Widths are configurable so that tests can use a tiny copy.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pflkit.core import Param, SplitModel, flat_size


class BatchNorm1dAnyBatch(nn.BatchNorm1d):
    """BatchNorm1d that also accepts a training batch of one sample.

    A batch of one has no batch variance, and plain BatchNorm1d raises; client data sizes are arbitrary, so the
    last mini-batch of an epoch can hold a single sample. That batch is normalised with the running statistics
    (as in evaluation) and leaves them unchanged; the affine parameters still train.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] == 1:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                            training=False, eps=self.eps)
        return super().forward(x)


def _widths(v) -> str | None:
    return None if len(v) >= 1 and all(isinstance(c, int) and c > 0 for c in v) else "needs one or more positive integers"


def fedbn_cnn(input_shape: Sequence[int], num_classes: int, channels: list = None, hidden: list = None
              ) -> SplitModel:
    """FedBN's digit CNN (BN after every conv and hidden FC layer); features end after the last hidden FC.

    ``channels``: one conv5x5-BN-ReLU per entry, max-pooling after the first two; ``hidden``: one FC-BN-ReLU per
    entry.
    """
    channels = [64, 64, 128] if channels is None else list(channels)
    hidden = [2048, 512] if hidden is None else list(hidden)
    layers: list = []
    cin = input_shape[0]
    for i, c in enumerate(channels):
        layers += [nn.Conv2d(cin, c, 5, padding=2), nn.BatchNorm2d(c), nn.ReLU()]
        if i < 2:
            layers.append(nn.MaxPool2d(2))
        cin = c
    conv = nn.Sequential(*layers, nn.Flatten())
    width = flat_size(conv.eval(), input_shape)
    conv.train()
    fc: list = []
    for h in hidden:
        fc += [nn.Linear(width, h), BatchNorm1dAnyBatch(h), nn.ReLU()]
        width = h
    return SplitModel(nn.Sequential(*conv, *fc), nn.Linear(width, num_classes), width)


fedbn_cnn.params = {
    "channels": Param([64, 64, 128], "conv layer widths (FedBN paper: 64, 64, 128)", type=list, check=_widths),
    "hidden": Param([2048, 512], "hidden FC layer widths (FedBN paper: 2048, 512)", type=list, check=_widths),
}
