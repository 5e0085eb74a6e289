"""The torch.distributed backend: N = 2 processes (gloo on 127.0.0.1) give the serial run's exact numbers, resume
across world sizes, refuse bad input with one line, and stop with a clear message when a worker dies."""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from pflkit.core import Algorithm
from pflkit.core.api import registry as reg
from pflkit.core.engine.config import deep_merge, to_plain
from pflkit.core.engine.assign import assign_clients
from pflkit.core.engine.simulation import Simulation
from pflkit.core.testing import run_in_own_session, tiny_config

FAST = ["fedavg", "fedcac", "fedcp", "fedsa"]
OTHERS = ["ditto", "fedbn", "fedc2i", "fedper", "fedproto", "fedprox", "fedrep", "fedrod", "local", "pcfl"]
# algorithms whose tiny test configuration differs from core.testing.TINY (as in their own plugin tests)
OVERRIDES = {
    "fedc2i": {"dataset": {"domains": ["original", "thick", "inverted", "rotated"]}, "partition": {"num_clients": 4},
               "aggregator": {"plot_every": 0}},
    "pcfl": {"rounds": 2, "seed": 0, "dataset": {"name": "pcfl_sine", "num_clients": 6, "samples_per_client": 40},
             "partition": {"name": "by_group", "num_clients": 6}, "model": {"name": "mlp", "hidden": [8, 8]},
             "participation": {"join_ratio": 0.5}, "train": {"batch_size": 10, "local_epochs": 1, "lr": 0.05},
             "trainer": {"clusters": 2},
             "aggregator": {"flow_epochs": 4, "setup_block": 2, "flow_hidden": 8, "flow_transforms": 2,
                            "flow_inner_transforms": 2, "flow_join_ratio": 0.5, "flow_batch_size": 20,
                            "flow_lr": 0.01},
             "checkpoint": {"every": 1}},  # set-up steps checkpoint too
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PFLKIT_RENDEZVOUS_TIMEOUT": "60", "PFLKIT_DIST_TIMEOUT": "120"}


def _register_misbehaving() -> None:
    """'misbehaving': FedAvg where client 0 reports NaN (round 1), client 1 uploads a function (round 1), client 2
    a view of its own data (round 2) and client 3 raises (round 2): isolation, rollback and the privacy check."""
    from pflkit_fedavg import FedAvgTrainer

    class Misbehaving(FedAvgTrainer):
        def on_fit(self, payload):
            reply = super().on_fit(payload)
            cid, rnd = self.ctx.cid, self.ctx.round
            if cid == 0 and rnd == 1:
                reply["train_loss"] = float("nan")
            if cid == 1 and rnd == 1:
                reply["extra"] = lambda: 0
            if cid == 2 and rnd == 2:
                reply["extra"] = self.ctx.train.x[:3]
            if cid == 3 and rnd == 2:
                raise RuntimeError("boom")
            return reply

    reg.TRAINERS.register("misbehaving", Misbehaving, replace=True)
    reg.ALGORITHMS.register("misbehaving", Algorithm(trainer="misbehaving", aggregator="fedavg"), replace=True)


@pytest.fixture
def misbehaving():
    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items() if r.names() is not None}
    _register_misbehaving()
    yield
    for k, r in reg.ALL_REGISTRIES.items():
        if k in before:
            r._entries = before[k]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(run_dir: Path) -> List[Dict]:
    """metrics.jsonl without timings (which differ between any two runs)."""
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if "seconds" not in k})
    return out


def _summary(run_dir: Path) -> Dict:
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    return {k: v for k, v in s.items() if k not in ("run_dir", "checkpoint_bytes")}


def _tiny(algorithm: str, over: dict):
    return tiny_config(algorithm, deep_merge(OVERRIDES.get(algorithm, {}), over))


def _failures(run_dir: Path) -> List[tuple]:
    from pflkit.core.storage.checkpoint import load_checkpoint

    return [(f["round"], f["client"], f["reason"]) for f in load_checkpoint(run_dir)[1]["failures"]]


def _config_file(tmp_path: Path, algorithm: str, tag: str = "", **over) -> Path:
    path = tmp_path / f"{algorithm}{tag}.json"
    path.write_text(json.dumps(to_plain(_tiny(algorithm, over))))
    return path


