"""Where declared per-client state lives, and the pooled trainer that works on it.

``ClientStateStore`` keeps each client's declared state (``ClientTrainer.client_state``) in host memory; past a
byte budget (``clients.state_memory``) the least recently used states spill to one file per client in the run
directory (``torch.save`` of ``{"client": cid, "state": ...}``, tensors and plain containers, read back with
``weights_only=True``: data, never code). The store keeps each spill file's SHA-256 and size in memory and checks
them, and the client id inside, when it reads the file back: a spill file swapped with another client's, copied
over, edited or replaced by a link is one clear error naming it, never silently another client's state. A disk
that fills while spilling is one clear error too. A client that was never touched holds no entry: its state is
the shared initial one.

``TrainerPool`` is one worker's working trainer: a single instance (model, optimiser buffers, scratch tensors)
rebound to whichever client a call is for. Both are owned by an execution backend, so a multi-process backend
keeps one pool per worker and one store per worker for the clients it owns.
"""
from __future__ import annotations

import hashlib
import io
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

import torch

from ..common.errors import CheckpointError, ConfigError
from ..common.safefiles import OwnDir, RunFileError, check_entry

SPILL_DIR = "client_state"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: Any, key: str = "clients.state_memory") -> Optional[int]:
    """Bytes of a size such as ``512MiB``, ``1GiB``, ``1.5GB`` or ``1000000``; None/"none"/"unlimited": no limit."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "unlimited", "")):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a size (examples: 512MiB, 1GiB, 1000000)")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: {value!r} is not a size (examples: 512MiB, 1GiB, 1000000)")
        number, unit = float(m.group(1)), m.group(2).lower()
    if not number >= 0 or number != number or number == float("inf"):
        raise ConfigError(f"{key}: {value!r} is not a size (examples: 512MiB, 1GiB, 1000000)")
    return int(number * _UNITS[unit])


def _serialise(cid: int, state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save({"client": int(cid), "state": state}, buf)  # tensors and plain containers: read with weights_only
    return buf.getvalue()


def _write_state(data: bytes, f: Any) -> None:
    f.write(data)  # OSError (ENOSPC, EIO) when the disk is full


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def same_state(a: Any, b: Any) -> bool:
    """Structural and bitwise equality of two states (tensors compared with ``torch.equal``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b.to(a.device))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


_NO_ENTRY = "no-entry"  # previous-state markers: the client had no entry (initial state) / it was spilled
_SPILLED = "spilled"


