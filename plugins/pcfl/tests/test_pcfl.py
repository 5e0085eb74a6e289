"""PCFL (Algorithm 2, Eq. 9-14) on tiny inputs: composition with each base, set-up resume, overlaps, synthetic
sampling, routing and averaging of the overlap term, byte accounting, privacy, bad input, end to end."""
import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.core import Message, Simulation, payload_nbytes
from pflkit.core.testing import SerialBackend, cli, parse_sets, resolve
from pflkit_ditto import DittoTrainer
from pflkit_fedavg import FedAvgTrainer
from pflkit_fedrep import FedRepTrainer
from pflkit_local import LocalTrainer
from pflkit_pcfl import PcflClientMixin, PcflServerMixin
from pflkit_pcfl.equations import average_overlap_terms, default_latent_dim, overlap_indices, sample_unshared
from pflkit_pcfl.hull import build_region
from pflkit_pcfl.synthetic_eval import FIGURE_NAME, truth_counts

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_ROUNDS = 50  # `fl run --plugin pcfl`: the README states its time; configs/sine.toml has the paper's 200


def pcfl_cfg(layer, sets=()):
    return resolve([layer, parse_sets(list(sets))], algorithm="pcfl")


class RecordingBackend(SerialBackend):
    """The serial backend, remembering every (client, message, reply) it carried."""

    def __init__(self):
        super().__init__()
        self.log = []

    def execute(self, calls, snapshot=False):
        results = super().execute(calls, snapshot)
        for cid in sorted(calls):
            self.log.append((cid, calls[cid].message, results[cid].reply))
        return results


def run_sim(tmp_path, layer, sets=(), name="run", **kw):
    sim = Simulation(pcfl_cfg(layer, sets), run_dir=Path(tmp_path) / name, tensorboard=False, **kw)
    return sim, sim.run()


# -- composition -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("base, base_cls, protocol", [("local", LocalTrainer, "local"),
                                                      ("fedavg", FedAvgTrainer, "global-model"),
                                                      ("fedrep", FedRepTrainer, "global-model"),
                                                      ("ditto", DittoTrainer, "global-model")])
def test_pcfl_wraps_each_base_end_to_end(tmp_path, tiny_sine, base, base_cls, protocol):
    sim, out = run_sim(tmp_path, tiny_sine, [f"trainer.base={base}"] +
                       (["trainer.head_epochs=1"] if base == "fedrep" else []))
    assert issubclass(sim.trainer_cls, PcflClientMixin) and issubclass(sim.trainer_cls, base_cls)
    assert issubclass(sim.aggregator_cls, PcflServerMixin)
    assert sim.trainer_cls.protocol == sim.aggregator_cls.protocol == "pcfl/" + protocol
    assert out["rounds_completed"] == 2 and out["client_failures"] == 0
    assert np.isfinite(out["final"]["uniform"])
    assert sim.server.flow_step == 4 and sim.server.regions_done


def test_base_defaults_apply_beneath_pcfl():
    cfg = pcfl_cfg({}, ["trainer.base=fedrep"])
    assert cfg.trainer.head_epochs == 10          # FedRep's default
    assert cfg.train.local_epochs == 15           # PCFL's default over FedRep's 1
    assert cfg.participation.join_ratio == 0.1 and cfg.rounds == DEFAULT_ROUNDS
    assert cfg.trainer.alpha == cfg.trainer.beta == 0.5
    assert pcfl_cfg({}).trainer.base == "local"   # the authors' synthetic run is PCFL(local)


# -- set-up: flow pre-training, regions; resumable --------------------------------------------------------------
def _server_state(sim):
    return sim.server.state_dict()["pcfl"]


@pytest.mark.parametrize("pause", [1, 2, 3])  # inside pre-training, after it (before regions), after set-up
def test_setup_resumes_with_identical_numbers(tmp_path, tiny_sine, pause):
    whole, ref = run_sim(tmp_path, tiny_sine, name="whole")
    first = Simulation(pcfl_cfg(tiny_sine), run_dir=tmp_path / "cut", tensorboard=False).run(stop_in_setup=pause)
    assert first["interrupted"] and first["rounds_completed"] == 0
    sim = Simulation.resume(tmp_path / "cut", tensorboard=False)
    assert sim.server.flow_step == min(2 * pause, 4)
    out = sim.run()
    assert out["final"] == ref["final"] and out["bytes_up_total"] == ref["bytes_up_total"]
    assert out["bytes_down_total"] == ref["bytes_down_total"]
    for key, value in _server_state(whole)["flow"].items():
        assert torch.equal(value, _server_state(sim)["flow"][key])
    assert torch.equal(whole.server.counts, sim.server.counts)
    for cid in whole.client_ids:
        a, b = whole.backend.get_state(cid)["pcfl"], sim.backend.get_state(cid)["pcfl"]
        assert torch.equal(a["syn_x"], b["syn_x"]) and a["overlaps"].keys() == b["overlaps"].keys()
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert "pcfl/overlap_precision" in rows[0]  # the set-up report reaches round 1's record even after a pause


