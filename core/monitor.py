"""Run monitoring: TensorBoard event files plus a JSON-lines record of the same scalars."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import numpy as np


def _round_of(line: str) -> Optional[int]:
    """The round of one metrics.jsonl line; None for a blank or half-written line (a killed write)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return int(rec.get("round", 0)) if isinstance(rec, dict) and isinstance(rec.get("round", 0), int) else None


class RunLogger:
    """Collects one round's scalars (core's and plugins'), writes them to TensorBoard and ``metrics.jsonl``.

    Plugins call ``log_scalar`` / ``log_histogram`` / ``log_image`` / ``log_text`` through their context;
    everything logged during round r is stamped with step r.
    """

    def __init__(self, run_dir: Path, resume_from_round: Optional[int] = None, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.step = 0
        self._pending: Dict[str, float] = {}
        if resume_from_round is not None:
            self._truncate_jsonl(resume_from_round)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                purge = None if resume_from_round is None else resume_from_round + 1
                self.writer = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge)
            except ImportError:  # tensorboard is a dependency, but keep runs going without it
                self.writer = None

    def _truncate_jsonl(self, last_round: int) -> None:
        if not self.jsonl_path.exists():
            return
        kept = [ln for ln in self.jsonl_path.read_text(encoding="utf-8", errors="replace").splitlines()
                if _round_of(ln) is not None and _round_of(ln) <= last_round]
        self.jsonl_path.write_text("".join(ln + "\n" for ln in kept))

    def set_step(self, step: int) -> None:
        self.step = step

    def log_scalar(self, tag: str, value: float, step: Optional[int] = None) -> None:
        """Record ``value`` for this round; with an explicit ``step`` (a curve inside one round, e.g. set-up
        pre-training steps) it goes to TensorBoard at that step only, not into the round's record."""
        value = float(value)
        if step is None:
            self._pending[tag] = value
        if self.writer is not None and math.isfinite(value):
            self.writer.add_scalar(tag, value, self.step if step is None else step)

    def log_scalars(self, values: Dict[str, float], prefix: str = "") -> None:
        for k, v in values.items():
            self.log_scalar(prefix + k, v)

    def log_histogram(self, tag: str, values: Iterable[float]) -> None:
        arr = np.asarray(list(values), dtype=np.float64)
        if self.writer is not None and arr.size and np.isfinite(arr).all():
            self.writer.add_histogram(tag, arr, self.step)

    def log_image(self, tag: str, image: np.ndarray, step: Optional[int] = None) -> None:
        """``image``: HxW (values scaled to [0, 1] for display) or HxWx3 in [0, 1]."""
        if self.writer is None:
            return
        step = self.step if step is None else step
        img = np.asarray(image, dtype=np.float64)
        if img.ndim == 2:
            lo, hi = float(np.nanmin(img)), float(np.nanmax(img))
            img = (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)
            self.writer.add_image(tag, img[None], step, dataformats="CHW")
        else:
            self.writer.add_image(tag, img, step, dataformats="HWC")

    def log_text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, self.step)

    def end_round(self, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        record = {"round": self.step, **self._pending, **(extra or {})}
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._pending = {}
        if self.writer is not None:
            self.writer.flush()
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
