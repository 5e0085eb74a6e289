"""The researcher's workflow (issue 16): threads and run metadata, batch-job logging, reusable partitions, the small
options an exact comparison needs, and runs that died before their first checkpoint."""
import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from pflkit.core.storage.checkpoint import CHECKPOINT_NAME, read_header
from pflkit.core.cli.main import cli
from pflkit.core.engine.config import config_fingerprint, resolve
from pflkit.core.common.errors import ConfigError
from pflkit.core.engine.simulation import Simulation
from pflkit.core.testing import tiny_config

TINY = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
        "--set", "model.hidden=[16]", "--set", "checkpoint.every=0"]


def fl(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def run_cli(tmp_path, name, *extra):
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}",
             "--set", f"run_name={name}", *TINY, *extra)
    assert res.exit_code == 0, res.output
    return tmp_path / name


def metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numbers(run_dir):
    """The computed numbers of a run (no timings)."""
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in metrics(run_dir)]


# -- item 1: threads and run metadata ------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [(0, r"threads: 0 is invalid: must lie in \[1, 1024\]"),
                                             ("two", "threads: expected int"), (1.5, "threads: expected int")])
def test_threads_setting_is_validated(value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve([{"threads": value}], algorithm="fedavg")


def test_run_uses_its_threads_setting_records_it_and_restores_the_process_setting(tmp_path):
    before = torch.get_num_threads()
    seen = []
    sim = Simulation(tiny_config("fedavg", {"threads": 2, "rounds": 1}), run_dir=tmp_path / "r", tensorboard=False)
    sim.run(on_round=lambda rec: seen.append(torch.get_num_threads()))
    assert seen == [2] and torch.get_num_threads() == before
    assert read_header(tmp_path / "r" / CHECKPOINT_NAME)[0]["torch_threads"] == 2
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())["entries"]
    assert len(info) == 1 and info[0]["event"] == "start" and info[0]["threads"] == 2


def test_run_info_records_software_machine_and_command_and_grows_on_resume(tmp_path):
    run = run_cli(tmp_path, "r")
    entries = json.loads((run / "run_info.json").read_text())["entries"]
    assert len(entries) == 1
    e = entries[0]
    for key in ("command", "pflkit", "torch", "threads", "threads_source", "device", "hostname", "components",
                "git"):
        assert key in e, key
    assert e["torch"] == torch.__version__ and e["device"] == "cpu" and e["threads"] == torch.get_num_threads()
    assert e["components"]["trainer"] == {"name": "fedavg", "distribution": "pflkit-fedavg",
                                          "version": e["components"]["trainer"]["version"]}
    assert e["components"]["trainer"]["version"]
    res = fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress")
    assert res.exit_code == 0, res.output
    entries = json.loads((run / "run_info.json").read_text())["entries"]
    assert [x["event"] for x in entries] == ["start", "resume"] and entries[1]["from_round"] == 2


def test_git_commit_is_recorded_from_a_checkout(tmp_path):
    from pflkit.core.storage.runinfo import git_commit

    assert git_commit(tmp_path) is None  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == {"commit": head, "dirty": False, "path": str(tmp_path)}
    (tmp_path / "f").write_text("b")
    assert git_commit(tmp_path)["dirty"] is True


def test_threads_may_change_on_resume_with_a_warning(tmp_path, caplog):
    run = run_cli(tmp_path, "r", "--set", "threads=1")
    res = fl("run", "--resume", str(run), "--set", "rounds=3", "--set", "threads=2", "--no-progress")
    assert res.exit_code == 0, res.output
    assert any("checkpointed with 1 torch threads and resumes with 2" in r.getMessage() for r in caplog.records)
    assert "resumes with 2" in (run / "run.log").read_text()
    assert json.loads((run / "config.json").read_text())["threads"] == 2
    assert json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])["torch_threads"] == 2


def test_fl_command_defaults_to_one_thread_unless_omp_num_threads_is_set(monkeypatch):
    from pflkit.core.common import threads

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_cli_default_applied", False)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        threads.apply_cli_default()
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
        assert threads.threads_source({"threads": None}).startswith("fl default")
        assert threads.threads_source({"threads": 3}) == "threads setting"
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        threads.apply_cli_default()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_new_keys_at_their_defaults_keep_old_checkpoints_resumable():
    """A config.json written before threads/drop_last/init_seed existed hashes as before."""
    cfg = resolve([{}], algorithm="fedavg")
    old = json.loads(json.dumps(cfg))
    del old["threads"], old["train"]["drop_last"], old["model"]["init_seed"], old["dataset"]["normalize"]
    assert config_fingerprint(cfg) == config_fingerprint(old)
    assert config_fingerprint(resolve([{"train": {"drop_last": True}}], algorithm="fedavg")) != config_fingerprint(cfg)


