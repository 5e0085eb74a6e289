"""From a dataset to per-client tensors: load, partition, split per client, move to the device once."""
from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from easydict import EasyDict

from ..api import registry as reg
from ..common.errors import ConfigError, DataError
from ..common.seeding import derive_seed
from ..api.task import Task
from ..api.training import TensorData
from .roots import ROOT_RULE, dataset_root, root_words  # noqa: F401  (imported from here too)


@dataclass
class DatasetBundle:
    """What a dataset plugin returns: the pooled samples of one task, held in memory as tensors.

    ``groups`` (optional) gives each sample's natural owner (a domain, a writer, a synthetic client); the
    ``by_group`` partitioners use it. ``transform`` runs on each batch on the device (e.g. uint8 -> normalised
    float), so large image sets stay compact in memory. ``test_rows`` (optional, one bool per sample) marks the
    samples of the dataset's own test set (Adult's ``adult.test``): with ``split.test = dataset`` each client is
    tested on exactly its samples marked there and trains on the rest, instead of a stratified share of its samples.
    """

    x: torch.Tensor
    y: torch.Tensor
    task: Task
    input_shape: Sequence[int]
    groups: Optional[torch.Tensor] = None
    group_names: Optional[List[str]] = None
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    class_names: Optional[List[str]] = None
    meta: Dict[str, Any] = field(default_factory=dict)
    test_rows: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise DataError(f"dataset has {len(self.x)} inputs but {len(self.y)} targets")
        if self.groups is not None and len(self.groups) != len(self.y):
            raise DataError("dataset groups must give one group per sample")
        if self.test_rows is not None and (not isinstance(self.test_rows, torch.Tensor)
                                           or self.test_rows.dtype != torch.bool
                                           or tuple(self.test_rows.shape) != (len(self.y),)):
            raise DataError("dataset test_rows must be a bool tensor with one entry per sample")

    @property
    def num_classes(self) -> int:
        """The number of classes (or outputs) of the task."""
        return self.task.output_dim

    def labels_for_partition(self) -> np.ndarray:
        """Labels used by label-skew partitioners (regression targets are binned into 10 quantiles)."""
        if self.task.kind == "classification":
            return self.y.cpu().numpy().astype(np.int64)
        y = self.y.reshape(len(self.y), -1)[:, 0].cpu().numpy()
        edges = np.quantile(y, np.linspace(0, 1, 11)[1:-1])
        return np.searchsorted(edges, y).astype(np.int64)


def _no_indices() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class ClientSplit:
    """One client's train and test indices into the pooled dataset. A partitioner may return these instead of
    plain index arrays; the core then uses them as given instead of splitting each client itself. ``val``: the
    validation rows held out of the client's training rows (``split.val``; empty without one)."""

    train: np.ndarray  # indices into the pooled dataset
    test: np.ndarray
    val: np.ndarray = field(default_factory=_no_indices)

    def parts(self) -> List[tuple]:
        """``(name, indices)`` of the train and test split, and of the validation split when it holds rows."""
        return [("train", self.train), ("test", self.test)] + ([("val", self.val)] if len(self.val) else [])


@dataclass(frozen=True)
class DatasetInfo:
    """What a partitioner may know about the dataset it partitions (passed as ``dataset=`` to partitioners that
    declare a ``dataset`` parameter; older partitioners without it keep working)."""

    name: str
    options: Dict[str, Any]
    num_samples: int
    num_classes: int
    input_shape: tuple
    meta: Dict[str, Any]
    class_names: Optional[List[str]] = None
    group_names: Optional[List[str]] = None

    @staticmethod
    def of(cfg: EasyDict, bundle: DatasetBundle) -> "DatasetInfo":
        return DatasetInfo(name=cfg.dataset.name, options={k: v for k, v in cfg.dataset.items() if k != "name"},
                           num_samples=len(bundle.y), num_classes=bundle.task.output_dim,
                           input_shape=tuple(bundle.input_shape), meta=dict(bundle.meta),
                           class_names=bundle.class_names, group_names=bundle.group_names)