class ClientStateStore:
    """cid -> declared state, in memory up to ``budget`` bytes of tensors, the rest spilled to ``spill_dir``.

    Stored states are never modified in place (loading copies them into the working modules, and ``put``
    replaces an entry). With ``track_previous(True)`` the entry a ``put`` replaces is kept (under the same budget,
    spilled first) until the next ``track_previous`` call, so ``restore_previous`` can roll a client back.
    """

    def __init__(self, budget: Optional[int] = None, spill_dir: Optional[Path] = None,
                 what: str = "client state", budget_key: str = "clients.state_memory") -> None:
        self.what = what  # how errors name a spilled entry (the server store: "server state 'NAME'")
        self.budget_key = budget_key  # the key errors suggest raising
        self.budget = budget
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._dir = OwnDir(self.spill_dir) if spill_dir is not None else None  # held open from the first spill
        self._memory: "OrderedDict[int, Any]" = OrderedDict()  # least recently used first
        self._bytes: Dict[int, int] = {}
        self._spilled: Set[int] = set()
        self._prev: Dict[int, Any] = {}  # cid -> the replaced state, _NO_ENTRY or _SPILLED
        self._prev_bytes: Dict[int, int] = {}  # in-memory previous states' bytes (counted in memory_bytes)
        self._tracking = False
        self._sums: Dict[str, Tuple[str, int]] = {}  # spill file name -> (SHA-256, size) of what was written
        self.memory_bytes = 0
        self.spills = 0  # states written to disk so far (for tests and the benchmark)
        if self.budget is not None and self.spill_dir is None:
            raise ValueError("a state budget needs a spill directory")

    def __contains__(self, cid: int) -> bool:
        return cid in self._memory or cid in self._spilled

    def __len__(self) -> int:
        return len(self._memory) + len(self._spilled)

    @property
    def spilled(self) -> int:
        return len(self._spilled)

    def ids(self) -> Set[int]:
        """Every client with an entry, in memory or spilled."""
        return set(self._memory) | self._spilled

    def spill_oldest(self) -> bool:
        """Spill the least recently used in-memory entry (False: none left); for a budget shared by several
        stores (core.api.serverstore), which spills from whichever store holds the most."""
        if not self._memory:
            return False
        self._spill(next(iter(self._memory)))
        return True

    def get(self, cid: int) -> Optional[Any]:
        """The state of ``cid`` (None: never stored); a spilled state is read back without re-admitting it."""
        if cid in self._memory:
            self._memory.move_to_end(cid)
            return self._memory[cid]
        if cid in self._spilled:
            return self._read(cid)
        return None

    def put(self, cid: int, state: Any) -> None:
        if self._tracking and cid not in self._prev:
            self._keep_previous(cid)
        self.discard(cid)
        nbytes = state_nbytes(state)
        self._memory[cid] = state
        self._bytes[cid] = nbytes
        self.memory_bytes += nbytes
        if self.budget is not None:
            while self.memory_bytes > self.budget and (self._prev_bytes or self._memory):
                if self._prev_bytes:  # previous states are needed only for a rollback: they go to disk first
                    self._spill_previous(next(iter(self._prev_bytes)))
                else:
                    self._spill(next(iter(self._memory)))

    # previous states (rollback) ---------------------------------------------------------------------------
    def track_previous(self, on: bool) -> None:
        """Forget the previous states kept so far; from now on keep what each first ``put`` replaces (if ``on``)."""
        for cid, prev in self._prev.items():
            if prev is _SPILLED:
                self._unlink(self._prev_path(cid))
        self.memory_bytes -= sum(self._prev_bytes.values())
        self._prev.clear()
        self._prev_bytes.clear()
        self._tracking = on

    def restore_previous(self, cid: int) -> None:
        """Make the state replaced since ``track_previous(True)`` current again (nothing when none was replaced)."""
        if cid not in self._prev:
            return
        self.discard(cid)
        prev = self._prev.pop(cid)
        if prev is _SPILLED:
            self._rename(self._prev_path(cid), self._path(cid))
            self._spilled.add(cid)
        elif prev is not _NO_ENTRY:
            nbytes = self._prev_bytes.pop(cid)
            self._memory[cid] = prev
            self._bytes[cid] = nbytes  # already counted in memory_bytes

    def forget_previous(self, cid: int) -> None:
        """Drop the state kept for ``cid``'s rollback (its call was accepted), so a round keeps at most the
        previous states of clients not yet vetted."""
        prev = self._prev.pop(cid, None)
        if prev is _SPILLED:
            self._unlink(self._prev_path(cid))
        elif prev is not None and prev is not _NO_ENTRY:
            self.memory_bytes -= self._prev_bytes.pop(cid)

    def _keep_previous(self, cid: int) -> None:
        if cid in self._memory:
            self._prev[cid] = self._memory.pop(cid)
            self._prev_bytes[cid] = self._bytes.pop(cid)  # stays counted in memory_bytes
        elif cid in self._spilled:
            self._spilled.discard(cid)
            self._rename(self._path(cid), self._prev_path(cid))  # a rename: nothing is read
            self._prev[cid] = _SPILLED
        else:
            self._prev[cid] = _NO_ENTRY

    def _spill_previous(self, cid: int) -> None:
        self._write(cid, self._prev[cid], self._prev_path(cid))
        self._prev[cid] = _SPILLED
        self.memory_bytes -= self._prev_bytes.pop(cid)

    def discard(self, cid: int) -> None:
        if cid in self._memory:
            del self._memory[cid]
            self.memory_bytes -= self._bytes.pop(cid)
        if cid in self._spilled:
            self._spilled.discard(cid)
            self._unlink(self._path(cid))

    def _unlink(self, path: Path) -> None:
        self._sums.pop(path.name, None)
        self._dir.unlink(path.name)

    def _rename(self, src: Path, dst: Path) -> None:
        self._dir.rename(src.name, dst.name)  # renames the entry itself (a link is never followed)
        self._sums[dst.name] = self._sums.pop(src.name, ("", -1))

    def clear(self) -> None:
        """Drop every state and the spill directory (scratch space: checkpoints hold the states)."""
        self._memory.clear()
        self._bytes.clear()
        self._spilled.clear()
        self._prev.clear()
        self._prev_bytes.clear()
        self._sums.clear()
        self.memory_bytes = 0
        if self.spill_dir is not None:
            self._dir.close()
            shutil.rmtree(self.spill_dir, ignore_errors=True)  # refuses a link: only a real folder is removed

    def remove_spill_files(self) -> None:
        """Remove the spill folder once the run has finished and its checkpoint holds every state: the files are
        scratch space of this process (checked against checksums only it knows). A spilled state is then gone from
        this store; asking for it is one line pointing at the checkpoint."""
        if self.spill_dir is None:
            return
        self._dir.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)  # refuses a link: only a real folder is removed
        self._sums.clear()
        self._files_removed = True

    # spill files ------------------------------------------------------------------------------------------
    def _path(self, cid: int) -> Path:
        return self.spill_dir / f"{int(cid)}.pt"

    def _prev_path(self, cid: int) -> Path:
        return self.spill_dir / f"{int(cid)}.previous.pt"

    def _spill(self, cid: int) -> None:
        self._write(cid, self._memory[cid], self._path(cid))
        del self._memory[cid]
        self.memory_bytes -= self._bytes.pop(cid)
        self._spilled.add(cid)

    def _write(self, cid: int, state: Any, target: Path) -> None:
        try:
            data = _serialise(cid, state)
            if self._dir.fd is None:  # first spill: the folder (and a distributed rank's parent) must be real
                self.spill_dir.parent.mkdir(parents=True, exist_ok=True)
                check_entry(self.spill_dir.parent, directory=True)
            self._dir.write(target.name, lambda f: _write_state(data, f))  # new temporary file, then a rename
        except RunFileError:
            raise
        except (OSError, RuntimeError) as exc:  # RuntimeError: torch's writer reports a full disk this way
            reason = getattr(exc, "strerror", None) or (str(exc).splitlines()[0][:200] if str(exc) else
                                                        type(exc).__name__)
            raise CheckpointError(
                f"cannot spill {self.what} to {self.spill_dir}: {reason}; the run's last checkpoint "
                f"is intact (free disk space or raise {self.budget_key}, then resume the run)") from None
        self._sums[target.name] = (hashlib.sha256(data).hexdigest(), len(data))
        self.spills += 1

    def _read(self, cid: int) -> Any:
        path = self._path(cid)
        if getattr(self, "_files_removed", False):
            raise CheckpointError(f"spilled {self.what} of client {cid} was removed with its folder {self.spill_dir} "
                                  f"when the run finished; the run's checkpoint holds it")
        digest, size = self._sums.get(path.name, ("", -1))
        try:
            data = self._dir.read(path.name, max(size, 0))
        except RunFileError as exc:
            raise CheckpointError(f"spilled {self.what} {path} was replaced after pflkit wrote it ({exc}); resume "
                                  f"the run from its last checkpoint") from None
        except OSError as exc:
            raise CheckpointError(f"spilled {self.what} {path} cannot be read back ({exc.strerror or exc}); resume "
                                  f"the run from its last checkpoint") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"spilled {self.what} {path} is not the file pflkit wrote for client {cid} "
                                  f"(checksum mismatch: swapped, copied over or edited); resume the run from its "
                                  f"last checkpoint")
        try:
            doc = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"spilled {self.what} {path} cannot be read back ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); resume the run from its "
                                  f"last checkpoint") from None
        if not isinstance(doc, dict) or doc.get("client") != cid or "state" not in doc:
            raise CheckpointError(f"spilled {self.what} {path} does not hold client {cid}'s state (wrong structure "
                                  f"or another client's); resume the run from its last checkpoint")
        return doc["state"]