def test_flow_training_reduces_both_losses(tmp_path, tiny_sine):
    tiny_sine["aggregator"].update({"flow_epochs": 40, "setup_block": 40})
    first = {}
    sim = Simulation(pcfl_cfg(tiny_sine, ["rounds=1"]), run_dir=tmp_path / "r", tensorboard=False)
    original = sim.server._flow_step

    def spy(comm, total):
        step = sim.server.flow_step
        phase, loss = original(comm, total)
        assert phase == ("recon" if step < total / 2 else "nll") and loss == sim.server.report[f"flow_{phase}"]
        first.setdefault(phase, loss)
        return phase, loss

    sim.server._flow_step = spy
    sim.run()
    report = sim.server.report
    assert report["flow_recon"] < first["recon"] and report["flow_nll"] < first["nll"]


# -- Eq. 10 and 12, unit level -------------------------------------------------------------------------------------
def test_overlap_indices_and_labels():
    square = build_region(np.array([[0, 0], [1, 0], [0, 1], [1, 1.0]]), None)
    codes = np.array([[0.5, 0.5], [2, 2], [0.1, 0.9], [-0.1, 0.5]])
    assert overlap_indices(square, codes).tolist() == [0, 2]
    assert overlap_indices(square, np.zeros((0, 2))).numel() == 0
    per_label = build_region(np.array([[0, 0], [1, 0], [0, 1.0], [5, 5], [6, 5], [5, 6.0]]),
                             np.array([0, 0, 0, 1, 1, 1]))
    # a code inside label 1's hull counts only for a sample of label 1
    pts = np.array([[5.2, 5.2], [5.2, 5.2], [0.2, 0.2]])
    assert overlap_indices(per_label, pts, np.array([1, 0, 0])).tolist() == [0, 2]


def test_unshared_sampling_stays_in_the_unshared_region():
    own = build_region(np.array([[-1, -1], [1, -1], [-1, 1], [1, 1.0]]), None)
    other = build_region(np.array([[0, 0], [2, 0], [0, 2], [2, 2.0]]), None)
    gen = torch.Generator().manual_seed(0)
    sample = lambda n, g: torch.randn(n, 2, generator=g)
    u, draws = sample_unshared(sample, own, [other], wanted=50, max_draws=100000, generator=gen)
    assert len(u) == 50 and draws >= 50
    x = u.numpy()
    assert (np.abs(x) <= 1).all() and not ((x[:, 0] > 0) & (x[:, 1] > 0)).any()
    # the budget bounds the attempts: an unshared region that is empty yields nothing
    u, draws = sample_unshared(sample, own, [own], wanted=10, max_draws=300, generator=gen)
    assert len(u) == 0 and draws == 300


def test_clients_keep_overlaps_and_synthetic_samples(tmp_path, tiny_sine):
    sim, _ = run_sim(tmp_path, tiny_sine)
    counts = sim.server.counts
    for cid in sim.client_ids:
        trainer = sim.backend.trainers[cid]
        assert {i: len(v) for i, v in trainer.overlaps.items()} == \
            {i: int(counts[i, cid]) for i in range(6) if counts[i, cid] > 0}
        assert cid not in trainer.overlaps
        n = len(trainer.syn_y)
        assert n <= round(0.5 * trainer.ctx.num_train)
        if n:
            assert trainer.syn_x.shape == (n, 1) and trainer.syn_y.shape == (n, 1)
            assert torch.isfinite(trainer.syn_x).all() and trainer.syn_x.dtype == torch.float32
    assert sim.server.report["synthetic_got"] > 0 and 0 < sim.server.report["synthetic_acceptance"] < 1
    assert counts.sum() > 0 and torch.all(counts.diagonal() == 0)


# -- Algorithm 2: routing and averaging of the overlap term -------------------------------------------------------
class Recorder:
    """A server channel that records every send."""

    def __init__(self, sim):
        self.sim, self.sent = sim, []

    @property
    def client_ids(self):
        return list(self.sim.client_ids)

    def send(self, messages, accounted=True):
        replies = self.sim.comm.send(messages, accounted)
        self.sent.append((messages, replies))
        return replies


def test_eq11_average():
    parts = [{"w": torch.tensor([2.0, 4.0])}, {"w": torch.tensor([4.0, 8.0])}]
    assert torch.equal(average_overlap_terms(parts, 5, "all")["w"], torch.tensor([1.5, 3.0]))  # /(N-1) = /4
    assert torch.equal(average_overlap_terms(parts, 5, "contributing")["w"], torch.tensor([3.0, 6.0]))
    assert average_overlap_terms([], 5) == {}


