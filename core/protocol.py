"""Messages between the server strategy and client handlers, and what they cost on the wire.

A round is a sequence of message exchanges driven by the server (see ``server.ServerAggregator.run_round``):
the server builds one ``Message`` per addressed client, each client's handler answers with a reply payload.
Messages may differ per client (FedCAC), carry every client's upload (FedC2I), or ask client k to work on
client i's model (PCFL) -- the core only routes them, counts their bytes and checks the replies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

import torch


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
        n = math.prod(self.shape)
        bits = torch.bitwise_and(self.packed.unsqueeze(1),
                                 torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)) > 0
        out = bits.reshape(-1)[:n].reshape(self.shape)
        return out.to(device) if device is not None else out

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel())


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
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            return path or "<payload>"
        return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path or "<payload>")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            hit = first_non_finite(v, f"{path}.{k}" if path else str(k))
            if hit:
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = first_non_finite(v, f"{path}[{i}]")
            if hit:
                return hit
    return None