def _serial(tmp_path: Path, algorithm: str, name: str, stop_after=None, **over) -> Path:
    run = tmp_path / name
    Simulation(_tiny(algorithm, over), run_dir=run, tensorboard=False).run(stop_after=stop_after)
    return run


# -- a group of 2 spawned processes running several jobs (one start-up for many runs) --------------------------
def _group_worker(rank: int, world: int, port: int, jobs: List[dict]) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pflkit.core.distributed.backend import DistributedBackend
    from pflkit.core.distributed.worker import Endpoint, RunRequest, _run, init_group

    _register_misbehaving()
    ep = Endpoint(rank, world, rank, "127.0.0.1", port)
    init_group(ep)
    try:
        for job in jobs:
            req = RunRequest(config_file=job.get("config"), sets=tuple(job.get("sets", ())),
                             resume_dir=job.get("resume"), progress=False)
            backend = DistributedBackend()
            with _gloo_standing_in_for_nccl(job.get("device_group", False)), _data_built() as built:
                assert _run(req, ep, backend) == 0
            assert (backend.device_group is not None) == job.get("device_group", False)
            # this process built the data of its own clients only (the privacy check runs where the data is)
            assert built == backend.owned and len(built) < len(backend.owner), (built, backend.assignment)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _data_built():
    """The clients whose data tensors this process builds while the block runs, in order of building."""
    from pflkit.core.data.data import FederatedData

    built: List[int] = []
    original = FederatedData.client_tensors

    def recording(self, cid, device):
        built.append(cid)
        return original(self, cid, device)

    FederatedData.client_tensors = recording
    try:
        yield built
    finally:
        FederatedData.client_tensors = original


@contextlib.contextmanager
def _gloo_standing_in_for_nccl(on: bool):
    """The start-up picks NCCL and creates a second process group for device tensors, but (no GPU here) that group
    is a gloo group on the CPU: the plumbing of the NCCL path, minus NCCL itself."""
    from pflkit.core.distributed import worker

    if not on:
        yield
        return
    pick, new_group = worker.device_collective_backend, worker.dist.new_group
    worker.device_collective_backend = lambda requested, device: "nccl"
    worker.dist.new_group = lambda backend=None, **kw: new_group(backend="gloo", **kw)
    try:
        yield
    finally:
        worker.device_collective_backend, worker.dist.new_group = pick, new_group


def _spawn(jobs: List[dict], world: int = 2, timeout: float = 400) -> None:
    _start_and_join(_group_worker, (world, _free_port(), jobs), world, timeout)


def _start_and_join(fn, args: tuple, nprocs: int = 2, timeout: float = 400) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; fails if one fails or all have not ended in time, and
    kills whatever is left either way."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the spawned processes did not finish in time"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _fresh(tmp_path: Path, algorithm: str, name: str, rounds: int = 2) -> dict:
    cfg = _config_file(tmp_path, algorithm, f"-{name}", rounds=rounds)
    return {"config": str(cfg), "sets": [f"output_dir={tmp_path}", f"run_name={name}"]}


# -- tests ------------------------------------------------------------------------------------------------------
def test_assignment_is_deterministic_balanced_and_largest_first():
    cost = {0: 10, 1: 9, 2: 4, 3: 4, 4: 2, 5: 1}
    a = assign_clients(cost, 2)
    assert a == assign_clients(dict(reversed(list(cost.items()))), 2)  # independent of the input's order
    assert sorted(sum(a, [])) == list(cost)
    assert a[0][0] == 0 and 1 in a[1]  # the two largest clients go to different ranks
    loads = [sum(cost[c] for c in r) for r in a]
    assert max(loads) - min(loads) <= 2
    assert all(r for r in assign_clients({0: 100, 1: 1, 2: 1}, 3))  # no idle rank


