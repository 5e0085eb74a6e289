"""The folder runs share set-up results through (``core.api.artifacts``): one file per result, named by its key.

A file is ``<name>-<digest>.pt``, ``digest`` the SHA-256 of the canonical JSON of the whole key (the strategy's part
and the core's, ``run_key``). It holds the bytes of ``{"format", "key", "cost", "tensors", "made_by"}`` and their
HMAC with this user's key (``common.userkey``, as ``fl compare`` keys the runs it reuses), and is read as data
(``weights_only``): a file that does not load, is not signed with the key, names another key or holds anything but
tensors is ignored with a warning, and the run computes the result and writes the file again. Files are written to
a temporary name and renamed, so a reader never sees half a file. A run making a result holds ``fcntl.flock`` on
``<name>-<digest>.making`` until it saves the file or ends; a run that finds neither file nor free lock waits for
the lock (polling, so a second Ctrl-C still stops it) and reads the file, or makes the result when the maker ended
without it. A lock this process already holds is never waited for (runs in one process come one after another);
where flock is missing or fails the runs do not wait, and two that make the same result both write the same tensors.
"""
from __future__ import annotations

import hashlib
import hmac
import importlib.util
import io
import json
import logging
import os
import pkgutil
import sys
import time
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

import torch

from ..api.artifacts import SharedArtifacts
from ..common.errors import PflError
from ..common.safefiles import ensure_dir, open_rw, read_regular, write_atomic
from ..common.userkey import verify_key

try:
    import fcntl
except ImportError:  # pragma: no cover -- Windows: runs made at once may make one result twice
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("pflkit")
FORMAT = "pflkit-artifact/1"
MAX_ARTIFACT_BYTES = 4 << 30  # a file larger than this is not read back (it is not one pflkit wrote)
COST_KEYS = ("calls", "bytes_up", "bytes_down")  # what making a result cost in messages and traffic
# settings that say where data are read from, not what they are
_LOCATION = {"dataset": ("root", "download")}
MAKING_SUFFIX = ".making"  # the lock file a result's maker holds
WAIT_POLL_SECONDS = 0.5  # how often a run waiting for another's make looks at the lock
_HELD_BY_THIS_PROCESS: Dict[str, int] = {}  # lock file -> descriptor, for the makes this process holds


@lru_cache(maxsize=None)
def package_digest(package: str) -> str:
    """SHA-256 of the code an import of ``package`` runs: a package's ``.py`` files (relative path and bytes,
    sorted), a single-file module's bytes; '' when there is no source. A namespace package (``pflkit``: no
    ``__init__.py``; its parts may lie in several folders, e.g. an editable checkout and a stray install in the
    system site-packages) is the digest of its parts *as imported* -- each part from the one folder an import finds
    it in -- so a folder that an import never reads does not change the key."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return ""
    folders = list(spec.submodule_search_locations or [])
    h = hashlib.sha256()
    if spec.origin is None and folders:  # a namespace package
        parts = sorted({m.name for m in pkgutil.iter_modules(folders)})
        h.update(_canonical({name: package_digest(f"{package}.{name}") for name in parts}).encode())
        return h.hexdigest()
    if not folders:  # a module, not a package
        origin = Path(spec.origin or "")
        return hashlib.sha256(origin.read_bytes()).hexdigest() if origin.suffix == ".py" and origin.is_file() else ""
    root = Path(folders[0])
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def code_digest(classes: Iterable[type]) -> Dict[str, str]:
    """The digest of pflkit and of every package that defines one of ``classes`` or a class they derive from."""
    packages = {"pflkit"}
    for cls in classes:
        for klass in getattr(cls, "__mro__", ()):
            module = sys.modules.get(klass.__module__)
            if module is not None and getattr(module, "__file__", None):
                packages.add(klass.__module__.split(".")[0])
    return {p: package_digest(p) for p in sorted(packages)}


def run_key(cfg: Mapping[str, Any], partition_sha256: str, classes: Iterable[type],
            device: Optional[str] = None) -> Dict[str, Any]:
    """The core's part of every key: the clients' data, the code, torch, the device type (``device``: the run's
    resolved one, e.g. 'cpu' for ``device = auto`` on a machine without a GPU) and the thread count."""
    data = {}
    for section in ("dataset", "partition", "split"):
        values = dict(cfg.get(section) or {})
        for key in _LOCATION.get(section, ()):
            values.pop(key, None)
        data[section] = values
    device = str(device if device is not None else cfg.get("device", "cpu"))
    return {"data": data, "partition_sha256": partition_sha256, "code": code_digest(classes),
            "torch": torch.__version__, "device": device.split(":")[0],
            "threads": torch.get_num_threads()}


def _is_result_file_name(name: str) -> bool:
    """``name`` is a result file's name in the folder (``<name>-<digest>.pt``), not a path."""
    return (name.endswith(".pt") and not name.startswith(".")
            and all(ch.isalnum() or ch in "-_." for ch in name))


