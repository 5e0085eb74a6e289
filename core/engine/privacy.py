"""The privacy boundary: what a client's reply may contain before the server sees it.

What it guarantees (checked on every reply, before the server, the logs or the byte counters see it):

1. **Plain data only.** A reply is built from tensors, ``BitMask``, Python numbers, booleans, strings and ``None``,
   nested in dicts (string or integer keys), lists and tuples. Anything else -- numpy arrays, bytes, sets, objects
   of any other class (which could wrap anything) -- is refused. Attributes are payload too: Python attributes
   or slots on a tensor, a dict, a list, a string... (e.g. a state dict's ``_metadata``) are checked like any
   other field, and a ``BitMask`` must be well formed (a flat uint8 buffer of exactly the bytes its shape needs).
2. **Metrics are named scalars.** ``reply["metrics"]`` maps names matching ``METRIC_NAME`` (at most 64 letters,
   digits and ``_ . / -``) to single numbers, so nothing but per-client scalars under plain names reaches
   ``metrics.jsonl`` and TensorBoard.
3. **No raw samples.** A reply is refused when a tensor in it overlaps the memory of the client's data tensors,
   or when it contains one of the client's raw input rows (train or test), or one of its label vectors. A row is
   found in any dtype, at any offset of a tensor's values in row-major order, along any other dimension of the
   tensor at least as long as the row (a row as a column of a 2-D tensor, along dim 0 or 1 of a 3-D one...), in
   a ``BitMask``'s buffer, and in a list or tuple, whose numbers, 0-d and larger tensors are read in order as one
   sequence (strings, ``None`` and nested dicts in between are skipped). Rows are fingerprinted once at start-up
   (a polynomial hash of each row, compared at every offset with a rolling hash in linear time); each candidate
   match is then confirmed exactly against the client's data, so no model is refused by chance. Rows of fewer
   than ``MIN_ROW_VALUES`` values and constant rows or label vectors are not checked: a match would be chance,
   and their content is public (label counts are in ``partition.json``). Nor are rows holding NaN: NaN equals
   nothing, so no match could be confirmed (datasets holding NaN are refused when they are loaded anyway),
   and they cost nothing. A label vector is caught as a whole tensor or list, not inside a longer one.

What it is not: a sandbox. Plugin code runs in the same process as the core; code written to leak (encoding data
into model weights, into strings, into floats one value at a time, permuting a row's values) is not stopped by
these checks. They catch mistakes. Isolation from malicious plugin code needs clients in separate processes or
machines, which the execution backends are designed for.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..api.protocol import PLAIN_NAME, BitMask, safe_name

MIN_ROW_VALUES = 4
# at most this many distinct row values per client are kept for the may-hold-a-row shortcut (8 KiB a client)
MAX_VALUE_SET = 1024
METRIC_NAME = PLAIN_NAME
_PLAIN_LEAVES = (bool, int, float, str, type(None))
_EXACT_LEAVES = frozenset(_PLAIN_LEAVES)
_NO_ATTRIBUTES = _EXACT_LEAVES | {dict, list, tuple}  # instances of these cannot carry attributes
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# the rolling hash's base (odd, so every power is invertible modulo 2^64); positions are hashed
# in chunks of _CHUNK, so a reply's scan needs O(_CHUNK + row length) memory whatever its size
_BASE = 0x9E3779B97F4A7C15
_CHUNK = 1 << 16
# splitmix64's finaliser (shift, multiplier) steps, applied to each value's bit pattern before it is hashed: the
# patterns of round values (0.0, 1.0, anything of float32 origin) end in up to 52 zero bits, and multiplying them raw
# kept as few bits of a row (Adult's one-hot rows shared a few thousand hashes, so the zero windows of a gradient
# became candidates compared exactly against thousands of rows: minutes a reply). 0 still hashes to 0.
_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))


def _int64(v: int) -> int:
    v %= 1 << 64
    return v - (1 << 64) if v >= 1 << 63 else v


def _mix_(bits: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns, in place (``scratch``: a buffer of the same size); int64
    arithmetic wraps, and the right shifts are made logical by masking the sign bits they copy."""
    for shift, multiplier in _MIX:
        torch.bitwise_right_shift(bits, shift, out=scratch)
        bits.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1))
        if multiplier is not None:
            bits.mul_(_int64(multiplier))
    return bits