# -- item 4: logging for batch jobs ------------------------------------------------------------------------
def test_batch_job_gets_one_line_per_round_and_run_log_has_them_with_warnings(tmp_path, registries_snapshot):
    from pflkit.core import LocalSGDTrainer

    class NanForClientZero(LocalSGDTrainer):
        """fedavg, except that client 0 uploads NaN (rejected with a warning)"""

        def upload(self):
            up = super().upload()
            if self.ctx.cid == 0:
                up = {k: v.float() * float("nan") for k, v in up.items()}
            return up

    registries_snapshot.TRAINERS.register("nan_zero")(NanForClientZero)
    # without --no-progress and with stdout not a terminal (CliRunner): one flushed line per round
    res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={tmp_path}", "--set", "run_name=r", *TINY,
             "--set", "trainer.name=nan_zero")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("round ")]
    assert len(lines) == 2 and lines[0].startswith("round 1/2  loss ") and "accuracy " in lines[0]
    assert "(weighted " in lines[0] and "1 client failure(s)" in lines[0] and lines[0].endswith(" s")
    log = (tmp_path / "r" / "run.log").read_text()
    for ln in lines:
        assert ln in log
    assert "WARNING pflkit: round 1: client 0 'fit' rejected" in log
    assert log.splitlines()[0].split(" ", 2)[2].startswith("start at round 0 of 2")
    # --no-progress: nothing per round on the console, run.log still written
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=q",
             *TINY)
    assert not [ln for ln in res.output.splitlines() if ln.startswith("round ")]
    assert "round 2/2" in (tmp_path / "q" / "run.log").read_text()


