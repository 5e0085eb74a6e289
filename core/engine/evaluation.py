"""Evaluation maths: per-client results -> uniform / weighted means and spread; final vs best over rounds."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..api.training import VAL_PREFIX
from .replies import VAL_COUNT


def summarize(results: Mapping[int, Mapping[str, float]], metric: str = "accuracy") -> Dict[str, float]:
    """``results``: cid -> {num_samples, loss_sum, metric_sum}. Returns the round's evaluation scalars.

    uniform = mean over clients of each client's own metric; weighted = pooled over all test samples.
    """
    if not results:
        return {}
    n = np.array([r["num_samples"] for r in results.values()], dtype=np.float64)
    m_sum = np.array([r["metric_sum"] for r in results.values()], dtype=np.float64)
    l_sum = np.array([r["loss_sum"] for r in results.values()], dtype=np.float64)
    keep = n > 0
    per_client = m_sum[keep] / n[keep]
    per_loss = l_sum[keep] / n[keep]
    return {
        f"{metric}/uniform": float(per_client.mean()),
        f"{metric}/weighted": float(m_sum.sum() / n.sum()),
        f"{metric}/std": float(per_client.std()),
        f"{metric}/min": float(per_client.min()),
        f"{metric}/max": float(per_client.max()),
        f"{metric}/p10": float(np.percentile(per_client, 10)),
        f"{metric}/p90": float(np.percentile(per_client, 90)),
        "test_loss/uniform": float(per_loss.mean()),
        "test_loss/weighted": float(l_sum.sum() / n.sum()),
        "clients_evaluated": int(keep.sum()),
        **validation_summary(results, metric),
    }


def validation_summary(results: Mapping[int, Mapping[str, float]], metric: str) -> Dict[str, float]:
    """The validation split's scalars (``split.val``): ``val_<metric>/uniform`` and ``/weighted``, and the loss
    alike, over the clients whose replies hold validation sums; {} when none does (no validation split)."""
    held = [r for r in results.values() if r.get(VAL_COUNT)]
    if not held:
        return {}
    n = np.array([r[VAL_COUNT] for r in held], dtype=np.float64)
    m_sum = np.array([r[f"{VAL_PREFIX}metric_sum"] for r in held], dtype=np.float64)
    l_sum = np.array([r[f"{VAL_PREFIX}loss_sum"] for r in held], dtype=np.float64)
    return {f"{VAL_PREFIX}{metric}/uniform": float((m_sum / n).mean()),
            f"{VAL_PREFIX}{metric}/weighted": float(m_sum.sum() / n.sum()),
            f"{VAL_PREFIX}loss/uniform": float((l_sum / n).mean()),
            f"{VAL_PREFIX}loss/weighted": float(l_sum.sum() / n.sum())}


def per_client_validation(results: Mapping[int, Mapping[str, float]]) -> Dict[int, float]:
    """Each client's validation metric, for the clients whose replies hold validation sums."""
    return {cid: r[f"{VAL_PREFIX}metric_sum"] / r[VAL_COUNT] for cid, r in results.items() if r.get(VAL_COUNT)}


def per_client_metric(results: Mapping[int, Mapping[str, float]]) -> Dict[int, float]:
    """Each client's metric (``metric_sum / num_samples``) from evaluation sums, for clients with test samples."""
    return {cid: r["metric_sum"] / r["num_samples"] for cid, r in results.items() if r["num_samples"] > 0}


# An evaluated round's metrics.jsonl record names each client's metric and test-sample count while at most this many
# clients have test samples: measured 37-39 bytes a client (the rest of the record: about 0.36 kB), so 37 kB a round
# at 1,000 clients (7,000 evaluations before rundata.METRICS_LIMIT, 256 MiB); 5,000 clients would take 0.19 MB a
# round (1,300 evaluations). Beyond it a record holds the spread only (min, max, p10, p90, std).
PER_CLIENT_LIMIT = 1000


def per_client_record(results: Mapping[int, Mapping[str, float]], limit: int = PER_CLIENT_LIMIT) -> Dict[str, Any]:
    """``{"per_client": {cid: metric}, "per_client_samples": {cid: test samples}}`` (ids as text, in id order) for
    the clients with test samples, the values ``summarize`` averages, and ``per_client_val`` (their validation
    metric) with a validation split; {} beyond ``limit`` clients."""
    metrics = per_client_metric(results)
    if not metrics or len(metrics) > limit:
        return {}
    ids = sorted(metrics)
    out = {"per_client": {str(c): float(metrics[c]) for c in ids},
           "per_client_samples": {str(c): int(results[c]["num_samples"]) for c in ids}}
    val = per_client_validation(results)
    if val:  # split.val: each client's validation metric, what its own selected round is chosen on
        out["per_client_val"] = {str(c): float(val[c]) for c in sorted(val)}
    return out


