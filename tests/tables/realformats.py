"""Writers of small datasets in the real on-disk formats the paper tables' columns load (download=False).

Shared by the quick-scale reproduction tests of every installed table (tests/tables/): each writes a few hundred
samples under one root (``dataset.root`` / ``$PFLKIT_DATA``) in exactly the files the loader reads, so a table's
columns run offline, end to end, through ``fl reproduce``. Images carry a faint class-dependent pattern so a model
can learn something in one round; nothing asserts accuracy.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import pickle
import struct
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy as np

DIGIT5_DOMAINS = ("mnist", "svhn", "usps", "synth_digits", "mnist_m")
OFFICE10_DOMAINS = ("amazon", "caltech", "dslr", "webcam")
OFFICE10_CLASSES = ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor",
                    "mouse", "mug", "projector")


def _images(rng: np.random.Generator, labels: np.ndarray, shape: Sequence[int], num_classes: int) -> np.ndarray:
    """uint8 images (shape H,W or H,W,C or C,H,W with C = 3 first): noise plus a brighter band of rows whose
    position depends on the label."""
    x = rng.integers(0, 128, (len(labels), *shape)).astype(np.int32)
    channels_first = len(shape) == 3 and shape[0] == 3 and shape[-1] != 3
    rows = shape[1] if channels_first else shape[0]
    step = max(1, rows // max(1, num_classes))
    for i, lab in enumerate(labels):
        r = int(lab) * step % max(1, rows - 1)
        if channels_first:
            x[i, :, r:r + 2] += 120
        else:
            x[i, r:r + 2] += 120
    return np.clip(x, 0, 255).astype(np.uint8)


def _labels(rng: np.random.Generator, n: int, num_classes: int, offset: int = 0) -> np.ndarray:
    """Every class at least once (when n allows), the rest drawn uniformly."""
    base = np.arange(min(n, num_classes))
    rest = rng.integers(0, num_classes, max(0, n - len(base)))
    return np.concatenate([base, rest]).astype(np.int64) + offset


def write_png(path: Path, arr: np.ndarray, fmt: str = "PNG") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(arr, dtype=np.uint8)).save(path, fmt)


# -- MNIST family (IDX files, torchvision's raw/ layout) -----------------------------------------------------------
def write_idx(path: Path, arr: np.ndarray, gz: bool = False) -> None:
    arr = np.asarray(arr, dtype=np.uint8)
    payload = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)


def write_mnist_like(folder: Path, n_train: int, n_test: int, rng: np.random.Generator, prefix: str = "",
                     gz: bool = False, label_offset: int = 0, num_classes: int = 10):
    """``train-images-idx3-ubyte`` etc. in ``folder`` (``prefix`` for EMNIST's ``emnist-<split>-`` names)."""
    y_tr = _labels(rng, n_train, num_classes, label_offset)
    y_te = _labels(rng, n_test, num_classes, label_offset)
    x_tr = _images(rng, y_tr - label_offset, (28, 28), num_classes)
    x_te = _images(rng, y_te - label_offset, (28, 28), num_classes)
    test = "test" if prefix else "t10k"
    write_idx(folder / f"{prefix}train-images-idx3-ubyte", x_tr, gz)
    write_idx(folder / f"{prefix}train-labels-idx1-ubyte", y_tr, gz)
    write_idx(folder / f"{prefix}{test}-images-idx3-ubyte", x_te, gz)
    write_idx(folder / f"{prefix}{test}-labels-idx1-ubyte", y_te, gz)
    return np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])


def write_mnist(root: Path, n_train: int, n_test: int, rng: np.random.Generator):
    return write_mnist_like(Path(root) / "MNIST" / "raw", n_train, n_test, rng)


def write_emnist(root: Path, n_train: int, n_test: int, rng: np.random.Generator, split: str = "digits"):
    classes = {"digits": 10, "mnist": 10, "letters": 26, "balanced": 47, "byclass": 62, "bymerge": 47}[split]
    return write_mnist_like(Path(root) / "EMNIST" / "raw", n_train, n_test, rng, prefix=f"emnist-{split}-",
                            label_offset=1 if split == "letters" else 0, num_classes=classes)


