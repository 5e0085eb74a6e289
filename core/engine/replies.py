"""What the core expects of each reply, from what it knows itself: never from another client's reply.

- Uploaded tensor fields have the layout the server declares (``ServerAggregator.reply_layout``: the server
  model's keys, shapes and dtypes by default), so a malformed reply is refused whatever its position.
- A training reply's ``num_samples`` is an int from 1 to the client's training-split size (or the larger count
  its algorithm declares, ``ServerAggregator.reply_sample_limit``).
- An evaluate reply's sums (``evaluate``, and ``evaluate_global``: the global model's evaluation) are over the
  client's own test split: ``loss_sum`` and ``metric_sum`` present, finite and >= 0, a classification
  ``metric_sum`` at most the split's size; its count is the core's own (a reply that states another one is
  refused, its sums being over other samples). A client that holds a validation split (``split.val``) replies with
  ``val_loss_sum`` and ``val_metric_sum`` too, checked alike against that split's size.

A refused reply is one failed client, counted and logged like any other (``Communicator._reject``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..common.errors import PflError
from ..api.fold import Layout, layout_problem
from ..api.adaptation import REPLY_SECONDS, REPLY_STEPS
from ..api.globalmodel import GLOBAL_EVALUATE
from ..api.protocol import safe_name
from ..api.training import VAL_PREFIX

EVALUATE = "evaluate"  # the message kind whose replies are evaluation sums (ServerAggregator.configure_evaluate)
EVALUATION_KINDS = (EVALUATE, GLOBAL_EVALUATE)  # ... and the core's evaluation of the global model (globalmodel)
EVAL_SUMS = ("loss_sum", "metric_sum")
VAL_SUMS = tuple(VAL_PREFIX + key for key in EVAL_SUMS)  # the validation split's (split.val)
VAL_COUNT = VAL_PREFIX + "num_samples"  # its size, set by the core like num_samples


def count_of(value: Any) -> Optional[int]:
    """``value`` as a sample count when it is an integer (a Python or NumPy int, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def real_of(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (int, float, NumPy or 0-d tensor; not a bool), else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    return float(value)


class ReplyChecks:
    """The checks of one run. ``train_sizes`` / ``test_sizes``: cid -> the size of each client's split (the core's
    partition); ``bounded_metric``: the metric is a per-sample score in [0, 1] (classification accuracy);
    ``layout_of``: ``(kind, field) -> expected layout or None`` (the aggregator's ``reply_layout``);
    ``sample_limit``: ``num_train -> largest num_samples`` (the aggregator's ``reply_sample_limit``)."""

    def __init__(self, train_sizes: Mapping[int, int], test_sizes: Mapping[int, int], bounded_metric: bool,
                 layout_of: Optional[Callable[[str, str], Optional[Layout]]] = None,
                 sample_limit: Optional[Callable[[int], int]] = None, who: str = "the aggregator",
                 val_sizes: Optional[Mapping[int, int]] = None) -> None:
        self.who = who
        self.train_sizes = {int(c): int(n) for c, n in train_sizes.items()}
        self.test_sizes = {int(c): int(n) for c, n in test_sizes.items()}
        self.val_sizes = {int(c): int(n) for c, n in (val_sizes or {}).items() if int(n) > 0}
        self.bounded_metric = bool(bounded_metric)
        self._layout_of = layout_of
        self._sample_limit = sample_limit
        self._layouts: Dict[Tuple[str, str], Optional[Layout]] = {}
        self._limits: Dict[int, int] = {}

    @classmethod
    def of_run(cls, server: Any, splits: Sequence[Any], task: Any) -> "ReplyChecks":
        """The checks of a run from its partition (``splits[cid].train`` / ``.test``), task and aggregator."""
        return cls({cid: len(s.train) for cid, s in enumerate(splits)},
                   {cid: len(s.test) for cid, s in enumerate(splits)},
                   getattr(task, "kind", "") == "classification",
                   getattr(server, "reply_layout", None), getattr(server, "reply_sample_limit", None),
                   f"aggregator {type(server).__name__}",
                   {cid: len(getattr(s, "val", ())) for cid, s in enumerate(splits)})

    def begin(self) -> None:
        """A new exchange: the server's expectations are asked again (its model may have been replaced)."""
        self._layouts.clear()

    def layout(self, kind: str, field: str) -> Optional[Layout]:
        key = (kind, field)
        if key not in self._layouts:
            self._layouts[key] = self._layout_of(kind, field) if self._layout_of is not None else None
        return self._layouts[key]

    def streamed_layouts(self, kinds: Sequence[str], fields: Sequence[str]) -> Dict[str, Layout]:
        """field -> the layout every streamed ``field`` must have in replies to ``kinds`` (one per field: the
        fold sums them together); a strategy that streams a field without declaring it is a plugin error."""
        out: Dict[str, Layout] = {}
        for f in fields:
            found = {k: self.layout(k, f) for k in sorted(set(kinds))}
            declared = [v for v in found.values() if v is not None]
            if len(declared) < len(found):
                kind = next(k for k, v in found.items() if v is None)
                raise PflError(f"{self.who} streams reply field '{f}' (mean_fields) but declares no layout for it in "
                               f"'{kind}' replies: override reply_layout(kind, field) to return the keys, shapes "
                               f"and dtypes it expects")
            if any(v != declared[0] for v in declared[1:]):
                raise PflError(f"{self.who} declares other layouts of the streamed field '{f}' for the message kinds "
                               f"{', '.join(sorted(found))} of one exchange, whose replies are summed together")
            if declared:
                out[f] = declared[0]
        return out

    def problem(self, cid: int, kind: str, reply: Any) -> Optional[str]:
        """Why ``cid``'s reply to a ``kind`` message is refused, or None."""
        if not isinstance(reply, Mapping):  # the privacy check says what a reply may be; the strategy reads the rest
            return "its evaluation is not a dict of sums" if kind in EVALUATION_KINDS else None
        for key, value in reply.items():
            if isinstance(key, str):
                expected = self.layout(kind, key)
                if expected is not None:
                    problem = layout_problem(value, expected)
                    if problem is not None:
                        return f"its '{safe_name(key)}' {problem}"
        if kind in EVALUATION_KINDS:
            return self.evaluation_problem(cid, reply)
        if "num_samples" in reply:
            return self.count_problem(cid, reply["num_samples"])
        return None

    def count_problem(self, cid: int, value: Any) -> Optional[str]:
        n = count_of(value)
        if n is None:
            return f"its num_samples is a {type(value).__name__}, not an int"
        limit = self._limits.get(cid)
        if limit is None:
            own = self.train_sizes.get(cid, 0)
            limit = self._limits[cid] = int(self._sample_limit(own)) if self._sample_limit is not None else own
        if not 1 <= n <= limit:
            return f"its num_samples {n} is not from 1 to {limit} (the samples it trains on)"
        return None

    def evaluation_problem(self, cid: int, reply: Mapping[str, Any]) -> Optional[str]:
        n = self.test_sizes.get(cid, 0)
        if "num_samples" in reply:
            stated = count_of(reply["num_samples"])
            if stated != n:
                shown = stated if stated is not None else f"a {type(reply['num_samples']).__name__}"
                return f"its evaluation's num_samples is {shown}, its test split holds {n}"
        problem = self._sums_problem(reply, EVAL_SUMS, n, "test")
        if problem is None and cid in self.val_sizes:
            problem = self._sums_problem(reply, VAL_SUMS, self.val_sizes[cid], "validation")
        return problem if problem is not None else adaptation_problem(reply)

    def _sums_problem(self, reply: Mapping[str, Any], keys: Sequence[str], n: int, split: str) -> Optional[str]:
        sums = {}
        for key in keys:
            if key not in reply:
                why = (" (split.val: the client holds a validation split; score with ClientTrainer.evaluate_model, "
                       "which adds it)" if split == "validation" else "")
                return f"its evaluation lacks '{key}'{why}"
            value = real_of(reply[key])
            if value is None:
                return f"its evaluation's {key} is a {type(reply[key]).__name__}, not a number"
            if not math.isfinite(value) or value < 0:
                return f"its evaluation's {key} {value!r} is not a finite number >= 0"
            sums[key] = value
        if self.bounded_metric and sums[keys[1]] > n:
            return f"its evaluation's {keys[1]} {sums[keys[1]]:g} exceeds its {n} {split} samples"
        return None

    def test_size(self, cid: int) -> int:
        return self.test_sizes.get(cid, 0)

    def val_size(self, cid: int) -> int:
        return self.val_sizes.get(cid, 0)


def adaptation_problem(reply: Mapping[str, Any]) -> Optional[str]:
    """An evaluate reply's adaptation cost (``adapt_steps``, ``adapt_seconds``: what the round's summary adds up),
    when present: a count >= 0 and a finite number of seconds >= 0."""
    if REPLY_STEPS in reply:
        steps = count_of(reply[REPLY_STEPS])
        if steps is None or steps < 0:
            return f"its evaluation's {REPLY_STEPS} {_shown(reply[REPLY_STEPS])} is not a count >= 0"
    if REPLY_SECONDS in reply:
        seconds = real_of(reply[REPLY_SECONDS])
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            return f"its evaluation's {REPLY_SECONDS} {_shown(reply[REPLY_SECONDS])} is not a finite number >= 0"
    return None


def _shown(value: Any) -> str:
    """A reply's value in a log line: the number, else only its type (a client's value may hold anything)."""
    number = real_of(value)
    return f"{number:g}" if number is not None else f"(a {type(value).__name__})"
