"""Every file-backed dataset loads tiny files written here in its real on-disk format (download=False)."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pflkit.core.api import registry as reg
from pflkit.core.common.errors import DataError
from pflkit.datasets import _common
from pflkit.datasets.digit5 import load_digit5
from pflkit.datasets.tabular import load_adult, load_csv
from pflkit.datasets.vision import (load_cifar10, load_cifar100, load_emnist, load_fashion_mnist, load_image_folder,
                                    load_mnist, load_svhn, load_tiny_imagenet)


# -- writers of the real formats: one copy, shared with the paper tables' tests (tests/tables/realformats.py) ------
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tables"))
from realformats import write_mnist_like, write_png, write_svhn_mat, write_usps  # noqa: E402
from realformats import write_mnist_m as _write_mnist_m  # noqa: E402


def write_mnist_m(root: Path, rng, n: int = 3) -> None:
    _write_mnist_m(root, n, n, rng)


# -- CIFAR ---------------------------------------------------------------------------------------------------
def test_cifar10_reads_python_batches(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    all_x, all_y = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (3, 3072)).astype(np.uint8)
        y = rng.integers(0, 10, 3).tolist()
        with open(folder / name, "wb") as fh:
            pickle.dump({b"batch_label": name.encode(), b"data": x, b"labels": y}, fh)
        all_x.append(x)
        all_y += y
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": names, b"num_vis": 3072}, fh)

    b = load_cifar10(root=str(tmp_path), download=False)
    assert b.x.shape == (18, 3, 32, 32) and b.x.dtype == torch.uint8
    assert b.y.tolist() == all_y and b.class_names == names and b.num_classes == 10
    # the channel-major row layout of the pickles is kept: pixel (c=1, h=2, w=5) = data[1024 + 2*32 + 5]
    assert int(b.x[4, 1, 2, 5]) == int(all_x[1][1, 1024 + 2 * 32 + 5])
    assert b.meta["official_train"] == 15
    out = b.transform(b.x[:2])
    assert out.dtype == torch.float32 and out.shape == (2, 3, 32, 32)
    expected = (float(b.x[0, 0, 0, 0]) / 255 - 0.4914) / 0.2470
    assert out[0, 0, 0, 0].item() == pytest.approx(expected, abs=1e-5)


def test_cifar100_fine_and_coarse(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 5), ("test", 2)):
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
                         "fine_labels": list(range(n)), "coarse_labels": [n % 20] * n}, fh)
    with open(folder / "meta", "wb") as fh:
        pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)],
                     "coarse_label_names": [f"c{i}" for i in range(20)]}, fh)
    fine = load_cifar100(root=str(tmp_path), download=False)
    assert fine.num_classes == 100 and fine.y.tolist() == [0, 1, 2, 3, 4, 0, 1]
    coarse = load_cifar100(root=str(tmp_path), download=False, label_type="coarse")
    assert coarse.num_classes == 20 and coarse.y.tolist() == [5] * 5 + [2] * 2


def test_missing_files_message_names_each_file(tmp_path):
    with pytest.raises(DataError) as err:
        load_cifar10(root=str(tmp_path), download=False)
    msg = str(err.value)
    assert "\n" not in msg and f"dataset.root '{tmp_path}'" in msg  # one line, the folder once
    for name in ("data_batch_1", "data_batch_5", "test_batch", "batches.meta"):
        assert f"cifar-10-batches-py/{name}" in msg
    assert "set dataset.download=true" in msg
    assert list(tmp_path.iterdir()) == []  # nothing was made
    with pytest.raises(DataError, match=r"train_32x32\.mat"):
        load_svhn(root=str(tmp_path), download=False)
    with pytest.raises(DataError, match=r"MNIST/raw/t10k-labels-idx1-ubyte"):
        load_mnist(root=str(tmp_path), download=False)


def test_failed_download_becomes_data_error(tmp_path):
    def offline(root):
        raise OSError("network is unreachable")

    target = tmp_path / "sub" / "a.bin"

    def offline_after_mkdir(root):
        (root / "sub" / "deeper").mkdir(parents=True)  # as torchvision makes its folders before downloading
        raise OSError("network is unreachable")

    for fetch in (offline, offline_after_mkdir):
        with pytest.raises(DataError, match="download failed.*network is unreachable") as err:
            _common.ensure_files("x", str(tmp_path / "root"), [tmp_path / "root" / "sub" / "a.bin"], True, fetch)
        assert "sub/a.bin" in str(err.value) and "\n" not in str(err.value)
        assert list(tmp_path.iterdir()) == []  # the failed download left no folder behind
    target.parent.mkdir()
    # a fetch that produces the files is accepted
    _common.ensure_files("x", tmp_path, [target], True, lambda root: target.write_bytes(b"1"))


def test_download_uses_torchvision_layout(tmp_path, monkeypatch):
    """download=True calls torchvision's class, whose files land where the reader looks (torchvision faked:
    no network, and its slow import is skipped)."""
    import sys
    import types
    calls = []

    class FakeMNIST:
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            if len(calls) == 1:
                write_mnist_like(Path(root) / "MNIST" / "raw", 4, 2, np.random.default_rng(0))

    fake_pkg, fake_datasets = types.ModuleType("torchvision"), types.ModuleType("torchvision.datasets")
    fake_datasets.MNIST = FakeMNIST
    fake_pkg.datasets = fake_datasets
    monkeypatch.setitem(sys.modules, "torchvision", fake_pkg)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake_datasets)
    b = load_mnist(root=str(tmp_path), download=True)
    assert len(b.y) == 6 and calls == [(str(tmp_path), True, True), (str(tmp_path), False, True)]


# -- MNIST family ---------------------------------------------------------------------------------------------
def test_mnist_idx_plain_and_gz(tmp_path):
    rng = np.random.default_rng(2)
    x, y = write_mnist_like(tmp_path / "MNIST" / "raw", 6, 3, rng, gz=True)
    b = load_mnist(root=str(tmp_path), download=False)
    assert b.x.shape == (9, 1, 28, 28) and b.input_shape == (1, 28, 28)
    assert np.array_equal(b.x[:, 0].numpy(), x) and b.y.tolist() == y.tolist()
    x2, y2 = write_mnist_like(tmp_path / "FashionMNIST" / "raw", 4, 2, rng)
    f = load_fashion_mnist(root=str(tmp_path), download=False)
    assert np.array_equal(f.x[:, 0].numpy(), x2) and f.class_names[9] == "Ankle boot"


def test_emnist_letters_transposed_and_shifted(tmp_path):
    rng = np.random.default_rng(3)
    x, y = write_mnist_like(tmp_path / "EMNIST" / "raw", 5, 2, rng, prefix="emnist-letters-", label_offset=1,
                            num_classes=26)
    b = load_emnist(root=str(tmp_path), download=False, split="letters")
    assert b.num_classes == 26 and b.y.tolist() == (y - 1).tolist()
    assert np.array_equal(b.x[0, 0].numpy(), x[0].T)
    with pytest.raises(DataError, match="emnist-digits-train-images"):
        load_emnist(root=str(tmp_path), download=False, split="digits")


def test_corrupt_idx_is_a_data_error(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_mnist_like(folder, 2, 2, np.random.default_rng(0))
    (folder / "train-images-idx3-ubyte").write_bytes(b"\x01\x02\x03\x04garbage")
    with pytest.raises(DataError, match="bad magic"):
        load_mnist(root=str(tmp_path), download=False)


# -- SVHN -----------------------------------------------------------------------------------------------------
def test_svhn_mat(tmp_path):
    rng = np.random.default_rng(4)
    x_tr, _ = write_svhn_mat(tmp_path / "train_32x32.mat", 5, rng, labels=[10, 1, 2, 3, 10])
    write_svhn_mat(tmp_path / "test_32x32.mat", 3, rng, labels=[4, 5, 10])
    b = load_svhn(root=str(tmp_path), download=False)
    assert b.x.shape == (8, 3, 32, 32) and b.x.dtype == torch.uint8
    assert b.y.tolist() == [0, 1, 2, 3, 0, 4, 5, 0]  # label 10 means digit 0
    assert int(b.x[1, 2, 3, 4]) == int(x_tr[3, 4, 2, 1])  # HWCN -> NCHW


# -- Tiny-ImageNet and image folders -------------------------------------------------------------------------
def test_tiny_imagenet_layout(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n01443537", "n01629819"]
    for w in wnids:
        for i in range(3):
            write_png(root / "train" / w / "images" / f"{w}_{i}.JPEG", rng.integers(0, 256, (64, 64, 3)), "JPEG")
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text("n01443537\tgoldfish, Carassius auratus\nn01629819\tEuropean fire salamander\n")
    lines = []
    for i, w in enumerate([wnids[1], wnids[0]]):
        write_png(root / "val" / "images" / f"val_{i}.JPEG", np.full((64, 64, 3), 200), "JPEG")
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    b = load_tiny_imagenet(root=str(tmp_path), download=False, image_size=16)
    assert b.x.shape == (8, 3, 16, 16) and b.num_classes == 2
    assert b.y.tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    assert b.class_names == ["goldfish", "European fire salamander"]
    assert abs(float(b.x[-1].float().mean()) - 200) < 3  # a constant JPEG stays constant after resizing
    cache = root / "pflkit-cache-16.pt"
    assert cache.exists()
    (root / "val" / "images" / "val_0.JPEG").unlink()  # the cache answers without decoding again ...
    (root / "val" / "val_annotations.txt").write_text(lines[1] + "\n")
    again = load_tiny_imagenet(root=str(tmp_path), download=False, image_size=16)
    assert again.y.tolist() == [0, 0, 0, 1, 1, 1, 0]  # ... only for the same file list: rebuilt here
    assert torch.equal(again.x[-1], b.x[-1])


def test_image_folder_with_domains_fills_groups(tmp_path):
    rng = np.random.default_rng(6)
    for domain, classes in (("amazon", ("backpack", "mug")), ("dslr", ("mug",))):
        for c in classes:
            for i in range(2):
                write_png(tmp_path / domain / c / f"{i}.png", rng.integers(0, 256, (20, 24, 3)))
    b = load_image_folder(root=str(tmp_path), image_size=8, domains=True)
    assert b.x.shape == (6, 3, 8, 8) and b.class_names == ["backpack", "mug"]
    assert b.group_names == ["amazon", "dslr"] and b.groups.tolist() == [0, 0, 0, 0, 1, 1]
    assert b.y.tolist() == [0, 0, 1, 1, 1, 1]
    flat = load_image_folder(path=str(tmp_path / "amazon"), image_size=8, channels=1)
    assert flat.x.shape == (4, 1, 8, 8) and flat.groups is None
    mean = b.transform(b.x).mean(dim=(0, 2, 3))  # normalised with the set's own statistics
    assert torch.allclose(mean, torch.zeros(3), atol=1e-4)
    restored = pickle.loads(pickle.dumps(b.transform))  # bundles stay picklable
    assert torch.equal(restored(b.x[:2]), b.transform(b.x[:2]))
    relative = load_image_folder(root=str(tmp_path), path="dslr", image_size=8)
    assert len(relative.y) == 2
    with pytest.raises(DataError, match="does not exist"):
        load_image_folder(path=str(tmp_path / "nope"))


# -- Digit-5 --------------------------------------------------------------------------------------------------
def test_digit5_assembles_domains_as_groups(tmp_path):
    rng = np.random.default_rng(7)
    write_mnist_like(tmp_path / "MNIST" / "raw", 6, 2, rng)
    write_svhn_mat(tmp_path / "train_32x32.mat", 4, rng)
    write_svhn_mat(tmp_path / "test_32x32.mat", 2, rng)
    usps_labels = np.concatenate([write_usps(tmp_path / "usps.bz2", 5, rng), write_usps(tmp_path / "usps.t.bz2", 2, rng)])
    write_svhn_mat(tmp_path / "synth_train_32x32.mat", 3, rng, labels=[0, 1, 2])
    write_svhn_mat(tmp_path / "synth_test_32x32.mat", 2, rng, labels=[3, 4])
    write_mnist_m(tmp_path, rng)

    b = load_digit5(root=str(tmp_path), download=False)
    assert b.group_names == ["mnist", "svhn", "usps", "synth_digits", "mnist_m"]
    assert b.x.shape == (8 + 6 + 7 + 5 + 6, 3, 32, 32) and b.x.dtype == torch.uint8
    assert torch.bincount(b.groups).tolist() == [8, 6, 7, 5, 6]
    assert b.y[b.groups == 2].tolist() == usps_labels.tolist()
    assert b.meta["domain_sizes"]["usps"] == 7
    mnist_part = b.x[b.groups == 0]
    assert torch.equal(mnist_part[:, 0], mnist_part[:, 1])  # grey replicated to RGB

    sub = load_digit5(root=str(tmp_path), download=False, domains=["usps", "mnist"], image_size=28, channels=1,
                      max_per_domain=4)
    assert sub.group_names == ["usps", "mnist"] and sub.x.shape == (8, 1, 28, 28)
    with pytest.raises(DataError, match="unknown domain"):
        load_digit5(root=str(tmp_path), download=False, domains=["mnistm"])


def test_digit5_missing_domain_and_folder_fallback(tmp_path):
    rng = np.random.default_rng(8)
    with pytest.raises(DataError, match="no domain found") as err:
        load_digit5(root=str(tmp_path), download=False)
    assert "synth_train_32x32.mat" in str(err.value) and "mnist_m_train_labels.txt" in str(err.value)
    with pytest.raises(DataError, match=r"synth_test_32x32\.mat"):
        load_digit5(root=str(tmp_path), download=False, domains=["synth_digits"])
    for c in (3, 7):  # SynthDigits given as an image folder instead
        write_png(tmp_path / "synth_digits" / str(c) / "a.png", rng.integers(0, 256, (32, 32, 3)))
    b = load_digit5(root=str(tmp_path), download=False, domains=["synth_digits"])
    assert b.y.tolist() == [3, 7] and b.groups.tolist() == [0, 0]


# -- CSV / Adult ---------------------------------------------------------------------------------------------
def test_csv_one_hot_and_standardised(tmp_path):
    (tmp_path / "t.csv").write_text("age,work,label,edu\n20,Private,>50K,Doctorate\n40,?,<=50K,HS\n"
                                    "60,Gov,>50K.,HS\n,Private,<=50K,Doctorate\n")
    b = load_csv(root=str(tmp_path), path="t.csv", label_column="label", group_column="edu",
                 group_values=["Doctorate"])
    assert b.class_names == ["<=50K", ">50K"] and b.y.tolist() == [1, 0, 1, 0]
    names = b.meta["feature_names"]
    assert names == ["age", "work=?", "work=Gov", "work=Private", "edu=Doctorate", "edu=HS"]
    age = b.x[:, 0]
    assert age.mean().abs() < 1e-6 and age.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert age[3].item() == pytest.approx(0.0, abs=1e-6)  # missing numeric -> column mean
    assert b.x[:, 1:4].sum(dim=1).tolist() == [1, 1, 1, 1]
    assert b.groups.tolist() == [1, 0, 0, 1]
    with pytest.raises(DataError, match=r"label_column.*'income'"):
        load_csv(root=str(tmp_path), path="t.csv", label_column="income")
    with pytest.raises(DataError, match="does not exist"):
        load_csv(root=str(tmp_path), path="missing.csv", label_column="label")
    with pytest.raises(DataError, match="listed as numeric"):
        load_csv(root=str(tmp_path), path="t.csv", label_column="label", categorical_columns=["edu"])


def test_adult_headerless(tmp_path):
    rows = ["39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, "
            "40, United-States, <=50K",
            "50, Self-emp-not-inc, 83311, Doctorate, 16, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, "
            "0, 13, United-States, >50K", ""]
    (tmp_path / "adult.data").write_text("\n".join(rows))
    b = load_adult(root=str(tmp_path), group_values=["Doctorate"])
    assert b.y.tolist() == [0, 1] and b.groups.tolist() == [0, 1]
    assert "fnlwgt" not in b.meta["feature_names"] and "education=Doctorate" in b.meta["feature_names"]


def test_all_builtins_registered_with_params():
    for name in ("cifar10", "cifar100", "mnist", "fashion_mnist", "emnist", "svhn", "tiny_imagenet", "image_folder",
                 "digit5", "pcfl_sine", "fedprox_synthetic", "csv", "adult"):
        loader = reg.DATASETS.get(name)
        assert isinstance(getattr(loader, "params"), dict)