@dataclass
class FederatedData:
    bundle: DatasetBundle
    splits: List[ClientSplit]
    dataset_name: Optional[str] = None  # recorded in partition.json, checked when the split is reused

    @property
    def num_clients(self) -> int:
        """How many clients the partition has."""
        return len(self.splits)

    def client_tensors(self, cid: int, device: torch.device) -> tuple[TensorData, TensorData]:
        """Client ``cid``'s training and test splits as tensors on ``device``."""
        s = self.splits[cid]
        b = self.bundle

        def take(idx: np.ndarray) -> TensorData:
            t = torch.as_tensor(idx, dtype=torch.long)
            return TensorData(b.x[t].to(device), b.y[t].to(device), b.transform)

        return take(s.train), take(s.test)

    def validation_tensors(self, cid: int, device: torch.device) -> Optional[TensorData]:
        """Client ``cid``'s validation split as tensors on ``device`` (None without one: ``split.val`` = 0)."""
        s = self.splits[cid]
        if not len(s.val):
            return None
        t = torch.as_tensor(s.val, dtype=torch.long)
        return TensorData(self.bundle.x[t].to(device), self.bundle.y[t].to(device), self.bundle.transform)

    @property
    def has_validation(self) -> bool:
        """Whether the clients hold validation splits (``split.val`` > 0, or a saved partition that has them)."""
        return any(len(s.val) for s in self.splits)

    def summary(self) -> Dict[str, Any]:
        """The partition as data: each client's sample and label counts (what ``fl data`` and ``partition.json`` show)."""
        labels = self.bundle.labels_for_partition()
        n_labels = int(labels.max()) + 1 if len(labels) else 0
        clients = []
        for cid, s in enumerate(self.splits):
            clients.append({
                "client": cid, "train": len(s.train), "test": len(s.test),
                "train_label_counts": np.bincount(labels[s.train], minlength=n_labels).tolist(),
                "test_label_counts": np.bincount(labels[s.test], minlength=n_labels).tolist(),
            })
            if self.has_validation:  # only then: a partition without one keeps its file as before
                clients[-1]["val"] = len(s.val)
                clients[-1]["val_label_counts"] = np.bincount(labels[s.val], minlength=n_labels).tolist()
        out: Dict[str, Any] = {"num_clients": self.num_clients, "num_labels": n_labels}
        if self.dataset_name is not None:
            out["dataset"] = self.dataset_name
        out["num_samples"] = len(self.bundle.y)
        out["clients"] = clients
        return out

    def save(self, path: Path) -> None:
        """Write the partition (the summary plus every client's sample indices) to ``path`` (a run's ``partition.json``)."""
        doc = self.summary()
        for c, s in zip(doc["clients"], self.splits):
            c["train_indices"] = s.train.tolist()
            c["test_indices"] = s.test.tolist()
            if "val" in c:
                c["val_indices"] = s.val.tolist()
        from ..common.safefiles import write_atomic  # never through a link planted in the run directory

        write_atomic(path, json.dumps(doc))

    def fingerprint(self) -> str:
        """SHA-256 of every client's train and test indices, in client order (what a checkpoint's results rest on:
        a resumed run checks its partition.json against the one the checkpoint was computed with)."""
        return partition_fingerprint(self.splits)

    @staticmethod
    def load_splits(path: Path) -> List[ClientSplit]:
        """Read a saved partition as data (a damaged file is one clear error; indices are checked on use)."""
        from ..common.safefiles import read_regular

        try:
            from ..common.strictjson import loads as strict_loads  # duplicate keys, deep nesting: refused (ValueError)

            doc = strict_loads(read_regular(path, _MAX_PARTITION_BYTES).decode("utf-8"))
            splits = [ClientSplit(_index_array(c["train_indices"]), _index_array(c["test_indices"]),
                                  _index_array(c.get("val_indices", [])))
                      for c in doc["clients"]]
        except (ValueError, TypeError, KeyError, OSError) as exc:
            raise DataError(f"partition file {path} is corrupt ({type(exc).__name__}: {str(exc)[:120]}); restore "
                            f"it from a copy") from None
        if not splits:
            raise DataError(f"partition file {path} lists no clients")
        return splits

    def check_indices(self, source: str = "partition", disjoint: bool = False) -> None:
        """Every client index must address a sample of the dataset, and each client needs 2 training samples;
        with ``disjoint`` (splits made outside the core) no sample may be in both a client's train and test set."""
        n = len(self.bundle.y)
        for cid, s in enumerate(self.splits):
            for part, idx in s.parts():
                if len(idx) and (idx.min() < 0 or idx.max() >= n):
                    bad = int(idx.max() if idx.max() >= n else idx.min())
                    raise DataError(f"{source}: client {cid}'s {part} index {bad} is out of range for a dataset "
                                    f"of {n} samples")
            if disjoint:
                for (name_a, a), (name_b, b) in ((s.parts()[i], s.parts()[j]) for i in range(len(s.parts()))
                                                 for j in range(i + 1, len(s.parts()))):
                    both = np.intersect1d(a, b)
                    if len(both):
                        raise DataError(f"{source}: client {cid}'s sample {int(both[0])} is in both its {name_a} "
                                        f"and its {name_b} set ({len(both)} shared)")
            if len(s.train) < 2:
                raise DataError(f"{source}: client {cid} has {len(s.train)} training samples, it needs at least 2 "
                                f"(lower split.test_ratio or give the client more data)")
        if disjoint:
            check_no_shared_samples(self.splits, source)


