"""Digit-5: a feature-shift benchmark of five digit domains (MNIST, SVHN, USPS, SynthDigits, MNIST-M), one domain
per client (FedC2I, Zhou et al. 2020's setting).

Every domain is read from its own real format under ``dataset.root`` (train and test pooled):

- mnist:        ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``   (torchvision layout)
- svhn:         ``train_32x32.mat``, ``test_32x32.mat``                          (torchvision layout)
- usps:         ``usps.bz2``, ``usps.t.bz2`` (libsvm text, pixels in [-1, 1])     (torchvision layout)
- synth_digits: ``synth_train_32x32.mat``, ``synth_test_32x32.mat`` (Ganin & Lempitsky's SynNumbers, SVHN .mat format)
- mnist_m:      ``mnist_m/mnist_m_{train,test}/*.png`` with ``mnist_m/mnist_m_{train,test}_labels.txt``
                (lines "00000000.png 5", the original MNIST-M release)

Any domain may instead be given as an image folder ``<root>/<domain>/<class 0..9>/<images>``. All images are
resized to ``image_size`` (32 by default; FedC2I's LeNet Table 7 with its FC(64*13*13) layer implies 64) and
converted to ``channels`` (3 = RGB, grey replicated). The domain of every sample is its group, so the
``by_group`` partitioner gives one domain per client.
"""
from __future__ import annotations

import bz2
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from pflkit.core.data.data import DatasetBundle, root_words
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param, positive
from pflkit.core.api.task import classification

from ._common import (NormalizeUint8, channel_stats, data_root, ensure_files, list_images, load_images, missing,
                      read_idx, resize_uint8, to_channels)
from .vision import _MNIST_FILES, read_svhn_mat

DOMAINS = ("mnist", "svhn", "usps", "synth_digits", "mnist_m")

Arrays = Tuple[torch.Tensor, torch.Tensor]  # uint8 NCHW at native size, int64 labels


def _files(domain: str, base: Path) -> List[Path]:
    if domain == "mnist":
        return [base / "MNIST" / "raw" / f for f in _MNIST_FILES]
    if domain == "svhn":
        return [base / "train_32x32.mat", base / "test_32x32.mat"]
    if domain == "usps":
        return [base / "usps.bz2", base / "usps.t.bz2"]
    if domain == "synth_digits":
        return [base / "synth_train_32x32.mat", base / "synth_test_32x32.mat"]
    if domain == "mnist_m":
        m = base / "mnist_m"
        return [m / "mnist_m_train", m / "mnist_m_train_labels.txt", m / "mnist_m_test", m / "mnist_m_test_labels.txt"]
    raise DataError(f"unknown Digit-5 domain '{domain}'; domains are {', '.join(DOMAINS)}")


def _folder_layout(domain: str, base: Path) -> Optional[Path]:
    d = base / domain
    if d.is_dir() and any((d / str(c)).is_dir() for c in range(10)):
        return d
    return None


def _read_mnist(base: Path) -> Arrays:
    folder = base / "MNIST" / "raw"
    x_tr, y_tr, x_te, y_te = (read_idx(folder / f) for f in _MNIST_FILES)
    x = torch.from_numpy(np.concatenate([x_tr, x_te]).astype(np.uint8)).unsqueeze(1)
    return x, torch.from_numpy(np.concatenate([y_tr, y_te]).astype(np.int64))


def _read_svhn_like(paths: List[Path]) -> Arrays:
    parts = [read_svhn_mat(p) for p in paths]
    return (torch.from_numpy(np.concatenate([p[0] for p in parts])),
            torch.from_numpy(np.concatenate([p[1] for p in parts])))


def read_usps(path: Path) -> Arrays:
    """USPS in libsvm format (bz2): "label idx:value ..." with labels 1..10 and 256 pixels in [-1, 1]."""
    xs, ys = [], []
    try:
        with bz2.open(path, "rt") as fh:
            for line in fh:
                # "label i1:v1 i2:v2 ..." -> [label, i1, v1, i2, v2, ...] parsed in one call per line
                vals = np.array(line.replace(":", " ").split(), dtype=np.float64)
                if vals.size == 0:
                    continue
                row = np.zeros(256, dtype=np.float64)
                row[vals[1::2].astype(np.int64) - 1] = vals[2::2]
                xs.append(row)
                ys.append(int(vals[0]) - 1)
    except (OSError, ValueError, EOFError, IndexError) as exc:
        raise DataError(f"cannot read USPS file {path}: {exc}") from exc
    if not xs:
        raise DataError(f"USPS file {path} holds no samples")
    x = np.round((np.stack(xs) + 1.0) * 127.5).clip(0, 255).astype(np.uint8).reshape(-1, 1, 16, 16)
    return torch.from_numpy(x), torch.tensor(ys, dtype=torch.long)


