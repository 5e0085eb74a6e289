"""Per-client state kept by the server: FedAMP's uploaded models, FedFomo's model store, IFCA's assignments,
Network Lasso's edge variables -- one entry per client, under a memory budget, checkpointed lean.

An aggregator asks for a named store and uses it like a small dict keyed by client id::

    class MyAggregator(ServerAggregator):
        def __init__(self, ctx):
            super().__init__(ctx)
            self.models = self.client_store("models")        # created once, in __init__ (or later, lazily)

        def aggregate_fit(self, rnd, replies):
            for cid, reply in replies.items():
                self.models.put(cid, reply["params"])          # replaces cid's entry
            ...
            w_j = self.models.get(j)                           # None (or a given default): never stored
            for cid in self.models.ids(): ...                  # sorted client ids holding an entry

The core owns the stores' life cycle, so an aggregator neither saves nor restores them in its ``state_dict``:

* **Memory.** All stores of a run share one budget, ``server.state_memory`` (default: no limit). Past it the least
  recently used entries of the store holding the most spill to ``RUN_DIR/server_state/NAME/CID.pt`` (a distributed
  rank, which replicates the server: ``server_state/rankR/NAME/``). This is ``ClientStateStore`` -- the clients'
  store, its spill files and their checks (SHA-256 and the client id inside, verified on read; a swapped, copied
  or edited file is one line naming it) -- one per name. The key is separate from ``clients.state_memory``
  because the two live in different places (the server's state on every rank, the clients' on the rank that owns
  them) and a user sizes them separately; both are resume-safe (they never change the numbers).
* **Checkpoints.** Each entry is one blob of the checkpoint, written and read one at a time (like the clients'
  declared states), so neither a checkpoint nor a resume holds every entry at once; a resume puts them back into
  the stores under the budget in force. Identical entries are stored once.
* **What an entry may hold:** tensors and plain containers of them, numbers, strings (what ``torch.load`` with
  ``weights_only=True`` rebuilds: data, never code). An entry is never modified in place: ``get`` may return the
  stored object itself, so an aggregator changes an entry by ``put``-ting a new one.

A ``ServerContext`` built outside a run (unit tests of an aggregator) gets unbudgeted in-memory stores.
"""
from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .clientstate import ClientStateStore
from ..common.errors import CheckpointError, PluginError

SERVER_SPILL_DIR = "server_state"
BUDGET_KEY = "server.state_memory"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


class ServerClientStore:
    """One named store: client id -> that client's entry (see the module docstring)."""

    def __init__(self, name: str, owner: "ServerStores", backing: ClientStateStore) -> None:
        self.name = name
        self._owner = owner
        self._backing = backing

    def get(self, cid: int, default: Any = None) -> Any:
        """``cid``'s entry (read back from disk when spilled, without re-admitting it), else ``default``."""
        state = self._backing.get(int(cid))
        return default if state is None else state

    def put(self, cid: int, state: Any) -> None:
        """Make ``state`` ``cid``'s entry (replacing any); may spill entries to keep the server's budget."""
        if state is None:
            raise ValueError(f"server store '{self.name}': None cannot be stored (use discard)")
        self._backing.put(int(cid), state)
        self._owner._enforce_budget()

    def discard(self, cid: int) -> None:
        """Forget client ``cid``'s entry (in memory or spilled); nothing when it has none."""
        self._backing.discard(int(cid))

    def ids(self) -> List[int]:
        """Client ids holding an entry, ascending."""
        return sorted(self._backing.ids())

    def items(self) -> Iterator[Tuple[int, Any]]:
        """(cid, entry) in ascending cid order, read one at a time (spilled entries are not re-admitted)."""
        for cid in self.ids():
            yield cid, self._backing.get(cid)

    def __contains__(self, cid: int) -> bool:
        return int(cid) in self._backing

    def __len__(self) -> int:
        return len(self._backing)

    @property
    def memory_bytes(self) -> int:
        """Bytes of tensors held in memory by this store."""
        return self._backing.memory_bytes

    @property
    def spilled(self) -> int:
        """Entries currently on disk."""
        return self._backing.spilled


