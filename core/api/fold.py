"""Streaming aggregation: fold the reply fields of which a strategy needs only the weighted mean, one reply at a
time, into running sums; the replies themselves are dropped as they arrive.

A strategy declares such fields (``ServerAggregator.mean_fields``). The communicator folds every accepted reply
of a round in client-id order and hands the strategy one ``WeightedMean`` per field, so a round holds one
accumulator per field instead of every upload. A distributed run folds each rank's clients the same way and
all-reduces the sums (``partial``/``finish``): one mechanism on every path.

Numbers: ``sum_i w_i x_i`` accumulated in the upload's dtype (float32 for half-precision uploads), divided by
``sum_i w_i`` in float64 and rounded once to the field's dtype. ``weighted_average`` (the all-replies path)
accumulates ``(w_i / W) x_i`` instead, so the two agree to within K roundings of the dtype
(``pflkit.core.testing.fold_tolerance``, tested); any two folds of the same replies in the same order are
bit-identical. Float64 accumulators were measured 10x slower per reply (a mixed-dtype add is not one fused
kernel) for no gain over float32's K-rounding bound, which the all-replies path has too.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .protocol import safe_name
from .state import State, WeightedMean

Layout = List[Tuple[str, Tuple[int, ...], torch.dtype]]


def layout_of(state: Dict[str, torch.Tensor]) -> Layout:
    """Keys, shapes and dtypes of a state, in its order: replies folded together must share it."""
    return [(k, tuple(v.shape), v.dtype) for k, v in state.items()]


def layout_problem(value: Any, layout: Layout) -> Optional[str]:
    """How ``value`` (a reply field) differs from ``layout`` (the keys, shapes and dtypes the server expects), or
    None when it matches: the same keys (in any order), each a tensor of the expected shape and dtype."""
    if not isinstance(value, dict):
        return "is not a dict of tensors"
    expected = {k: (shape, dt) for k, shape, dt in layout}
    missing = [k for k in expected if k not in value]
    if missing:
        return f"lacks key '{safe_name(missing[0])}'" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    extra = [k for k in value if k not in expected]
    if extra:
        return f"has key '{safe_name(extra[0])}' the server does not expect" + \
            (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
    for k, (shape, dt) in expected.items():
        v = value[k]
        if not isinstance(v, torch.Tensor):
            return f"key '{safe_name(k)}' is not a tensor"
        if v.dtype != dt:
            return f"key '{safe_name(k)}' is {str(v.dtype).replace('torch.', '')}, the server expects " \
                   f"{str(dt).replace('torch.', '')}"
        if tuple(v.shape) != shape:
            return f"key '{safe_name(k)}' has shape {list(v.shape)}, the server expects {list(shape)}"
    return None


def foldable(reply: Dict[str, Any], field: str, weighted_by_samples: bool) -> Optional[str]:
    """Why ``reply[field]`` cannot enter a weighted sum, or None."""
    value = reply[field]
    if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
        return f"'{field}' is not a dict of tensors"
    n = reply.get("num_samples")
    if weighted_by_samples and (isinstance(n, bool) or not isinstance(n, (int, float))):
        return "the reply has no numeric 'num_samples' to weight it by"
    return None


def unflatten(flat: torch.Tensor, layout: Layout, ints: Dict[str, torch.Tensor], device: torch.device) -> State:
    """The state of ``layout`` from the flat mean of its floating keys; integer keys (BN batch counters) take the
    first contributing client's value, as ``weighted_average`` does."""
    out: State = {}
    at = 0
    for k, shape, dt in layout:
        if dt.is_floating_point:
            n = math.prod(shape)
            out[k] = flat[at:at + n].reshape(shape).to(device=device, dtype=dt)
            at += n
        else:
            out[k] = ints[k].to(device).clone()
    return out


def fold_mean(states: Sequence[State], weights: Sequence[float]) -> State:
    """The weighted mean of ``states`` with streaming aggregation's arithmetic (running sums in the given order,
    one rounding): what a strategy that needs every upload computes when its mean must equal a streamed one bit for
    bit (IFCA with one cluster is FedAvg; FedGen without its regulariser is FedAvg).

    States that are each finite can still take float32 running sums past their range (two uploads of 2e38): then,
    and only then, the sums run in float64 and each key comes back in its own dtype, because the mean of finite
    values is finite and a strategy must not receive inf for it."""
    if not states:
        raise ValueError("fold_mean of no states")
    if _sums_would_overflow(states, weights):
        wide = [{k: v.to(torch.float64) if v.is_floating_point() else v for k, v in s.items()} for s in states]
        mean = _fold_states(wide, weights)
        return {k: v.to(states[0][k].dtype) for k, v in mean.items()}
    return _fold_states(states, weights)


