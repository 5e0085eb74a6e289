"""Declared per-client state: pooled trainers give the numbers of one-trainer-per-client runs, keep only what
they declare, spill past a memory budget, and checkpoints hold the declared states only."""
import errno
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from pflkit.core import LocalSGDTrainer, Simulation
from pflkit.core.storage.checkpoint import CHECKPOINT_NAME, MAGIC, load_checkpoint, open_checkpoint, to_safe
from pflkit.core.api.client import can_pool, state_declared
from pflkit.core.api.clientstate import ClientStateStore, parse_size, same_state
from pflkit.core.common.errors import ConfigError
from pflkit.core.api.server import GlobalModelAggregator, ServerAggregator
from pflkit.core.testing import OneTrainerPerClient as LegacyBackend, tiny_config


def run(tmp_path, name, algorithm, over=None, sets=(), backend=None, stop_after=None):
    cfg = tiny_config(algorithm, {"rounds": 3, "participation": {"join_ratio": 0.5}, **(over or {})}, sets)
    sim = Simulation(cfg, run_dir=tmp_path / name, tensorboard=False, backend=backend)
    return sim, sim.run(stop_after=stop_after)


def records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines]


CONVERTED = [("fedavg", ()), ("fedavg", ("trainer.bn_stats=local", "model.name=resnet8")), ("fedprox", ()),
             ("fedper", ()), ("fedrep", ("trainer.head_epochs=2",)), ("fedbn", ()), ("ditto", ()), ("local", ()),
             ("fedsa", ()), ("fedcac", ()), ("fedcp", ()),
             ("fedcp", ("trainer.use_client_vector=false", "trainer.use_sample_vector=false")),  # per-client input
             ("fedrod", ()), ("fedrod", ("trainer.personal_init=generic",)), ("fedproto", ()),
             ("fedproto", ("trainer.prototypes_from=last_epoch",)), ("fedc2i", ()),
             ("fedc2i", ("trainer.class_level=client", "trainer.client_level=local")),
             ("pcfl", ()), ("pcfl", ("trainer.alpha_mode=gradient",))]  # PCFL(Local): set-up, overlaps, deferral


PCFL_TINY = {"seed": 0, "dataset": {"name": "pcfl_sine", "num_clients": 6, "samples_per_client": 40},
             "partition": {"name": "by_group", "num_clients": 6}, "model": {"name": "mlp", "hidden": [8, 8]},
             "participation": {"join_ratio": 0.5}, "train": {"batch_size": 10, "local_epochs": 1, "lr": 0.05},
             "trainer": {"clusters": 2},
             "aggregator": {"flow_epochs": 4, "setup_block": 2, "flow_hidden": 8, "flow_transforms": 2,
                            "flow_inner_transforms": 2, "flow_join_ratio": 0.5, "flow_batch_size": 20,
                            "flow_lr": 0.01}}


@pytest.mark.parametrize("algorithm, sets", CONVERTED)
def test_pooled_run_equals_one_trainer_per_client(tmp_path, algorithm, sets):
    over = {"model": {"name": "fedbn_cnn", "channels": [4], "hidden": [8]}} if algorithm == "fedbn" else None
    if algorithm == "pcfl":  # its tiny sine setting, as in its own tests
        over = PCFL_TINY
    if algorithm == "fedc2i":  # its tiny setting, as in its own tests: four feature-shift domains, one per client
        over = {"dataset": {"domains": ["original", "thick", "inverted", "rotated"]},
                "partition": {"num_clients": 4}, "aggregator": {"plot_every": 0}}
    if "model.name=resnet8" in sets:  # BN statistics stay on the clients: their declared state
        over, sets = {"model": {"name": "resnet8", "width": 4}}, sets[:1]
    pooled, a = run(tmp_path, "pooled", algorithm, over, sets)
    legacy, b = run(tmp_path, "legacy", algorithm, over, sets, backend=LegacyBackend())
    assert pooled.backend.pool is not None and legacy.backend.pool is None
    assert records(tmp_path / "pooled") == records(tmp_path / "legacy")
    assert a["final"] == b["final"]
    for k, v in pooled.server.state_dict().get("global_state", {}).items():
        assert torch.equal(v, legacy.server.state_dict()["global_state"][k])
    for cid in pooled.client_ids:  # every client's persistent part, as its own trainer holds it, bit for bit
        want = legacy.backend.trainers[cid].state_dict()
        got = pooled.backend.trainers[cid].state_dict()
        assert sorted(got) == sorted(want) and all(same_state(got[part], want[part]) for part in want), cid


