"""Would a run start? The checks ``fl run`` makes when it starts (configuration, data, model fit, every component's
constructor), made by starting the run in a temporary directory and giving it up at once.

``fl show`` uses it to list only the base algorithms an augmenting algorithm (PCFL, ...) can run over with its
defaults: a base whose trainer refuses the default task (e.g. FedRoD on a regression dataset) is named with the
reason instead of being offered and then refused by every run.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import compose
from ..api import registry as reg
from .backend import SerialBackend
from ..common.errors import DataError, PflError


class _FirstClientBackend(SerialBackend):
    """Builds the first client's data and trainer only: a trainer's start checks (task, model, options) are the
    same for every client, and building all of them would make ``fl show`` take seconds per base."""

    def assign(self, costs) -> List[int]:
        return sorted(costs)[:1]

    def start(self, build_trainer, client_ids, state_options=None) -> None:
        self.client_ids = list(client_ids)
        build_trainer(self.client_ids[0])


@contextlib.contextmanager
def _quiet():
    """No warnings while probing (a base's start warning, e.g. FedBN without BatchNorm, is the run's to give)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def start_refusal(algorithm: str, sets: Sequence[str] = (), data_ok: bool = False) -> Optional[str]:
    """Why ``fl run --plugin ALGORITHM --set SETS...`` would be refused at start (its one-line message), or None
    when it starts. Nothing is left behind: the run directory is temporary, no round runs. ``data_ok``: a missing
    or unreadable dataset (DataError) counts as starting -- the check is about the rest."""
    from .config import parse_sets, resolve
    from .simulation import Simulation

    with _quiet(), tempfile.TemporaryDirectory(prefix="pflkit-dryrun-") as tmp:
        try:
            cfg = resolve([parse_sets(tuple(sets))], algorithm=algorithm)
            sim = Simulation(cfg, run_dir=Path(tmp) / "run", backend=_FirstClientBackend(), tensorboard=False,
                             progress=False)
        except DataError as exc:
            return None if data_ok else str(exc)
        except PflError as exc:
            return str(exc)
        sim.abandon()
    return None


def runnable_bases(algorithm: str) -> Tuple[List[str], Dict[str, str]]:
    """For an augmenting algorithm: the installed bases it starts over with its defaults, and the others it can
    wrap by class but whose run is refused with these defaults (base -> reason). ([], {}) when nothing wraps."""
    algo = reg.ALGORITHMS.get(algorithm)
    trainer, aggregator = reg.TRAINERS.get(algo.trainer), reg.AGGREGATORS.get(algo.aggregator)
    section = compose.base_section(trainer, aggregator)
    if section is None:
        return [], {}
    runs, refused = [], {}
    for base in compose.allowed_bases(trainer, aggregator):
        # never a download from `fl show`; a dataset that is not here says nothing about the base
        reason = start_refusal(algorithm, [f"{section}.{compose.BASE_KEY}={base}", "dataset.download=false"],
                               data_ok=True)
        if reason is None:
            runs.append(base)
        else:
            refused[base] = reason
    return runs, refused


def global_model_line(algorithm: str) -> str:
    """Whether ``fl run --plugin ALGORITHM`` (its defaults) reports a global model beside the personal ones, and how
    (core/engine/globaleval.py), from a run started and given up at once, as ``start_refusal`` does."""
    from ..api.globalmodel import personal_is_global
    from ..api.server import GlobalModelAggregator
    from .config import resolve
    from .globaleval import global_model_of
    from .simulation import Simulation

    with _quiet(), tempfile.TemporaryDirectory(prefix="pflkit-dryrun-") as tmp:
        try:
            cfg = resolve([{"dataset": {"download": False}}], algorithm=algorithm)
            sim = Simulation(cfg, run_dir=Path(tmp) / "run", backend=_FirstClientBackend(), tensorboard=False,
                             progress=False)
        except PflError as exc:
            return f"global model: not known with the defaults (the run would not start: {exc})"
        try:
            server, trainer = sim.server, sim.trainer_cls
            if global_model_of(server) is not None:
                if personal_is_global(trainer) and sim.global_eval.adaptation is not None:
                    return ("global model: reported -- evaluated on its own at each evaluation: eval.adapt fine-tunes "
                            "the personal model (the trainer's personal model is otherwise the global one)")
                if personal_is_global(trainer):
                    return ("global model: reported (global_<metric>/... in metrics.jsonl, summary.json 'global'); "
                            "the personal model is the global model (the trainer declares personal_is_global), so "
                            "its numbers are the personal ones, not evaluated twice (with eval.adapt it is "
                            "evaluated on its own)")
                return ("global model: reported -- the aggregator's global model is scored on every client's test "
                        "split at each evaluation, beside the personal models (global_<metric>/... in "
                        "metrics.jsonl, summary.json 'global')")
            if isinstance(server, GlobalModelAggregator):
                why = ("the aggregator opts out (reports_global_model = False)" if not server.reports_global_model
                       else f"its global state holds {len(server.global_state)} of the model's "
                            f"{len(server.model_layout('state'))} state keys: the trainer shares only part of it")
            else:
                why = "the aggregator names none (ServerAggregator.global_model)"
            return f"global model: none -- {why}; summary.json 'global' is null"
        finally:
            sim.abandon()
