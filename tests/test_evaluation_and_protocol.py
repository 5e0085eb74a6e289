import math

import numpy as np
import pytest
import torch

from pflkit.core.engine.evaluation import History, summarize
from pflkit.core.api.protocol import BitMask, first_non_finite, payload_nbytes
from pflkit.core.api.state import weighted_average


def test_summary_uniform_weighted_and_spread():
    results = {0: {"num_samples": 10, "loss_sum": 5.0, "metric_sum": 10},   # acc 1.0
               1: {"num_samples": 30, "loss_sum": 30.0, "metric_sum": 15}}  # acc 0.5
    s = summarize(results)
    assert s["accuracy/uniform"] == pytest.approx(0.75)
    assert s["accuracy/weighted"] == pytest.approx(25 / 40)
    assert s["accuracy/std"] == pytest.approx(0.25)
    assert (s["accuracy/min"], s["accuracy/max"]) == (0.5, 1.0)
    assert s["test_loss/uniform"] == pytest.approx((0.5 + 1.0) / 2)


def test_history_final_is_mean_of_last_k_and_best_is_labelled():
    h = History("accuracy", higher_is_better=True)
    for r, v in enumerate([0.1, 0.9, 0.5, 0.6, 0.7], start=1):
        h.add(r, {"accuracy/uniform": v, "accuracy/weighted": v, "accuracy/std": 0.0})
    assert h.final(3)["uniform"] == pytest.approx(0.6)
    assert h.best() == {"uniform": 0.9, "weighted": 0.9, "round": 2}
    mse = History("mse", higher_is_better=False)
    mse.add(1, {"mse/uniform": 0.3})
    mse.add(2, {"mse/uniform": 0.1})
    assert mse.best()["round"] == 2


def test_bitmask_roundtrip_and_wire_size():
    mask = torch.rand(3, 7, 5) > 0.5
    packed = BitMask(mask)
    assert torch.equal(packed.unpack(), mask)
    assert packed.nbytes == math.ceil(105 / 8)
    assert payload_nbytes({"m": packed, "w": torch.zeros(105)}) == 14 + 420


def test_payload_size_and_non_finite_detection():
    payload = {"params": {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.int8)},
               "num_samples": 5}
    assert payload_nbytes(payload) == 32 + 2 + 8
    assert first_non_finite(payload) is None
    payload["params"]["a"][1] = float("nan")
    assert first_non_finite(payload) == "params.a"
    assert first_non_finite({"x": [1.0, float("inf")]}) == "x[1]"


def test_weighted_average_per_key():
    a = {"w": torch.tensor([0.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, 6.0]), "n": torch.tensor(9)}
    out = weighted_average([a, b], [1, 3])
    assert torch.allclose(out["w"], torch.tensor([3.0, 5.0]))
    assert int(out["n"]) == 3  # integer buffers are not averaged


def test_per_client_record_names_each_client_and_stops_at_the_limit():
    from pflkit.core.engine.evaluation import PER_CLIENT_LIMIT, per_client_record
    results = {2: {"num_samples": 10, "loss_sum": 5.0, "metric_sum": 10},
               0: {"num_samples": 30, "loss_sum": 30.0, "metric_sum": 15},
               1: {"num_samples": 0, "loss_sum": 0.0, "metric_sum": 0}}  # no test samples: not a client's value
    rec = per_client_record(results)
    assert rec == {"per_client": {"0": 0.5, "2": 1.0}, "per_client_samples": {"0": 30, "2": 10}}
    assert list(rec["per_client"]) == ["0", "2"]  # in id order
    assert per_client_record(results, limit=1) == {} and PER_CLIENT_LIMIT == 1000