def check_no_shared_samples(splits: Sequence[ClientSplit], source: str) -> None:
    """No sample may be held twice: not by two clients, not twice by one client, not in a client's train and test
    set (a split made outside the core -- a saved or given partition -- is checked; one line names the clients)."""
    if not splits:
        return
    names = ("train", "test", "val")
    idx = np.concatenate([np.concatenate([s.train, s.test, s.val]) for s in splits])
    owner = np.concatenate([np.full(len(s.train) + len(s.test) + len(s.val), cid, dtype=np.int64)
                            for cid, s in enumerate(splits)])
    part_of = np.concatenate([np.repeat(np.arange(3), [len(s.train), len(s.test), len(s.val)]) for s in splits])
    order = np.argsort(idx, kind="stable")
    srt = idx[order]
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if not len(dup):
        return
    i = int(dup[0])
    first, second = order[i], order[i + 1]
    a, b, sample = int(owner[first]), int(owner[second]), int(srt[i])
    if a != b:
        what = f"clients {a} and {b} both hold sample {sample}"
    elif part_of[first] != part_of[second]:
        what = (f"client {a}'s sample {sample} is in both its {names[part_of[first]]} and its "
                f"{names[part_of[second]]} set")
    else:
        what = f"client {a} holds sample {sample} twice in its {names[part_of[first]]} set"
    raise DataError(f"{source}: {what} ({len(dup)} repeated sample(s) in all); clients must not share samples")


def partition_fingerprint(splits: Sequence[ClientSplit]) -> str:
    digest = hashlib.sha256()
    for s in splits:  # a validation split joins the digest only when it holds rows: older fingerprints stay valid
        for _, part in s.parts():
            arr = np.ascontiguousarray(part, dtype="<i8")
            digest.update(len(arr).to_bytes(8, "little"))
            digest.update(arr.tobytes())
    return digest.hexdigest()


_MAX_PARTITION_BYTES = 1 << 30


