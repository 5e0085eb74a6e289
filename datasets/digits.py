"""The embedded default dataset: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

It ships inside scikit-learn, so the quickstart needs no network.
"""
from __future__ import annotations

import torch

from pflkit.core.data import DatasetBundle
from pflkit.core.task import classification


def load_digits(root=None, download=True) -> DatasetBundle:
    """scikit-learn's 8x8 handwritten digits, embedded (offline)."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    x = torch.as_tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values 0..16
    x = (x - 0.3) / 0.4  # roughly zero mean, unit variance
    y = torch.as_tensor(data.target, dtype=torch.long)
    return DatasetBundle(x=x, y=y, task=classification(10), input_shape=(1, 8, 8),
                         class_names=[str(i) for i in range(10)], meta={"source": "sklearn.datasets.load_digits"})


load_digits.params = {}
