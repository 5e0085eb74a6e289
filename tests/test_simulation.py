import json

import numpy as np
import pytest
import torch

from pflkit.core import LocalSGDTrainer, Simulation
from pflkit.core.engine.comm import ClientAbort
from pflkit.core.common.errors import CheckpointError
from pflkit.core.testing import quick_run, tiny_config


def read_jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fedavg_learns_and_every_client_is_evaluated(tmp_path):
    result = quick_run("fedavg", tmp_path, {"rounds": 6, "partition": {"name": "iid"},
                                            "participation": {"join_ratio": 0.5}})
    assert result["final"]["uniform"] > 0.5  # 10 classes: chance is 0.1
    for rec in read_jsonl(tmp_path / "run"):
        assert rec["clients_selected"] == 2 and rec["clients_evaluated"] == 4
    assert result["bytes_up_total"] > 0 and result["best"]["round"] is not None


def test_same_seed_same_partition_and_numbers(tmp_path):
    a = quick_run("fedavg", tmp_path / "a", {"seed": 7})
    b = quick_run("fedavg", tmp_path / "b", {"seed": 7})
    c = quick_run("fedavg", tmp_path / "c", {"seed": 8})
    assert (tmp_path / "a/run/partition.json").read_text() == (tmp_path / "b/run/partition.json").read_text()
    assert read_jsonl(tmp_path / "a/run")[-1]["train_loss"] == read_jsonl(tmp_path / "b/run")[-1]["train_loss"]
    assert a["final"] == b["final"] and a["final"] != c["final"]


def test_partition_seed_fixes_the_partition_across_run_seeds(tmp_path):
    fixed = {"partition": {"seed": 5}}
    quick_run("fedavg", tmp_path / "a", {"seed": 1, **fixed})
    quick_run("fedavg", tmp_path / "b", {"seed": 2, **fixed})
    quick_run("fedavg", tmp_path / "c", {"seed": 5})
    part = lambda d: (tmp_path / d / "run/partition.json").read_text()
    assert part("a") == part("b") == part("c")
    assert read_jsonl(tmp_path / "a/run")[-1]["train_loss"] != read_jsonl(tmp_path / "b/run")[-1]["train_loss"]


def test_random_join_ratio_varies_participation(tmp_path):
    quick_run("fedavg", tmp_path, {"rounds": 6, "partition": {"num_clients": 10},
                                   "participation": {"random_join_ratio": [0.1, 1.0]}})
    selected = [r["clients_selected"] for r in read_jsonl(tmp_path / "run")]
    assert len(set(selected)) > 1 and min(selected) >= 1 and max(selected) <= 10


def test_resume_reaches_the_same_numbers_as_an_uninterrupted_run(tmp_path):
    over = {"rounds": 5, "checkpoint": {"every": 2}, "participation": {"join_ratio": 0.5}}
    full = Simulation(tiny_config("fedavg", over), run_dir=tmp_path / "full", tensorboard=False).run()
    part = Simulation(tiny_config("fedavg", over), run_dir=tmp_path / "part", tensorboard=False).run(stop_after=3)
    assert part["interrupted"] and part["rounds_completed"] == 3
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["rounds_completed"] == 5 and not resumed["interrupted"]
    assert resumed["final"] == full["final"] and resumed["best"] == full["best"]
    strip = lambda rs: [{k: v for k, v in r.items() if "seconds" not in k} for r in rs]
    assert strip(read_jsonl(tmp_path / "part")) == strip(read_jsonl(tmp_path / "full"))


class NaNOnClientOne(LocalSGDTrainer):
    def local_update(self):
        loss = super().local_update()
        if self.ctx.cid == 1:
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return loss


class RaisesOnClientTwo(LocalSGDTrainer):
    def local_update(self):
        if self.ctx.cid == 2:
            raise RuntimeError("client bug")
        return super().local_update()


class LeaksData(LocalSGDTrainer):
    def on_fit(self, payload):
        reply = super().on_fit(payload)
        if self.ctx.cid == 0:
            reply["sneaky"] = self.ctx.train.x[:3]
        return reply


