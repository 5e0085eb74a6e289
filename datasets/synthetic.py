"""Generated federated tasks, fully determined by their ``seed`` param; ``groups`` = the generating client, so
the ``by_group`` partitioner reproduces the papers' clients exactly."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from pflkit.core.data.data import DatasetBundle
from pflkit.core.api.params import Param, non_negative, positive
from pflkit.core.api.task import classification, regression


def load_pcfl_sine(root: Optional[str] = None, download: bool = False, num_clients: int = 96,
                   samples_per_client: int = 100, noise_std: float = 0.1, num_intervals: int = 4,
                   intervals_per_client: int = 2, seed: int = 0) -> DatasetBundle:
    """PCFL's synthetic regression benchmark (paper section 5.1), a regression task scored by MSE.

    [0, 2*pi] is cut into 4 equal intervals; each client picks 2 different intervals at random and draws x
    uniformly from their union (half of its samples from each). The first half of the clients (48 of 96) label
    y = sin(x) + eps, the others y = -sin(x) + eps, eps ~ N(0, noise_std^2) -- the paper writes N(0, 0.1); we read
    0.1 as the standard deviation. The paper's data point is z = (x, 0, y) (the zero pads the flow's input);
    as a regression dataset the input is x (shape (1,)) and the target y (shape (1,)).
    The paper does not state the per-client sample count; ``samples_per_client`` sets it.
    Which clients use -sin is shuffled by the seed; ``meta['sign']`` records it, ``meta['intervals']`` each
    client's intervals.
    """
    rng = np.random.default_rng(seed)
    # choose intervals_per_client distinct intervals per client: argsort of uniform noise = random permutation rows
    intervals = np.sort(np.argsort(rng.random((num_clients, num_intervals)), axis=1)[:, :intervals_per_client], axis=1)
    sign = np.ones(num_clients)
    sign[rng.permutation(num_clients)[: num_clients // 2]] = -1.0
    width = 2 * math.pi / num_intervals
    # sample j of a client comes from its (j mod k)-th interval, so each chosen interval gets an equal share
    slot = np.arange(samples_per_client) % intervals_per_client
    chosen = intervals[:, slot]  # (clients, samples)
    x = (chosen + rng.random((num_clients, samples_per_client))) * width
    y = sign[:, None] * np.sin(x) + rng.normal(0.0, noise_std, size=x.shape)
    groups = np.repeat(np.arange(num_clients), samples_per_client)
    return DatasetBundle(
        x=torch.tensor(x.reshape(-1, 1), dtype=torch.float32), y=torch.tensor(y.reshape(-1, 1), dtype=torch.float32),
        task=regression(1), input_shape=(1,), groups=torch.from_numpy(groups),
        group_names=[f"client{k}" for k in range(num_clients)],
        meta={"sign": sign.astype(int).tolist(), "intervals": intervals.tolist(), "interval_width": width})


load_pcfl_sine.params = {
    "num_clients": Param(96, "number of generating clients (paper: 96)", check=positive),
    "samples_per_client": Param(100, "samples drawn per client (not given in the paper)", check=positive),
    "noise_std": Param(0.1, "standard deviation of the label noise eps", check=non_negative),
    "num_intervals": Param(4, "equal intervals [0, 2*pi] is cut into (paper: 4)", check=positive),
    "intervals_per_client": Param(2, "distinct intervals each client samples from (paper: 2)", check=positive),
    "seed": Param(0, "generation seed"),
}


def load_fedprox_synthetic(root: Optional[str] = None, download: bool = False, alpha: float = 1.0, beta: float = 1.0,
                           num_devices: int = 30, dimension: int = 60, num_classes: int = 10, iid: bool = False,
                           size_mean: float = 4.0, size_sigma: float = 2.0, min_samples: int = 50,
                           max_samples: Optional[int] = None, seed: int = 0) -> DatasetBundle:
    """Synthetic(alpha, beta) of FedProx (Li et al. 2020, section 5.1 / its generate_niid.py).

    Device k: y = argmax(softmax(W_k x + b_k)), W_k ~ N(u_k, 1), b_k ~ N(u_k, 1), u_k ~ N(0, alpha);
    x ~ N(v_k, Sigma), v_k ~ N(B_k, 1) elementwise, B_k ~ N(0, beta), Sigma diagonal with Sigma_jj = j^-1.2.
    alpha and beta are used as standard deviations, as in the reference generator. Device sizes follow a power
    law: floor(lognormal(size_mean, size_sigma)) + min_samples (capped at ``max_samples`` when set).
    ``iid=true`` gives the reference's Synthetic-IID (one W, b ~ N(0, 1) for all devices, v_k = 0).
    """
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(size_mean, size_sigma, num_devices).astype(np.int64) + min_samples
    if max_samples is not None:
        sizes = np.minimum(sizes, max_samples)
    diag = np.arange(1, dimension + 1, dtype=np.float64) ** -1.2
    if iid:
        w_shared = rng.normal(0, 1, (dimension, num_classes))
        b_shared = rng.normal(0, 1, num_classes)
        mean_x = np.zeros((num_devices, dimension))
    else:
        u = rng.normal(0, alpha, num_devices)
        big_b = rng.normal(0, beta, num_devices)
        mean_x = rng.normal(big_b[:, None], 1.0, (num_devices, dimension))
    xs, ys = [], []
    for k in range(num_devices):  # one vectorised draw per device
        if iid:
            w, b = w_shared, b_shared
        else:
            w = rng.normal(u[k], 1.0, (dimension, num_classes))
            b = rng.normal(u[k], 1.0, num_classes)
        x = mean_x[k] + rng.standard_normal((sizes[k], dimension)) * np.sqrt(diag)
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))  # argmax of softmax = argmax of the logits
    groups = np.repeat(np.arange(num_devices), sizes)
    return DatasetBundle(
        x=torch.tensor(np.concatenate(xs), dtype=torch.float32), y=torch.tensor(np.concatenate(ys), dtype=torch.long),
        task=classification(num_classes), input_shape=(dimension,), groups=torch.from_numpy(groups),
        group_names=[f"device{k}" for k in range(num_devices)], class_names=[str(c) for c in range(num_classes)],
        meta={"device_sizes": sizes.tolist(), "alpha": alpha, "beta": beta, "iid": iid})


load_fedprox_synthetic.params = {
    "alpha": Param(1.0, "spread of the devices' models: u_k ~ N(0, alpha)", check=non_negative),
    "beta": Param(1.0, "spread of the devices' input means: B_k ~ N(0, beta)", check=non_negative),
    "num_devices": Param(30, "number of devices (FedProx: 30)", check=positive),
    "dimension": Param(60, "input dimension (FedProx: 60)", check=positive),
    "num_classes": Param(10, "number of classes (FedProx: 10)", check=positive),
    "iid": Param(False, "Synthetic-IID: shared W, b and v_k = 0"),
    "size_mean": Param(4.0, "mean of the log-normal device sizes"),
    "size_sigma": Param(2.0, "sigma of the log-normal device sizes", check=non_negative),
    "min_samples": Param(50, "added to every device's size", check=non_negative),
    "max_samples": Param(None, "cap on a device's size (the log-normal tail is heavy)", type=int, check=positive),
    "seed": Param(0, "generation seed"),
}
