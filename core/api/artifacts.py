"""Set-up results that runs may share: ``ServerContext.artifacts``.

Some algorithms spend most of a run on a set-up whose result does not depend on the run's seed when the protocol
fixes it -- PCFL's manifold flow, which its authors train once (their ``train_manifold.py``) and load in every
classification run. A strategy shares such a result through ``ctx.artifacts``:

    tensors = ctx.artifacts.load("pcfl-flow", key)       # None: not made yet (or sharing is off)
    ...train it...
    ctx.artifacts.save("pcfl-flow", key, tensors)

``key`` (JSON-able) must hold everything of the strategy's own that determines the result: its options and the
seed it drew from. The core adds what it knows determines it too -- the clients' data (the partition's SHA-256
and the dataset, partition and split settings), the code (a digest of the source files of pflkit's core and of the
run's plugins), torch's version, the device type and the thread count -- so a result is only ever reused by a run
that would have computed the same bits. Loading a result instead of computing it must not change the run: a
strategy shares only what it computes from its own seeded generators, never from a client's or the global RNG
streams, which the skipped work would have advanced.

Runs share through a folder: ``fl compare`` and ``fl reproduce`` give their runs ``OUT/artifacts``; ``fl run
--artifacts DIR`` another one; by default a run shares nothing (this class: ``load`` finds nothing, ``save`` keeps
nothing). A distributed run shares nothing either (its ranks must take the same path). Each file is signed with
this user's key (``verify.key``) and read as data (``torch.load(weights_only=True)``); a damaged, foreign or unsigned
one is ignored with a warning, and the run computes the result. A run that loads a result counts the messages its
maker sent between the unsuccessful ``load`` and the ``save`` as its own (the later messages keep their seeds, the
traffic totals are a computing run's), so call ``load`` first. What a run loaded or saved is listed in its
``summary.json`` (``shared_artifacts``).

Runs that start at once (``fl compare --jobs N``) do not make one result twice: the first whose ``load`` finds
nothing makes it, holding a lock on the result (``fcntl.flock``, released when it saves, when its run ends, or when
its process dies); another run's ``load`` of the same result waits for that lock and then reads the file, or makes
the result itself when the maker ended without saving it. A run resumed in the middle of a make takes its lock
again (``reclaim``, called by the core), unless another run took it meanwhile.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch


class SharedArtifacts:
    """No folder: nothing is shared (every run computes its own set-up). See the module docstring."""

    enabled = False

    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []  # what the run loaded or saved, for its summary
        # results this run looked for and did not find: the run's message count and traffic at that moment (kept in
        # its checkpoint, so a result made across a resume still records what making it cost)
        self.pending: Dict[str, Dict[str, int]] = {}

    def load(self, name: str, key: Mapping[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
        """The tensors saved under ``name`` for ``key`` (and the core's part of the key), or None."""
        return None

    def save(self, name: str, key: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (a flat ``str -> Tensor`` mapping) for later runs with the same ``key``."""
        return None

    def reclaim(self) -> None:
        """The run resumed from a checkpoint (called by the core): take the locks of the results it was making
        (``pending``) again, so that a run started beside it waits for the make instead of starting its own."""
        return None

    def release(self) -> None:
        """The run ended (called by the core): give up the results it was making and did not save, so that a run
        waiting for one makes it."""
        return None
