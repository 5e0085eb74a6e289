"""Checkpoints as data, never code: a checksummed header, then ``torch.save`` blobs read with ``weights_only``.

File layout (format 3)::

    PFLKIT-CHECKPOINT\n
    {"format_version": 3, "body_sha256": ..., "body_bytes": ..., "index_bytes": ..., "config_sha256": ...}\n
    <body: the run state blob | one blob per client state holding tensors | the index blob>

The run state (server, RNG, history, ...) and every client's state are separate ``torch.save`` blobs, written
and read one at a time (so is every entry of the server's per-client stores, ``core.api.serverstore``: the run
state's ``server_stores`` and the index's ``stores``), so a run with thousands of clients never holds all their states at once; client states
without tensors (e.g. FedAvg's, which is empty) are kept inline in the run state, and identical client states
(clients still at the shared initial state) are stored once. The index (last ``index_bytes``
of the body) gives each blob's offset and length. Format 2 files (one blob holding everything) still load.

The body's checksum is verified before anything is unpickled, and every blob is unpickled with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers: a crafted file cannot run
code. Types that ``weights_only`` does not know (numpy arrays and scalars in RNG states) are converted to tensors
and plain values on the way out and back on the way in. Writes are atomic: a temporary file in the run directory,
fsynced, then renamed over the previous checkpoint, which therefore stays intact when a write fails. The file is
read without following a link (a link, FIFO or device named ``checkpoint.pt`` is refused). The header records the
partition's fingerprint (``partition_sha256``); a resume checks it and every counter it relies on
(``check_header``, ``check_run_state``).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Tuple

import numpy as np
import torch

from ..common.errors import CheckpointError
from ..common.safefiles import open_read

CHECKPOINT_NAME = "checkpoint.pt"
TEMP_PREFIX = ".checkpoint-"
TEMP_SUFFIX = ".tmp"
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
MAGIC = b"PFLKIT-CHECKPOINT\n"
_CHUNK = 1 << 20
_MAX_HEADER = 1 << 16
_NDARRAY_TAG = "__pflkit_ndarray__"


def to_safe(obj: Any) -> Any:
    """Convert what ``weights_only`` loading cannot rebuild into tensors and plain values (see ``from_safe``)."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY_TAG: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return type(obj)((k, to_safe(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: to_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_safe(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_safe(v) for v in obj)
    return obj


def from_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _NDARRAY_TAG in obj:
            return obj[_NDARRAY_TAG].numpy()
        return type(obj)((k, from_safe(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: from_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_safe(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_safe(v) for v in obj)
    return obj


def remove_orphaned_temporaries(run_dir: Path) -> int:
    """Delete temporary checkpoint files left by a write that was killed; returns how many."""
    n = 0
    for p in Path(run_dir).glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(to_safe(obj), buf)
    return buf.getvalue()


def save_checkpoint(run_dir: Path, state: Dict[str, Any], meta: Dict[str, Any]) -> Path:
    """Write ``state`` atomically; ``meta`` (JSON-able: config hash, algorithm, round, ...) goes into the header.

    ``state["clients"]`` (cid -> client state; may be a lazy mapping) is written one client at a time.
    """
    run_dir = Path(run_dir)
    target = run_dir / CHECKPOINT_NAME
    clients: Mapping = state.get("clients") or {}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=run_dir)
        with os.fdopen(fd, "wb") as f:
            # the header's size is reserved now and its values filled in once the body is written
            worst = {"format_version": FORMAT_VERSION, "body_sha256": "0" * 64, "body_bytes": 10 ** 18,
                     "index_bytes": 10 ** 18, **meta}
            reserved = len(json.dumps(worst, sort_keys=True).encode())
            f.write(MAGIC + b" " * reserved + b"\n")
            body_start = f.tell()
            digest = hashlib.sha256()

            def put(data: bytes) -> List[int]:
                offset = f.tell() - body_start
                f.write(data)
                digest.update(data)
                return [offset, len(data)]

            written: Dict[str, List[int]] = {}  # blob digest -> [offset, length]: identical states stored once

            def stream(entries: Mapping) -> Tuple[Dict[str, Any], List[List[int]]]:
                """Write each entry holding tensors as its own blob: ({order, inline}, index records)."""
                records: List[List[int]] = []
                inline: Dict[Any, Any] = {}
                order: List[Any] = []
                for cid in entries:
                    cstate = entries[cid]
                    order.append(cid)
                    if _has_tensor(cstate):
                        data = _blob(cstate)
                        key = hashlib.sha256(data).hexdigest()
                        if key not in written:
                            written[key] = put(data)
                        records.append([int(cid), *written[key]])
                    else:
                        inline[cid] = cstate
                return {"order": order, "inline": inline}, records

            main = {k: v for k, v in state.items() if k not in ("clients", "server_stores")}
            main["clients"], records = stream(clients)
            index = {"records": records}
            if "server_stores" in state:  # core.api.serverstore: name -> cid -> entry, streamed like the clients
                main["server_stores"], index["stores"] = {}, {}
                for name, entries in state["server_stores"].items():
                    main["server_stores"][name], index["stores"][name] = stream(entries)
            index["main"] = put(_blob(main))
            index_bytes = put(_blob(index))[1]
            body_bytes = f.tell() - body_start
            header = {"format_version": FORMAT_VERSION, "body_sha256": digest.hexdigest(), "body_bytes": body_bytes,
                      "index_bytes": index_bytes, **meta}
            line = json.dumps(header, sort_keys=True).encode()
            f.seek(len(MAGIC))
            f.write(line.ljust(reserved))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        _discard(tmp)
        raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}; the previous checkpoint "
                              f"is intact (free space or fix permissions, then 'fl run --resume {run_dir}')") from exc
    except BaseException:
        _discard(tmp)
        raise
    return target