def test_two_processes_give_the_serial_numbers_and_resume_across_world_sizes(tmp_path, misbehaving):
    jobs = [_fresh(tmp_path, algo, f"dist-{algo}") for algo in FAST + ["misbehaving"]]
    # written by 2 processes after round 1, resumed serially below; and the reverse
    jobs.append(_fresh(tmp_path, "fedcac", "dist-part", rounds=1))
    serial_part = _serial(tmp_path, "fedcac", "serial-part", rounds=2, stop_after=1)
    jobs.append({"resume": str(serial_part)})
    _spawn(jobs)
    for algo in FAST + ["misbehaving"]:
        ref = _serial(tmp_path, algo, f"serial-{algo}")
        assert _records(tmp_path / f"dist-{algo}") == _records(ref), algo
        assert _summary(tmp_path / f"dist-{algo}") == _summary(ref), algo
    # the same clients were rejected, for the same reasons, on 2 processes as in the serial run
    failures = [_failures(tmp_path / f"{kind}-misbehaving") for kind in ("dist", "serial")]
    assert failures[0] == failures[1] and len(failures[0]) == 4, failures
    whole = tmp_path / "serial-fedcac"
    Simulation.resume(tmp_path / "dist-part", overrides={"rounds": 2}, tensorboard=False).run()
    assert _records(tmp_path / "dist-part") == _records(whole)  # 2 processes -> serial
    assert _records(serial_part) == _records(whole)  # serial -> 2 processes
    # rank 1 wrote nothing: exactly one line per round, one run_info entry
    assert [r["round"] for r in _records(tmp_path / "dist-fedavg")] == [1, 2]
    assert len(json.loads((tmp_path / "dist-fedavg" / "run_info.json").read_text())) == 1


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_every_other_algorithm_gives_the_serial_numbers_with_two_processes(tmp_path):
    _spawn([_fresh(tmp_path, algo, f"dist-{algo}") for algo in OTHERS], timeout=1800)
    for algo in OTHERS:
        ref = _serial(tmp_path, algo, f"serial-{algo}")
        assert _records(tmp_path / f"dist-{algo}") == _records(ref), algo
        assert _summary(tmp_path / f"dist-{algo}") == _summary(ref), algo