@pytest.mark.parametrize("mode", ["update", "gradient"])
def test_round_routes_models_to_overlap_holders_and_averages(tmp_path, tiny_sine, mode):
    tiny_sine["participation"]["join_ratio"] = 1.0
    sim, _ = run_sim(tmp_path, tiny_sine, [f"trainer.alpha_mode={mode}", "rounds=1"])
    before = {cid: {k: v.clone() for k, v in sim.backend.trainers[cid].model.named_parameters()}
              for cid in sim.client_ids}
    rec = Recorder(sim)
    sim.comm.begin_round(2)
    sim.server.run_round(2, sim.client_ids, rec)
    (fit, fit_replies), (jobs, contrib), (applies, finals) = rec.sent[:3]
    counts = sim.server.counts
    deferred = sorted(i for i in fit if fit[i].payload["defer"])
    assert deferred == sorted(i for i in range(6) if counts[i].sum() > 0)
    for i in deferred:
        assert set(fit_replies[i]) == {"personal", "steps"}
    # one message per client k, carrying exactly the owners i whose D^{i,k} it holds
    assert sorted(jobs) == sorted(k for k in range(6) if any(counts[i, k] > 0 for i in deferred))
    for k, msg in jobs.items():
        assert msg.kind == "pcfl_alpha"
        assert sorted(msg.payload["models"]) == sorted(i for i in deferred if counts[i, k] > 0)
        assert sorted(contrib[k]["updates"]) == sorted(msg.payload["models"])
    alpha, lr = sim.cfg.trainer.alpha, sim.cfg.train.lr
    for i in deferred:
        parts = [contrib[k]["updates"][i] for k in sorted(contrib) if i in contrib[k]["updates"]]
        expected = {key: sum(p[key] for p in parts) / 5 for key in parts[0]}  # Eq. 11: 1/(N-1), N = 6
        for key, value in applies[i].payload["update"].items():
            assert torch.allclose(value, expected[key], atol=1e-7)
        # client i applied it to its personal model (local base: self.model) on top of its local update
        personal = fit_replies[i]["personal"]
        now = dict(sim.backend.trainers[i].model.named_parameters())
        for key, value in applies[i].payload["update"].items():
            step = value if mode == "update" else -lr * alpha * value
            assert torch.allclose(now[key].detach(), personal[key] + step, atol=1e-6)
        assert set(finals[i]) == {"num_samples", "train_loss"}  # exactly the base's (Local's) fit reply
    for cid in set(range(6)) - set(deferred):
        assert cid in fit_replies and "train_loss" in fit_replies[cid]
    assert any(not torch.equal(before[i][k], now_v) for i in deferred
               for k, now_v in sim.backend.trainers[i].model.named_parameters())


def test_alpha_zero_sends_no_overlap_messages(tmp_path, tiny_sine):
    sim, _ = run_sim(tmp_path, tiny_sine, ["trainer.alpha=0", "rounds=1"])
    rec = Recorder(sim)
    sim.comm.begin_round(2)
    sim.server.run_round(2, [0, 1, 2], rec)
    assert len(rec.sent) == 1 and all(not m.payload["defer"] for m in rec.sent[0][0].values())


def test_fedavg_base_uploads_after_the_overlap_term(tmp_path, tiny_sine):
    tiny_sine["participation"]["join_ratio"] = 1.0
    sim, _ = run_sim(tmp_path, tiny_sine, ["trainer.base=fedavg", "rounds=1"])
    rec = Recorder(sim)
    sim.comm.begin_round(2)
    sim.server.run_round(2, sim.client_ids, rec)
    applies, finals = rec.sent[2]
    for i, reply in finals.items():
        model = sim.backend.trainers[i].model.state_dict()
        assert set(reply) == {"params", "num_samples", "train_loss"}
        assert all(torch.equal(reply["params"][k], model[k]) for k in reply["params"])


def test_beta_term_reaches_only_the_personal_model(tmp_path, tiny_sine):
    sim, _ = run_sim(tmp_path, tiny_sine, ["trainer.base=ditto", "trainer.alpha=0", "rounds=1",
                                           "trainer.synthetic_region=own"])
    trainer = next(t for t in sim.backend.trainers.values() if len(t.syn_y) > 0)
    seen = []
    original = DittoTrainer.data_loss

    def spy(self, model, x, y):
        seen.append(("personal" if model is self.personal else "global", len(x)))
        return original(self, model, x, y)

    DittoTrainer.data_loss = spy
    try:
        trainer.handle(Message("pcfl_fit", {"kind": "fit", "payload": {}, "defer": False}))
    finally:
        DittoTrainer.data_loss = original
    # per personal step: the local batch, then a synthetic batch; the global model sees local batches only
    personal = [n for who, n in seen if who == "personal"]
    glob = [n for who, n in seen if who == "global"]
    assert len(personal) == 2 * len(glob) and glob


# -- accounting and privacy -------------------------------------------------------------------------------------
def test_every_message_is_counted(tmp_path, tiny_sine):
    backend = RecordingBackend()
    sim, out = run_sim(tmp_path, tiny_sine, backend=backend)
    counted = [(m, r) for _, m, r in backend.log if m.kind not in ("evaluate", "pcfl_truth") and r is not None]
    assert out["bytes_down_total"] == sum(payload_nbytes(m.payload) for m, _ in counted)
    assert out["bytes_up_total"] == sum(payload_nbytes(r) for _, r in counted)
    kinds = {m.kind for m, _ in counted}
    assert {"pcfl_flow_grad", "pcfl_region", "pcfl_overlap", "pcfl_fit"} <= kinds
    regions = [r["region"] for _, m, r in backend.log if m.kind == "pcfl_region"]
    relays = [m for _, m, _ in backend.log if m.kind == "pcfl_overlap"]
    assert len(relays) == 6  # every region goes to every client: real downlink
    assert all(payload_nbytes(m.payload["regions"]) == payload_nbytes(regions) for m in relays)
    assert sim.server.report["region_bytes_down"] == 6 * sim.server.report["region_bytes_up"]