def _discard(tmp: str | None) -> None:
    if tmp and os.path.exists(tmp):
        try:
            os.unlink(tmp)
        except OSError:
            pass


_RESTORE = "restore the file from a copy, or start the run again"


def _parse_header(f: BinaryIO, path: Path) -> Tuple[Dict[str, Any], int]:
    """(header, offset of the body) of an open checkpoint file."""
    head = f.read(len(MAGIC) + _MAX_HEADER + 1)
    if not head.startswith(MAGIC):
        if head[:2] == b"PK":
            raise CheckpointError(f"checkpoint {path} was written by an older pflkit (format 1), which cannot be "
                                  f"loaded safely; start the run again")
        raise CheckpointError(f"{path} is not a pflkit checkpoint (corrupt or foreign file); {_RESTORE}")
    end = head.find(b"\n", len(MAGIC))
    try:
        if end < 0:
            raise ValueError("no header line")
        header = json.loads(head[len(MAGIC):end].decode())
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt (unreadable header: {exc}); {_RESTORE}") from exc
    if header.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {path} has format {header.get('format_version')!r}; this pflkit reads "
                              f"formats {', '.join(map(str, READABLE_VERSIONS))}")
    return header, end + 1


def _verify_body(f: BinaryIO, path: Path, header: Dict[str, Any], body_start: int) -> None:
    """Stream the body through SHA-256 (never all in memory) and compare with the header."""
    f.seek(body_start)
    digest, n = hashlib.sha256(), 0
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        digest.update(chunk)
        n += len(chunk)
    if n != header.get("body_bytes") or digest.hexdigest() != header.get("body_sha256"):
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete (checksum mismatch: the file was damaged "
                              f"or edited); {_RESTORE}")


def read_header(path: Path) -> Tuple[Dict[str, Any], bytes]:
    """Header and verified body bytes of a checkpoint file; a damaged or foreign file is a CheckpointError."""
    try:
        with open_read(path) as f:
            header, body_start = _parse_header(f, Path(path))
            _verify_body(f, Path(path), header, body_start)
            f.seek(body_start)
            return header, f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc


def _load_blob(data: bytes, path: Path) -> Any:
    try:
        return from_safe(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} holds data that is not plain tensors and containers; refused "
                              f"({first[:200]})") from exc


class ClientStates(MutableMapping):
    """cid -> client state of a format-3 checkpoint, each read from the file only when asked for (one at a time).

    Entries set or deleted here override the file (e.g. to write a modified copy with ``save_checkpoint``)."""

    def __init__(self, path: Path, body_start: int, order: List[Any], inline: Dict[Any, Any],
                 records: Dict[Any, Tuple[int, int]]) -> None:
        self._path, self._body_start = path, body_start
        self._order = list(order)
        self._inline = dict(inline)
        self._records = dict(records)
        self._set: Dict[Any, Any] = {}

    def __getitem__(self, cid: Any) -> Any:
        if cid in self._set:
            return self._set[cid]
        if cid in self._inline:
            return self._inline[cid]
        if cid not in self._records or cid not in self._order:
            raise KeyError(cid)
        offset, length = self._records[cid]
        try:
            with open_read(self._path) as f:
                f.seek(self._body_start + offset)
                data = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {self._path}: {exc.strerror or exc}") from exc
        if len(data) != length:
            raise CheckpointError(f"checkpoint {self._path} is corrupt or incomplete (truncated); {_RESTORE}")
        return _load_blob(data, self._path)

    def __setitem__(self, cid: Any, value: Any) -> None:
        if cid not in self._order:
            self._order.append(cid)
        self._set[cid] = value

    def __delitem__(self, cid: Any) -> None:
        if cid not in self._order:
            raise KeyError(cid)
        self._order.remove(cid)
        self._set.pop(cid, None)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