# -- CIFAR (the python pickles of the original release) ------------------------------------------------------------
def write_cifar10(root: Path, n_per_batch: int, rng: np.random.Generator) -> None:
    """``cifar-10-batches-py/``: data_batch_1..5, test_batch, batches.meta (n_per_batch images each)."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        y = _labels(rng, n_per_batch, 10)
        x = _images(rng, y, (3, 32, 32), 10).reshape(n_per_batch, 3072)
        with open(folder / name, "wb") as fh:
            pickle.dump({b"batch_label": name.encode(), b"data": x, b"labels": y.tolist()}, fh)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": names, b"num_vis": 3072}, fh)


def write_cifar100(root: Path, n_train: int, n_test: int, rng: np.random.Generator) -> None:
    """``cifar-100-python/``: train, test, meta (fine and coarse labels)."""
    folder = Path(root) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        fine = _labels(rng, n, 100)
        x = _images(rng, fine, (3, 32, 32), 100).reshape(n, 3072)
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": x, "fine_labels": fine.tolist(), "coarse_labels": (fine // 5).tolist()}, fh)
    with open(folder / "meta", "wb") as fh:
        pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)],
                     "coarse_label_names": [f"c{i}" for i in range(20)]}, fh)


# -- Tiny-ImageNet (tiny-imagenet-200/: train/<wnid>/images, val/images + val_annotations.txt) ------------------------
def write_tiny_imagenet(root: Path, num_classes: int, train_per_class: int, val_per_class: int,
                        rng: np.random.Generator, size: int = 64) -> List[str]:
    """The release's layout with ``num_classes`` wnids (the real set has 200); JPEG files, as released."""
    base = Path(root) / "tiny-imagenet-200"
    wnids = [f"n{1443537 + 1000 * i:08d}" for i in range(num_classes)]
    for c, w in enumerate(wnids):
        imgs = _images(rng, np.full(train_per_class, c), (size, size, 3), num_classes)
        for i, img in enumerate(imgs):
            write_png(base / "train" / w / "images" / f"{w}_{i}.JPEG", img, "JPEG")
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (base / "words.txt").write_text("".join(f"{w}\tclass {i}\n" for i, w in enumerate(wnids)))
    lines, k = [], 0
    for c, w in enumerate(wnids):
        for img in _images(rng, np.full(val_per_class, c), (size, size, 3), num_classes):
            write_png(base / "val" / "images" / f"val_{k}.JPEG", img, "JPEG")
            lines.append(f"val_{k}.JPEG\t{w}\t0\t0\t{size - 1}\t{size - 1}")
            k += 1
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return wnids


# -- Digit-5 (MNIST idx, SVHN and SynthDigits .mat, USPS bz2 libsvm, MNIST-M png + labels) ----------------------------
def write_svhn_mat(path: Path, n: int, rng: np.random.Generator, labels: Optional[Iterable[int]] = None):
    """SVHN's ``.mat`` (X: 32x32x3xN, y: Nx1 with 10 for the digit 0)."""
    import scipy.io

    y = np.asarray(list(labels)) if labels is not None else _labels(rng, n, 10, offset=1)
    x = np.moveaxis(_images(rng, y % 10, (32, 32, 3), 10), 0, -1)
    path.parent.mkdir(parents=True, exist_ok=True)
    scipy.io.savemat(str(path), {"X": x, "y": y.reshape(-1, 1)})
    return x, y


