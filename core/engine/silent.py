"""The logger and progress reporter of a process that does not write the run directory (ranks other than 0):
they take the same calls as the real ones and write nothing, so the replicated loop runs unchanged."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from ..storage.monitor import RoundReporter, RunLogger


class SilentRunLogger(RunLogger):
    """Collects a round's scalars like ``RunLogger`` (so records are identical) without TensorBoard or files."""

    def __init__(self, run_dir: Path, resume_from_round: Optional[int] = None, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.step = 0
        self._pending: Dict[str, float] = {}
        self.writer = None  # the parent's methods then skip TensorBoard

    def end_round(self, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        record = {"round": self.step, **self._pending, **(extra or {})}
        self._pending = {}
        return record

    def log_histogram(self, tag: str, values: Iterable[float]) -> None:
        pass


class SilentReporter(RoundReporter):
    """No console output and no run.log."""

    def __enter__(self) -> "SilentReporter":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def write_log(self, text: str) -> None:
        pass

    def round(self, record: Dict[str, Any], seconds: float, postfix: Dict[str, str]) -> None:
        pass

    def setup_step(self, text: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
        pass

    def setup_finished(self) -> None:
        pass