class _StoreView(Mapping):
    """cid -> entry of one store, fetched only when asked for (the checkpoint writer streams it)."""

    def __init__(self, store: ServerClientStore) -> None:
        self._store, self._ids = store, store.ids()

    def __getitem__(self, cid: int) -> Any:
        if cid not in self._store:
            raise KeyError(cid)
        return self._store.get(cid)

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class ServerStores:
    """The run's named server stores under one budget (``budget`` bytes of tensors in memory; None: no limit)."""

    def __init__(self, budget: Optional[int] = None, spill_root: Optional[Path] = None) -> None:
        if budget is not None and spill_root is None:
            raise ValueError("a server state budget needs a spill directory")
        self.budget = budget
        self.spill_root = Path(spill_root) if spill_root is not None else None
        self._stores: Dict[str, ServerClientStore] = {}

    def store(self, name: str) -> ServerClientStore:
        """The store called ``name`` (letters, digits, '_' or '-', starting with a letter), created on first use."""
        if name in self._stores:
            return self._stores[name]
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise PluginError(f"server store name {name!r} is invalid: use 1-64 letters, digits, '_' or '-', "
                              f"starting with a letter")
        spill_dir = self.spill_root / name if self.spill_root is not None else None
        backing = ClientStateStore(None, spill_dir, what=f"server state '{name}'", budget_key=BUDGET_KEY)
        self._stores[name] = ServerClientStore(name, self, backing)
        return self._stores[name]

    def names(self) -> List[str]:
        return sorted(self._stores)

    @property
    def memory_bytes(self) -> int:
        return sum(s.memory_bytes for s in self._stores.values())

    @property
    def spilled(self) -> int:
        return sum(s.spilled for s in self._stores.values())

    def _enforce_budget(self) -> None:
        if self.budget is None:
            return
        while self.memory_bytes > self.budget:
            fullest = max(self._stores.values(), key=lambda s: s.memory_bytes)
            if not fullest._backing.spill_oldest():
                break

    # checkpoints ------------------------------------------------------------------------------------------
    def checkpoint_view(self) -> Dict[str, Mapping]:
        """name -> lazy (cid -> entry) mapping for ``checkpoint.save_checkpoint`` (streamed one entry at a time)."""
        return {name: _StoreView(self._stores[name]) for name in self.names()}

    def load(self, saved: Mapping, path: Path) -> None:
        """Replace every store's entries with a checkpoint's (``saved``: name -> cid -> entry, read lazily)."""
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"checkpoint {path} is corrupt (server stores are not a mapping)")
        for store in self._stores.values():
            for cid in store.ids():
                store.discard(cid)
        for name in saved:
            if not isinstance(name, str) or _NAME.fullmatch(name) is None:
                raise CheckpointError(f"checkpoint {path} is corrupt (server store name {str(name)[:40]!r})")
            store = self.store(name)
            entries = saved[name]
            for cid in entries:
                if type(cid) is not int or cid < 0:
                    raise CheckpointError(f"checkpoint {path} is corrupt (server store '{name}' has client id "
                                          f"{str(cid)[:40]!r})")
                store.put(cid, entries[cid])

    def remove_spill_files(self) -> None:
        """Remove the spill folder after the run finished (its checkpoint holds every entry; see
        ``ClientStateStore.remove_spill_files``)."""
        for store in self._stores.values():
            store._backing.remove_spill_files()
        if self.spill_root is not None:
            shutil.rmtree(self.spill_root, ignore_errors=True)  # refuses a link: only a real folder is removed

    def clear(self) -> None:
        """Drop every entry and the spill folder (scratch space: checkpoints hold the entries)."""
        for store in self._stores.values():
            store._backing.clear()
        if self.spill_root is not None:
            shutil.rmtree(self.spill_root, ignore_errors=True)  # refuses a link: only a real folder is removed
