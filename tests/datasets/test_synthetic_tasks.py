"""PCFL's sine regression task and FedProx's Synthetic(alpha, beta): generation, determinism, the clients."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pflkit.core.engine.config import resolve
from pflkit.core.data.data import build_federated_data
from pflkit.core.testing import quick_run
from pflkit.datasets.synthetic import load_fedprox_synthetic, load_pcfl_sine


def test_pcfl_sine_matches_section_5_1():
    b = load_pcfl_sine(seed=3)
    assert b.task.kind == "regression" and b.task.metric_name == "mse"
    assert b.x.shape == (96 * 100, 1) and b.y.shape == (96 * 100, 1) and b.input_shape == (1,)
    assert b.groups.unique().numel() == 96
    sign = np.asarray(b.meta["sign"])
    assert (sign == 1).sum() == 48 and (sign == -1).sum() == 48
    x = b.x[:, 0].numpy().reshape(96, 100)
    y = b.y[:, 0].numpy().reshape(96, 100)
    assert x.min() >= 0 and x.max() <= 2 * math.pi
    interval = np.floor(x / (math.pi / 2)).astype(int)
    for k in range(96):
        chosen = b.meta["intervals"][k]
        assert len(set(chosen)) == 2 and set(np.unique(interval[k])) == set(chosen)
        assert (interval[k] == chosen[0]).sum() == 50  # an equal share from each chosen interval
    residual = y - sign[:, None] * np.sin(x)
    assert abs(residual.std() - 0.1) < 0.01 and abs(residual.mean()) < 0.01
    again = load_pcfl_sine(seed=3)
    assert torch.equal(again.x, b.x) and torch.equal(again.y, b.y)
    assert not torch.equal(load_pcfl_sine(seed=4).x, b.x)


def test_pcfl_sine_by_group_reproduces_clients():
    cfg = resolve([{"dataset": {"name": "pcfl_sine", "samples_per_client": 20},
                    "partition": {"name": "by_group", "num_clients": 96}, "model": {"name": "mlp"}}])
    fed = build_federated_data(cfg)
    assert fed.num_clients == 96
    groups = fed.bundle.groups.numpy()
    for cid, split in enumerate(fed.splits):
        idx = np.concatenate([split.train, split.test])
        assert len(idx) == 20 and set(groups[idx]) == {cid}
        assert len(split.test) == 5


def test_pcfl_sine_trains_with_mse(tmp_path):
    summary = quick_run("fedavg", tmp_path, overrides={
        "train": {"lr": 0.01},
        "dataset": {"name": "pcfl_sine", "num_clients": 4, "samples_per_client": 40},
        "partition": {"name": "by_group", "num_clients": 4}})
    assert summary["metric"] == "mse" and summary["higher_is_better"] is False
    assert np.isfinite(summary["final"]["uniform"])


def test_fedprox_synthetic():
    b = load_fedprox_synthetic(alpha=0.5, beta=0.5, num_devices=10, seed=1)
    sizes = np.asarray(b.meta["device_sizes"])
    assert b.x.shape == (sizes.sum(), 60) and b.num_classes == 10 and (sizes >= 50).all()
    assert torch.bincount(b.groups).tolist() == sizes.tolist()
    again = load_fedprox_synthetic(alpha=0.5, beta=0.5, num_devices=10, seed=1)
    assert torch.equal(again.x, b.x) and torch.equal(again.y, b.y)
    # Sigma_jj = j^-1.2 around a per-device mean: the within-device variance decays with the coordinate index
    x0 = b.x[b.groups == int(np.argmax(sizes))]
    var = x0.var(dim=0)
    assert var[0] > 3 * var[-1]
    assert var[0].item() == pytest.approx(1.0, rel=0.5)
    # heterogeneous devices: label distributions differ across devices
    hist = np.stack([np.bincount(b.y[b.groups == k].numpy(), minlength=10) / sizes[k] for k in range(10)])
    assert np.abs(hist - hist.mean(0)).max() > 0.2
    capped = load_fedprox_synthetic(num_devices=10, max_samples=60, seed=1)
    assert max(capped.meta["device_sizes"]) <= 60
    iid = load_fedprox_synthetic(num_devices=5, iid=True, seed=0)
    assert iid.x.shape[1] == 60
