"""Messages between the server strategy and client handlers, and what they cost on the wire.

A round is a sequence of message exchanges driven by the server (see ``server.ServerAggregator.run_round``):
the server builds one ``Message`` per addressed client, each client's handler answers with a reply payload.
Messages may differ per client (FedCAC), carry every client's upload (FedC2I), or ask client k to work on
client i's model (PCFL) -- the core only routes them, counts their bytes and checks the replies.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch


# a name that may appear in logs and metric files as it is: metric names, and reply keys quoted in messages
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,63}")


def safe_name(key: Any) -> str:
    """``key`` as it may appear in a log line: itself when it is a plain name or an int, else its type and length
    (a client's key may hold anything, e.g. raw bytes)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if isinstance(key, str) and PLAIN_NAME.fullmatch(key):
        return key
    size = f" of {len(key)} characters" if isinstance(key, str) else ""
    return f"<{type(key).__name__}{size}>"


@dataclass
class Message:
    """An instruction for one client: ``kind`` selects the handler method ``on_<kind>``."""

    kind: str
    payload: Dict[str, Any] = field(default_factory=dict)


class BitMask:
    """A boolean tensor sent as packed bits (8 mask entries per byte on the wire)."""

    __slots__ = ("packed", "shape")

    def __init__(self, mask: torch.Tensor):
        flat = mask.detach().reshape(-1).to(torch.bool).cpu()
        pad = (-flat.numel()) % 8
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
        self.packed = (flat.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
        self.shape = tuple(mask.shape)

    def unpack(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The boolean mask, of ``shape``, on ``device``."""
        n = math.prod(self.shape)
        bits = torch.bitwise_and(self.packed.unsqueeze(1),
                                 torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)) > 0
        out = bits.reshape(-1)[:n].reshape(self.shape)
        return out.to(device) if device is not None else out

    @property
    def nbytes(self) -> int:
        """The bytes the packed mask takes on the wire (one bit per entry)."""
        return int(self.packed.numel())

    def problem(self) -> str | None:
        """Why this is not a mask as ``__init__`` builds it (its slots are writable), or None: the shape must be
        a tuple of non-negative ints and ``packed`` a flat uint8 tensor of exactly the bytes the shape needs, so
        that it carries nothing but the mask and is counted right on the wire."""
        shape = getattr(self, "shape", None)
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 64:
            return "its shape is not a tuple of at most 64 non-negative ints"
        packed = getattr(self, "packed", None)
        if type(packed) is not torch.Tensor or packed.dtype != torch.uint8 or packed.dim() != 1:
            return "its buffer is not a flat uint8 tensor"
        if packed.numel() != (math.prod(shape) + 7) // 8:
            return f"its buffer holds {packed.numel()} bytes, its shape needs {(math.prod(shape) + 7) // 8}"
        return None


def payload_nbytes(obj: Any) -> int:
    """Bytes ``obj`` would occupy on the wire: tensors at their dtype's size, masks as bits, scalars as 8 bytes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, BitMask):
        return obj.nbytes
    if isinstance(obj, Mapping):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    if isinstance(obj, (int, float, bool)):
        return 8
    if isinstance(obj, str):
        return len(obj.encode())
    if obj is None:
        return 0
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    return 0


def iter_tensors(obj: Any):
    """Every tensor inside a payload (for validation)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def first_non_finite(obj: Any, path: str = "") -> str | None:
    """Path of the first floating tensor holding NaN or Inf, or None."""
    trail = _non_finite_trail(obj)
    if trail is None:
        return None
    for is_index, step in reversed(trail):  # the path is spelled out only for a hit (every reply is checked)
        path = f"{path}[{step}]" if is_index else (f"{path}.{safe_name(step)}" if path else safe_name(step))
    return path or "<payload>"


def _non_finite_trail(obj: Any) -> Optional[List[Tuple[bool, Any]]]:
    """(is a list index, key or index) steps to the first non-finite value, innermost first; None when every value
    is finite."""
    if isinstance(obj, torch.Tensor):
        # a finite sum has only finite terms (an inf or NaN term makes it inf or NaN): one cheap reduction, and the
        # elementwise test (10-100x slower) only when the sum is not finite (NaN/Inf, or finite terms overflowing it)
        if obj.is_floating_point() and not bool(torch.isfinite(obj.sum())) and not bool(torch.isfinite(obj).all()):
            return []
        return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            hit = _non_finite_trail(v)
            if hit is not None:
                hit.append((False, k))
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = _non_finite_trail(v)
            if hit is not None:
                hit.append((True, i))
                return hit
    return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path or "<payload>")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            hit = first_non_finite(v, f"{path}.{safe_name(k)}" if path else safe_name(k))
            if hit:
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = first_non_finite(v, f"{path}[{i}]")
            if hit:
                return hit
    return None