def _fold_states(states: Sequence[State], weights: Sequence[float]) -> State:
    fold = FieldFold("params")
    for i, (state, weight) in enumerate(zip(states, weights)):
        problem = fold.check(i, state)
        if problem is not None:
            raise ValueError(f"state {i}: {problem}")
        fold.add(i, state, float(weight))
    return fold.mean(next(iter(states[0].values())).device if states[0] else torch.device("cpu")).state


def _sums_would_overflow(states: Sequence[State], weights: Sequence[float]) -> bool:
    """Whether ``sum w_i max|x_i|`` (the fold's bound on every running sum) passes the sums' headroom."""
    probe = FieldFold("params")
    for state, weight in zip(states, weights):
        weight = float(weight)
        if not math.isfinite(weight) or weight <= 0:
            continue  # not an overflow: the fold itself takes (or refuses) such weights as before
        why, bound = probe.overflow(state, weight)
        if why is not None:
            return True
        probe.bound = bound
    return False


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The running sum's dtype: the upload's own for float32 and float64, float32 for half-precision uploads (their
    sums would lose too much)."""
    return torch.promote_types(dtype, torch.float32)


def headroom(dtype: torch.dtype) -> float:
    """The largest value a running sum of ``dtype`` may reach: half its range, so that the roundings of the
    accumulation (relative 2**-24 each, far less in all) can never carry a sum past it to inf."""
    return torch.finfo(dtype).max / 2


class FieldFold:
    """The running ``sum w_i x_i`` (one accumulator per floating key) and ``sum w_i`` of one reply field.

    ``layout``: the keys, shapes and dtypes every folded value must have: the server's (the aggregator declares it,
    ``ServerAggregator.reply_layout``), so a malformed reply is refused whatever its position. Without one, the
    first folded value sets it: only for arithmetic over states the caller has vetted already (``fold_mean``).

    A finite reply can never overflow the sums: ``bound`` is ``sum_i w_i max|x_i|``, an upper bound on every
    accumulated element; a reply that would take it past ``headroom`` is refused before anything is added (one
    min-max pass over the upload, about the add's own cost)."""

    __slots__ = ("field", "acc", "weight", "first_cid", "layout", "ints", "float_keys", "bound", "limit", "declared")

    def __init__(self, field: str, layout: Optional[Layout] = None) -> None:
        self.field = field
        self.acc: Optional[List[torch.Tensor]] = None
        self.weight = 0.0
        self.bound = 0.0
        self.first_cid: Optional[int] = None
        self.ints: Dict[str, torch.Tensor] = {}
        self.layout: Optional[Layout] = None
        self.float_keys: List[str] = []
        self.limit = 0.0
        self.declared = layout is not None
        if layout is not None:
            self._set_layout(list(layout))

    def _set_layout(self, layout: Layout) -> None:
        self.layout = layout
        self.float_keys = [k for k, _, dt in layout if dt.is_floating_point]
        dtypes = [accumulator_dtype(dt) for _, _, dt in layout if dt.is_floating_point]
        self.limit = min((headroom(dt) for dt in dtypes), default=math.inf)

    @property
    def folded(self) -> bool:
        return self.acc is not None

    def check(self, cid: int, value: Dict[str, torch.Tensor]) -> Optional[str]:
        if self.layout is None:
            return None
        problem = layout_problem(value, self.layout)
        if problem is None:
            return None
        if not self.declared:
            return f"its '{self.field}' has other keys, shapes or dtypes than client {self.first_cid}'s"
        return f"its '{self.field}' {problem}"

    def overflow(self, value: Dict[str, torch.Tensor], weight: float) -> Tuple[Optional[str], float]:
        """(why adding ``weight * value`` could overflow the sums, or None; the new bound)."""
        if not math.isfinite(weight) or weight <= 0:
            return f"its weight {weight!r} is not a positive finite number", self.bound
        layout = self.layout if self.layout is not None else layout_of(value)
        keys = self.float_keys if self.layout is not None else [k for k, _, dt in layout if dt.is_floating_point]
        limit = self.limit if self.layout is not None else \
            min((headroom(accumulator_dtype(dt)) for _, _, dt in layout if dt.is_floating_point), default=math.inf)
        tensors = [value[k].detach() for k in keys if value[k].numel()]
        if not tensors:
            return None, self.bound
        if weight > limit:
            return f"its weight {weight:.3g} would overflow the round's sums", self.bound
        # min and max of each tensor in one pass (aminmax), one sync in all: the largest magnitude
        ends = [torch.aminmax(t) for t in tensors]
        peak = float(torch.stack([e.max for e in ends] + [-e.min for e in ends]).max())
        bound = self.bound + weight * peak
        if not bound <= limit:  # also catches NaN
            return (f"its '{self.field}' (largest magnitude {peak:.3g}, weight {weight:.3g}) would overflow the "
                    f"round's sums"), self.bound
        return None, bound

    def add(self, cid: int, value: Dict[str, torch.Tensor], weight: float, bound: Optional[float] = None) -> None:
        if self.layout is None:  # not declared: the first folded value's (fold_mean over vetted states)
            self._set_layout(layout_of(value))
        floats = [value[k].detach() for k in self.float_keys]
        if self.acc is None:
            self.first_cid = cid
            self.ints = {k: value[k].detach().clone() for k, _, dt in self.layout if not dt.is_floating_point}
            self.acc = [v.to(accumulator_dtype(v.dtype)).mul(weight) for v in floats]
        elif self.acc:  # one fused multi-tensor kernel per reply (torch._foreach), no flattened copy of the upload
            same = [v if v.dtype == a.dtype and v.device == a.device else v.to(a) for v, a in zip(floats, self.acc)]
            torch._foreach_add_(self.acc, same, alpha=weight)
        self.weight += weight
        if bound is not None:
            self.bound = bound

    def flat(self) -> torch.Tensor:
        """The sums as one float64 vector (the distributed all-reduce's buffer)."""
        parts = [a.reshape(-1).to(torch.float64) for a in self.acc or []]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def mean(self, device: torch.device) -> WeightedMean:
        return WeightedMean(unflatten(self.flat() / self.weight, self.layout, self.ints, device), self.weight)


class MeanFold:
    """Folds the ``fields`` of accepted replies, one reply at a time, in the order they are given.

    ``weight_of``: the strategy's ``reply_weight`` (None: the reply's ``num_samples``). ``layouts``: field -> the
    keys, shapes and dtypes the server expects of it (the communicator always passes the aggregator's declaration;
    a field without one takes its first folded reply's, for callers that fold states they vetted themselves).
    ``add`` returns the reply without its folded fields (None in their place, so the key order stays) or, when a
    field cannot be folded (another layout, a weight that is not a positive finite number, sums it would
    overflow), leaves the sums untouched and returns the reason: the caller rejects that client like any refused
    reply.
    """

    def __init__(self, fields: Sequence[str], weight_of: Optional[Callable[[Dict[str, Any]], float]] = None,
                 layouts: Optional[Dict[str, Layout]] = None) -> None:
        self.fields = tuple(fields)
        self.weight_of = weight_of
        layouts = layouts or {}
        self.folds: Dict[str, FieldFold] = {f: FieldFold(f, layouts.get(f)) for f in self.fields}

    def __bool__(self) -> bool:
        return bool(self.fields)

    def add(self, cid: int, reply: Any) -> Tuple[Any, Optional[str]]:
        present = [f for f in self.fields if isinstance(reply, dict) and f in reply]
        if not present:
            return reply, None
        for f in present:  # check every field before folding any: a refused reply leaves no trace in the sums
            problem = foldable(reply, f, self.weight_of is None) or self.folds[f].check(cid, reply[f])
            if problem is not None:
                return reply, problem
        weight = float(self.weight_of(reply)) if self.weight_of is not None else float(reply["num_samples"])
        bounds = []
        for f in present:
            problem, bound = self.folds[f].overflow(reply[f], weight)
            if problem is not None:
                return reply, problem
            bounds.append(bound)
        for f, bound in zip(present, bounds):
            self.folds[f].add(cid, reply[f], weight, bound)
        return {k: None if k in present else v for k, v in reply.items()}, None

    def means(self, device: torch.device) -> Dict[str, WeightedMean]:
        """field -> the weighted mean of every folded reply's field (fields no reply held are absent)."""
        return {f: fold.mean(device) for f, fold in self.folds.items() if fold.folded}

    @staticmethod
    def restore(replies: Dict[int, Dict[str, Any]], folded: Dict[int, Sequence[str]],
                means: Dict[str, WeightedMean]) -> None:
        """Put the shared ``WeightedMean`` of each folded field back into every reply that held it (in place)."""
        for cid, fields in folded.items():
            reply = replies[cid]
            for f in fields:
                reply[f] = means[f]
