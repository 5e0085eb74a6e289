"""The embedded default dataset: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

It ships inside scikit-learn, so the quickstart needs no network.
"""
from __future__ import annotations

import torch

from pflkit.core.data.data import DatasetBundle
from pflkit.core.api.params import Param
from pflkit.core.api.task import classification

# Pixel values are 0..16; /16 gives [0, 1] (mean 0.31, std 0.38 over the whole set), then (x - 0.3) / 0.4 gives
# roughly zero mean and unit variance.
NORMALIZATIONS = {
    "standard": "(x / 16 - 0.3) / 0.4: roughly zero mean, unit variance (the default)",
    "unit": "x / 16: the raw [0, 1] scale (as other libraries load these digits)",
}


def load_digits(root=None, download=False, normalize: str = "standard") -> DatasetBundle:
    """scikit-learn's 8x8 handwritten digits, embedded (offline); inputs standardised by default (normalize)."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    x = torch.as_tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values 0..16
    if normalize == "standard":
        x = (x - 0.3) / 0.4
    y = torch.as_tensor(data.target, dtype=torch.long)
    return DatasetBundle(x=x, y=y, task=classification(10), input_shape=(1, 8, 8),
                         class_names=[str(i) for i in range(10)],
                         meta={"source": "sklearn.datasets.load_digits", "normalize": normalize})


load_digits.params = {
    "normalize": Param("standard", "input scaling: " + "; ".join(f"{k} = {v}" for k, v in NORMALIZATIONS.items()),
                       choices=tuple(NORMALIZATIONS)),
}