def _tabular(tmp_path):
    """A classification task with 6 features (rows the privacy guard fingerprints), 4 natural clients."""
    return {
        "rounds": 1, "device": "cpu",
        "dataset": {"name": "fedprox_synthetic", "num_devices": 4, "dimension": 6, "num_classes": 2,
                    "min_samples": 40, "size_sigma": 0.0, "size_mean": 0.0},
        "partition": {"name": "by_group", "num_clients": 4},
        "model": {"name": "mlp", "hidden": [8]},
        "participation": {"join_ratio": 1.0},
        "train": {"batch_size": 10, "local_epochs": 1},
        "trainer": {"overlap": "box"},
        "aggregator": {"latent_dim": 2, "flow_epochs": 2, "setup_block": 2, "flow_hidden": 8,
                       "flow_transforms": 1, "flow_inner_transforms": 1, "flow_join_ratio": 1.0},
        "checkpoint": {"every": 0},
    }


def test_no_raw_sample_crosses_the_privacy_boundary(tmp_path):
    backend = RecordingBackend()
    sim, out = run_sim(tmp_path, _tabular(tmp_path), backend=backend)
    assert out["client_failures"] == 0
    kinds = set()
    for cid, msg, reply in backend.log:
        kinds.add(msg.kind)
        for other in sim.client_ids:  # neither a reply nor a relayed payload holds any client's raw rows
            assert sim.guard.violation(other, reply) is None
            assert sim.guard.violation(other, msg.payload) is None
    assert {"pcfl_region", "pcfl_overlap", "pcfl_alpha", "pcfl_apply"} <= kinds


def test_the_core_refuses_a_region_reply_with_raw_rows(tmp_path, monkeypatch, caplog):
    original = PcflClientMixin.on_pcfl_region

    def leaky(self, payload):
        reply = original(self, payload)
        if self.ctx.cid == 0:
            reply["debug"] = self.ctx.train.x[:3].clone()  # a copy of raw input rows: must never leave
        return reply

    monkeypatch.setattr(PcflClientMixin, "on_pcfl_region", leaky)
    sim, out = run_sim(tmp_path, _tabular(tmp_path))
    refused = [f for f in sim.failures if f["kind"] == "pcfl_region"]
    assert [f["client"] for f in refused] == [0] and "raw data" in refused[0]["reason"]
    assert int(sim.server.counts[0].sum()) == 0  # client 0's region never reached the others
    assert len(sim.backend.trainers[0].syn_y) == 0 and out["rounds_completed"] == 1


def test_states_are_plain_data(tmp_path, tiny_sine):
    sim, _ = run_sim(tmp_path, tiny_sine)
    for state in [sim.server.state_dict(), *(sim.backend.get_state(c) for c in sim.client_ids)]:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)  # no numpy, no custom classes


# -- the synthetic experiment's instrumentation -------------------------------------------------------------------
def test_truth_counts():
    truth = {"sign": [1, 1, -1], "intervals": [[0, 1], [1, 2], [0, 1]], "width": 1.0}
    x = torch.tensor([0.5, 1.5, 2.5, 0.2])  # client 1's samples: intervals 0, 1, 2, 0
    overlaps = {0: torch.tensor([0, 2]), 2: torch.tensor([1])}
    # useful to 0 (same sign, intervals 0/1): samples 0, 1, 3; to 2: none (other sign)
    assert truth_counts(1, x, overlaps, truth) == {"tp": 1, "pred": 3, "true": 3}


def test_sine_run_logs_overlap_quality_and_draws_figure_5e(tmp_path, tiny_sine):
    sim, _ = run_sim(tmp_path, tiny_sine)
    report = sim.server.report
    assert 0 <= report["overlap_precision"] <= 1 and 0 <= report["overlap_recall"] <= 1
    assert (tmp_path / "run" / FIGURE_NAME).stat().st_size > 1000
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["pcfl/overlap_precision"] == report["overlap_precision"]


def test_paper_latent_dims():
    assert default_latent_dim("pcfl_sine", 3) == 2 and default_latent_dim("emnist", 784) == 12
    assert default_latent_dim("adult", 100) == 32 and default_latent_dim("cifar10", 3072) == 256
    assert default_latent_dim("digits", 64) == 2


# -- bad input: one clear line, exit status 2 -------------------------------------------------------------------
def fl(*args):
    return CliRunner().invoke(cli, list(args))


def one_clear_line(res, *fragments):
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in res.output and len(errors) == 1, res.output
    assert res.output.strip().splitlines()[-1] == errors[0], res.output  # at most 'run directory: ...' before it
    for f in fragments:
        assert f in res.output, res.output


def _tiny_sets(tmp_path, extra=()):
    sets = ["dataset.num_clients=6", "partition.num_clients=6", "rounds=1", "aggregator.flow_epochs=2",
            "aggregator.flow_hidden=8", "aggregator.flow_transforms=1", "aggregator.flow_inner_transforms=1",
            f"output_dir={tmp_path}", "participation.join_ratio=0.5", "train.local_epochs=1"]
    return [a for s in [*sets, *extra] for a in ("--set", s)]