def test_stateless_clients_keep_nothing_and_stateful_ones_only_their_declared_part(tmp_path):
    fedavg, _ = run(tmp_path, "a", "fedavg")
    assert len(fedavg.backend.pool.store) == 0 and fedavg.backend.pool.store.memory_bytes == 0
    fedper, _ = run(tmp_path, "p", "fedper")
    model = fedper.build_model()
    heads = [k for k in model.state_dict() if k.startswith("head.")]
    store = fedper.backend.pool.store
    trained = [c for c in fedper.client_ids if c in store]
    assert len(trained) >= 2  # clients that trained hold their own head; the others still share the initial one
    assert all(sorted(store.get(c)["model"]) == sorted(heads) for c in trained)
    head_bytes = sum(model.state_dict()[k].numel() * 4 for k in heads)
    assert store.memory_bytes == len(trained) * head_bytes


def test_only_trainers_that_declare_their_own_state_are_pooled():
    from pflkit_ditto import DittoTrainer
    from pflkit_fedavg import FedAvgTrainer

    class WithCounter(FedAvgTrainer):  # a third-party subclass adding undeclared state stays on the legacy path
        pass

    assert state_declared(FedAvgTrainer) and state_declared(DittoTrainer)
    assert not state_declared(WithCounter) and not state_declared(LocalSGDTrainer)
    assert can_pool(FedAvgTrainer, GlobalModelAggregator)

    class BareFit(GlobalModelAggregator):  # sends messages without params: clients must keep their whole model
        def configure_fit(self, rnd, selected):
            return ServerAggregator.configure_fit(self, rnd, selected)

    assert not can_pool(FedAvgTrainer, BareFit) and not can_pool(FedAvgTrainer, ServerAggregator)


def test_pooled_trainer_refuses_a_message_without_params(tmp_path):
    sim, _ = run(tmp_path, "r", "fedavg", {"rounds": 1})
    trainer = sim.backend.pool.bind(1)
    with pytest.raises(RuntimeError, match="must carry 'params'"):
        trainer.on_evaluate({})
    sim.backend.pool.release(1)


# -- checkpoints -------------------------------------------------------------------------------------------------
def checkpoint_size(tmp_path, name, algorithm, clients):
    run(tmp_path, name, algorithm, {"rounds": 1, "partition": {"num_clients": clients}})
    return (tmp_path / name / CHECKPOINT_NAME).stat().st_size


def test_fedavg_checkpoint_does_not_grow_with_clients_but_ditto_grows_by_its_personal_models(tmp_path):
    small, large = checkpoint_size(tmp_path, "a4", "fedavg", 4), checkpoint_size(tmp_path, "a16", "fedavg", 16)
    assert large - small < 400  # a few bytes of bookkeeping per client, no model
    d4, d16 = checkpoint_size(tmp_path, "d4", "ditto", 4), checkpoint_size(tmp_path, "d16", "ditto", 16)
    model_bytes = sum(v.numel() * v.element_size() for v in
                      Simulation(tiny_config("ditto"), run_dir=tmp_path / "m").build_model().state_dict().values())
    # one round, half the clients train: 8 personal models of their own vs 2, plus one shared initial record
    assert 6 * model_bytes <= d16 - d4 < 6 * model_bytes * 1.3
    header, state = load_checkpoint(tmp_path / "a16")
    assert header["format_version"] == 3 and set(state["clients"]) == set(range(16))
    assert all(not s["model"] for s in state["clients"].values())


def test_checkpoint_final_false_with_every_0_writes_none_and_summary_reports_size(tmp_path):
    _, res = run(tmp_path, "none", "fedavg", {"checkpoint": {"every": 0, "final": False}})
    assert not (tmp_path / "none" / CHECKPOINT_NAME).exists() and res["checkpoint_bytes"] is None
    _, res = run(tmp_path, "final", "fedavg", {"checkpoint": {"every": 0}})
    assert res["checkpoint_bytes"] == (tmp_path / "final" / CHECKPOINT_NAME).stat().st_size > 0