@dataclass
class History:
    """Evaluations over rounds; reports the final value (mean of the last k) and the best, both labelled."""

    metric: str
    higher_is_better: bool
    rounds: List[int] = field(default_factory=list)
    records: List[Dict[str, float]] = field(default_factory=list)
    keep_per_client: int = 1  # how many of the last evaluations' per-client values are kept (eval.final_k)
    per_client: List[Tuple[int, Dict[str, float]]] = field(default_factory=list)  # (round, client id -> metric)
    #: split.val: client id -> [its best validation metric, its test metric then, that round] (per-client selection)
    client_selection: Dict[str, List[float]] = field(default_factory=dict)

    def add(self, rnd: int, summary: Dict[str, float], per_client: Optional[Mapping[str, float]] = None) -> None:
        self.rounds.append(rnd)
        self.records.append(dict(summary))
        if per_client:
            self.per_client = (self.per_client + [(rnd, dict(per_client))])[-max(1, self.keep_per_client):]

    def note_clients(self, rnd: int, test: Mapping[int, float], val: Mapping[int, float]) -> None:
        """Per-client selection (``split.val``): each client keeps the test metric of its evaluation with the best
        validation metric so far (the first of equal ones), never looking at test values to choose."""
        better = (lambda a, b: a > b) if self.higher_is_better else (lambda a, b: a < b)
        for cid, v in val.items():
            if cid not in test or not math.isfinite(v):
                continue
            kept = self.client_selection.get(str(cid))
            if kept is None or better(v, kept[0]):
                self.client_selection[str(cid)] = [float(v), float(test[cid]), rnd]

    def truncate(self, last_round: int) -> None:
        keep = [i for i, r in enumerate(self.rounds) if r <= last_round]
        self.rounds = [self.rounds[i] for i in keep]
        self.records = [self.records[i] for i in keep]
        self.per_client = [(r, v) for r, v in self.per_client if r <= last_round]

    def series(self, key: str) -> List[float]:
        return [r[key] for r in self.records if key in r]

    def final(self, k: int) -> Dict[str, Any]:
        out: Dict[str, Any] = {"k": min(k, len(self.records))}
        for agg in ("uniform", "weighted", "std"):
            vals = self.series(f"{self.metric}/{agg}")[-k:]
            out[agg] = float(np.mean(vals)) if vals else math.nan
        per_client = final_per_client(self.rounds[-k:] if k > 0 else [], self.per_client)
        if per_client:
            out["per_client"] = per_client
        return out

    def best(self) -> Dict[str, Any]:
        vals = self.series(f"{self.metric}/uniform")
        if not vals:
            return {"uniform": math.nan, "round": None}
        i = int(np.argmax(vals) if self.higher_is_better else np.argmin(vals))
        return {"uniform": vals[i], "weighted": self.records[i].get(f"{self.metric}/weighted"),
                "round": self.rounds[i]}

    def best_weighted(self) -> Dict[str, Any]:
        """The evaluation with the best sample-weighted (pooled) metric; its round may differ from ``best``'s."""
        key = f"{self.metric}/weighted"
        found = [(r, rec[key]) for r, rec in zip(self.rounds, self.records) if key in rec]
        if not found:
            return {"weighted": math.nan, "round": None}
        pick = max if self.higher_is_better else min
        rnd, val = pick(found, key=lambda t: t[1])  # the first of equal values, as np.argmax in best()
        return {"weighted": val, "uniform": self.records[self.rounds.index(rnd)].get(f"{self.metric}/uniform"),
                "round": rnd}

    def selected(self, agg: str = "uniform") -> Optional[Dict[str, Any]]:
        """The test metric (``agg``: uniform or weighted) at the evaluation with the best validation metric of the
        same kind -- a round chosen without the test data; None when the run has no validation split."""
        key = f"{VAL_PREFIX}{self.metric}/{agg}"
        found = [(i, rec[key]) for i, rec in enumerate(self.records) if key in rec and math.isfinite(rec[key])]
        if not found:
            return None
        pick = max if self.higher_is_better else min
        i, val = pick(found, key=lambda t: t[1])  # the first of equal values
        return {agg: self.records[i].get(f"{self.metric}/{agg}"), f"val_{agg}": val, "round": self.rounds[i]}

    def selected_per_client(self) -> Optional[Dict[str, Any]]:
        """Each client's test metric at its own best validation evaluation, averaged over the clients (uniform):
        early stopping per personal model; None without a validation split."""
        if not self.client_selection:
            return None
        tests = [kept[1] for kept in self.client_selection.values()]
        return {"uniform": float(np.mean(tests)), "clients": len(tests)}

    def summary(self, k: int) -> Dict[str, Any]:
        out = {"metric": self.metric, "higher_is_better": self.higher_is_better,
               "final": self.final(k), "best": self.best(), "best_weighted": self.best_weighted()}
        for name, section in (("selected", self.selected("uniform")), ("selected_weighted", self.selected("weighted")),
                              ("selected_per_client", self.selected_per_client())):
            if section is not None:  # split.val: chosen on validation, beside best (chosen on test)
                out[name] = section
        return {**out, "evaluations": len(self.records), "last": self.records[-1] if self.records else {}}

    def state_dict(self) -> Dict[str, Any]:
        state = {"rounds": self.rounds, "records": self.records,
                 "per_client": [[r, v] for r, v in self.per_client]}
        if self.client_selection:
            state["client_selection"] = self.client_selection
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rounds = list(state["rounds"])
        self.records = [dict(r) for r in state["records"]]
        self.per_client = [(int(r), dict(v)) for r, v in state.get("per_client", [])]  # older checkpoints: none
        self.client_selection = {str(c): [float(v[0]), float(v[1]), int(v[2])]
                                 for c, v in state.get("client_selection", {}).items()}


def final_per_client(last_rounds: List[int], per_client: List[Tuple[int, Mapping[str, float]]]) -> Dict[str, float]:
    """Each client's mean metric over the evaluations of ``last_rounds`` (the last k) that recorded it: the
    summary's ``final.per_client``; {} unless every one of those evaluations recorded per-client values."""
    by_round = dict(per_client)
    if not last_rounds or any(r not in by_round for r in last_rounds):
        return {}
    values: Dict[str, List[float]] = {}
    for r in last_rounds:
        for cid, v in by_round[r].items():
            values.setdefault(str(cid), []).append(float(v))
    return {cid: float(np.mean(vals)) for cid, vals in sorted(values.items(), key=lambda kv: _id_order(kv[0]))}


def _id_order(cid: str) -> Tuple[int, Any]:
    return (0, int(cid)) if cid.isdigit() else (1, cid)