def _attributes(obj: Any) -> Dict[str, Any]:
    """Python attributes and slot values an object carries besides its content (both are payload)."""
    if type(obj) in _NO_ATTRIBUTES:
        return {}
    out = dict(getattr(obj, "__dict__", None) or {})
    for cls in type(obj).__mro__:
        if cls.__module__ == "builtins" or cls in _TENSOR_TYPES:
            continue
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out[name] = getattr(obj, name)
    return out


def first_non_plain(obj: Any, path: str = "") -> Optional[Tuple[str, str]]:
    """(path, what is wrong) of the first value that is not plain data, or None."""
    found = _non_plain_trail(obj)
    if found is None:
        return None
    trail, what = found
    for kind, step in reversed(trail):  # the path is spelled out only for a hit (every reply is checked)
        if kind == "index":
            path = f"{path}[{step}]"
        elif kind == "attribute":
            path = f"{path}.<attribute {safe_name(step)}>"
        elif kind == "key-type":
            path = f"{path}.<key>" if path else "<key>"
        else:
            path = f"{path}.{safe_name(step)}" if path else safe_name(step)
    return path or "<reply>", what


def _non_plain_trail(obj: Any) -> Optional[Tuple[List[Tuple[str, Any]], str]]:
    """((kind, step) innermost first, what is wrong) for the first value that is not plain data, or None."""
    if isinstance(obj, BitMask):
        if type(obj) is not BitMask:
            return [], f"{type(obj).__name__} (a BitMask subclass)"
        problem = obj.problem()
        return None if problem is None else ([], f"malformed BitMask ({problem})")
    if isinstance(obj, torch.Tensor):
        if type(obj) not in _TENSOR_TYPES:
            return [], f"{type(obj).__name__} (a tensor subclass)"
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:  # only dense values can be checked
            return [], f"tensor of layout {obj.layout}, dtype {obj.dtype} on {obj.device}"
    if not isinstance(obj, _TENSOR_TYPES + _PLAIN_LEAVES + (dict, list, tuple)):
        return [], type(obj).__name__
    for name, value in _attributes(obj).items():  # e.g. a state dict's _metadata
        hit = _non_plain_trail(value)
        if hit:
            hit[0].append(("attribute", name))
            return hit
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                return [("key-type", None)], type(k).__name__
            hit = _non_plain_trail(v)
            if hit:
                hit[0].append(("key", k))
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = _non_plain_trail(v)
            if hit:
                hit[0].append(("index", i))
                return hit
    return None


def bad_metric(reply: Dict[str, Any]) -> Optional[str]:
    """Why ``reply["metrics"]`` may not reach the logs (a name or a value), or None."""
    metrics = reply.get("metrics")
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        return "field 'metrics' is not a dict of named numbers"
    for k, v in metrics.items():
        if not isinstance(k, str) or not METRIC_NAME.fullmatch(k):
            return (f"metric name {safe_name(k)} is not a plain name (1-64 letters, digits, '_', '.', '/', '-', "
                    f"not starting with '.', '/' or '-')")
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return f"field 'metrics.{k}' is not a single number; plugin metrics must be scalars per client"
    return None


def _sequences(obj: Any) -> Iterator[Tuple[str, Any]]:
    """What is scanned for raw rows: ('tensor', t) for every tensor (its storage, its values in row-major order
    and along its other dimensions) and ('values', flat float64) for every list/tuple's numbers read in order."""
    if isinstance(obj, torch.Tensor):
        yield "tensor", obj
    elif isinstance(obj, BitMask):
        yield "tensor", obj.packed
        yield "values", torch.tensor([float(v) for v in obj.shape], dtype=torch.float64)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _sequences(v)
    elif isinstance(obj, (list, tuple)):
        parts: List[torch.Tensor] = []
        numbers: List[float] = []
        nested: List[Any] = []
        _collect(obj, parts, numbers, nested)
        if numbers:
            parts.append(torch.tensor(numbers, dtype=torch.float64))
        if len(parts) > 1 or (parts and not any(parts[0] is v for v in nested)):  # a lone tensor: read below
            yield "values", torch.cat([_widen(p.reshape(-1)) for p in parts])
        for item in nested:
            yield from _sequences(item)
    if type(obj) not in _EXACT_LEAVES and not isinstance(obj, BitMask):
        attrs = _attributes(obj)
        if attrs:
            yield from _sequences(attrs)


