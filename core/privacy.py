"""The privacy boundary: what a client's reply may contain before the server sees it.

What it guarantees (checked on every reply, before the server, the logs or the byte counters see it):

1. **Plain data only.** A reply is built from tensors, ``BitMask``, Python numbers, booleans, strings and ``None``,
   nested in dicts (string or integer keys), lists and tuples. Anything else -- numpy arrays, bytes, sets, objects
   of any other class (which could wrap anything) -- is refused.
2. **Metrics are scalars.** ``reply["metrics"]`` maps names to single numbers, so nothing but per-client scalars
   reaches ``metrics.jsonl`` and TensorBoard.
3. **No raw samples.** A reply is refused when a tensor or numeric list in it shares storage with the client's
   data tensors, or contains one of the client's raw input rows (train or test; any dtype, any shape, as long as
   the row's values are stored contiguously at a multiple of the row length, or as a column of a 2-D tensor), or
   one of its label vectors. Rows are fingerprinted once at start-up; each candidate match is then confirmed
   exactly against the client's data, so no model is refused by chance. Rows of fewer than ``MIN_ROW_VALUES``
   values and constant rows or label vectors are not checked: a match would be chance, and their content is
   public (label counts are in ``partition.json``).

What it is not: a sandbox. Plugin code runs in the same process as the core; code written to leak (encoding data
into model weights, into strings, into floats one value at a time) is not stopped by these checks. They catch
mistakes. Isolation from malicious plugin code needs clients in separate processes or machines, which the
execution backends are designed for.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .protocol import BitMask

MIN_ROW_VALUES = 4
_PLAIN_LEAVES = (bool, int, float, str, type(None))


def first_non_plain(obj: Any, path: str = "") -> Optional[Tuple[str, str]]:
    """(path, type name) of the first value that is not plain data, or None."""
    if isinstance(obj, (torch.Tensor, BitMask) + _PLAIN_LEAVES):
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                return (f"{path}.<key>" if path else "<key>", type(k).__name__)
            hit = first_non_plain(v, f"{path}.{k}" if path else str(k))
            if hit:
                return hit
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = first_non_plain(v, f"{path}[{i}]")
            if hit:
                return hit
        return None
    return (path or "<reply>", type(obj).__name__)


def bad_metric(reply: Dict[str, Any]) -> Optional[str]:
    """Name of the first plugin metric that is not a single number, or None."""
    metrics = reply.get("metrics")
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        return "metrics"
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return f"metrics.{k}"
    return None


def _numeric_leaves(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor in a payload, plus each list/tuple of numbers as one flat float64 tensor."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numeric_leaves(v)
    elif isinstance(obj, (list, tuple)):
        flat: List[float] = []
        if _flatten_numbers(obj, flat):
            if flat:
                yield torch.tensor(flat, dtype=torch.float64)
        else:
            for v in obj:
                yield from _numeric_leaves(v)


def _flatten_numbers(obj: Any, out: List[float]) -> bool:
    for v in obj:
        if isinstance(v, (list, tuple)):
            if not _flatten_numbers(v, out):
                return False
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
        else:
            return False
    return True


class _ClientRows:
    """One client's raw rows (fingerprinted) and label vectors."""

    def __init__(self, xs: List[torch.Tensor], ys: List[torch.Tensor], weights: torch.Tensor):
        self.weights = weights
        self.storages = set()
        for t in xs + ys:
            try:
                self.storages.add(t.untyped_storage().data_ptr())
            except RuntimeError:
                pass
        first = xs[0] if xs else None
        self.row_len = int(first[0].numel()) if first is not None and len(first) else 0
        # the client's own tensors, referenced rather than copied (a float64 copy of every client's inputs was
        # the largest per-client cost of a stateless run); a row is widened to float64 only to confirm a match
        self.sources = [x.detach().reshape(len(x), -1) for x in xs] if self.row_len else []
        self.check_rows = self.row_len >= MIN_ROW_VALUES and sum(len(x) for x in self.sources) > 0
        self.index: Dict[int, List[Tuple[int, int]]] = {}
        if self.check_rows:
            for s, source in enumerate(self.sources):
                rows = _widen(source)
                varied = (rows != rows[:, :1]).any(dim=1)
                prints = _fingerprints(rows, weights)
                for i in torch.nonzero(varied).flatten().tolist():
                    self.index.setdefault(int(prints[i]), []).append((s, i))
        self.known = torch.tensor(sorted(self.index), dtype=torch.int64)
        self.labels = [y.detach().reshape(-1).to("cpu", torch.float64) + 0.0 for y in ys
                       if y.numel() >= MIN_ROW_VALUES and bool((y.reshape(-1) != y.reshape(-1)[0]).any())]