def _lock_path(path: Path) -> Path:
    """The lock file the maker of the result ``path`` holds."""
    return path.with_name(path.stem + MAKING_SUFFIX)


class _Unsigned(Exception):
    """A file not signed with this user's key."""


def _keyed(data: bytes) -> str:
    return hmac.new(verify_key(), data, hashlib.sha256).hexdigest()


def _unwrap(raw: bytes) -> Any:
    """The document inside a file: the outer layer holds its bytes and their HMAC with this user's key (a file
    copied in from another user or machine, or edited, is not trusted); both layers are read as data only."""
    outer = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(outer, dict) or outer.get("format") != FORMAT:
        return outer
    body = outer.get("body")
    if not isinstance(body, torch.Tensor) or body.dtype != torch.uint8 or body.ndim != 1:
        raise _Unsigned("its body is not a byte tensor")
    data = body.numpy().tobytes()
    if not isinstance(outer.get("hmac"), str) or not hmac.compare_digest(outer["hmac"], _keyed(data)):
        raise _Unsigned("it is not signed with this user's key (verify.key: edited, or made by another user or "
                        "machine)")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


class ArtifactFolder(SharedArtifacts):
    """Results shared through ``folder`` by every run given it (``fl compare``: ``OUT/artifacts``)."""

    enabled = True

    def __init__(self, folder: Path, core_key: Mapping[str, Any], run_dir: Optional[Path] = None,
                 meter: Optional[Callable[[], Dict[str, int]]] = None,
                 replay: Optional[Callable[[Mapping[str, int]], None]] = None) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.core_key = dict(core_key)
        self.run_dir = run_dir
        # the run's message count and traffic so far (``meter``) and a way to count what a loaded result replaced
        # (``replay``): the messages a result's maker sent between its unsuccessful ``load`` and its ``save`` are
        # recorded with it, and a run that loads it counts them as sent -- the same message numbers (which seed each
        # client's generator) and the same traffic totals as a run that computed it
        self.meter = meter
        self.replay = replay
        self.making: Dict[str, int] = {}  # lock file -> descriptor: the results this run is making (flock held)

    def _path_and_key(self, name: str, key: Mapping[str, Any]):
        if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or name.startswith("."):
            raise ValueError(f"shared artifact name {name!r}: use letters, digits, '-', '_' and '.'")
        text = _canonical({"name": name, "key": key, "core": self.core_key})
        digest = hashlib.sha256(text.encode()).hexdigest()
        return self.folder / f"{name}-{digest[:24]}.pt", text

    def load(self, name: str, key: Mapping[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
        path, text = self._path_and_key(name, key)
        if not path.exists() and not self._made_while_waiting(path):
            self._missed(path)
            return None
        try:
            doc = _unwrap(read_regular(path, MAX_ARTIFACT_BYTES))
            problem = self._problem(doc, text)
        except _Unsigned as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 -- any unreadable file is ignored, never trusted
            problem = f"it does not load ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if problem:
            log.warning("shared artifact %s ignored: %s; this run computes it", path, problem)
            self._missed(path)
            return None
        made_by = doc.get("made_by") or {}
        cost = doc.get("cost")
        if self.replay is not None and isinstance(cost, dict):
            self.replay({k: int(cost.get(k, 0)) for k in COST_KEYS})
        self.events.append({"name": name, "action": "loaded", "file": str(path),
                            "made_by": str(made_by.get("run", ""))})
        log.info("shared artifact %s loaded (made by %s)", path.name, made_by.get("run", "?"))
        return dict(doc["tensors"])

    def _missed(self, path: Path) -> None:
        if self.meter is not None:
            self.pending[path.name] = dict(self.meter())

    def _made_while_waiting(self, path: Path) -> bool:
        """The result is not there: claim its make (False: this run makes it, holding the lock), or wait for the
        run making it and say whether its file is there now (True: read it; False: the maker ended without it and
        this run makes it)."""
        lock = _lock_path(path)
        if fcntl is None or str(lock) in _HELD_BY_THIS_PROCESS:
            return False
        try:
            self._ensure_folder()
            fd = open_rw(lock)
        except (OSError, PflError) as exc:
            log.warning("shared artifact %s: no lock for its make (%s); runs started at once may make it twice",
                        path.name, exc)
            return False
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.info("shared artifact %s: another run is making it; waiting for it instead of making it "
                             "again", path.name)
                    waited = True
                time.sleep(WAIT_POLL_SECONDS)
            except OSError as exc:  # a file system without flock: no coordination
                os.close(fd)
                log.warning("shared artifact %s: no lock for its make (%s); runs started at once may make it "
                            "twice", path.name, exc)
                return False
            except BaseException:
                os.close(fd)
                raise
        if path.exists():  # made while this run waited (or between its look and its lock)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return True
        if waited:
            log.info("shared artifact %s: the run making it ended without saving it; this run makes it", path.name)
        _HELD_BY_THIS_PROCESS[str(lock)] = fd
        self.making[str(lock)] = fd
        return False

    def reclaim(self) -> None:
        for name in self.pending:
            if fcntl is None or not _is_result_file_name(name):  # the checkpoint's names are data: no path
                continue
            path = self.folder / name
            if path.exists():
                continue
            lock = _lock_path(path)
            if str(lock) in _HELD_BY_THIS_PROCESS:
                continue
            try:
                self._ensure_folder()
                fd = open_rw(lock)
            except (OSError, PflError) as exc:
                log.warning("shared artifact %s: no lock for its resumed make (%s)", name, exc)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another run started making it while this one was paused: both make it
                os.close(fd)
                log.warning("shared artifact %s: another run started making it while this run was paused; both "
                            "make it", name)
                continue
            _HELD_BY_THIS_PROCESS[str(lock)] = fd
            self.making[str(lock)] = fd

    def _ensure_folder(self) -> None:
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        ensure_dir(self.folder)

    def _unlock(self, lock: str) -> None:
        fd = self.making.pop(lock, None)
        if fd is None:
            return
        _HELD_BY_THIS_PROCESS.pop(lock, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def release(self) -> None:
        for lock in list(self.making):
            self._unlock(lock)

    def __del__(self) -> None:  # a run dropped without ending must not keep a result it never saved locked
        try:
            self.release()
        except Exception:
            pass

    @staticmethod
    def _problem(doc: Any, text: str) -> Optional[str]:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            return f"not a {FORMAT} file"
        if doc.get("key") != text:
            return "it was made for another key"
        cost = doc.get("cost")
        if cost is not None and not (isinstance(cost, dict) and all(
                isinstance(cost.get(k), int) and cost[k] >= 0 for k in COST_KEYS)):
            return "its 'cost' is not a count of messages and bytes"
        tensors = doc.get("tensors")
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in tensors.items()):
            return "its 'tensors' is not a mapping of names to tensors"
        return None

    def save(self, name: str, key: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        path, text = self._path_and_key(name, key)
        bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"shared artifact {name!r}: {bad[0]!r} is not a tensor (save a str -> Tensor mapping)")
        start = self.pending.pop(path.name, None)
        cost = None
        if start is not None and self.meter is not None:
            now = self.meter()
            cost = {k: int(now[k]) - int(start[k]) for k in COST_KEYS}
        body = io.BytesIO()
        torch.save({"format": FORMAT, "key": text, "cost": cost,
                    "tensors": {k: v.detach().to("cpu").clone() for k, v in tensors.items()},
                    "made_by": {"run": str(self.run_dir or ""),
                                "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}}, body)
        data = body.getvalue()
        buffer = io.BytesIO()
        torch.save({"format": FORMAT, "body": torch.frombuffer(bytearray(data), dtype=torch.uint8),
                    "hmac": _keyed(data)}, buffer)
        try:
            self._ensure_folder()
            write_atomic(path, buffer.getvalue())
        except (OSError, PflError) as exc:  # the run has its result; only later runs miss it
            log.warning("shared artifact %s not saved: %s", path, exc)
            return
        finally:
            self._unlock(str(_lock_path(path)))
        self.events.append({"name": name, "action": "saved", "file": str(path)})
        log.info("shared artifact %s saved for later runs", path.name)