def _collect(seq: Any, parts: List[torch.Tensor], numbers: List[float], nested: List[Any]) -> None:
    """Numbers and tensors of a list (through nested lists/tuples) in order; tensors and dicts also go to
    ``nested`` (their own storage and dimension checks)."""
    for v in seq:
        if type(v) not in _EXACT_LEAVES and not isinstance(v, (torch.Tensor, dict, BitMask)):
            attrs = _attributes(v)  # a subclass of str, int, list... carrying attributes
            if attrs:
                nested.append(attrs)
        if isinstance(v, (bool, int, float)):
            numbers.append(float(v))
        elif isinstance(v, torch.Tensor):
            if numbers:
                parts.append(torch.tensor(numbers, dtype=torch.float64))
                numbers.clear()
            if not v.is_complex():
                parts.append(v)
            nested.append(v)
        elif isinstance(v, (list, tuple)):
            _collect(v, parts, numbers, nested)
        elif isinstance(v, (dict, BitMask)):
            nested.append(v)


class _ClientRows:
    """One client's raw rows (fingerprinted), the memory they occupy, and its label vectors."""

    def __init__(self, xs: List[torch.Tensor], ys: List[torch.Tensor], hasher: "_RollingHash"):
        self.memory: List[Tuple[int, int]] = []
        for t in xs + ys:
            try:
                storage = t.untyped_storage()
                self.memory.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
            except RuntimeError:
                pass
        first = next((x for x in xs if len(x)), None)  # a split may be empty (e.g. a client tested on nothing)
        self.row_len = int(first[0].numel()) if first is not None else 0
        # the client's own tensors, referenced rather than copied (a float64 copy of every client's inputs was
        # the largest per-client cost of a stateless run); a row is widened to float64 only to confirm a match
        self.sources = [x.detach().reshape(len(x), self.row_len) for x in xs if len(x)] if self.row_len else []
        self.check_rows = self.row_len >= MIN_ROW_VALUES and sum(len(x) for x in self.sources) > 0
        self.index: Dict[int, List[Tuple[int, int]]] = {}
        fewest_nonzero = self.row_len  # the fewest non-zero values a checked row holds (see min_nonzero below)
        if self.check_rows:
            for s, source in enumerate(self.sources):
                rows = _widen(source)
                # a row holding NaN equals nothing (torch.equal), so no match of it could ever be confirmed; its
                # fingerprint would only make every all-NaN window of a NaN model a candidate, each compared
                # exactly against every such row (20-400x the cost of a round), so it is not fingerprinted
                checked = (rows != rows[:, :1]).any(dim=1) & ~rows.isnan().any(dim=1)
                if bool(checked.any()):
                    fewest_nonzero = min(fewest_nonzero, int((rows[checked] != 0).sum(dim=1).min()))
                prints = hasher.rows(rows)
                for i in torch.nonzero(checked).flatten().tolist():
                    self.index.setdefault(int(prints[i]), []).append((s, i))
        self.known = torch.tensor(sorted(self.index), dtype=torch.int64)
        self.filter = _Filter(self.known)
        self.labels = [y.detach().reshape(-1).to("cpu", torch.float64) + 0.0 for y in ys
                       if y.numel() >= MIN_ROW_VALUES and bool((y.reshape(-1) != y.reshape(-1)[0]).any())]
        # the distinct values of the checked rows, when they are few (uint8 images: at most 256): a tensor holding
        # fewer than row_len of them cannot hold a row in any layout, so its scans are skipped (trained weights
        # are rarely exact pixel values); None when the rows have many distinct values (no shortcut then)
        self.values: Optional[torch.Tensor] = None
        if self.check_rows and self.index:
            distinct = torch.unique(torch.cat([torch.unique(_widen(source)) for source in self.sources]))
            distinct = distinct[~distinct.isnan()]  # every NaN is distinct to unique(); no checked row holds one
            if len(distinct) <= MAX_VALUE_SET:
                self.values = distinct
        self.screens = _screens(self.values) if self.values is not None else {}
        # the fewest non-zero values a checked row holds: a tensor holding fewer non-zero row values holds no row
        # (gradients and sparse weights are full of exact zeros, which one-hot and image rows also hold, so the
        # count of all row values alone rarely settles anything there)
        self.zero_is_value = self.values is not None and bool((self.values == 0).any())
        self.min_nonzero = fewest_nonzero if self.zero_is_value else self.row_len

    def may_hold_a_row(self, t: torch.Tensor) -> bool:
        """False only when ``t`` holds fewer values from the client's rows than a row has, or fewer non-zero ones
        than the sparsest checked row (a sound shortcut)."""
        if self.values is None:
            return True
        return self._enough(_widen(t.reshape(-1)))

    def _enough(self, flat: torch.Tensor) -> bool:
        """Whether the float64 values ``flat`` hold as many row values as a row and as many non-zero row values as
        the sparsest checked row."""
        found = self._row_values(flat)
        if found < self.row_len:
            return False
        return not self.zero_is_value or found - int((flat == 0).sum()) >= self.min_nonzero

    def none_may_hold_a_row(self, parts: List[torch.Tensor]) -> bool:
        """True when ``parts`` together hold fewer values from the client's rows than a row has: then none of them
        can hold a row (each one's count is at most the total), and one count replaces a count per tensor."""
        if self.values is None or not parts:
            return False
        flats = [p.reshape(-1) for p in parts]
        screened, zeros = self._screened(flats)  # an upper bound of the count, cheaper than the count
        if screened < self.row_len or (zeros is not None and screened - zeros < self.min_nonzero):
            return True
        if all(f.dtype == flats[0].dtype for f in flats):  # one copy to float64, the values as _widen gives them
            joined = _widen(torch.cat(flats))
        else:
            joined = torch.cat([_widen(f) for f in flats])
        return not self._enough(joined)

    def _screened(self, flats: List[torch.Tensor]) -> Tuple[int, Optional[int]]:
        """An upper bound of how many of ``flats``' values are values of the client's rows: float32 and float64
        values are looked up by the low bits of their bit patterns (a value equal to a row value has its bit
        pattern, -0.0 folded into 0.0, so it is always counted; others collide now and then); values of other
        dtypes are counted exactly. With it, when 0 is a row value, the number of zeros among the counted values
        (every zero is counted then), so that the difference bounds the non-zero row values; else None."""
        total, zeros = 0, 0
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for f in flats:
            by_dtype.setdefault(f.dtype, []).append(f)
        for dtype, group in by_dtype.items():
            joined = torch.cat(group) if len(group) > 1 else group[0]
            if self.zero_is_value:
                zeros += int((joined == 0).sum())
            screen = self.screens.get(dtype)
            if screen is None:
                total += self._row_values(_widen(joined))
                continue
            table, mask, itype = screen
            bits = (joined + 0.0).view(itype).bitwise_and_(mask)
            total += int(table.index_select(0, bits).sum())
        return total, (zeros if self.zero_is_value else None)

    def _row_values(self, flat: torch.Tensor) -> int:
        """How many of the float64 values ``flat`` are values of the client's rows."""
        at = torch.searchsorted(self.values, flat).clamp_(max=len(self.values) - 1)
        return int((self.values.index_select(0, at) == flat).sum())