def test_bad_input_is_one_clear_line(tmp_path):
    cfg = str(CONFIGS / "sine.toml")
    one_clear_line(fl("run", "--plugin", "pcfl", "-c", cfg, *_tiny_sets(tmp_path, ["aggregator.latent_dim=3"])),
                   "aggregator.latent_dim: 3 is invalid", "data dimension d = 3")
    one_clear_line(fl("run", "--plugin", "pcfl", "-c", cfg, *_tiny_sets(tmp_path, ["aggregator.latent_dim=0"])),
                   "aggregator.latent_dim")
    one_clear_line(fl("run", "--plugin", "pcfl", "-c", cfg, *_tiny_sets(tmp_path, ["trainer.clusters=20"])),
                   "fewer than d'+1 = 3", "overlap=box")
    one_clear_line(fl("run", "--plugin", "pcfl", "-c", cfg, *_tiny_sets(tmp_path, ["trainer.base=fedcac"])),
                   "trainer.base", "cannot wrap 'fedcac'", "Bases it can wrap:", "fedrep")
    one_clear_line(fl("run", "--plugin", "pcfl", "-c", cfg, *_tiny_sets(tmp_path, ["trainer.base=fedprox"])),
                   "cannot wrap 'fedprox'", "overrides loss()")
    one_clear_line(fl("run", "--plugin", "pcfl", "-c", cfg, *_tiny_sets(tmp_path, ["trainer.base=nope"])),
                   "unknown algorithm 'nope'")


def test_fl_run_pcfl_on_the_sine_task(tmp_path):
    # the algorithm's defaults are the paper's synthetic task (= configs/sine.toml); shrunk here
    res = fl("run", "--plugin", "pcfl",  # with progress: a batch job's lines (output is not a terminal)
             *_tiny_sets(tmp_path, ["rounds=2", "run_name=e2e", "trainer.base=fedavg"]))
    assert res.exit_code == 0, res.output
    assert "final mse" in res.output
    assert "pcfl (trainer pcfl, aggregator pcfl; trainer.base = fedavg)" in res.output  # the summary names the base
    # set-up progress: one line per block of flow steps with its losses, then the regions, on the console and in run.log
    setup = [ln for ln in res.output.splitlines() if ln.startswith("set-up: ")]
    assert setup == [ln.split(" ", 2)[2] for ln in (tmp_path / "e2e" / "run.log").read_text().splitlines()
                     if ln.split(" ", 2)[2].startswith("set-up: ")]
    assert len(setup) == 2 and setup[0].startswith("set-up: PCFL flow steps 1-2 of 2 (Algorithm 1): mean "
                                                    "reconstruction loss of g ")
    assert "NLL of h" in setup[0] and setup[1].startswith("set-up: PCFL regions")
    run = tmp_path / "e2e"
    assert json.loads((run / "summary.json").read_text())["base"] == {"trainer.base": "fedavg"}
    assert (run / FIGURE_NAME).exists() and (run / "tb").is_dir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and "pcfl/overlap_recall" in rows[0]


def test_paper_configs_resolve():
    from pflkit.core.testing import load_file

    assert {p.stem for p in CONFIGS.glob("*.toml")} == {"sine", "cifar10", "femnist", "adult"}
    for path in sorted(CONFIGS.glob("*.toml")):
        cfg = resolve([load_file(path)])
        assert cfg.algorithm == "pcfl", path
        if path.stem != "sine":
            assert cfg.trainer.clusters == 0 and cfg.dataset.download is False
    sine = resolve([load_file(CONFIGS / "sine.toml")])
    # `fl run --plugin pcfl` is the sine config in fewer rounds (minutes on 2 cores); the config keeps the paper's 200
    defaults = resolve([{}], algorithm="pcfl")
    for key in ("dataset", "partition", "model", "participation", "train", "trainer", "eval"):
        assert sine[key] == defaults[key], key
    # the flow and its training too (the sine config spells out d' = 2, which the default derives from the dataset)
    assert {**defaults.aggregator, "latent_dim": 2} == sine.aggregator
    assert sine.rounds == 200 and defaults.rounds == DEFAULT_ROUNDS < sine.rounds


def test_missing_data_is_named(tmp_path):
    res = fl("run", "-c", str(CONFIGS / "adult.toml"), "--set", f"dataset.root={tmp_path}",
             "--set", f"output_dir={tmp_path / 'runs'}")
    one_clear_line(res, "adult.data", "does not exist")
    assert not (tmp_path / "runs").exists()


def test_vectorized_overlap_updates_match_the_loop(tmp_path, tiny_sine, monkeypatch):
    sim, _ = run_sim(tmp_path, tiny_sine, ["rounds=1"])
    counts = sim.server.counts
    k = max(range(6), key=lambda c: int((counts[:, c] > 0).sum()))
    owners = [i for i in range(6) if counts[i, k] > 0]
    assert len(owners) >= 2
    state = {n: v.clone() for n, v in sim.backend.trainers[owners[0]].model.state_dict().items()}
    payload = {"models": {i: {"state": state, "steps": 3 + i} for i in owners}}
    trainer = sim.backend.trainers[k]
    assert trainer._can_vectorize()

    def run(vectorize):
        monkeypatch.setattr(type(trainer), "_can_vectorize", lambda self: vectorize)
        trainer.ctx.generator.manual_seed(7)
        return trainer.on_pcfl_alpha(payload)["updates"]

    fast, slow = run(True), run(False)
    assert sorted(fast) == sorted(slow) == owners
    for i in owners:
        for n in slow[i]:
            assert torch.allclose(fast[i][n], slow[i][n], atol=1e-6), (i, n)
        assert any(v.abs().sum() > 0 for v in fast[i].values())