class TrainerPool:
    """One working trainer, rebound to a client around each call: memory independent of the number of clients.

    ``bind(cid)`` points the trainer at that client's context, loads its declared state (or the initial one),
    and returns it; ``release(cid)`` stores what the trainer holds for that client afterwards.
    """

    def __init__(self, build_trainer: Callable[[int], Any], context_of: Callable[[int], Any],
                 store: ClientStateStore) -> None:
        self._build = build_trainer
        self._context_of = context_of
        self.store = store
        self.trainer: Any = None
        self.initial: Any = None  # every client's state before its first call (all clients start equal)
        self.bound: Optional[int] = None
        self._loaded: Any = None  # the state loaded by the last bind (to skip storing an unchanged one)

    def _ensure(self, cid: int) -> Any:
        if self.trainer is None:
            trainer = self._build(cid)
            self.initial = trainer.client_state()  # set together: a raising client_state() leaves no half pool
            self.trainer = trainer
        return self.trainer

    def state_of(self, cid: int) -> Any:
        """``cid``'s declared state without running anything (the shared initial state when never stored)."""
        if self.bound == cid:
            return self.trainer.client_state()
        state = self.store.get(cid)
        if state is None:
            self._ensure(cid)
            return self.initial
        return state

    def bind(self, cid: int) -> Any:
        """Swap ``cid`` in; when the trainer's ``load_client_state`` raises, the backend counts the client as failed
        (``failures.*``) and the stored state stays as it was."""
        self.bound = None
        trainer = self._ensure(cid)
        trainer.ctx = self._context_of(cid)
        state = self.store.get(cid)
        self._loaded = self.initial if state is None else state
        trainer.load_client_state(self._loaded)
        trainer.swapped_in()
        self.bound = cid
        return trainer

    def release(self, cid: int) -> None:
        """Store the bound client's state unless the call left it unchanged (evaluation, usually): then the stored
        copy, in memory or on disk, stays as it is and nothing is written."""
        self.bound = None
        state = self.trainer.client_state()
        if same_state(state, self._loaded):
            return
        self.store.put(cid, state)
    def set_state(self, cid: int, state: Any) -> None:
        """Install ``state`` (from a checkpoint or a rollback) as ``cid``'s declared state."""
        trainer = self.bind(cid)
        trainer.load_client_state(state)  # normalises a full legacy state_dict to the declared part
        self.release(cid)