def open_checkpoint(run_dir: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(header, state) of the run's checkpoint, verified; ``state["clients"]`` loads each client state lazily.

    Everything is rebuilt as data only (``weights_only=True``).
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    try:
        with open_read(path) as f:
            header, body_start = _parse_header(f, path)
            _verify_body(f, path, header, body_start)
            if header["format_version"] == 2:  # one blob holding everything
                f.seek(body_start)
                state = _load_blob(f.read(), path)
                if not isinstance(state, dict):
                    raise CheckpointError(f"checkpoint {path} does not hold a pflkit run state")
                return header, state
            index_bytes = header.get("index_bytes")
            body_bytes = header["body_bytes"]
            if not isinstance(index_bytes, int) or not 0 < index_bytes <= body_bytes:
                index_bytes = body_bytes  # then the blob below fails to load: refused as not plain data
            f.seek(body_start + body_bytes - index_bytes)
            index = _load_blob(f.read(index_bytes), path)
            try:
                offset, length = index["main"]
                records = {cid: (int(o), int(n)) for cid, o, n in index["records"]}
                store_records = {name: {cid: (int(o), int(n)) for cid, o, n in recs}
                                 for name, recs in dict(index.get("stores") or {}).items()}
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CheckpointError(f"checkpoint {path} is corrupt (unreadable index); {_RESTORE}") from exc
            f.seek(body_start + offset)
            state = _load_blob(f.read(length), path)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("clients"), dict):
        raise CheckpointError(f"checkpoint {path} does not hold a pflkit run state")
    clients = state["clients"]
    state["clients"] = ClientStates(path, body_start, clients.get("order", []), clients.get("inline", {}), records)
    if "server_stores" in state:  # the server's per-client stores (core.api.serverstore), each read lazily too
        stores = state["server_stores"]
        if not isinstance(stores, dict) or not all(isinstance(v, dict) for v in stores.values()):
            raise CheckpointError(f"checkpoint {path} does not hold a pflkit run state (server stores)")
        state["server_stores"] = {name: ClientStates(path, body_start, v.get("order", []), v.get("inline", {}),
                                                     store_records.get(name, {})) for name, v in stores.items()}
    return header, state


def load_checkpoint(run_dir: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(header, state) of the run's checkpoint with every client state in memory (tools, tests, small runs)."""
    header, state = open_checkpoint(run_dir)
    state["clients"] = dict(state["clients"].items())
    if "server_stores" in state:
        state["server_stores"] = {name: dict(v.items()) for name, v in state["server_stores"].items()}
    return header, state


def _count(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


# header fields a resume relies on: name -> (lowest, highest) accepted integer; None allowed where noted
_HEADER_INTS = {"round": (0, 10 ** 9), "num_clients": (1, 10 ** 9), "torch_threads": (1, 1 << 16)}
_HEADER_OPTIONAL = ("torch_threads",)


def check_header(header: Dict[str, Any], path: Path) -> None:
    """Refuse header values a resume cannot trust (wrong types, negative or huge counts, NaN): one line naming
    the field. The body's checksum covers the body only, so the header's values are checked here."""
    for key, (low, high) in _HEADER_INTS.items():
        value = header.get(key)
        if value is None and key in _HEADER_OPTIONAL:
            continue
        if not _count(value, low, high):
            raise CheckpointError(f"checkpoint {path} is corrupt: header field '{key}' is {repr(value)[:40]}, not "
                                  f"an integer in [{low}, {high}]; {_RESTORE}")
    for key in ("config_sha256", "partition_sha256"):
        value = header.get(key)
        if value is None and key == "partition_sha256":  # written before partitions were fingerprinted
            continue
        if not isinstance(value, str) or len(value) != 64:
            raise CheckpointError(f"checkpoint {path} is corrupt: header field '{key}' is not a SHA-256 digest; "
                                  f"{_RESTORE}")


def check_run_state(state: Dict[str, Any], header: Dict[str, Any], path: Path) -> None:
    """The run state's counters must be plain non-negative integers agreeing with the header (a crafted state
    would otherwise run rounds that do not exist, e.g. round -5 running rounds -4..3)."""
    problems = []
    if not _count(state.get("round"), 0, 10 ** 9) or state.get("round") != header.get("round"):
        problems.append(f"round {repr(state.get('round'))[:40]} (header: {repr(header.get('round'))[:40]})")
    if not _count(state.get("setup_calls", 0), 0, 1 << 62):
        problems.append(f"setup_calls {repr(state.get('setup_calls'))[:40]}")
    if not isinstance(state.get("setup_done"), bool):
        problems.append("setup_done is not true or false")
    totals = state.get("totals")
    if not isinstance(totals, dict) or not all(_count(totals.get(k), 0, 1 << 62)
                                               for k in ("bytes_up", "bytes_down", "failures")):
        problems.append("totals are not non-negative integers")
    if not isinstance(state.get("failures"), list):
        problems.append("failures is not a list")
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems)}; {_RESTORE}")


def checkpoint_exists(run_dir: Path) -> bool:
    return (Path(run_dir) / CHECKPOINT_NAME).is_file()
