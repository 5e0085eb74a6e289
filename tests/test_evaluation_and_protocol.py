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