def test_models_with_dropout_momentum_or_clipping_take_the_loop(tmp_path, tiny_sine):
    tiny_sine["model"]["dropout"] = 0.2
    tiny_sine["participation"]["join_ratio"] = 1.0
    sim, out = run_sim(tmp_path, tiny_sine, ["rounds=1"])
    assert not sim.backend.trainers[0]._can_vectorize() and out["client_failures"] == 0
    sim, out = run_sim(tmp_path, tiny_sine, ["rounds=1", "model.dropout=0", "train.momentum=0.9"], name="m")
    assert not sim.backend.trainers[0]._can_vectorize() and out["client_failures"] == 0
    sim, out = run_sim(tmp_path, tiny_sine, ["rounds=1", "model.dropout=0", "train.max_grad_norm=1"], name="c")
    assert not sim.backend.trainers[0]._can_vectorize() and out["client_failures"] == 0


def test_fl_show_pcfl_lists_base_options_and_bases():
    res = fl("show", "pcfl")
    assert res.exit_code == 0, res.output
    assert "trainer 'pcfl' over trainer 'local' of base algorithm 'local' (protocol 'pcfl/local')" in res.output
    assert "trainer.base = 'local'" in res.output and "aggregator.latent_dim = None" in res.output
    bases = res.output.split("base algorithms it can wrap")[1].splitlines()[0]
    assert all(b in bases for b in ("local", "fedavg", "fedrep", "ditto")) and "fedcac" not in bases
    # FedRoD wraps by class but refuses PCFL's default (regression) task at start: named apart, with the reason
    assert "fedrod" not in bases
    assert "not with these defaults: fedrod (algorithm fedrod: FedRoD needs a classification task" in res.output


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("pcfl", {"dataset": {"name": "pcfl_sine", "num_clients": 6, "samples_per_client": 40},
         "partition": {"name": "by_group", "num_clients": 6}, "model": {"name": "mlp", "hidden": [8, 8]},
         "participation": {"join_ratio": 1.0}, "train": {"batch_size": 10, "local_epochs": 2, "lr": 0.05},
         "trainer": {"clusters": 2, "synthetic_region": "own"},
         "aggregator": {"flow_epochs": 4, "setup_block": 2, "flow_hidden": 8, "flow_transforms": 2,
                        "flow_inner_transforms": 2, "flow_join_ratio": 0.5, "flow_batch_size": 20, "flow_lr": 0.01}}, tmp_path)


# -- the authors' flow schedule (aggregator.flow_training = authors) -------------------------------------------------
def _authors(tiny_sine, batch=20):
    tiny_sine["aggregator"].update({"flow_training": "authors", "flow_recon_epochs": 2, "flow_density_epochs": 1,
                                    "flow_batch_size": batch})
    return tiny_sine


