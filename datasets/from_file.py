"""The ``from_file`` partitioner: reuse a saved client split (another run's, or a published one) exactly.

Accepted files (JSON):

- a run's ``partition.json`` (or the run directory itself): ``{"dataset": ..., "num_samples": ...,
  "clients": [{"train_indices": [...], "test_indices": [...], "train_label_counts": [...], ...}, ...]}``;
- a plain split: ``{"clients": [{"train": [...], "test": [...]}, ...]}``, optionally with ``"dataset"`` (its
  name) and ``"num_samples"``.

A client's validation rows (``"val_indices"`` in a run's file written with ``split.val``, or ``"val"``) come along:
the split is reused exactly, validation included.

Indices address the pooled dataset in its loading order. The split is checked against the dataset it is used with:
the number of clients, every index in range, no sample held twice (by two clients, or in a client's train and
test), at least 2 training and 1 test sample per client, and -- when the file records them -- the dataset name,
its size and each client's label counts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from pflkit.core.data.data import ClientSplit, DatasetInfo, check_no_shared_samples
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param

PARTITION_FILE = "partition.json"


def split_file(path: str) -> Path:
    """A run directory means its ``partition.json``."""
    p = Path(path).expanduser()
    return p / PARTITION_FILE if p.is_dir() else p


def read_split(path: str) -> Tuple[dict, List[dict]]:
    """The file's JSON document and its client entries (a damaged or foreign file is one clear DataError)."""
    file = split_file(path)
    if not file.is_file():
        raise DataError(f"partition file {str(file)!r} does not exist (partition.from / partition.path: a run "
                        f"directory or a JSON split file)")
    try:
        from pflkit.core.common.safefiles import read_regular  # bounded; no FIFO or device (a hang, endless memory)
        from pflkit.core.common.strictjson import loads as strict_loads  # no duplicate keys, no deep nesting

        doc = strict_loads(read_regular(file, 1 << 30).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"partition file {str(file)!r} cannot be read as JSON ({type(exc).__name__}: "
                        f"{str(exc)[:120]})") from None
    clients = doc.get("clients") if isinstance(doc, dict) else None
    if not isinstance(clients, list) or not clients or not all(isinstance(c, dict) for c in clients):
        raise DataError(f"partition file {str(file)!r} needs a non-empty list \"clients\" of objects with \"train\" "
                        f"and \"test\" index lists (or a run's \"train_indices\"/\"test_indices\")")
    return doc, clients


def _indices(file: Path, cid: int, entry: dict, part: str) -> np.ndarray:
    values = entry.get(f"{part}_indices", entry.get(part))
    arr = np.asarray(values if values is not None else [])
    if values is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise DataError(f"partition file {str(file)!r}: client {cid} needs a flat list of integer \"{part}\" indices")
    return arr.astype(np.int64)


def from_file(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None,
              dataset: Optional[DatasetInfo] = None, path: Optional[str] = None) -> List[ClientSplit]:
    """Load each client's train/test split from a file (a run's partition.json or a plain JSON split)."""
    if not path:
        raise DataError("partitioner 'from_file' needs partition.path (or use partition.from=RUN_DIR_OR_FILE)")
    file = split_file(path)
    doc, clients = read_split(path)
    n = len(labels)
    recorded = doc.get("dataset")
    if dataset is not None and recorded is not None and recorded != dataset.name:
        raise DataError(f"partition file {str(file)!r} was made for dataset '{recorded}', this run uses "
                        f"'{dataset.name}'")
    if doc.get("num_samples") is not None and doc["num_samples"] != n:
        raise DataError(f"partition file {str(file)!r} was made for a dataset of {doc['num_samples']} samples, this "
                        f"one has {n}")
    if len(clients) != num_clients:
        raise DataError(f"partition file {str(file)!r} holds {len(clients)} clients but partition.num_clients = "
                        f"{num_clients}; set partition.num_clients={len(clients)}")
    n_labels = int(labels.max()) + 1 if n else 0
    out = []
    for cid, entry in enumerate(clients):
        train, test = _indices(file, cid, entry, "train"), _indices(file, cid, entry, "test")
        has_val = "val_indices" in entry or isinstance(entry.get("val"), list)  # a run file's "val" is a count
        val = _indices(file, cid, entry, "val") if has_val else np.zeros(0, dtype=np.int64)
        for part, idx in (("train", train), ("test", test), ("val", val)):
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                bad = int(idx.max() if idx.max() >= n else idx.min())
                raise DataError(f"partition file {str(file)!r}: client {cid}'s {part} index {bad} is out of range "
                                f"for a dataset of {n} samples")
            if len(np.unique(idx)) != len(idx):
                raise DataError(f"partition file {str(file)!r}: client {cid}'s {part} indices repeat a sample")
            counts = entry.get(f"{part}_label_counts")
            if counts is not None and list(counts) != np.bincount(labels[idx], minlength=max(n_labels, len(counts))
                                                                   ).tolist()[:len(counts)]:
                raise DataError(f"partition file {str(file)!r}: client {cid}'s {part} labels differ from the "
                                f"label counts the file records: it was made for another dataset or version")
        if len(train) < 2 or len(test) < 1:
            raise DataError(f"partition file {str(file)!r}: client {cid} has {len(train)} train and {len(test)} "
                            f"test samples; each client needs at least 2 and 1")
        out.append(ClientSplit(train, test, val))
    check_no_shared_samples(out, f"partition file {str(file)!r}")
    return out


from_file.params = {
    "path": Param(None, "a run directory (its partition.json) or a JSON split file {\"clients\": [{\"train\": [...], "
                        "\"test\": [...]}, ...]}; --set partition.from=PATH is a shortcut", type=str),
}