def test_pooled_resume_is_bit_identical(tmp_path):
    over = {"rounds": 4, "checkpoint": {"every": 1}}
    run(tmp_path, "full", "ditto", over)
    run(tmp_path, "part", "ditto", over, stop_after=2)
    Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert records(tmp_path / "part") == records(tmp_path / "full")


def write_format2(run_dir, legacy_clients):
    """Rewrite a run's checkpoint in the previous format (one blob holding everything, full client state_dicts)."""
    header, state = load_checkpoint(run_dir)
    state["clients"] = legacy_clients
    buf = io.BytesIO()
    torch.save(to_safe(state), buf)
    body = buf.getvalue()
    meta = {k: v for k, v in header.items() if k not in ("format_version", "body_sha256", "body_bytes",
                                                         "index_bytes")}
    head = {"format_version": 2, "body_sha256": hashlib.sha256(body).hexdigest(), "body_bytes": len(body), **meta}
    (Path(run_dir) / CHECKPOINT_NAME).write_bytes(MAGIC + json.dumps(head).encode() + b"\n" + body)


def test_checkpoint_of_the_previous_format_resumes_with_the_same_numbers(tmp_path):
    over = {"rounds": 4, "checkpoint": {"every": 1}}
    run(tmp_path, "full", "fedper", over)
    sim, _ = run(tmp_path, "part", "fedper", over, stop_after=2)
    write_format2(tmp_path / "part", {c: sim.backend.trainers[c].state_dict() for c in sim.client_ids})
    assert open_checkpoint(tmp_path / "part")[0]["format_version"] == 2
    Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert records(tmp_path / "part") == records(tmp_path / "full")


# -- memory budget and spill store -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("512MiB", 512 << 20), ("1GiB", 1 << 30), ("1000000", 10 ** 6),
                                            (4096, 4096), ("1.5 GB", 1_500_000_000), ("none", None), (None, None)])
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "12XB", "1e9", True])
def test_a_state_budget_that_is_not_a_size_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"^clients\.state_memory: .*not a size"):
        tiny_config("ditto", {"clients": {"state_memory": bad}})


def test_budget_spills_states_to_disk_with_the_same_numbers(tmp_path):
    over = {"rounds": 3, "partition": {"num_clients": 6}}
    unlimited, _ = run(tmp_path, "mem", "ditto", over)
    per_client = unlimited.backend.pool.store.memory_bytes // 6
    cfg = tiny_config("ditto", {"participation": {"join_ratio": 0.5}, **over,
                                "clients": {"state_memory": str(2 * per_client)}})
    spilled = Simulation(cfg, run_dir=tmp_path / "disk", tensorboard=False)
    seen = {}

    def last_round(record):  # the spill files, as they are during the run
        if record["round"] == 3:
            seen["files"] = sorted((tmp_path / "disk" / "client_state").glob("*.pt"))
            seen["first"] = torch.load(seen["files"][0], weights_only=True)  # plain tensors: no code in the file
            seen["personal"] = {cid: spilled.backend.get_state(cid)["personal"] for cid in spilled.client_ids}

    spilled.run(on_round=last_round)
    store = spilled.backend.pool.store
    assert store.spills > 0 and store.spilled >= 4 and store.memory_bytes <= 2 * per_client
    assert records(tmp_path / "disk") == records(tmp_path / "mem")
    assert len(seen["files"]) == store.spilled
    data = seen["first"]
    assert set(data) == {"client", "state"} and set(data["state"]) == {"model", "personal"}  # the id is checked on read
    for cid in unlimited.client_ids:
        for k, v in unlimited.backend.get_state(cid)["personal"].items():
            assert torch.equal(seen["personal"][cid][k], v)
    # finished: the final checkpoint holds the states, the spill files are gone (issue 29)
    assert not (tmp_path / "disk" / "client_state").exists()