def test_authors_schedule_passes_over_every_pooled_row_once_per_pass(tmp_path, tiny_sine):
    """Each pass cuts one seeded permutation of the pooled rows into batches of flow_batch_size; each batch's rows go
    to the clients holding them, so every client's rows are used exactly once a pass; phases by pass (2 + 1)."""
    backend = RecordingBackend()
    sim, out = run_sim(tmp_path, _authors(tiny_sine, batch=20), ["rounds=1"], backend=backend)
    sizes = {cid: backend.contexts[cid].num_train for cid in sim.client_ids}
    pooled = sum(sizes.values())
    per_pass = -(-pooled // 20)
    grads = [(cid, m.payload) for cid, m, _ in backend.log if m.kind == "pcfl_flow_grad"]
    assert [m.kind for _, m, _ in backend.log[:len(sizes)]] == ["pcfl_flow_size"] * len(sizes)
    assert sim.server.flow_step == 3 * per_pass and sim.server.flow_sizes == sizes
    seen = [{cid: [] for cid in sizes} for _ in range(3)]
    step = -1
    last = None
    for cid, payload in grads:
        assert payload["objective"] == "authors"
        key = id(payload["flow"])  # one payload (one flow state) per step, shared by its clients
        if key != last:
            step, last = step + 1, key
        seen[step // per_pass][cid] += payload["rows"].tolist()
        assert payload["phase"] == ("recon" if step < 2 * per_pass else "nll")
    assert step == 3 * per_pass - 1
    for passed in seen:
        for cid, rows in passed.items():
            assert sorted(rows) == list(range(sizes[cid]))


def test_authors_schedule_gradient_is_the_pooled_batch_gradient(tmp_path, tiny_sine):
    """The sample-weighted mean of the clients' replies for one batch equals the gradient of the authors' loss on
    the pooled batch (1000 x MSE + 0.01 x mean g(z)^2), computed centrally from the same rows."""
    from pflkit_pcfl.flow import flow_data
    from pflkit_pcfl.trainer import AUTHORS_LATENT_L2, AUTHORS_MSE_FACTOR, build_flow

    backend = RecordingBackend()
    sim, _ = run_sim(tmp_path, _authors(tiny_sine, batch=50), ["rounds=1"], backend=backend)
    first = [(cid, m.payload, r) for cid, m, r in backend.log if m.kind == "pcfl_flow_grad"]
    first = [x for x in first if x[1]["flow"] is first[0][1]["flow"]]
    assert len(first) >= 2  # a batch of 50 of 180 pooled rows spans several clients
    flow = build_flow(first[0][1]["arch"], torch.device("cpu"))
    flow.load_state_dict(first[0][1]["flow"])
    xs, ys = zip(*(backend.contexts[cid].train.batch(p["rows"]) for cid, p, _ in first))
    z, c = flow_data(torch.cat(xs), torch.cat(ys), sim.task, pad=1)
    loss = AUTHORS_MSE_FACTOR * flow.reconstruction_loss(z, c, kind="mse") + AUTHORS_LATENT_L2 * flow.latent_l2(z, c)
    names = [k for k, _ in flow.named_parameters() if k.startswith("g.")]
    pooled = torch.autograd.grad(loss, [dict(flow.named_parameters())[k] for k in names])
    total = sum(r["n"] for _, _, r in first)
    assert total == 50
    for name, g in zip(names, pooled):
        mean = sum(r["grads"][name].double() * r["n"] / total for _, _, r in first)
        assert torch.allclose(mean.float(), g, rtol=1e-4, atol=1e-5 * float(g.abs().max())), name  # float32 sums


def test_authors_schedule_resumes_with_identical_numbers(tmp_path, tiny_sine):
    whole, ref = run_sim(tmp_path, _authors(tiny_sine), ["rounds=1"], name="whole")
    cfg = pcfl_cfg(_authors(copy.deepcopy(tiny_sine)), ["rounds=1"])
    first = Simulation(cfg, run_dir=tmp_path / "cut", tensorboard=False).run(stop_in_setup=1)
    assert first["interrupted"]
    sim = Simulation.resume(tmp_path / "cut", tensorboard=False)
    assert 0 < sim.server.flow_step < whole.server.flow_step
    out = sim.run()
    assert out["final"] == ref["final"]
    for key, value in _server_state(whole)["flow"].items():
        assert torch.equal(value, _server_state(sim)["flow"][key])


def test_authors_schedule_lr_is_their_cosine_per_phase_and_clips(tmp_path, tiny_sine):
    """The learning rate of each pass is CosineAnnealingLR's, restarted for the density phase; AdamW decays."""
    sim = Simulation(pcfl_cfg(_authors(tiny_sine), ["rounds=1", "aggregator.flow_clip=0.001"]),
                     run_dir=tmp_path / "r", tensorboard=False)
    assert isinstance(sim.server.flow_opt, torch.optim.AdamW)
    assert sim.server.flow_opt.param_groups[0]["weight_decay"] == 1e-5
    lrs, norms = [], []
    original = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **kw):
        params = list(params)
        original(params, max_norm, *a, **kw)
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        lrs.append(sim.server.flow_opt.param_groups[0]["lr"])

    import unittest.mock
    with unittest.mock.patch("torch.nn.utils.clip_grad_norm_", spy):
        sim.run()
    per_pass = len(lrs) // 3
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2)
    expected = []
    for _ in range(2):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        cosine.step()
    assert [lrs[0], lrs[per_pass]] == pytest.approx(expected) and lrs[2 * per_pass] == pytest.approx(0.01)
    assert max(norms) <= 0.001 * (1 + 1e-5)  # every step's gradient clipped to flow_clip