def _widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` as CPU float64 with -0.0 folded into 0.0, the form rows are fingerprinted and compared in."""
    return t.to("cpu", torch.float64) + 0.0


def _fingerprints(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """An exact-equality fingerprint per row: int64 dot product of the float64 bit patterns (wrapping arithmetic,
    so the result does not depend on summation order)."""
    bits = rows.contiguous().view(torch.int64)
    return (bits * weights[: rows.shape[1]]).sum(dim=1)


class PrivacyGuard:
    """Holds each client's fingerprints; ``violation(cid, reply)`` says why a reply must be refused, or None."""

    def __init__(self) -> None:
        self._clients: Dict[int, _ClientRows] = {}
        gen = torch.Generator().manual_seed(0x5EED)
        self._weights = torch.randint(-(2 ** 62), 2 ** 62, (1 << 16,), generator=gen, dtype=torch.int64) | 1

    def register(self, cid: int, inputs: List[torch.Tensor], labels: List[torch.Tensor]) -> None:
        weights = self._weights
        row_len = int(inputs[0][0].numel()) if inputs and len(inputs[0]) else 0
        if row_len > len(weights):  # rows longer than the weight table: extend it deterministically
            gen = torch.Generator().manual_seed(row_len)
            weights = torch.randint(-(2 ** 62), 2 ** 62, (row_len,), generator=gen, dtype=torch.int64) | 1
        self._clients[cid] = _ClientRows(inputs, labels, weights)

    def violation(self, cid: int, reply: Any) -> Optional[str]:
        plain = first_non_plain(reply)
        if plain is not None:
            return (f"reply field '{plain[0]}' holds a {plain[1]}; only tensors, numbers, strings, lists and dicts "
                    f"may leave a client (privacy boundary)")
        metric = bad_metric(reply) if isinstance(reply, dict) else None
        if metric is not None:
            return f"reply field '{metric}' is not a single number; plugin metrics must be scalars per client"
        client = self._clients.get(cid)
        if client is None:
            return None
        for t in _numeric_leaves(reply):
            reason = self._tensor_leak(client, t)
            if reason:
                return f"reply contains {reason} of the client's raw data (privacy boundary)"
        return None

    def _tensor_leak(self, client: _ClientRows, t: torch.Tensor) -> Optional[str]:
        try:
            if t.untyped_storage().data_ptr() in client.storages:
                return "a tensor sharing storage with the data"
        except RuntimeError:
            pass
        if t.is_complex() or t.numel() == 0:
            return None
        flat = t.detach().reshape(-1).to("cpu", torch.float64) + 0.0
        for labels in client.labels:
            if flat.numel() == labels.numel() and torch.equal(flat, labels):
                return "a label vector"
        if not client.check_rows:
            return None
        n = client.row_len
        candidates = []
        if flat.numel() % n == 0:
            candidates.append(flat.reshape(-1, n))
        if t.dim() == 2 and t.shape[0] == n:
            candidates.append(t.detach().to("cpu", torch.float64).t().contiguous() + 0.0)
        for rows in candidates:
            prints = _fingerprints(rows, client.weights)
            for r in torch.nonzero(torch.isin(prints, client.known)).flatten().tolist():
                for s, i in client.index[int(prints[r])]:
                    if torch.equal(rows[r], _widen(client.sources[s][i])):
                        return "an input row"
        return None