def _index_array(values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError("indices must be a flat list of integers")
    return arr.astype(np.int64)


def split_train_test(indices: np.ndarray, labels: np.ndarray, rng: np.random.Generator,
                     test_ratio: float = 0.25, train_size: Optional[int] = None,
                     test_size: Optional[int] = None, fraction: float = 1.0) -> ClientSplit:
    """Stratified per-client split, so a client's test set follows its training distribution.

    With ``train_size``/``test_size`` the client's samples are first subsampled (stratified) to that total; with
    ``fraction`` < 1 to that share of them (at least 2), so client sizes keep their proportions.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if fraction < 1.0:  # the default draws nothing from ``rng``: runs without it keep their numbers
        indices = _stratified_take(indices, labels, max(2, int(round(len(indices) * fraction))), rng)
    if train_size is not None:
        total = train_size + test_size
        if len(indices) < total:
            raise DataError(f"a client holds {len(indices)} samples, fewer than train_size + test_size = {total}; "
                            f"use the 'fixed' partitioner or lower the sizes")
        test_ratio = test_size / total
        indices = _stratified_take(indices, labels, total, rng)
    train_parts, test_parts = [], []
    for lab in np.unique(labels[indices]):
        members = rng.permutation(indices[labels[indices] == lab])
        train_parts.append(members)
    # Allocate test counts per label by largest remainder so the total is exact.
    sizes = np.array([len(p) for p in train_parts])
    n_test_total = int(round(len(indices) * test_ratio)) if test_size is None else test_size
    n_test_total = min(n_test_total, len(indices) - 1) if len(indices) > 1 else 0
    quota = sizes * (n_test_total / max(1, len(indices)))
    n_test = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - n_test))[: n_test_total - n_test.sum()]:
        n_test[i] += 1
    for members, k in zip(train_parts, n_test):
        test_parts.append(members[:k])
    train = np.concatenate([m[k:] for m, k in zip(train_parts, n_test)]) if train_parts else indices[:0]
    test = np.concatenate(test_parts) if test_parts else indices[:0]
    return ClientSplit(np.sort(train), np.sort(test))


def split_by_dataset(indices: np.ndarray, test_rows: np.ndarray, labels: np.ndarray, rng: np.random.Generator,
                     fraction: float = 1.0) -> ClientSplit:
    """``split.test = dataset``: the client's samples that the dataset marks as its own test set (``test_rows``)
    are its test split, the others its training split; with ``fraction`` < 1 each part keeps that stratified share
    (at least 1), so the two keep their sizes' proportion."""
    indices = np.asarray(indices, dtype=np.int64)
    train, test = indices[~test_rows[indices]], indices[test_rows[indices]]
    if fraction < 1.0:
        train, test = (_stratified_take(part, labels, max(1, int(round(len(part) * fraction))), rng) if len(part)
                       else part for part in (train, test))
    return ClientSplit(np.sort(train), np.sort(test))


def hold_out_validation(split: ClientSplit, labels: np.ndarray, rng: np.random.Generator, ratio: float
                        ) -> ClientSplit:
    """``split.val``: a stratified share ``ratio`` of the client's training rows (at least one) becomes its
    validation split; the test split is untouched. Fewer than 2 training rows left is the caller's clear error."""
    k = max(1, int(round(len(split.train) * ratio)))
    if len(split.train) - k < 2:
        return ClientSplit(split.train, split.test, split.train[:0])
    val = _stratified_take(split.train, labels, k, rng)
    return ClientSplit(np.setdiff1d(split.train, val), split.test, np.sort(val))


def _stratified_take(indices: np.ndarray, labels: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    labs, counts = np.unique(labels[indices], return_counts=True)
    quota = counts * total / len(indices)
    take = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - take))[: total - take.sum()]:
        take[i] += 1
    parts = [rng.permutation(indices[labels[indices] == lab])[:k] for lab, k in zip(labs, take)]
    return np.concatenate(parts)


def partition_seed(cfg: EasyDict) -> int:
    """The seed of the partition and split: ``partition.seed`` when set, else the run seed."""
    seed = cfg.partition.get("seed")
    return cfg.seed if seed is None else seed