# -- one flow shared by the runs of a comparison (aggregator.flow_seed, core.api.artifacts) --------------------------
def _rows(run_dir):
    """metrics.jsonl without the timings (everything else must be equal)."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k and "time" not in k} for r in rows]


@pytest.mark.parametrize("schedule", ["authors", "algorithm1"])
def test_a_shared_flow_is_trained_once_and_loading_it_changes_no_number(tmp_path, tiny_sine, schedule):
    """The first run trains the flow and saves it; a second run with the same flow seed loads it, sends no flow
    message, and gives every number of a run that trained it itself -- metrics, traffic totals (the loaded flow
    counts the messages it replaced), the synthetic samples (their seeds follow the message numbers)."""
    layer = _authors(tiny_sine) if schedule == "authors" else tiny_sine
    layer["partition"]["seed"] = 0  # the same clients' data for both seeds (the flow is trained on it)
    shared = tmp_path / "artifacts"
    maker, made = run_sim(tmp_path, layer, ["aggregator.flow_seed=7"], name="maker", artifacts_dir=shared)
    assert [e["action"] for e in made["shared_artifacts"]] == ["saved"]
    assert len(list(shared.glob("pcfl-flow-*.pt"))) == 1
    backend = RecordingBackend()
    user, used = run_sim(tmp_path, layer, ["aggregator.flow_seed=7", "seed=3"], name="user", artifacts_dir=shared,
                         backend=backend)
    plain, alone = run_sim(tmp_path, layer, ["aggregator.flow_seed=7", "seed=3"], name="plain")
    assert [e["action"] for e in used["shared_artifacts"]] == ["loaded"]
    assert used["shared_artifacts"][0]["made_by"] == str(tmp_path / "maker")
    assert "shared_artifacts" not in alone
    assert not [m for _, m, _ in backend.log if m.kind in ("pcfl_flow_grad", "pcfl_flow_size")]
    for key, value in _server_state(plain)["flow"].items():  # seed 3 trains seed 0's flow: the flow seed is 7
        assert torch.equal(value, _server_state(user)["flow"][key])
        assert torch.equal(value, _server_state(maker)["flow"][key])
    assert _rows(tmp_path / "user") == _rows(tmp_path / "plain")
    assert used["final"] == alone["final"] and used["best"] == alone["best"]
    assert used["bytes_up_total"] == alone["bytes_up_total"] and used["bytes_down_total"] == alone["bytes_down_total"]
    for cid in plain.client_ids:
        assert torch.equal(plain.backend.get_state(cid)["pcfl"]["syn_x"], user.backend.get_state(cid)["pcfl"]["syn_x"])


def test_without_a_flow_seed_each_seed_trains_its_own_flow(tmp_path, tiny_sine):
    shared = tmp_path / "artifacts"
    a, first = run_sim(tmp_path, tiny_sine, ["seed=0"], name="a", artifacts_dir=shared)
    b, second = run_sim(tmp_path, tiny_sine, ["seed=1"], name="b", artifacts_dir=shared)
    again, third = run_sim(tmp_path, tiny_sine, ["seed=1", "trainer.alpha=0.25"], name="c", artifacts_dir=shared)
    assert [e["action"] for e in second["shared_artifacts"]] == ["saved"]
    assert len(list(shared.glob("pcfl-flow-*.pt"))) == 2
    assert not all(torch.equal(v, _server_state(b)["flow"][k]) for k, v in _server_state(a)["flow"].items())
    # another trainer option, the same flow seed and flow options: seed 1's flow is loaded
    assert [e["action"] for e in third["shared_artifacts"]] == ["loaded"]
    # another flow option: trained anew
    _, fourth = run_sim(tmp_path, tiny_sine, ["seed=1", "aggregator.flow_lr=0.02"], name="d", artifacts_dir=shared)
    assert [e["action"] for e in fourth["shared_artifacts"]] == ["saved"]


def test_a_shared_flow_made_across_a_resume_records_its_whole_cost(tmp_path, tiny_sine):
    import fcntl
    import os

    shared = tmp_path / "artifacts"
    cut = Simulation(pcfl_cfg(tiny_sine), run_dir=tmp_path / "cut", tensorboard=False, artifacts_dir=shared)
    assert cut.run(stop_in_setup=1)["interrupted"]
    assert not list(shared.glob("*.pt"))
    # the paused run gave up its make's lock (the core releases it as the run ends): a run started now would make it
    (lock,) = shared.glob("pcfl-flow-*.making")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    resumed = Simulation.resume(tmp_path / "cut", tensorboard=False, artifacts_dir=shared)
    # resumed in the middle of the make, the run holds its lock again: a run started beside it waits for the flow
    fd = os.open(lock, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        resumed.run()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # saved: the lock is free
    finally:
        os.close(fd)
    _, whole = run_sim(tmp_path, tiny_sine, name="whole")
    _, loaded = run_sim(tmp_path, tiny_sine, name="loaded", artifacts_dir=shared)
    assert [e["action"] for e in loaded["shared_artifacts"]] == ["loaded"]
    assert loaded["bytes_down_total"] == whole["bytes_down_total"] and loaded["final"] == whole["final"]
    assert _rows(tmp_path / "loaded") == _rows(tmp_path / "whole")


def test_a_damaged_or_foreign_shared_flow_is_ignored_and_trained_again(tmp_path, tiny_sine, caplog):
    import logging

    shared = tmp_path / "artifacts"
    run_sim(tmp_path, tiny_sine, name="maker", artifacts_dir=shared)
    (path,) = shared.glob("pcfl-flow-*.pt")
    path.write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        _, out = run_sim(tmp_path, tiny_sine, name="again", artifacts_dir=shared)
    assert [e["action"] for e in out["shared_artifacts"]] == ["saved"]
    assert "ignored" in caplog.text
    # a file of the right format whose key is another run's (renamed onto this key's name) is not trusted either
    other = tmp_path / "other"
    run_sim(tmp_path, tiny_sine, ["aggregator.flow_lr=0.02"], name="other", artifacts_dir=other)
    (foreign,) = other.glob("pcfl-flow-*.pt")
    path.write_bytes(foreign.read_bytes())
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        _, out = run_sim(tmp_path, tiny_sine, name="third", artifacts_dir=shared)
    assert [e["action"] for e in out["shared_artifacts"]] == ["saved"]
    assert "made for another key" in caplog.text


def test_the_seeds_of_a_comparison_share_one_flow(tmp_path, tiny_sine):
    from pflkit.core import run_comparison

    layer = _authors(tiny_sine)
    layer["partition"]["seed"] = 0
    layer["aggregator"]["flow_seed"] = 0
    # jobs=2: both seeds start at once in two processes; the one that finds the make taken waits for it
    run_comparison(["pcfl"], [0, 1], [layer], tmp_path / "out", jobs=2)
    actions = {p.parent.name: [e["action"] for e in json.loads(p.read_text())["shared_artifacts"]]
               for p in (tmp_path / "out" / "runs").glob("*/summary.json")}
    assert sorted(actions.values()) == [["loaded"], ["saved"]]
    assert len(list((tmp_path / "out" / "artifacts").glob("pcfl-flow-*.pt"))) == 1