@pytest.fixture
def faulty_trainers(registries_snapshot):
    for name, cls in [("nan1", NaNOnClientOne), ("raise2", RaisesOnClientTwo), ("leak", LeaksData)]:
        registries_snapshot.TRAINERS.register(name, cls)
    return registries_snapshot


def test_nan_update_is_rejected_and_round_goes_on(tmp_path, faulty_trainers):
    result = quick_run("fedavg", tmp_path, {"trainer": {"name": "nan1"}, "rounds": 2})
    recs = read_jsonl(tmp_path / "run")
    assert [r["client_failures"] for r in recs] == [1, 1] and [r["clients_replied"] for r in recs] == [3, 3]
    assert np.isfinite(result["final"]["uniform"])  # the global model stayed finite
    assert result["client_failures"] == 2


def test_raising_client_is_skipped_or_aborts(tmp_path, faulty_trainers):
    result = quick_run("fedavg", tmp_path / "skip", {"trainer": {"name": "raise2"}})
    assert result["client_failures"] == 2 and result["rounds_completed"] == 2
    with pytest.raises(ClientAbort, match="client 2 failed.*client bug"):
        quick_run("fedavg", tmp_path / "abort", {"trainer": {"name": "raise2"},
                                                 "failures": {"on_client_error": "abort"}})


class AlwaysRaises(LocalSGDTrainer):
    def local_update(self):
        raise RuntimeError("broken everywhere")


def test_a_round_where_every_client_fails_stops_the_run(tmp_path, registries_snapshot):
    from pflkit.core.engine.simulation import RunFailure

    registries_snapshot.TRAINERS.register("always_raises", AlwaysRaises)
    with pytest.raises(RunFailure, match="every selected client failed in round 1.*broken everywhere"):
        quick_run("fedavg", tmp_path, {"trainer": {"name": "always_raises"}})


def test_reply_exposing_raw_data_is_refused(tmp_path, faulty_trainers):
    result = quick_run("fedavg", tmp_path, {"trainer": {"name": "leak"}, "rounds": 1})
    assert result["client_failures"] == 1  # client 0's reply refused, the others aggregated
    assert read_jsonl(tmp_path / "run")[0]["clients_replied"] == 3


def test_server_context_holds_no_client_data(tmp_path):
    sim = Simulation(tiny_config("fedavg"), run_dir=tmp_path / "r", tensorboard=False)
    private = {t.untyped_storage().data_ptr() for c in sim.contexts.values()
               for t in (c.train.x, c.train.y, c.test.x, c.test.y)}

    def tensors(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif depth < 4 and isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v, depth + 1)
        elif depth < 4 and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                yield from tensors(v, depth + 1)

    assert all(t.untyped_storage().data_ptr() not in private for t in tensors(sim.server))


def test_corrupt_checkpoint_and_missing_run_are_clear_errors(tmp_path):
    Simulation(tiny_config("fedavg"), run_dir=tmp_path / "r", tensorboard=False).run(stop_after=1)
    (tmp_path / "r" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        Simulation.resume(tmp_path / "r")
    with pytest.raises(CheckpointError, match="not a run directory"):
        Simulation.resume(tmp_path / "nowhere")


def test_regression_task_reports_mse(tmp_path, registries_snapshot):
    from pflkit.core import DatasetBundle, regression

    def sine(root=None, download=True):
        g = torch.Generator().manual_seed(0)
        x = torch.rand(400, 1, generator=g) * 6.28
        return DatasetBundle(x=x, y=torch.sin(x).squeeze(1), task=regression(1), input_shape=(1,))

    registries_snapshot.DATASETS.register("tiny_sine", sine)
    result = quick_run("fedavg", tmp_path, {"dataset": {"name": "tiny_sine"}, "partition": {"name": "iid"},
                                            "rounds": 3})
    assert result["metric"] == "mse" and result["higher_is_better"] is False
    rec = read_jsonl(tmp_path / "run")[-1]
    assert "mse/uniform" in rec and "accuracy/uniform" not in rec and rec["mse/uniform"] < 1.0