def _screens(values: torch.Tensor) -> Dict[torch.dtype, Tuple[torch.Tensor, int, torch.dtype]]:
    """For float32 and float64: a table over the low bits of bit patterns marking those of the row values that the
    dtype holds exactly (``_ClientRows._screened``), its mask and the integer dtype of the patterns. 2^10 to 2^16
    one-byte entries, about 64 per value, so that few other values collide."""
    width = min(16, max(10, (len(values) - 1).bit_length() + 6))
    mask = (1 << width) - 1
    out = {}
    for dtype, itype in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        held = values.to(dtype)
        held = held[held.to(torch.float64) == values]  # a value the dtype cannot hold equals none of its values
        table = torch.zeros(1 << width, dtype=torch.uint8)
        table[held.view(itype).bitwise_and(mask).long()] = 1
        out[dtype] = (table, mask, itype)
    return out


def _real(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, a complex tensor as its real view (real and imaginary parts along a last dimension)."""
    return torch.view_as_real(t.detach()) if t.is_complex() else t.detach()


def _widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` as CPU float64 with -0.0 folded into 0.0, the form rows are fingerprinted and compared in."""
    return t.detach().to("cpu", torch.float64, copy=True).add_(0.0)


class _Filter:
    """A bit set over the high bits of a client's row hashes (8 bytes per row): a window whose bit is clear
    cannot be a row, so only about 1 window in 64 is looked up exactly."""

    def __init__(self, known: torch.Tensor):
        self.shift = 64 - max(6, int(len(known) * 64 - 1).bit_length())
        self.words = torch.zeros(1 << (64 - self.shift - 6), dtype=torch.int64)
        slots = (known >> self.shift) & ((1 << (64 - self.shift)) - 1)
        for word, bit in zip((slots >> 6).tolist(), (slots & 63).tolist()):
            self.words[word] |= _int64(1 << bit)


class _RollingHash:
    """h(v[p:p+n]) = sum_j mix(bits(v[p+j])) * B^j mod 2^64 of float64 bit patterns, for one row or for every offset p
    of a sequence.

    Wrapping int64 arithmetic, so the result does not depend on summation order. At offset p the prefix sums
    give B^p * h, and B's inverse power undoes the B^p: one pass over the sequence whatever the row length.
    Sequences are read in chunks of _CHUNK windows into buffers kept between replies (fresh multi-megabyte
    buffers per reply cost more in page faults than the arithmetic). ``mix`` (splitmix64's finaliser) spreads the
    bits of round values over the whole word; a hash's high bits pick its filter bit."""

    def __init__(self) -> None:
        self._pow = torch.ones(1, dtype=torch.int64)
        self._inv = torch.ones(1, dtype=torch.int64)
        self._buffers: Dict[str, torch.Tensor] = {}

    def _tables(self, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(self._pow) < size:
            size = max(size, 2 * len(self._pow))
            self._pow = torch.cat([torch.ones(1, dtype=torch.int64),
                                   torch.full((size - 1,), _int64(_BASE), dtype=torch.int64).cumprod(0)])
            inverse = pow(_BASE, -1, 1 << 64)
            self._inv = torch.cat([torch.ones(1, dtype=torch.int64),
                                   torch.full((size - 1,), _int64(inverse), dtype=torch.int64).cumprod(0)])
        return self._pow, self._inv

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or len(buf) < size:
            buf = self._buffers[name] = torch.empty(size, dtype=dtype)
        return buf[:size]

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        powers, _ = self._tables(rows.shape[1])
        bits = rows.contiguous().view(torch.int64).clone()
        return (_mix_(bits, torch.empty_like(bits)) * powers[: rows.shape[1]]).sum(dim=1)

    def candidates(self, source: torch.Tensor, n: int, filt: _Filter
                   ) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(values, offsets, hashes) per chunk of the 1-D ``source``: the chunk's values as float64 (-0.0 folded
        into 0.0) and the offsets in it, with their hashes, of the length-n windows whose filter bit is set."""
        total = len(source) - n + 1
        powers, inverse = self._tables(min(total, _CHUNK) + n)
        for start in range(0, total, _CHUNK):
            count = min(_CHUNK, total - start)
            m = count + n - 1
            values = self._buffer("values", m, torch.float64)
            values.copy_(source[start: start + m]).add_(0.0)
            terms = self._buffer("terms", m, torch.int64)
            terms.copy_(values.view(torch.int64))
            _mix_(terms, self._buffer("scratch", m, torch.int64)).mul_(powers[:m])
            prefix = self._buffer("prefix", m + 1, torch.int64)
            prefix[0] = 0
            torch.cumsum(terms, 0, out=prefix[1:])
            hashes = self._buffer("hashes", count, torch.int64)
            torch.sub(prefix[n: n + count], prefix[:count], out=hashes).mul_(inverse[:count])
            slots = self._buffer("slots", count, torch.int64)
            torch.bitwise_right_shift(hashes, filt.shift, out=slots)
            slots.bitwise_and_((1 << (64 - filt.shift)) - 1)
            word_at = self._buffer("word_at", count, torch.int64)
            torch.bitwise_right_shift(slots, 6, out=word_at)
            words = self._buffer("words", count, torch.int64)
            torch.index_select(filt.words, 0, word_at, out=words)
            words.bitwise_right_shift_(slots.bitwise_and_(63)).bitwise_and_(1)
            offsets = torch.nonzero(words).flatten()
            if len(offsets):
                yield values, offsets, hashes.index_select(0, offsets)


class PrivacyGuard:
    """Holds each client's fingerprints; ``violation(cid, reply)`` says why a reply must be refused, or None."""

    def __init__(self) -> None:
        self._clients: Dict[int, _ClientRows] = {}
        self._hash = _RollingHash()

    def register(self, cid: int, inputs: List[torch.Tensor], labels: List[torch.Tensor]) -> None:
        self._clients[cid] = _ClientRows(inputs, labels, self._hash)

    def violation(self, cid: int, reply: Any) -> Optional[str]:
        plain = first_non_plain(reply)
        if plain is not None:
            return (f"reply field '{plain[0]}' holds a {plain[1]}; only tensors, numbers, strings, lists and dicts "
                    f"may leave a client (privacy boundary)")
        metric = bad_metric(reply) if isinstance(reply, dict) else None
        if metric is not None:
            return f"reply {metric}"
        client = self._clients.get(cid)
        if client is None:
            return None
        items = list(_sequences(reply))
        # trained weights rarely hold a row's values at all: one count over the whole reply settles that for every
        # tensor at once (the per-tensor count, then the row scans, run only when the reply holds enough of them)
        clear = client.check_rows and client.none_may_hold_a_row(
            [_real(item) for _, item in items if item.numel()])
        for kind, item in items:
            reason = self._tensor_leak(client, item, clear) if kind == "tensor" else \
                self._values_leak(client, item, clear)
            if reason:
                return f"reply contains {reason} (privacy boundary)"
        return None

    def _tensor_leak(self, client: _ClientRows, t: torch.Tensor, clear: bool = False) -> Optional[str]:
        try:
            storage = t.untyped_storage()
            start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
            if any(start < hi and lo < end for lo, hi in client.memory):
                return "a tensor sharing memory with the client's raw data"
        except RuntimeError:
            pass
        if t.numel() == 0:
            return None
        t = _real(t)  # real parts along dim -2
        flat = t.reshape(-1)
        if not client.check_rows or clear or not client.may_hold_a_row(t):
            return self._labels_leak(client, flat)
        reason = self._labels_leak(client, flat) or self._rows_leak(client, flat)
        if reason:
            return reason
        for dim in range(t.dim() - 1):  # rows running along another dimension (columns of a matrix, ...)
            if t.shape[dim] >= client.row_len:
                reason = self._rows_leak(client, t.movedim(dim, -1).reshape(-1))
                if reason:
                    return reason
        return None

    @staticmethod
    def _labels_leak(client: _ClientRows, flat: torch.Tensor) -> Optional[str]:
        for labels in client.labels:
            if flat.numel() == labels.numel() and torch.equal(_widen(flat), labels):
                return "a label vector of the client's raw data"
        return None

    def _values_leak(self, client: _ClientRows, flat: torch.Tensor, clear: bool = False) -> Optional[str]:
        """``flat``: a 1-D tensor of any real dtype, read in order."""
        reason = self._labels_leak(client, flat)
        if reason or not client.check_rows or clear or not client.may_hold_a_row(flat):
            return reason
        return self._rows_leak(client, flat)

    def _rows_leak(self, client: _ClientRows, source: torch.Tensor) -> Optional[str]:
        n, known = client.row_len, client.known
        if source.numel() < n or not len(known):
            return None
        for values, offsets, hashes in self._hash.candidates(source, n, client.filter):
            at = torch.searchsorted(known, hashes).clamp_(max=len(known) - 1)
            for p, h in zip(offsets[known.index_select(0, at) == hashes].tolist(),
                            hashes[known.index_select(0, at) == hashes].tolist()):
                window = values[p: p + n]
                for s, i in client.index[h]:
                    if torch.equal(window, _widen(client.sources[s][i])):
                        return "an input row of the client's raw data"
        return None