class _Terminal:
    """A stream that says it is a terminal and keeps what is written."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_warnings_are_written_above_the_progress_bar_not_through_it(tmp_path, monkeypatch):
    import logging

    from pflkit.core.storage.monitor import RoundReporter

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    console = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(console)
    try:
        with RoundReporter(tmp_path, total=3, initial=0, desc="algo", metric="accuracy") as rep:
            rep.round({"round": 1, "train_loss": 0.5}, 0.1, {"loss": "0.500"})
            logging.getLogger("pflkit").warning("client 3 rejected")
            rep.round({"round": 2, "train_loss": 0.4}, 0.1, {"loss": "0.400"})
    finally:
        logging.getLogger().removeHandler(console)
    assert rep.bar is not None and not rep.lines  # a terminal: the bar, no per-round lines
    rows = term.text.replace("\r", "\n").split("\n")
    warning_rows = [r for r in rows if "client 3 rejected" in r]
    assert warning_rows and all("round" not in r and "algo" not in r for r in warning_rows)
    assert "WARNING pflkit: client 3 rejected" in (tmp_path / "run.log").read_text()


# -- item 5: partitions as reusable artefacts ------------------------------------------------------------------
def clients_of(run_dir):
    doc = json.loads((run_dir / "partition.json").read_text())
    return [(c["train_indices"], c["test_indices"]) for c in doc["clients"]]


def test_partition_from_another_run_reuses_its_split_and_gives_identical_numbers(tmp_path):
    a = run_cli(tmp_path, "a")
    # another partition seed would give another split; the reused one wins
    b = run_cli(tmp_path, "b", "--set", f"partition.from={a}", "--set", "partition.seed=7")
    assert (a / "partition.json").read_text() == (b / "partition.json").read_text()
    assert numbers(a) == numbers(b)
    cfg = json.loads((b / "config.json").read_text())["partition"]
    assert cfg["name"] == "from_file" and cfg["path"] == str(a) and cfg["num_clients"] == 4
    c = run_cli(tmp_path, "c", "--set", "partition.seed=7")
    assert clients_of(c) != clients_of(a)  # so the equality above is the reuse, not a coincidence
    # without partition.num_clients the file decides it (the core default would be 20)
    assert resolve([{"partition": {"from": str(a)}}], algorithm="fedavg").partition.num_clients == 4


def test_a_plain_json_split_is_used_as_given(tmp_path):
    from pflkit.core.data.data import build_federated_data

    rng = __import__("numpy").random.default_rng(0)
    perm = rng.permutation(1797).tolist()
    split = {"dataset": "digits", "clients": [{"train": sorted(perm[i * 300:i * 300 + 200]),
                                               "test": sorted(perm[i * 300 + 200:i * 300 + 300])} for i in range(3)]}
    path = tmp_path / "split.json"
    path.write_text(json.dumps(split))
    fed = build_federated_data(resolve([{"partition": {"from": str(path)}}], algorithm="fedavg"))
    assert fed.num_clients == 3
    for s, c in zip(fed.splits, split["clients"]):
        assert s.train.tolist() == c["train"] and s.test.tolist() == c["test"]


def _split_error(tmp_path, doc, *sets):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=x",
             *TINY, "--set", f"partition.from={path}", *sets)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert not (tmp_path / "x").exists()
    return res.output


GOOD = [{"train": [0, 1, 2], "test": [3]}, {"train": [4, 5, 6], "test": [7]}, {"train": [8, 9], "test": [10]},
        {"train": [11, 12], "test": [13]}]


@pytest.mark.parametrize("change, sets, fragment", [
    ({"dataset": "mnist"}, (), "was made for dataset 'mnist', this run uses 'digits'"),
    ({"num_samples": 60000}, (), "was made for a dataset of 60000 samples, this one has 1797"),
    ({"clients": GOOD[:3] + [{"train": [11, 1797], "test": [13]}]}, (), "index 1797 is out of range"),
    ({"clients": GOOD[:3] + [{"train": [11, 12], "test": [12]}]}, (), "in both its train and its test set"),
    ({"clients": GOOD[:3] + [{"train": [11], "test": [13]}]}, (), "needs at least 2 and 1"),
    ({"clients": GOOD[:3] + [{"train": [11, 12.5], "test": [13]}]}, (), "flat list of integer"),
    ({"clients": GOOD[:3] + [{"train": [11, 12], "test": [13], "train_label_counts": [2]}]}, (),
     "labels differ from the label counts"),
    ({}, ("--set", "partition.num_clients=5"), "holds 4 clients but partition.num_clients = 5"),
    ({"clients": "x"}, (), "needs a non-empty list"),
])
def test_a_reused_split_is_checked_against_the_dataset(tmp_path, change, sets, fragment):
    out = _split_error(tmp_path, {"clients": GOOD, **change}, *sets)
    assert fragment in out


def test_partition_from_a_missing_or_conflicting_source_is_one_clear_error(tmp_path):
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", *TINY,
             "--set", f"partition.from={tmp_path / 'nothing'}")
    assert res.exit_code == 2 and "does not exist" in res.output
    with pytest.raises(ConfigError, match="cannot be combined with partition.name='iid'"):
        resolve([{"partition": {"from": "x", "name": "iid"}}], algorithm="fedavg")


def test_partitioners_may_take_the_dataset_and_return_their_own_train_test_split(registries_snapshot):
    import numpy as np

    from pflkit.core.data.data import ClientSplit, build_federated_data

    seen = {}

    def halves(labels, num_clients, rng, groups=None, dataset=None):
        seen["dataset"] = dataset
        chunks = np.array_split(np.arange(len(labels)), num_clients)
        return [ClientSplit(c[: len(c) // 2], c[len(c) // 2:]) for c in chunks]

    halves.params = {}
    registries_snapshot.PARTITIONERS.register("halves")(halves)
    fed = build_federated_data(resolve([{"partition": {"name": "halves", "num_clients": 3}}], algorithm="fedavg"))
    info = seen["dataset"]
    assert info.name == "digits" and info.num_samples == 1797 and info.num_classes == 10
    assert info.meta["source"] == "sklearn.datasets.load_digits"
    assert fed.splits[0].train.tolist() == list(range(299)) and fed.splits[0].test.tolist() == list(range(299, 599))

    def mixed(labels, num_clients, rng, groups=None):
        return [np.arange(10), ClientSplit(np.arange(10, 20), np.arange(20, 30))]

    mixed.params = {}
    registries_snapshot.PARTITIONERS.register("mixed")(mixed)
    with pytest.raises(Exception, match="index arrays for some clients"):
        build_federated_data(resolve([{"partition": {"name": "mixed", "num_clients": 2}}], algorithm="fedavg"))


# -- item 7: the small options an exact comparison needs ------------------------------------------------------
def test_train_drop_last_drops_the_incomplete_batch(tmp_path):
    def sizes(drop):
        cfg = tiny_config("fedavg", {"train": {"batch_size": 32, "drop_last": drop}})
        sim = Simulation(cfg, run_dir=tmp_path / f"d{drop}", tensorboard=False)
        try:
            n = sim.contexts[0].num_train
            return n, [len(y) for _, y in sim.trainer_cls(sim.contexts[0]).batches()]
        finally:
            sim.abandon()

    n, kept = sizes(False)
    assert n % 32 and kept[-1] == n % 32 and sum(kept) == n
    n, dropped = sizes(True)
    assert dropped == [32] * (n // 32)


def test_model_init_seed_fixes_the_initial_weights_independently_of_the_run_seed():
    from pflkit.core.engine.simulation import make_model_factory

    def weights(**over):
        cfg = tiny_config("fedavg", over)
        return make_model_factory(cfg, (1, 8, 8), 10, torch.device("cpu"))().state_dict()

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    seed0 = weights(seed=0)
    assert not same(seed0, weights(seed=1))
    assert same(seed0, weights(seed=1, model={"init_seed": 0}))  # init_seed=s: the initial model of seed s
    assert not same(seed0, weights(seed=0, model={"init_seed": 5}))
    with pytest.raises(ConfigError, match="model.init_seed: -1 is invalid"):
        tiny_config("fedavg", {"model": {"init_seed": -1}})


def test_digits_normalize_option_and_what_fl_show_says():
    from pflkit.datasets.digits import load_digits

    unit, std = load_digits(normalize="unit").x, load_digits().x
    assert float(unit.min()) == 0.0 and float(unit.max()) == 1.0
    assert torch.allclose(std, (unit - 0.3) / 0.4)  # standardised stays the default
    res = fl("show", "digits")
    assert "(x / 16 - 0.3) / 0.4" in res.output and "unit = x / 16" in res.output and "standardised" in res.output
    with pytest.raises(ConfigError, match="dataset.normalize: 'minmax' is not one of"):
        resolve([{"dataset": {"normalize": "minmax"}}], algorithm="fedavg")


def test_best_round_of_the_weighted_mean_is_reported_next_to_the_uniform_one(tmp_path):
    from pflkit.core.cli.run import format_summary
    from pflkit.core.engine.evaluation import History

    h = History("accuracy", True)
    h.add(1, {"accuracy/uniform": 0.7, "accuracy/weighted": 0.9})
    h.add(2, {"accuracy/uniform": 0.8, "accuracy/weighted": 0.6})
    s = h.summary(1)
    assert s["best"]["round"] == 2 and s["best_weighted"] == {"weighted": 0.9, "uniform": 0.7, "round": 1}
    run = run_cli(tmp_path, "r")
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    best = max(rows, key=lambda r: r["accuracy/weighted"])
    assert summary["best_weighted"]["round"] == best["round"]
    assert summary["best_weighted"]["weighted"] == best["accuracy/weighted"]
    text = format_summary(summary)
    assert f"best accuracy, sample-weighted (round {best['round']})" in text


# -- item 8: a run that died before its first checkpoint -------------------------------------------------------
def start_cmd(tmp_path, name):
    return ["run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", "--set",
            f"run_name={name}", *TINY]


def killed_before_first_checkpoint(tmp_path, name):
    run = run_cli(tmp_path, name)
    full = json.loads((run / "summary.json").read_text())
    for f in (CHECKPOINT_NAME, "summary.json"):
        (run / f).unlink()
    return run, full


def test_killed_after_saving_its_configuration_the_advice_to_resume_works(tmp_path):
    run, full = killed_before_first_checkpoint(tmp_path, "r")
    again = fl(*start_cmd(tmp_path, "r"))
    assert again.exit_code == 2 and f"fl run --resume {run}" in again.output
    res = fl("run", "--resume", str(run), "--no-progress")  # exactly what the message says
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["final"] == full["final"]


@pytest.mark.parametrize("config", [None, '{"rounds": 2, "see'])  # killed before or while writing config.json
def test_killed_before_saving_its_configuration_the_advice_to_start_again_works(tmp_path, config):
    run, full = killed_before_first_checkpoint(tmp_path, "r")
    (run / "config.json").unlink()
    if config is not None:
        (run / "config.json").write_text(config)
    res = fl("run", "--resume", str(run), "--no-progress")
    assert res.exit_code == 2 and "nothing to resume" in res.output and "Start it again with the original fl run " \
        "command (the same run_name reuses this directory)" in res.output.replace("\n", " "), res.output
    res = fl(*start_cmd(tmp_path, "r"))
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["final"] == full["final"]


def test_an_unrelated_folder_is_never_taken_over(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    res = fl(*start_cmd(tmp_path, "r"))
    assert res.exit_code == 2 and "already exists" in res.output
    assert (tmp_path / "r" / "notes.txt").read_text() == "mine"


def test_a_damaged_partition_without_checkpoint_is_made_again_on_resume(tmp_path):
    run, full = killed_before_first_checkpoint(tmp_path, "r")
    saved = (run / "partition.json").read_text()
    (run / "partition.json").write_text(saved[:100])  # killed while writing it
    res = fl("run", "--resume", str(run), "--no-progress")
    assert res.exit_code == 0, res.output
    assert (run / "partition.json").read_text() == saved
    assert json.loads((run / "summary.json").read_text())["final"] == full["final"]