def test_history_final_per_client_is_the_mean_of_the_last_k_and_survives_a_checkpoint():
    h = History("accuracy", higher_is_better=True, keep_per_client=2)
    for r, (a, b) in enumerate([(0.1, 0.2), (0.3, 0.4), (0.5, 0.8)], start=1):
        h.add(r, {"accuracy/uniform": (a + b) / 2}, {"0": a, "10": b})
    assert len(h.per_client) == 2  # only the last final_k evaluations' values are kept
    assert h.final(2)["per_client"] == {"0": pytest.approx(0.4), "10": pytest.approx(0.6)}
    assert list(h.final(2)["per_client"]) == ["0", "10"]
    assert "per_client" not in h.final(3)  # the third-last evaluation's values are gone: no partial mean
    again = History("accuracy", higher_is_better=True, keep_per_client=2)
    again.load_state_dict(h.state_dict())
    assert again.final(2) == h.final(2)
    again.truncate(2)
    assert again.final(1)["per_client"] == {"0": 0.3, "10": 0.4}
    old = History("accuracy", higher_is_better=True)
    old.load_state_dict({"rounds": [1], "records": [{"accuracy/uniform": 0.5}]})  # a checkpoint from before
    assert "per_client" not in old.final(1)


def test_metrics_record_holds_each_clients_metric_never_as_a_scalar(tmp_path, monkeypatch):
    """Every evaluated round's metrics.jsonl record names each client's metric and test samples: the values the
    round's uniform / weighted / min / max come from; summary.json's final.per_client is their last-k mean; none of
    it goes to TensorBoard as a scalar."""
    import json
    from pflkit.core import Simulation
    from pflkit.core.engine.config import resolve
    from pflkit.core.storage.monitor import RunLogger
    from pflkit.core.storage.rundata import finished_run_problem, read_records, read_summary
    from pflkit.core.testing import TINY
    tags = []
    real = RunLogger.log_scalar
    monkeypatch.setattr(RunLogger, "log_scalar", lambda self, tag, value, step=None: (tags.append(tag),
                                                                                     real(self, tag, value, step)))
    cfg = resolve([TINY, {"rounds": 3, "eval": {"final_k": 2}}], algorithm="fedavg")
    Simulation(cfg, run_dir=tmp_path / "run", tensorboard=False).run()
    assert tags and not [t for t in tags if t.startswith("per_client")]
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    evaluated = [r for r in records if "accuracy/uniform" in r]
    assert len(evaluated) == 3
    for rec in evaluated:
        acc, n = rec["per_client"], rec["per_client_samples"]
        assert sorted(acc, key=int) == [str(c) for c in range(cfg.partition.num_clients)] and set(n) == set(acc)
        assert np.mean(list(acc.values())) == pytest.approx(rec["accuracy/uniform"], rel=1e-12)
        assert (min(acc.values()), max(acc.values())) == (rec["accuracy/min"], rec["accuracy/max"])
        pooled = sum(acc[c] * n[c] for c in acc) / sum(n.values())
        assert pooled == pytest.approx(rec["accuracy/weighted"], rel=1e-9)
    summary = read_summary(tmp_path / "run")  # the strict reader accepts final.per_client
    last2 = [rec["per_client"] for rec in evaluated[-2:]]
    want = {c: (last2[0][c] + last2[1][c]) / 2 for c in last2[1]}
    assert summary["final"]["per_client"] == pytest.approx(want)
    assert finished_run_problem(summary, records, 3, 2) is None
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["last"].get("per_client") is None


def test_final_per_client_of_a_resumed_run_equals_the_uninterrupted_runs(tmp_path):
    import json
    from pflkit.core import Simulation
    from pflkit.core.engine.config import resolve
    from pflkit.core.testing import TINY
    cfg = lambda: resolve([TINY, {"rounds": 4, "eval": {"final_k": 3}, "checkpoint": {"every": 1}}],  # noqa: E731
                          algorithm="fedavg")
    Simulation(cfg(), run_dir=tmp_path / "full", tensorboard=False).run()
    Simulation(cfg(), run_dir=tmp_path / "cut", tensorboard=False).run(stop_after=2)
    Simulation.resume(tmp_path / "cut", tensorboard=False).run()  # the last 3 evaluations span the resume
    full, cut = (json.loads((tmp_path / name / "summary.json").read_text())["final"] for name in ("full", "cut"))
    assert cut["per_client"] == full["per_client"] and len(full["per_client"]) == 4