def load_dataset(cfg: EasyDict) -> DatasetBundle:
    loader = reg.DATASETS.get(cfg.dataset.name)
    args = {k: v for k, v in cfg.dataset.items() if k != "name"}
    try:
        bundle = loader(**args)
    except (UnicodeDecodeError, OSError, EOFError) as exc:  # unreadable files: the user's input, not a bug
        raise DataError(f"dataset '{cfg.dataset.name}' cannot be read: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    if not isinstance(bundle, DatasetBundle):
        raise DataError(f"dataset '{cfg.dataset.name}' returned {type(bundle).__name__}, not a DatasetBundle")
    check_bundle_values(cfg.dataset.name, bundle)
    return bundle


def check_bundle_values(name: str, bundle: DatasetBundle) -> None:
    """A dataset's values are checked once, when it is loaded, so a broken loader is named here and not blamed
    later on a trainer's loss, the partitioner or the privacy guard: a classification label must be an integer in
    ``0 .. num_classes - 1``, and float inputs and regression targets must be finite (NaN or inf in a sample is
    almost always a loader's bug: it turns every model it touches into NaN)."""
    what = f"dataset '{name}' (its pooled samples, before they are split into clients)"
    y = bundle.y
    if bundle.task.kind == "classification":
        if y.dtype == torch.bool or y.is_floating_point() or y.is_complex():
            raise DataError(f"{what}: labels are {y.dtype}, a classification dataset needs integer labels "
                            f"0 .. {bundle.num_classes - 1} (e.g. y.long() in the loader)")
        flat = y.reshape(-1)
        bad = torch.nonzero((flat < 0) | (flat >= bundle.num_classes)).flatten()
        if len(bad):
            sample = int(bad[0]) // max(1, flat.numel() // max(1, len(y)))
            raise DataError(f"{what}: label {int(flat[bad[0]])} of sample {sample} is outside the valid range "
                            f"0 .. {bundle.num_classes - 1} (classification({bundle.num_classes})); {len(bad)} "
                            f"label(s) are out of range")
    elif y.is_floating_point() or y.is_complex():
        _check_finite(what, "target", y)
    if bundle.x.is_floating_point() or bundle.x.is_complex():
        _check_finite(what, "input", bundle.x)


def _check_finite(what: str, part: str, values: torch.Tensor) -> None:
    """Every sample's values finite, else one line: how many samples hold NaN or inf and the first one's index."""
    if not len(values):
        return
    broken = ~torch.isfinite(values.reshape(len(values), -1)).all(dim=1)
    count = int(broken.sum())
    if count:
        first = int(torch.nonzero(broken)[0, 0])
        raise DataError(f"{what}: {count} of {len(values)} samples hold NaN or infinite {part} values (the first is "
                        f"sample {first}); fix the loader (drop or impute them) -- such samples make every model "
                        f"NaN")


def _takes_dataset(fn: Callable) -> bool:
    """Whether a partitioner declares a ``dataset`` parameter (partitioners written before it existed do not)."""
    try:
        return "dataset" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def partition_indices(cfg: EasyDict, bundle: DatasetBundle) -> List[Any]:
    """The partitioner's clients: index arrays (the core splits each into train/test) or ``ClientSplit``s (used
    as given), never a mix."""
    partitioner = reg.PARTITIONERS.get(cfg.partition.name)
    args = {k: v for k, v in cfg.partition.items() if k not in ("name", "num_clients", "seed")}
    if _takes_dataset(partitioner):
        args["dataset"] = DatasetInfo.of(cfg, bundle)
    rng = np.random.default_rng(derive_seed(partition_seed(cfg), "partition"))
    parts = partitioner(labels=bundle.labels_for_partition(), num_clients=cfg.partition.num_clients, rng=rng,
                        groups=None if bundle.groups is None else bundle.groups.cpu().numpy(), **args)
    if len(parts) != cfg.partition.num_clients:
        raise DataError(f"partitioner '{cfg.partition.name}' produced {len(parts)} clients, "
                        f"expected partition.num_clients = {cfg.partition.num_clients}")
    given = [isinstance(p, ClientSplit) for p in parts]
    if any(given) and not all(given):
        raise DataError(f"partitioner '{cfg.partition.name}' returned index arrays for some clients and train/test "
                        f"splits (ClientSplit) for others; return one kind for all clients")
    if all(given) and parts:
        try:
            return [ClientSplit(_index_array(p.train), _index_array(p.test), _index_array(getattr(p, "val", [])))
                    for p in parts]
        except ValueError as exc:
            raise DataError(f"partitioner '{cfg.partition.name}': {exc}") from None
    return [np.asarray(p, dtype=np.int64) for p in parts]


def _dataset_test_rows(cfg: EasyDict, bundle: DatasetBundle) -> Optional[np.ndarray]:
    """The dataset's own test rows when ``split.test = dataset`` (None: the stratified split)."""
    if cfg.split.get("test", "stratified") != "dataset":
        return None
    if bundle.test_rows is None:
        raise ConfigError(f"split.test: 'dataset' needs a dataset that marks its own test samples; dataset "
                          f"'{cfg.dataset.name}' does not (with these options) -- use split.test=stratified")
    return bundle.test_rows.cpu().numpy().astype(bool)


def _check_split_sizes(cfg: EasyDict, cid: int, received: int, split: ClientSplit) -> None:
    """Every client trains on at least one sample and is tested on at least one: else the setting that left it
    empty is named (a client without samples has nothing to train on or nothing to score)."""
    if len(split.train) and len(split.test):
        return
    fraction = cfg.split.get("fraction", 1.0)
    kept = len(split.train) + len(split.test)
    sizes = f"{len(split.train)} training and {len(split.test)} test samples"
    if fraction != 1.0:
        raise ConfigError(f"split.fraction: {fraction} leaves client {cid} with {sizes} (it keeps {kept} of its "
                          f"{received}); raise split.fraction or lower partition.num_clients")
    if cfg.split.get("test", "stratified") == "dataset":
        raise ConfigError(f"split.test: 'dataset' leaves client {cid} with {sizes} (of its {received}): the "
                          f"dataset's own test set holds none of its samples or all of them; use "
                          f"split.test=stratified")
    raise ConfigError(f"split.test_ratio: {cfg.split.test_ratio} leaves client {cid} with {sizes} (of its "
                      f"{received}); change split.test_ratio or give each client more samples (the partitioner's "
                      f"min_size, fewer partition.num_clients)")


def with_validation(cfg: EasyDict, splits: List[ClientSplit], labels: np.ndarray) -> List[ClientSplit]:
    """Each client's validation split (``split.val`` of its training rows, stratified, drawn from its own seed so
    that the train/test split is the one of a run without validation). A partition that already holds validation
    splits (a saved one) is used as given."""
    ratio = float(cfg.split.get("val", 0.0) or 0.0)
    if ratio <= 0 or any(len(s.val) for s in splits):
        return splits
    rng = np.random.default_rng(derive_seed(partition_seed(cfg), "validation"))
    out = []
    for cid, s in enumerate(splits):
        held = hold_out_validation(s, labels, rng, ratio)
        if not len(held.val):
            raise ConfigError(f"split.val: client {cid} has {len(s.train)} training samples, too few to hold out a "
                              f"validation sample and keep 2 to train on; lower partition.num_clients, raise the "
                              f"partitioner's min_size, or set split.val=0")
        out.append(held)
    return out


def build_federated_data(cfg: EasyDict, bundle: Optional[DatasetBundle] = None,
                         splits: Optional[List[ClientSplit]] = None) -> FederatedData:
    """Load, partition and split; the same config and seed always give the same clients."""
    fed = _build_federated_data(cfg, bundle, splits)
    if splits is None and cfg.split.get("val", 0.0):
        fed = FederatedData(fed.bundle, with_validation(cfg, fed.splits, fed.bundle.labels_for_partition()),
                            fed.dataset_name)
        fed.check_indices("split", disjoint=True)
    return fed


def _build_federated_data(cfg: EasyDict, bundle: Optional[DatasetBundle],
                          splits: Optional[List[ClientSplit]]) -> FederatedData:
    bundle = bundle if bundle is not None else load_dataset(cfg)
    name = cfg.dataset.name
    if splits is None:
        parts = partition_indices(cfg, bundle)
        if parts and isinstance(parts[0], ClientSplit):  # the partitioner made the split: use it as given
            if cfg.split.get("fraction", 1.0) != 1.0 or cfg.split.train_size is not None:
                raise ConfigError(f"split.fraction/train_size: partitioner '{cfg.partition.name}' makes each "
                                  f"client's train/test split itself, so the split settings do not apply; keep "
                                  f"fewer clients (e.g. dataset options) or save a smaller split and pass it as "
                                  f"partition.from")
            fed = FederatedData(bundle, parts, name)
            fed.check_indices(f"partitioner '{cfg.partition.name}'", disjoint=True)
            return fed
        labels = bundle.labels_for_partition()
        rng = np.random.default_rng(derive_seed(partition_seed(cfg), "split"))
        test_rows = _dataset_test_rows(cfg, bundle)
        splits = []
        for cid, idx in enumerate(parts):
            if len(idx) < 2:
                raise DataError(f"client {cid} received {len(idx)} samples; it needs at least 2 "
                                f"(raise the partitioner's min_size or lower partition.num_clients)")
            if test_rows is not None:
                split = split_by_dataset(idx, test_rows, labels, rng, cfg.split.get("fraction", 1.0))
            else:
                split = split_train_test(idx, labels, rng, cfg.split.test_ratio, cfg.split.train_size,
                                         cfg.split.test_size, cfg.split.get("fraction", 1.0))
            _check_split_sizes(cfg, cid, len(idx), split)
            splits.append(split)
        fed = FederatedData(bundle, splits, name)
        fed.check_indices("split", disjoint=True)
        return fed
    fed = FederatedData(bundle, splits, name)
    fed.check_indices("saved partition", disjoint=True)
    return fed