def _run_cmd(cmd: List[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout the whole group (its workers too) is killed."""
    return run_in_own_session(cmd, ENV, timeout)


def _fl(*args, timeout=300) -> subprocess.CompletedProcess:
    return _run_cmd([sys.executable, "-m", "pflkit.core.cli", *args], timeout)


def test_fl_run_workers_gives_the_serial_numbers(tmp_path):
    cfg = _config_file(tmp_path, "fedavg")
    res = _fl("run", "--workers", "2", "--no-progress", "--config", str(cfg), "--set", f"output_dir={tmp_path}",
              "--set", "run_name=w2")
    assert res.returncode == 0, res.stderr
    assert "final accuracy, uniform" in res.stdout and res.stdout.count("final accuracy, uniform") == 1
    ref = _serial(tmp_path, "fedavg", "serial")
    assert _records(tmp_path / "w2") == _records(ref)
    rec = json.loads((tmp_path / "w2" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"rank_seconds/0", "rank_seconds/1"} <= set(rec)  # the assignment's imbalance is visible


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_torchrun_gives_the_serial_numbers(tmp_path):
    cfg = _config_file(tmp_path, "fedavg")
    ref = _serial(tmp_path, "fedavg", "serial")
    port = str(_free_port())
    res = _run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", port, "-m", "pflkit.core.cli", "run", "--no-progress",
                    "--config", str(cfg), "--set", f"output_dir={tmp_path}", "--set", "run_name=tr"])
    assert res.returncode == 0, res.stderr
    assert _records(tmp_path / "tr") == _records(ref)


def _fl_here(monkeypatch, env: Dict[str, str], *args):
    """``fl`` in this process (the checks below fail before any worker process would start)."""
    from click.testing import CliRunner

    from pflkit.core.cli.main import cli

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("args, env, fragment", [
    (["--workers", "0"], {}, "--workers 0: expected from 1 to 1024 processes"),
    (["--workers", "5"], {}, "the run has 4 clients; use at most 4"),
    (["--workers", "2"], {"MASTER_ADDR": "203.0.113.7"}, "MASTER_ADDR=203.0.113.7 is not an address of this"),
    # this process claims to be rank 1 of 2 (torchrun's variables) whose rank 0 is nowhere: the rendezvous times out
    ([], {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
          "PFLKIT_RENDEZVOUS_TIMEOUT": "2"}, "rank 1: cannot join the run's processes at 127.0.0.1:"),
])
def test_bad_distributed_input_is_one_line_and_leaves_no_run_directory(tmp_path, monkeypatch, args, env, fragment):
    if env.get("MASTER_PORT") == "0":
        env = {**env, "MASTER_PORT": str(_free_port())}
    res = _fl_here(monkeypatch, env, "run", "--plugin", "fedavg", *args, "--set", "partition.num_clients=4",
                   "--set", f"output_dir={tmp_path / 'out'}", "--set", "run_name=r")
    assert res.exit_code == 2, res.stderr
    assert fragment in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out" / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_nccl_without_gpus_is_one_line_before_any_process_starts(tmp_path, monkeypatch):
    res = _fl_here(monkeypatch, {}, "run", "--plugin", "fedavg", "--workers", "2", "--set", "partition.num_clients=4",
                   "--set", "distributed.backend=nccl", "--set", f"output_dir={tmp_path / 'out'}",
                   "--set", "run_name=r")
    assert res.exit_code == 2, res.stderr
    assert res.stderr.strip() == ("Error: distributed.backend=nccl needs CUDA GPUs, but the run computes on cpu (no "
                                  "GPU found, or device=cpu); use distributed.backend=gloo or auto"), res.stderr
    assert not (tmp_path / "out").exists()


def test_collective_backend_choice():
    from pflkit.core.distributed.backend import device_collective_backend as pick
    from pflkit.core.common.errors import ConfigError

    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert pick("auto", gpu, nccl_available=True) == "nccl"
    assert pick("auto", gpu, nccl_available=False) == "gloo"
    assert pick("auto", cpu, nccl_available=True) == "gloo"
    assert pick("gloo", gpu, nccl_available=True) == "gloo"
    assert pick("nccl", gpu, nccl_available=True) == "nccl"
    with pytest.raises(ConfigError, match="needs CUDA GPUs, but the run computes on cpu"):
        pick("nccl", cpu, nccl_available=True)
    with pytest.raises(ConfigError, match="this torch build has no NCCL"):
        pick("nccl", gpu, nccl_available=False)


def _refusing_worker(rank: int, world: int, ports: List[int], cases: List[dict], out_dir: str) -> None:
    """Each case: one ``run_process`` (the torchrun path) whose start-up must fail on every rank; its exit status
    and what it printed go to ``out_dir``. ``version``: rank 1 reports another version of a plugin."""
    import contextlib
    import io

    torch.set_num_threads(1)
    from pflkit.core.distributed import worker

    original = worker.plugin_versions
    for k, (case, port) in enumerate(zip(cases, ports)):
        if case.get("version") and rank == 1:
            worker.plugin_versions = lambda: {**original(), "pflkit-fedavg": case["version"]}
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = worker.run_process(worker.RunRequest(config_file=case["config"], sets=tuple(case["sets"]),
                                                      progress=False),
                                    worker.Endpoint(rank, world, rank, "127.0.0.1", port))
        worker.plugin_versions = original
        Path(out_dir, f"case{k}-rank{rank}.json").write_text(json.dumps({"rc": rc, "err": err.getvalue()}))


def test_mismatched_versions_and_nccl_without_gpus_are_refused_by_every_rank(tmp_path):
    """Under torchrun every process checks for itself: a rank with another plugin version, or NCCL asked for on
    a machine without GPUs, stops every rank with one line (printed by rank 0) and no run directory."""
    cases = [{**_fresh(tmp_path, "fedavg", "versions"), "version": "0.0.1+other"}]
    if not torch.cuda.is_available():
        job = _fresh(tmp_path, "fedavg", "nccl")
        cases.append({**job, "sets": job["sets"] + ["distributed.backend=nccl"]})
    _start_and_join(_refusing_worker, (2, [_free_port() for _ in cases], cases, str(tmp_path)), timeout=300)
    wanted = ["rank 1 runs pflkit-fedavg 0.0.1+other but rank 0 runs", "distributed.backend=nccl needs CUDA GPUs"]
    for k, case in enumerate(cases):
        got = [json.loads((tmp_path / f"case{k}-rank{r}.json").read_text()) for r in (0, 1)]
        assert [g["rc"] for g in got] == [2, 2], got
        lines = got[0]["err"].strip().splitlines()
        assert len(lines) == 1 and wanted[k] in lines[0] and lines[0].startswith("Error: "), got
        assert got[1]["err"] == "", got  # rank 0 speaks for the run
        assert not (tmp_path / ("versions", "nccl")[k]).exists()


def test_a_killed_worker_stops_the_run_with_a_message_naming_it(tmp_path):
    cfg = _config_file(tmp_path, "fedavg", rounds=400, checkpoint={"every": 1})
    run = tmp_path / "k"
    proc = subprocess.Popen([sys.executable, "-m", "pflkit.core.cli", "run", "--workers", "2", "--no-progress",
                             "--config", str(cfg), "--set", f"output_dir={tmp_path}", "--set", "run_name=k"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in re.search(r"pids ([\d, ]+)", line).group(1).split(", ")]
        deadline = time.monotonic() + 240
        while not (run / "checkpoint.pt").exists():  # let it get going: a checkpoint to resume from
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 2, err
    msg = err.strip().splitlines()[-1]
    assert re.search(r"worker rank 1 \(clients [\d, ]+\) was killed by SIGKILL", msg), err
    assert f"fl run --resume {run}" in msg
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # no worker left behind
    # the last checkpoint stays usable: a serial resume continues it
    last = json.loads(run.joinpath("metrics.jsonl").read_text().splitlines()[-1])["round"]
    sim = Simulation.resume(run, overrides={"rounds": last + 1}, tensorboard=False)
    assert 1 <= sim.completed_round <= last
    assert sim.run()["rounds_completed"] == last + 1


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
@pytest.mark.parametrize("named", [True, False], ids=["run_name", "default-name"])
def test_torchrun_max_restarts_resumes_a_killed_run_to_the_serial_numbers(tmp_path, named):
    rounds = 12
    cfg = _config_file(tmp_path, "fedavg", rounds=rounds, checkpoint={"every": 1})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                             "1", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m",
                             "pflkit.core.cli", "run", "--no-progress", "--config", str(cfg), "--set",
                             f"output_dir={out}"] + (["--set", "run_name=mr"] if named else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("*/checkpoint.pt")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        run = list(out.glob("*/checkpoint.pt"))[0].parent
        workers = {}
        for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank:
                workers[int(rank[0])] = int(pid)
        os.kill(workers[1], signal.SIGKILL)
        stdout, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "resuming" in stdout  # the restarted workers continued the run, in its directory (a default name too)
    assert [p.name for p in out.iterdir()] == [run.name]
    assert _records(run) == _records(_serial(tmp_path, "fedavg", "serial", rounds=rounds))


# -- the all-reduce fast path (distributed.exact false) -----------------------------------------------------------
def _fast_worker(rank: int, world: int, port: int, jobs: List[dict], count_dir: str) -> None:
    """``_group_worker`` that also counts the all-reduced sends of each rank (the fast path must really run)."""
    from pflkit.core.distributed.backend import DistributedBackend

    calls = [0]
    original = DistributedBackend.execute_vetted

    def counting(self, calls_, snapshot, vet, fields=(), **kw):
        calls[0] += bool(fields)
        return original(self, calls_, snapshot, vet, fields, **kw)

    DistributedBackend.execute_vetted = counting
    try:
        _group_worker(rank, world, port, jobs)
    finally:
        DistributedBackend.execute_vetted = original
        Path(count_dir, f"rank{rank}").write_text(str(calls[0]))


def test_fast_path_all_reduces_fedavg_close_to_the_serial_numbers(tmp_path, misbehaving):
    from pflkit.core.storage.checkpoint import load_checkpoint

    fast = ["distributed.exact=false"]
    jobs = [{**_fresh(tmp_path, algo, f"fast-{algo}", rounds=3)} for algo in ("fedavg", "misbehaving")]
    # checkpoints across world sizes on the fast path: 2 processes -> 2 (resumed in this group), 2 -> 1, 1 -> 2
    jobs += [_fresh(tmp_path, "fedavg", "fast-part", rounds=1), _fresh(tmp_path, "fedavg", "fast-to-serial", rounds=1)]
    jobs += [{"resume": str(tmp_path / "fast-part"), "sets": ["rounds=3"]}]
    from_serial = _serial(tmp_path, "fedavg", "serial-to-fast", rounds=1, distributed={"exact": False})
    jobs += [{"resume": str(from_serial), "sets": ["rounds=3"]}]
    # the all-reduce through a second group for device tensors (what NCCL does on GPUs), stood in for by gloo
    jobs += [{**_fresh(tmp_path, "fedavg", "fast-device-group", rounds=3), "device_group": True}]
    for job in jobs:
        if "config" in job:
            job["sets"] = job["sets"] + fast
    _start_and_join(_fast_worker, (2, _free_port(), jobs, str(tmp_path)))
    # fit sends (3 rounds) and evaluations (every round) of both runs went through the fast path on both ranks (the
    # misbehaving run's global-model evaluations, the core's own exchange, fold no field and are not counted)
    assert [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)] == [30, 30]  # 15 rounds in all, 2 sends each
    whole = _records(tmp_path / "fast-fedavg")
    assert _records(tmp_path / "fast-part") == whole  # resumed on the same world size: bit for bit
    assert _records(tmp_path / "fast-device-group") == whole
    Simulation.resume(tmp_path / "fast-to-serial", overrides={"rounds": 3}, tensorboard=False).run()
    serial_whole = _records(_serial(tmp_path, "fedavg", "serial-whole", rounds=3))
    for moved in (tmp_path / "fast-to-serial", from_serial):  # other world size: within float rounding
        got = _records(moved)
        assert [sorted(r) for r in got] == [sorted(r) for r in serial_whole]
        assert max(abs(g[k] - v) for g, w in zip(got, serial_whole) for k, v in w.items()
                   if isinstance(v, float)) <= 1e-4
    for algo in ("fedavg", "misbehaving"):
        ref = _serial(tmp_path, algo, f"serial-{algo}", rounds=3)
        got, want = _records(tmp_path / f"fast-{algo}"), _records(ref)
        assert [sorted(r) for r in got] == [sorted(r) for r in want], algo
        for g, w in zip(got, want):  # same rounds, failures and bytes; metrics within float rounding
            for k, v in w.items():
                if isinstance(v, float):
                    assert abs(g[k] - v) <= 1e-4, (algo, k, g[k], v)
                else:
                    assert g[k] == v, (algo, k)
        states = [load_checkpoint(run)[1]["server"]["global_state"] for run in (tmp_path / f"fast-{algo}", ref)]
        diff = max(float((states[0][k].double() - states[1][k].double()).abs().max()) for k in states[1])
        assert diff <= 1e-5, (algo, diff)
        metric = max(abs(g[k] - v) for g, w in zip(got, want) for k, v in w.items() if isinstance(v, float))
        print(f"{algo}: max |global parameter difference| {diff:.3g}, max |metric difference| {metric:.3g}")
    # the rejected clients (NaN, non-plain, raw data, raised) are the serial run's, vetted before any sum
    failures = [_failures(tmp_path / f"{kind}-misbehaving") for kind in ("fast", "serial")]
    assert failures[0] == failures[1] and len(failures[0]) == 4, failures


# -- one run across nodes: two torchrun launchers (--nnodes 2) on this machine, c10d rendezvous on 127.0.0.1 --------
def _node(rank: int, port: int, rdzv_id: str, args: List[str]) -> subprocess.Popen:
    """One node's torchrun launcher (its own session, so that the node can be killed as a whole)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                             "-m", "pflkit.core.cli", "run", "--no-progress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)


def _finish(nodes: List[subprocess.Popen], timeout: float) -> List[Tuple[int, str, str]]:
    out = []
    try:
        for node in nodes:
            stdout, stderr = node.communicate(timeout=timeout)
            out.append((node.returncode, stdout, stderr))
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(10)
    return out


@pytest.mark.slow
def test_two_nodes_give_the_serial_numbers_and_a_lost_node_stops_the_other_with_one_line(tmp_path):
    """Two torchrun launchers of one node each (--nnodes 2, c10d on 127.0.0.1, gloo): the serial run's numbers; then
    a run whose second node is killed whole (launcher and worker): the first stops within seconds with one line that
    says how to go on, and launching both nodes again with --resume finishes with the serial numbers."""
    rounds = 40
    cfg = _config_file(tmp_path, "fedavg", rounds=rounds, checkpoint={"every": 1})
    ref = _serial(tmp_path, "fedavg", "serial", rounds=rounds)
    port = _free_port()
    done = _finish([_node(r, port, "two", ["--config", str(cfg), "--set", f"output_dir={tmp_path}", "--set",
                                           "run_name=two"]) for r in (0, 1)], 300)
    assert [code for code, _, _ in done] == [0, 0], done
    assert _records(tmp_path / "two") == _records(ref)

    run = tmp_path / "cut"
    long_cfg = _config_file(tmp_path, "fedavg", "-long", rounds=100000, checkpoint={"every": 1})
    port = _free_port()
    nodes = [_node(r, port, "cut", ["--config", str(long_cfg), "--set", f"output_dir={tmp_path}", "--set",
                                    "run_name=cut"]) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoint.pt").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes)
            time.sleep(0.2)
        # the node that does not host the run's rank 0 process: its launcher and its worker die together
        workers = {}
        for node in nodes:
            for pid in Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split():
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = [e[5:] for e in env if e.startswith(b"RANK=")]
                if rank:
                    workers[int(rank[0])] = (node, int(pid))
        victim, pid = workers[1]
        os.kill(pid, signal.SIGKILL)
        os.killpg(victim.pid, signal.SIGKILL)
        survivor = workers[0][0]
        t0 = time.monotonic()
        _, err = survivor.communicate(timeout=90)
        assert time.monotonic() - t0 < 90  # stopped, not hung
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(10)
    said = [ln for ln in err.splitlines() if ln.startswith("Error: rank 0: lost contact")]
    assert len(said) == 1 and f"run --resume {run}" in said[0], err
    logged = len((run / "metrics.jsonl").read_text().splitlines())
    port = _free_port()
    done = _finish([_node(r, port, "again", ["--resume", str(run), "--set", f"rounds={logged + 3}"])
                    for r in (0, 1)], 300)
    assert [code for code, _, _ in done] == [0, 0], done
    assert "resuming" in done[0][1] + done[1][1]
    assert _records(run) == _records(_serial(tmp_path, "fedavg", "serial-long", rounds=logged + 3))


# docs/scaling.md's submitit script for one run across nodes, with submitit's local executor in place of Slurm's (the
# tasks of one job are the run's processes) and the rendezvous on 127.0.0.1
SUBMITIT_RUN = '''
import os, subprocess, sys
import submitit

def one_rank(args):
    """One process of a pflkit run: submitit's task -> torch.distributed's env:// variables -> fl run."""
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # the test's loopback (on a cluster: the first node, as exported)
    return subprocess.run([sys.executable, "-m", "pflkit.core.cli", "run", "--no-progress", *args]).returncode

if __name__ == "__main__":
    folder, args = sys.argv[1], sys.argv[2:]
    executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(nodes=1, tasks_per_node=2, timeout_min=5)
    job = executor.submit(one_rank, args)
    print("exit codes:", job.results())
'''


@pytest.mark.slow
def test_one_run_through_submitit_tasks_gives_the_serial_numbers(tmp_path):
    """The documented submitit script (one job, one task per process) runs one pflkit run on two processes with the
    serial run's numbers."""
    pytest.importorskip("submitit")
    cfg = _config_file(tmp_path, "fedavg")
    ref = _serial(tmp_path, "fedavg", "serial")
    script = tmp_path / "submit_run.py"
    script.write_text(SUBMITIT_RUN)
    env = {**ENV, "MASTER_PORT": str(_free_port())}
    res = run_in_own_session([sys.executable, str(script), str(tmp_path / "jobs"), "--config", str(cfg), "--set",
                              f"output_dir={tmp_path}", "--set", "run_name=sub"], env, 300)
    assert res.returncode == 0 and "exit codes: [0, 0]" in res.stdout, res.stdout + res.stderr
    assert _records(tmp_path / "sub") == _records(ref)