def write_usps(path: Path, n: int, rng: np.random.Generator) -> np.ndarray:
    """USPS in libsvm form, bz2 (labels 1..10, 256 values in [-1, 1])."""
    labels = _labels(rng, n, 10, offset=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with bz2.open(path, "wt") as fh:
        for lab in labels:
            vals = rng.uniform(-1, 1, 256)
            fh.write(f"{lab} " + " ".join(f"{i + 1}:{v:.4f}" for i, v in enumerate(vals)) + "\n")
    return labels - 1


def write_mnist_m(root: Path, n_train: int, n_test: int, rng: np.random.Generator) -> None:
    for split, n in (("train", n_train), ("test", n_test)):
        labels = _labels(rng, n, 10)
        lines = []
        for i, (img, lab) in enumerate(zip(_images(rng, labels, (28, 28, 3), 10), labels)):
            write_png(Path(root) / "mnist_m" / f"mnist_m_{split}" / f"{i:08d}.png", img)
            lines.append(f"{i:08d}.png {lab}")
        (Path(root) / "mnist_m" / f"mnist_m_{split}_labels.txt").write_text("\n".join(lines) + "\n")


def write_digit5(root: Path, n_train: int, n_test: int, rng: np.random.Generator) -> None:
    """All five Digit-5 domains under ``root``, ``n_train`` + ``n_test`` samples each, in their original files."""
    root = Path(root)
    write_mnist(root, n_train, n_test, rng)
    write_svhn_mat(root / "train_32x32.mat", n_train, rng)
    write_svhn_mat(root / "test_32x32.mat", n_test, rng)
    write_usps(root / "usps.bz2", n_train, rng)
    write_usps(root / "usps.t.bz2", n_test, rng)
    write_svhn_mat(root / "synth_train_32x32.mat", n_train, rng, labels=_labels(rng, n_train, 10))
    write_svhn_mat(root / "synth_test_32x32.mat", n_test, rng, labels=_labels(rng, n_test, 10))
    write_mnist_m(root, n_train, n_test, rng)


# -- Office-10 (an image folder per domain: <domain>/<class>/*.jpg) ------------------------------------------------
def write_office10(folder: Path, per_class: int, rng: np.random.Generator, size: int = 32) -> None:
    """Office-Caltech-10's layout: amazon, caltech, dslr, webcam, each with the ten shared classes."""
    for d, domain in enumerate(OFFICE10_DOMAINS):
        for c, name in enumerate(OFFICE10_CLASSES):
            for i, img in enumerate(_images(rng, np.full(per_class, c), (size + 4 * d, size, 3), 10)):
                write_png(Path(folder) / domain / name / f"frame_{i:04d}.jpg", img, "JPEG")


# -- AG News (ag_news_csv/: quoted train.csv, test.csv, classes.txt) ----------------------------------------------
def write_ag_news(root: Path, n_train: int, n_test: int, rng: np.random.Generator) -> None:
    words = {1: "election minister talks war", 2: "match team cup goal", 3: "market shares oil profit",
             4: "software chip internet science"}
    folder = Path(root) / "ag_news_csv"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.csv", n_train), ("test.csv", n_test)):
        labels = _labels(rng, n, 4, offset=1)
        with open(folder / name, "w", newline="") as fh:
            w = csv.writer(fh, quoting=csv.QUOTE_ALL)
            for lab in labels:
                topic = words[int(lab)].split()
                body = " ".join(rng.choice(topic + ["the", "a", "of", "new"], 12))
                w.writerow([str(lab), f"{topic[0].title()} news", f"{body}."])
    (folder / "classes.txt").write_text("World\nSports\nBusiness\nSci/Tech\n")


# -- Adult (headerless adult.data, UCI's comma-and-space form) -----------------------------------------------------
def write_adult(root: Path, n: int, rng: np.random.Generator, n_test: int = 0) -> None:
    """``adult.data`` with ``n`` rows and, with ``n_test``, ``adult.test`` as UCI writes it (a first line
    ``|1x3 Cross validator``, labels with a trailing '.')."""
    _write_adult_rows(Path(root) / "adult.data", n, rng)
    if n_test:
        _write_adult_rows(Path(root) / "adult.test", n_test, rng, test=True)


def _write_adult_rows(path: Path, n: int, rng: np.random.Generator, test: bool = False) -> None:
    edu = ["Bachelors", "HS-grad", "Masters", "Doctorate", "Some-college"]
    work = ["Private", "State-gov", "Self-emp-not-inc", "?"]
    rows = []
    for i in range(n):
        e = edu[i % len(edu)]
        rich = rng.random() < (0.6 if e in ("Masters", "Doctorate") else 0.2)
        rows.append(", ".join(map(str, [
            int(rng.integers(18, 80)), work[int(rng.integers(0, len(work)))], int(rng.integers(20000, 400000)), e,
            9 + edu.index(e), "Never-married", "Adm-clerical", "Not-in-family", "White",
            "Male" if i % 2 else "Female", int(rng.integers(0, 5000)) if rich else 0, 0,
            int(rng.integers(20, 60)), "United-States", (">50K" if rich else "<=50K") + ("." if test else "")])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(("|1x3 Cross validator\n" if test else "") + "\n".join(rows) + "\n")