def _read_mnist_m(base: Path, size: Tuple[int, int]) -> Arrays:
    xs, ys = [], []
    for split in ("train", "test"):
        folder = base / "mnist_m" / f"mnist_m_{split}"
        names, labels = [], []
        for line in (base / "mnist_m" / f"mnist_m_{split}_labels.txt").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2:
                names.append(folder / fields[0])
                labels.append(int(fields[1]))
        absent = missing(names)
        if absent:
            raise DataError(f"MNIST-M labels list {len(absent)} images that do not exist, e.g. {absent[0]}")
        xs.append(load_images(names, size, 3))
        ys.append(torch.tensor(labels, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


def _read_folder(folder: Path, size: Tuple[int, int], channels: int) -> Arrays:
    paths, labels = [], []
    for c in range(10):
        if (folder / str(c)).is_dir():
            imgs = list_images(folder / str(c))
            paths += imgs
            labels += [c] * len(imgs)
    return load_images(paths, size, channels), torch.tensor(labels, dtype=torch.long)


def _fetcher(domain: str) -> Optional[Callable[[Path], None]]:
    """torchvision download into its own layout (imported lazily: torchvision's import is slow)."""
    classes = {"mnist": ("MNIST", "train"), "svhn": ("SVHN", "split"), "usps": ("USPS", "train")}
    if domain not in classes:
        return None  # SynthDigits and MNIST-M have no official download URL
    cls_name, kind = classes[domain]

    def fetch(root: Path) -> None:
        import torchvision.datasets as tvd
        cls = getattr(tvd, cls_name)
        for arg in ((True, False) if kind == "train" else ("train", "test")):
            cls(str(root), **{kind: arg}, download=True)
    return fetch


def _read_domain(domain: str, base: Path, size: Tuple[int, int], channels: int) -> Arrays:
    files = _files(domain, base)
    if missing(files):
        folder = _folder_layout(domain, base)
        if folder is None:
            raise AssertionError("caller checks presence first")
        return _read_folder(folder, size, channels)
    if domain == "mnist":
        return _read_mnist(base)
    if domain in ("svhn", "synth_digits"):
        return _read_svhn_like(files)
    if domain == "usps":
        xa, ya = read_usps(files[0])
        xb, yb = read_usps(files[1])
        return torch.cat([xa, xb]), torch.cat([ya, yb])
    return _read_mnist_m(base, size)


def _stratified_cap(y: torch.Tensor, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of at most ``cap`` samples, class proportions preserved (largest remainder)."""
    labels = y.numpy()
    if len(labels) <= cap:
        return np.arange(len(labels))
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * cap / len(labels)
    take = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - take))[: cap - take.sum()]:
        take[i] += 1
    idx = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    return np.sort(np.concatenate(idx))


def load_digit5(root: Optional[str] = None, download: bool = False, domains: Optional[list] = None,
                image_size: int = 32, channels: int = 3, max_per_domain: Optional[int] = None,
                seed: int = 0) -> DatasetBundle:
    """The Digit-5 domains found under ``root`` (or exactly ``domains``), one group per domain, 10 classes."""
    base = data_root(root)
    size = (image_size, image_size)
    present = [d for d in DOMAINS if not missing(_files(d, base)) or _folder_layout(d, base) is not None]
    if domains is None:
        chosen = present
        if not chosen:
            listing = "; ".join(f"{d}: " + ", ".join(str(p.relative_to(base)) for p in _files(d, base))
                                for d in DOMAINS)
            raise DataError(f"dataset 'digit5': no domain found in {root_words(root)}; place at least one domain's "
                            f"files there ({listing}), or image folders <domain>/<0..9>/<images>")
    else:
        unknown = [d for d in domains if d not in DOMAINS]
        if unknown:
            raise DataError(f"dataset.domains: unknown domain(s) {unknown}; choose from {', '.join(DOMAINS)}")
        chosen = list(domains)
        for d in chosen:
            if d not in present:
                ensure_files(f"digit5/{d}", root, _files(d, base), download, _fetcher(d),
                             hint=f"(or give the domain as image folders {base / d}/<0..9>/<images>)")
    rng = np.random.default_rng(seed)
    xs, ys, gs = [], [], []
    sizes: Dict[str, int] = {}
    for g, d in enumerate(chosen):
        x, y = _read_domain(d, base, size, channels)
        if len(y) and (int(y.min()) < 0 or int(y.max()) > 9):
            raise DataError(f"digit5 domain '{d}': labels must be digits 0..9, found {int(y.min())}..{int(y.max())}")
        if max_per_domain is not None:
            keep = torch.from_numpy(_stratified_cap(y, max_per_domain, rng))
            x, y = x[keep], y[keep]
        x = to_channels(resize_uint8(x, size), channels)
        xs.append(x)
        ys.append(y)
        gs.append(torch.full((len(y),), g, dtype=torch.long))
        sizes[d] = len(y)
    x = torch.cat(xs)
    mean, std = channel_stats(x)
    return DatasetBundle(x=x, y=torch.cat(ys), task=classification(10), input_shape=tuple(x.shape[1:]),
                         groups=torch.cat(gs), group_names=list(chosen), transform=NormalizeUint8(mean, std),
                         class_names=[str(i) for i in range(10)], meta={"domain_sizes": sizes, "root": str(base)})


load_digit5.params = {
    "domains": Param(None, f"domains to use, in client order (default: every one present): {', '.join(DOMAINS)}",
                     type=list),
    "image_size": Param(32, "images are resized to image_size x image_size", check=positive),
    "channels": Param(3, "3 (RGB; grey domains replicated) or 1 (grey)", choices=(1, 3)),
    "max_per_domain": Param(None, "keep a stratified random subset of at most this many samples per domain",
                            type=int, check=positive),
    "seed": Param(0, "seed of the max_per_domain subsampling"),
}
