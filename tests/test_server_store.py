"""The server-side per-client store (core.api.serverstore): API, one budget that spills with the same numbers,
lean checkpoints and bit-identical resume, tampered spill files refused with one line."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pflkit.core import Algorithm, GlobalModelAggregator
from pflkit.core.storage.checkpoint import load_checkpoint
from pflkit.core.common.errors import CheckpointError, PluginError
from pflkit.core.api.serverstore import ServerStores
from pflkit.core.engine.simulation import Simulation
from pflkit.core.api.state import weighted_average
from pflkit.core.testing import metrics_records, tiny_config, tiny_run, tiny_simulation

# ---------------------------------------------------------------------------------------------------------------
# the API on its own


def test_store_api_and_shared_budget_spill_least_recently_used(tmp_path):
    stores = ServerStores(budget=3 * 16, spill_root=tmp_path / "server_state")  # room for three 4-float entries
    a, b = stores.store("models"), stores.store("duals")
    assert stores.store("models") is a and stores.names() == ["duals", "models"]
    for cid in range(4):
        a.put(cid, {"w": torch.full((4,), float(cid))})
    b.put(7, [torch.ones(4), 3])  # plain containers and numbers are fine
    assert stores.memory_bytes <= 48 and stores.spilled == 2  # clients 0, 1 went to disk (least recently used)
    assert sorted(p.name for p in (tmp_path / "server_state" / "models").iterdir()) == ["0.pt", "1.pt"]
    assert a.ids() == [0, 1, 2, 3] and b.ids() == [7] and 2 in a and 5 not in a and len(a) == 4
    assert torch.equal(a.get(0)["w"], torch.zeros(4)) and a.get(5) is None and a.get(5, "d") == "d"
    assert [cid for cid, _ in a.items()] == [0, 1, 2, 3]
    a.discard(0)
    assert a.ids() == [1, 2, 3] and not (tmp_path / "server_state" / "models" / "0.pt").exists()
    stores.clear()
    assert not (tmp_path / "server_state").exists() and a.ids() == []


def test_store_names_and_values_are_checked(tmp_path):
    stores = ServerStores()
    for bad in ("", "1x", "a/b", "..", "x" * 65):
        with pytest.raises(PluginError, match="server store name"):
            stores.store(bad)
    with pytest.raises(ValueError, match="None cannot be stored"):
        stores.store("m").put(0, None)


# ---------------------------------------------------------------------------------------------------------------
# a run: an aggregator whose global model is the uniform mean of every client's latest upload, stale ones included
# (partial participation), so the numbers depend on every stored entry


class LatestUploadsMean(GlobalModelAggregator):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.latest = self.client_store("latest")

    def aggregate_fit(self, rnd, replies):
        for cid in sorted(replies):
            self.latest.put(cid, replies[cid]["params"])
        states = [state for _, state in self.latest.items()]
        if states:
            self.global_state.update(weighted_average(states, [1.0] * len(states)))
        self.ctx.logger.log_scalar("server/stored", float(len(states)))


@pytest.fixture
def store_algorithm(registries_snapshot):
    registries_snapshot.AGGREGATORS.register("latest_uploads_mean", LatestUploadsMean)
    registries_snapshot.ALGORITHMS.register("latest_mean", Algorithm("fedavg", "latest_uploads_mean"))
    return "latest_mean"


RUN = {"rounds": 3, "partition": {"num_clients": 6}, "participation": {"join_ratio": 0.5}}


def _with(budget):
    return {**RUN, "server": {"state_memory": budget}}


def test_a_budget_spills_and_gives_the_same_numbers(store_algorithm, tmp_path):
    free, a = tiny_run(store_algorithm, tmp_path / "free", RUN)
    tight, b = tiny_run(store_algorithm, tmp_path / "tight", _with(0))
    assert free.server_stores.spilled == 0 and len(free.server.latest) > 3  # stale uploads kept and used
    assert tight.server_stores.memory_bytes == 0 and tight.server_stores.spilled == len(tight.server.latest)
    # every entry went to disk during the run; finished, the checkpoint holds them and the spill files go (issue 29)
    assert not (tmp_path / "tight" / "server_state").exists()
    assert metrics_records(tmp_path / "free") == metrics_records(tmp_path / "tight") and a["final"] == b["final"]
    # the checkpoint holds every entry, one blob each, whatever the budget
    _, state = load_checkpoint(tmp_path / "tight")
    assert sorted(state["server_stores"]["latest"]) == free.server.latest.ids()
    for cid, entry in free.server.latest.items():
        assert all(torch.equal(entry[k], state["server_stores"]["latest"][cid][k]) for k in entry)


@pytest.mark.parametrize("budget", [None, 0])
def test_resume_is_bit_identical(store_algorithm, tmp_path, budget):
    overrides = _with(budget)
    _, full = tiny_run(store_algorithm, tmp_path / "full", overrides)
    part = tiny_simulation(store_algorithm, tmp_path / "part", overrides)
    part.run(stop_after=1)
    # the resumed process refills the store from the checkpoint (a budget may change on resume: resume-safe)
    resumed_sim = Simulation.resume(tmp_path / "part", {"server": {"state_memory": "1MiB" if budget == 0 else 0}},
                                    tensorboard=False)
    assert resumed_sim.server.latest.ids() == part.server.latest.ids()
    if budget is None:  # resumed under a zero budget: every entry went from the checkpoint straight to disk
        assert resumed_sim.server_stores.memory_bytes == 0
        assert resumed_sim.server_stores.spilled == len(resumed_sim.server.latest) > 0
    resumed = resumed_sim.run()
    assert resumed["final"] == full["final"]
    assert metrics_records(tmp_path / "part") == metrics_records(tmp_path / "full")


@pytest.mark.parametrize("saved, fragment", [
    ({"../x": {}}, "server store name"),
    ({"m": {"0": {"w": torch.ones(1)}}}, "has client id '0'"),
    ({"m": {-1: {"w": torch.ones(1)}}}, "has client id '-1'"),
    ([1, 2], "not a mapping"),
])
def test_a_crafted_checkpoint_store_is_refused(tmp_path, saved, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        ServerStores().load(saved, tmp_path / "checkpoint.pt")


def test_checkpoint_without_server_stores_still_loads(tmp_path):
    """Algorithms that keep no server store write no ``server_stores`` entry (checkpoints as before)."""
    tiny_run("fedavg", tmp_path / "r")
    _, state = load_checkpoint(tmp_path / "r")
    assert "server_stores" not in state


def test_a_tampered_server_spill_file_is_one_line(store_algorithm, tmp_path):
    cfg = tiny_config(store_algorithm, _with(0))
    sim = Simulation(cfg, run_dir=tmp_path / "r", tensorboard=False)
    folder = tmp_path / "r" / "server_state" / "latest"

    def swap(record):
        if record["round"] == 1:
            files = sorted(folder.glob("*.pt"))
            shutil.copy(files[1], files[0])  # another client's upload in place of this one's

    with pytest.raises(CheckpointError, match=r"spilled server state 'latest' .*server_state/latest/\d+\.pt is not "
                                              r"the file pflkit wrote for client \d+") as err:
        sim.run(on_round=swap)
    assert "\n" not in str(err.value)


def test_the_budget_key_is_checked_and_resume_safe(tmp_path):
    from pflkit.core.engine.config import RESUME_SAFE_KEYS, config_fingerprint
    from pflkit.core.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"server.state_memory.*not a size"):
        tiny_config("fedavg", {"server": {"state_memory": "lots"}})
    assert "server.state_memory" in RESUME_SAFE_KEYS
    assert config_fingerprint(tiny_config("fedavg")) == config_fingerprint(
        tiny_config("fedavg", {"server": {"state_memory": "1GiB"}}))


def test_a_run_made_before_the_key_existed_resumes(tmp_path):
    """config.json without a ``server`` section (written before it existed) matches its checkpoint and resumes;
    fl compare counts it as the same configuration."""
    import json

    from pflkit.core.engine.config import to_plain, without_neutral_defaults

    part = tiny_simulation("fedavg", tmp_path / "r", {"rounds": 2})
    part.run(stop_after=1)
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved.pop("server") == {"state_memory": None}
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    assert without_neutral_defaults(json.loads(json.dumps(saved))) == without_neutral_defaults(to_plain(part.cfg))
    assert Simulation.resume(tmp_path / "r", tensorboard=False).run()["rounds_completed"] == 2