def test_store_keeps_the_least_recently_used_out_of_memory(tmp_path):
    store = ClientStateStore(budget=2 * 400, spill_dir=tmp_path / "s")
    for cid in range(4):
        store.put(cid, {"w": torch.full((100,), float(cid))})
    assert store.spilled == 2 and store.memory_bytes == 800
    assert float(store.get(0)["w"][0]) == 0.0 and float(store.get(3)["w"][0]) == 3.0
    store.put(0, {"w": torch.zeros(100)})  # re-admitted: the least recently used in memory (2) goes out
    assert 0 not in store._spilled and 2 in store._spilled
    store.clear()
    assert not (tmp_path / "s").exists() and len(store) == 0


def test_full_disk_while_spilling_is_one_error_and_the_run_resumes(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from pflkit.core.api import clientstate
    from pflkit.core.cli.main import cli

    def fl(*args):
        return CliRunner().invoke(cli, list(args), catch_exceptions=False)

    common = ["--plugin", "ditto", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "rounds=1",
              "--set", "partition.num_clients=4", "--set", "model.name=mlp", "--set", "model.hidden=[16]",
              "--set", "checkpoint.every=1", "--set", "clients.state_memory=1"]
    assert fl("run", *common, "--set", "run_name=full").exit_code == 0
    assert fl("run", "--resume", str(tmp_path / "full"), "--set", "rounds=3").exit_code == 0
    assert fl("run", *common, "--set", "run_name=r").exit_code == 0
    run_dir = tmp_path / "r"
    before = (run_dir / CHECKPOINT_NAME).read_bytes()

    def no_space(state, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(clientstate, "_write_state", no_space)
    res = fl("run", "--resume", str(run_dir), "--set", "rounds=3")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "cannot spill client state" in res.output and "No space left on device" in res.output
    assert (run_dir / CHECKPOINT_NAME).read_bytes() == before
    monkeypatch.undo()
    assert fl("run", "--resume", str(run_dir), "--set", "rounds=3").exit_code == 0
    assert records(run_dir) == records(tmp_path / "full")


@pytest.mark.parametrize("rollback, budget", [(True, None), (False, None), (True, "1")])
def test_a_failing_pooled_client_is_rolled_back_as_on_the_legacy_path(tmp_path, rollback, budget):
    from pflkit_fedper import FedPerTrainer

    from pflkit.core.api import registry

    class FailsOnTwo(FedPerTrainer):  # trains (changing its head), then raises
        declares_state = True

        def local_update(self):
            loss = super().local_update()
            if self.ctx.cid == 2:
                raise RuntimeError("client bug")
            return loss

    registry.TRAINERS.register("fails_on_two", FailsOnTwo, replace=True)
    try:
        over = {"trainer": {"name": "fails_on_two"}, "participation": {"join_ratio": 1.0},
                "failures": {"rollback": rollback}}
        pooled, _ = run(tmp_path, "pooled", "fedper", {**over, "clients": {"state_memory": budget}})
        legacy, _ = run(tmp_path, "legacy", "fedper", over, backend=LegacyBackend())
    finally:
        registry.TRAINERS.unregister("fails_on_two")
    assert pooled.backend.pool is not None
    assert records(tmp_path / "pooled") == records(tmp_path / "legacy")
    head = pooled.backend.trainers[2].model.head.weight
    assert torch.equal(head, legacy.backend.trainers[2].model.head.weight)
    assert torch.equal(head, pooled.build_model().head.weight) == rollback  # rolled back: still the initial head


def test_replaced_states_are_kept_for_a_rollback_under_the_same_budget(tmp_path):
    store = ClientStateStore(budget=2 * 400, spill_dir=tmp_path / "s")
    for cid in range(3):
        store.put(cid, {"w": torch.full((100,), float(cid))})
    store.track_previous(True)
    for cid in range(3):
        store.put(cid, {"w": torch.full((100,), 10.0 + cid)})
    store.put(5, {"w": torch.zeros(100)})  # a client that had no entry before
    assert store.memory_bytes <= 800  # the replaced states went to disk first
    for cid in (0, 2, 5):
        store.restore_previous(cid)
    assert [float(store.get(c)["w"][0]) for c in range(3)] == [0.0, 11.0, 2.0] and store.get(5) is None
    store.track_previous(False)  # forgets what it kept: no rollback after the next call
    store.put(1, {"w": torch.ones(100)})
    store.restore_previous(1)
    assert float(store.get(1)["w"][0]) == 1.0
    assert not list((tmp_path / "s").glob("*.previous.pt"))
