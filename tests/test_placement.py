"""Runs of a comparison placed on a node's GPUs (core/results/placement.py), tested on CPU with a stand-in list of
GPU ids: the plan, the pinned workers and what each run records."""
import json

import pytest

from pflkit.core import ConfigError
from pflkit.core.results import placement
from pflkit.core.results.placement import Placement, plan_placement

FOUR = lambda: ["0", "1", "2", "3"]  # noqa: E731 -- a node with four visible GPUs


def test_one_run_per_gpu_by_default_dealt_in_turn():
    plan = plan_placement(["cuda"] * 10, jobs=3, runs_per_device=None, gpus=FOUR)
    assert plan == Placement(("0", "1", "2", "3"), 1, 3)
    assert plan.slots() == ["0", "1", "2"]  # three workers on three GPUs, not stacked on one
    assert plan_placement(["auto"] * 10, jobs=8, runs_per_device=None, gpus=FOUR).workers == 4
    packed = plan_placement(["cuda"] * 10, jobs=6, runs_per_device=2, gpus=FOUR)
    assert packed.slots() == ["0", "1", "2", "3", "0", "1"]
    assert "--jobs 9 is more than 4 GPU(s) x 2: 8 runs at a time" in \
        plan_placement(["cuda"], jobs=9, runs_per_device=2, gpus=FOUR).describe(9)


def test_cpu_runs_pinned_runs_and_one_job_are_not_placed():
    assert plan_placement(["cpu"] * 4, jobs=4, runs_per_device=None, gpus=FOUR) is None
    assert plan_placement(["cuda:1"] * 4, jobs=4, runs_per_device=None, gpus=FOUR) is None  # their own GPU
    assert plan_placement(["auto"] * 4, jobs=4, runs_per_device=None, gpus=lambda: []) is None  # no GPU: CPU
    assert plan_placement(["cuda"], jobs=1, runs_per_device=None, gpus=FOUR) is None


@pytest.mark.parametrize("devices, per, gpus, says", [
    (["cpu"], 2, FOUR, "--runs-per-device applies to runs on CUDA GPUs"),
    (["auto"], 2, lambda: [], "--runs-per-device applies to runs on CUDA GPUs"),
    (["cuda:0"], 2, FOUR, "a cuda:i run keeps its own GPU"),
    (["cuda"], 0, FOUR, "--runs-per-device must be a positive integer"),
    (["cuda"], None, lambda: [], "no visible CUDA GPU"),
])
def test_placement_that_cannot_apply_is_one_clear_line(devices, per, gpus, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        plan_placement(devices, jobs=2, runs_per_device=per, gpus=gpus)


def test_compare_pins_each_worker_and_records_it_in_run_info(tmp_path, monkeypatch):
    """fl compare --jobs 2 on a stand-in node of two GPUs (device auto; the runs compute on this CPU): two spawned
    workers, one per GPU, each run's run_info.json names its GPU, and the numbers are those of --jobs 1."""
    from pflkit.core.results.compare import run_comparison

    monkeypatch.setattr(placement, "visible_gpus", lambda: ["0", "1"])
    layer = {"rounds": 2, "device": "auto", "dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": [8]},
             "partition": {"num_clients": 4}, "checkpoint": {"every": 0}}
    lines = []
    placed = run_comparison(["fedavg", "local"], [0], [layer], tmp_path / "placed", jobs=2, echo=lines.append)
    assert any(line.startswith("placement: 2 worker(s) on GPU(s) 0, 1") for line in lines)
    gpus = set()
    for run in (tmp_path / "placed" / "runs").iterdir():
        entry = json.loads((run / "run_info.json").read_text())["entries"][-1]
        assert entry["placement"]["runs_per_device"] == 1
        gpus.add(entry["placement"]["gpu"])
    assert gpus <= {"0", "1"} and gpus
    serial = run_comparison(["fedavg", "local"], [0], [layer], tmp_path / "serial", jobs=1)
    for label in ("fedavg", "local"):
        a = json.loads((tmp_path / "placed" / "runs" / f"{label}-seed0" / "summary.json").read_text())
        b = json.loads((tmp_path / "serial" / "runs" / f"{label}-seed0" / "summary.json").read_text())
        assert a["final"] == b["final"] and a["last"] == b["last"]
    assert placed["results"]["fedavg"]["final_uniform"] == serial["results"]["fedavg"]["final_uniform"]
    with pytest.raises(ConfigError, match="--runs-per-device applies"):
        run_comparison(["fedavg"], [0], [dict(layer, device="cpu")], tmp_path / "cpu", jobs=2, runs_per_device=2)
    assert not (tmp_path / "cpu" / "runs").exists() or not any((tmp_path / "cpu" / "runs").iterdir())
