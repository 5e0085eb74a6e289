"""A model's layers in order, as groups of state keys: what "the top n layers" of LG-FedAvg counts."""
from __future__ import annotations

from typing import List

from torch import nn

# normalisation layers belong to the layer they normalise (the one before them), as in the authors' weight_keys,
# which list only convolutions and linear layers
NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def model_layers(model: nn.Module) -> List[List[str]]:
    """State keys grouped by layer, input side first: every module holding parameters of its own starts a layer;
    a normalisation module, or one holding only buffers, joins the layer before it. Order: registration order
    (``named_modules``), which is the forward order of the built-in sequential models (in a ResNet block the
    shortcut comes after the block's second convolution)."""
    keys = set(model.state_dict())
    layers: List[List[str]] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = [prefix + n for n, _ in module.named_parameters(recurse=False)]
        own += [prefix + n for n, _ in module.named_buffers(recurse=False)]
        own = [k for k in own if k in keys]
        if not own:
            continue
        has_params = any(True for _ in module.parameters(recurse=False))
        if layers and (isinstance(module, NORMS) or not has_params):
            layers[-1].extend(own)
        else:
            layers.append(own)
    return layers
