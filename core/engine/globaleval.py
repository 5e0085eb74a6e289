"""The global model's accuracy beside the personal one, at every evaluation of a run.

An aggregator names its global model (``ServerAggregator.global_model``; ``GlobalModelAggregator``: its global state
when it covers the whole model, unless it opts out with ``reports_global_model = False``). At each evaluation, after
the personal one, the core scores that state on every client's test split with its plain evaluation
(core/api/globalmodel.py), through the communicator like every exchange: each process of a distributed run
evaluates its own clients, the replies are vetted as evaluate replies (core/engine/replies.py), a failed client
is counted and logged. Where the trainer declares ``personal_is_global`` and the core can check that the personal
evaluation scored that very state (every evaluate message carries it, no ``eval.adapt`` this round), the personal
numbers are the global model's: they are reused, not computed twice.

metrics.jsonl: ``global_<metric>/uniform``, ``/weighted``, ``/std`` and ``global_reused`` (1: the personal numbers
reused), ``global_eval_seconds`` when evaluated. summary.json: ``global`` (None: the algorithm has no global model)
with ``final``, ``best`` and ``best_weighted`` as the personal ones, ``evaluations`` and ``source`` (personal:
every evaluation reused the personal numbers; evaluated: none did; mixed). The history is checkpointed: a resumed
run reports what the uninterrupted one does.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from ..api.globalmodel import GLOBAL_EVALUATE, personal_is_global
from ..api.protocol import Message
from ..api.training import VAL_PREFIX
from .evaluation import History, summarize

log = logging.getLogger("pflkit")

AGGREGATES = ("uniform", "weighted", "std")
VAL_AGGREGATES = ("uniform", "weighted")  # split.val: the validation means the selected rounds are chosen on
REUSED = "global_reused"


class GlobalEvaluation:
    """One run's evaluations of its global model: when to evaluate or reuse, the records, the summary section."""

    def __init__(self, metric: str, higher_is_better: bool, trainer_cls: type, adaptation: Any = None) -> None:
        self.metric = metric
        self.prefix = f"global_{metric}"
        self.history = History(self.prefix, higher_is_better)
        self.reuse_declared = personal_is_global(trainer_cls)
        self.trainer_name = getattr(trainer_cls, "__name__", str(trainer_cls))
        self.claim_refuted = False  # a personal_is_global claim that the spot check found false
        self._carried: Any = None  # the state every evaluate message of this round carried (note_evaluate_messages)
        self.adaptation = adaptation  # eval.adapt: an adapted personal model is not the global one

    def note_evaluate_messages(self, messages: Mapping[int, Message], client_ids: Sequence[int]) -> None:
        """Called with the round's evaluate messages: keeps the one state every client's message carried, if there
        is one (a single reference; per-client messages are not kept alive), for :meth:`reuses`."""
        carried = [m.payload.get("params") if isinstance(m.payload, dict) else None for m in messages.values()]
        whole = self.reuse_declared and set(messages) == set(client_ids) and carried and carried[0] is not None
        self._carried = carried[0] if whole and all(c is carried[0] for c in carried) else None

    def reuses(self, rnd: int, state: Any) -> bool:
        """Whether the personal evaluation of round ``rnd`` scored ``state`` on every client, as checked here: the
        trainer declares it scores what it receives, every client got an evaluate message carrying ``state``
        itself, and no evaluation-time adaptation applied."""
        if not self.reuse_declared or (self.adaptation is not None and self.adaptation.applies(rnd)):
            return False
        return self._carried is not None and self._carried is state

    def evaluate(self, rnd: int, server: Any, personal: Mapping[str, float], client_ids: Sequence[int],
                 send: Callable[[Dict[int, Message]], Dict[int, Dict[str, Any]]],
                 personal_results: Optional[Mapping[int, Mapping[str, Any]]] = None) -> Dict[str, float]:
        """The round's global-model numbers (the record's keys), {} when the aggregator has no global model now.
        ``personal``: the round's personal summary (after :meth:`note_evaluate_messages`); ``send``: the
        communicator's unaccounted send (evaluation traffic is no algorithm cost); ``personal_results``: the round's
        personal evaluate replies, against which a reuse is spot-checked."""
        state = global_model_of(server)
        if state is None:
            return {}
        m = self.metric
        reused = self.reuses(rnd, state)
        self._carried = None  # the reference goes with the round
        if reused and not self._claim_holds(state, client_ids, send, personal_results):
            reused = False
        if reused:
            out = {f"{self.prefix}/{a}": personal[f"{m}/{a}"] for a in AGGREGATES if f"{m}/{a}" in personal}
            out.update({f"{VAL_PREFIX}{self.prefix}/{a}": personal[f"{VAL_PREFIX}{m}/{a}"] for a in VAL_AGGREGATES
                        if f"{VAL_PREFIX}{m}/{a}" in personal})
            out[REUSED] = 1
        else:
            start = time.perf_counter()
            results = send({cid: Message(GLOBAL_EVALUATE, {"params": state}) for cid in client_ids})
            if not results:  # every client failed it (each counted and logged): no number this round
                log.warning("round %d: every client failed the global model's evaluation", rnd)
                return {}
            scores = summarize(results, m)
            out = {f"{self.prefix}/{a}": scores[f"{m}/{a}"] for a in AGGREGATES}
            out.update({f"{VAL_PREFIX}{self.prefix}/{a}": scores[f"{VAL_PREFIX}{m}/{a}"] for a in VAL_AGGREGATES
                        if f"{VAL_PREFIX}{m}/{a}" in scores})  # split.val: the global model's validation means
            out[REUSED] = 0
            out["global_eval_seconds"] = time.perf_counter() - start
        self.history.add(rnd, {k: v for k, v in out.items() if k != "global_eval_seconds"})
        return out

    def _claim_holds(self, state: Any, client_ids: Sequence[int], send: Callable, personal: Any) -> bool:
        """A trainer's ``personal_is_global`` is a claim, checked at each reuse: the core's own evaluation of the
        global state on one client (the lowest id) must give that client's personal evaluation sums. A false claim
        is said once, and the global model is scored separately from then on."""
        cid = min(client_ids)
        got = send({cid: Message(GLOBAL_EVALUATE, {"params": state})})
        mine = (personal or {}).get(cid)
        if cid not in got or mine is None:
            return True  # nothing to compare this round (the client failed one of them: counted as a failure)
        ours, theirs = got[cid], mine
        same = all(abs(float(ours.get(k, 0.0)) - float(theirs.get(k, 0.0))) <= 1e-6 * max(1.0, abs(float(ours.get(
            k, 0.0)))) for k in ("metric_sum", "loss_sum"))
        if not same:
            log.warning("trainer %s declares personal_is_global, but client %d's personal evaluation (%s %.6g) is "
                        "not the core's evaluation of the global model (%.6g): the global model is scored "
                        "separately from now on", self.trainer_name, cid, self.metric,
                        float(theirs.get("metric_sum", 0.0)), float(ours.get("metric_sum", 0.0)))
            self.reuse_declared = False
            self.claim_refuted = True
        return same

    def summary(self, k: int, has_global_model: bool) -> Optional[Dict[str, Any]]:
        """summary.json's ``global`` section; None when the run never scored a global model and its aggregator
        has none."""
        if not self.history.records and not has_global_model:
            return None
        reused = [r.get(REUSED) for r in self.history.records]
        source = ("personal" if reused and all(reused) else "evaluated" if not any(reused) else "mixed")
        out = self.history.summary(k)
        return {"metric": self.metric, "source": source, "final": out["final"], "best": out["best"],
                "best_weighted": out["best_weighted"], "evaluations": out["evaluations"],
                **{key: out[key] for key in ("selected", "selected_weighted") if key in out}}

    def state_dict(self) -> Dict[str, Any]:
        return self.history.state_dict()

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """``state`` None: a checkpoint written before global evaluation existed (its earlier rounds have none)."""
        if state is not None:
            self.history.load_state_dict(state)



def global_model_of(server: Any) -> Any:
    """The aggregator's global model now (``ServerAggregator.global_model``), None without one."""
    method = getattr(server, "global_model", None)
    return method() if callable(method) else None
