"""fl compare --launcher (core/results/launchers.py): the runs as jobs of submitit's local executor (the Slurm path's
code with subprocesses instead of sbatch): submit and return, collect on a rerun with the numbers of --jobs, leave a
running job alone, requeue a preempted job that resumes to the uninterrupted numbers; bad input is one line."""
import json
import os
import time
from pathlib import Path

import pytest

from pflkit.core import ConfigError
from pflkit.core.testing import cli

submitit = pytest.importorskip("submitit")

from pflkit.core.results.compare import run_comparison  # noqa: E402
from pflkit.core.results.launchers import LauncherSettings, RunJob, read_jobs  # noqa: E402

LAYER = {"rounds": 3, "dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": [8]},
         "partition": {"num_clients": 4}, "checkpoint": {"every": 1}}


def _wait_for(paths, seconds=180.0):
    deadline = time.monotonic() + seconds
    while not all(Path(p).exists() for p in paths):
        assert time.monotonic() < deadline, f"jobs did not finish: {[str(p) for p in paths if not Path(p).exists()]}"
        time.sleep(0.5)


def test_submit_return_collect_with_the_numbers_of_jobs(tmp_path):
    out = tmp_path / "sl"
    local = LauncherSettings("submitit-local", time_min=10)
    first = run_comparison(["fedavg", "local"], [0], [LAYER], out, launcher=local)
    assert len(first["submitted"]) == 2 and first["waiting"] == [] and first["interrupted"] is False
    jobs = read_jobs(out)
    assert sorted(jobs) == ["fedavg-seed0", "local-seed0"] and all(j["launcher"] == "submitit-local"
                                                                   for j in jobs.values())
    again = run_comparison(["fedavg", "local"], [0], [LAYER], out, launcher=local)
    assert again["submitted"] == []  # their jobs still run (or just finished): never submitted twice
    _wait_for([out / "runs" / name / "verified.json" for name in jobs])
    collected = run_comparison(["fedavg", "local"], [0], [LAYER], out, launcher=local)
    assert collected["submitted"] == [] and collected["waiting"] == [] and collected["complete"]
    serial = run_comparison(["fedavg", "local"], [0], [LAYER], tmp_path / "serial", jobs=1)
    for name in ("fedavg", "local"):
        assert collected["results"][name]["final_uniform"] == serial["results"][name]["final_uniform"]
        a = json.loads((out / "runs" / f"{name}-seed0" / "summary.json").read_text())
        b = json.loads((tmp_path / "serial" / "runs" / f"{name}-seed0" / "summary.json").read_text())
        assert a["final"] == b["final"] and a["last"] == b["last"]
    assert list((out / "jobs").glob("*_log.out"))  # each job's stdout and stderr, named in the run's run_info.json
    entry = json.loads((out / "runs" / "fedavg-seed0" / "run_info.json").read_text())["entries"][-1]
    assert entry["job"]["id"] == jobs["fedavg-seed0"]["job_id"] and Path(entry["job"]["stderr"]).exists()


def test_a_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_numbers(tmp_path):
    from pflkit.core.engine.config import resolve
    from pflkit.core.engine.simulation import Simulation

    cfg = resolve([dict(LAYER, rounds=30)], algorithm="fedavg")
    executor = LauncherSettings("submitit-local", time_min=10).executor(tmp_path / "jobs")
    run = tmp_path / "runs" / "fedavg-seed0"
    job = executor.submit(RunJob(), cfg, str(run))
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 5:
        assert time.monotonic() < deadline and job.state == "RUNNING", job.stderr()
        time.sleep(0.1)
    # Slurm's preemption signal reaches the job's task (srun forwards it): submitit's handler calls checkpoint(),
    # and the job is requeued with the same arguments (the local controller restarts the task)
    controller = job._process.pid
    task = int(Path(f"/proc/{controller}/task/{controller}/children").read_text().split()[0])
    os.kill(task, submitit.local.local.LocalJobEnvironment._usr_sig())
    summary = job.result()
    assert summary["rounds_completed"] == 30 and not summary.get("interrupted")
    assert "resum" in (run / "run.log").read_text()  # the requeued job continued the run
    ref = tmp_path / "ref"
    Simulation(cfg, run_dir=ref, tensorboard=False).run()

    def records(path):
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert records(run) == records(ref)


@pytest.mark.parametrize("args, says", [
    (["--slurm-partition", "gpu"], "--slurm-partition need --launcher slurm"),
    (["--launcher", "slurm"], "no sbatch on this machine's PATH"),
    (["--launcher", "submitit-local", "--slurm-time", "0"], "time_min: must be a positive integer"),
    (["--launcher", "slurm", "--slurm-option", "qos"], "--slurm-option 'qos': expected KEY=VALUE"),
])
def test_bad_launcher_input_is_one_line_and_submits_nothing(tmp_path, monkeypatch, args, says):
    from click.testing import CliRunner

    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None)  # no sbatch here
    res = CliRunner().invoke(cli, ["compare", "--plugins", "fedavg", "--set", "rounds=1", "--out",
                                   str(tmp_path / "o"), *args])
    assert res.exit_code == 2, res.output
    assert says in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o" / "jobs.json").exists()


def test_two_collectors_at_once_is_one_line_and_a_failed_job_is_resubmitted(tmp_path):
    """A second collector while one holds the output folder: one line, nothing submitted. A job that ended without
    finishing its run (here: a recorded job whose process is gone) is named, with where its output is, and its run
    is submitted again on the next collect."""
    import fcntl

    from pflkit.core.results import launchers

    out = tmp_path / "o"
    out.mkdir()
    with open(out / launchers.LOCK_NAME, "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match="another fl compare / fl reproduce is submitting or collecting"):
            run_comparison(["fedavg"], [0], [LAYER], out, launcher=LauncherSettings("submitit-local"))
    assert not (out / launchers.JOBS_NAME).exists()
    (out / launchers.JOBS_NAME).write_text(json.dumps({"fedavg-seed0": {
        "launcher": "submitit-local", "job_id": "4242", "folder": str(out / "jobs"), "pid": 2 ** 22 + 17}}))
    lines = []
    first = run_comparison(["fedavg"], [0], [LAYER], out, launcher=LauncherSettings("submitit-local"),
                           echo=lines.append)
    assert any("fedavg-seed0: job 4242 ended without finishing the run" in ln for ln in lines), lines
    assert len(first["submitted"]) == 1 and read_jobs(out)["fedavg-seed0"]["job_id"] == first["submitted"][0]
    _wait_for([out / "runs" / "fedavg-seed0" / "verified.json"])


LAUNCHER_TOML = """[launcher]
name = "slurm"
partition = "gpu"
time = 240
gpus = 1
cpus = 4
mem_gb = 16
account = "proj"
array_parallelism = 8

[launcher.options]
qos = "high"
"""


def _captured_settings(tmp_path, monkeypatch, args):
    """The LauncherSettings fl compare hands to the comparison (run_comparison stubbed: nothing runs)."""
    from click.testing import CliRunner

    seen = {}

    def fake(*a, launcher=None, **k):
        seen["settings"] = launcher
        return {"submitted": ["1_0"], "waiting": [], "launcher": launcher.name}

    monkeypatch.setattr("pflkit.core.results.compare.run_comparison", fake)
    res = CliRunner().invoke(cli, ["compare", "--plugins", "fedavg", "--set", "rounds=1", "--out",
                                   str(tmp_path / "o"), *args])
    return res, seen.get("settings")


def test_a_launcher_config_file_gives_the_settings_and_the_command_line_outranks_it(tmp_path, monkeypatch):
    conf = tmp_path / "cluster.toml"
    conf.write_text(LAUNCHER_TOML)
    res, settings = _captured_settings(tmp_path, monkeypatch, ["--launcher-config", str(conf)])
    assert res.exit_code == 0, res.output
    assert (settings.name, settings.partition, settings.time_min, settings.gpus_per_job, settings.cpus_per_job,
            settings.mem_gb, settings.account, settings.array_parallelism, settings.extra) == (
        "slurm", "gpu", 240, 1, 4, 16.0, "proj", 8, {"qos": "high"})
    assert "submitted 1 run(s) as slurm job(s): 1_0" in res.output
    # the command line outranks the file, also where it gives an option's default value
    res, settings = _captured_settings(tmp_path, monkeypatch, [
        "--launcher-config", str(conf), "--launcher", "submitit-local", "--slurm-time", "60", "--slurm-option",
        "qos=low"])
    assert res.exit_code == 0, res.output
    assert (settings.name, settings.time_min, settings.partition, settings.extra) == (
        "submitit-local", 60, "gpu", {"qos": "low"})


def test_the_slurm_executor_gets_the_settings(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: f"/usr/bin/{name}")
    settings = LauncherSettings("slurm", partition="gpu", time_min=240, gpus_per_job=1, cpus_per_job=4, mem_gb=16,
                                account="proj", array_parallelism=8, extra={"qos": "high"})
    params = settings.executor(tmp_path).parameters
    assert {k: params[k] for k in ("partition", "time", "gpus_per_node", "cpus_per_task", "mem", "account",
                                   "array_parallelism", "additional_parameters")} == {
        "partition": "gpu", "time": 240, "gpus_per_node": 1, "cpus_per_task": 4, "mem": "16384MB",
        "account": "proj", "array_parallelism": 8, "additional_parameters": {"qos": "high"}}


@pytest.mark.parametrize("text, says", [
    ("[launcher]\npartiton = 'gpu'\n", "unknown key launcher.partiton (known: name, partition, time,"),
    ("[launcher]\nname = 'slurm'\ntime = '4h'\n", "launcher.time must be an integer, got '4h'"),
    ("[launcher]\nname = 'pbs'\n", "launcher.name must be \"slurm\" or \"submitit-local\", got 'pbs'"),
    ("[launcher]\nname = 'slurm'\nmem_gb = true\n", "launcher.mem_gb must be a number (GiB)"),
    ("[launcher]\nname = 'slurm'\noptions = ['qos=high']\n", "launcher.options must be a table of sbatch options"),
    ("[slurm]\npartition = 'gpu'\n", "expected one table [launcher], not slurm"),
    ("[launcher]\npartition = 'gpu'\n", "launcher.partition (--launcher-config) need --launcher slurm"),
    ("[launcher\n", "cannot be parsed"),
    ("[launcher]\nname = 'submitit-local'\ntime = 0\n", "time_min: must be a positive integer"),
])
def test_a_bad_launcher_config_is_one_line_and_submits_nothing(tmp_path, monkeypatch, text, says):
    from click.testing import CliRunner

    conf = tmp_path / "cluster.toml"
    conf.write_text(text)
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None)  # no sbatch here
    res = CliRunner().invoke(cli, ["compare", "--plugins", "fedavg", "--set", "rounds=1", "--out",
                                   str(tmp_path / "o"), "--launcher-config", str(conf)])
    assert res.exit_code == 2, res.output
    assert says in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) <= 2, res.output  # the "comparing ..." line, then the error
    assert not (tmp_path / "o" / "jobs.json").exists() and not (tmp_path / "o" / "runs").exists()


def test_fl_reproduce_takes_a_launcher_config(tmp_path):
    """fl reproduce reads the same file (a bad one is the same one line, before anything runs)."""
    from click.testing import CliRunner

    conf = tmp_path / "cluster.toml"
    conf.write_text("[launcher]\nname = 'submitit-local'\ncpus = 'many'\n")
    res = CliRunner().invoke(cli, ["reproduce", "pcfl:table3", "--scale", "quick", "--out", str(tmp_path / "o"),
                                   "--launcher-config", str(conf)])
    assert res.exit_code == 2, res.output
    assert "launcher.cpus must be an integer, got 'many'" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


FAKE_SBATCH = """#!/bin/sh
# a stand-in for Slurm's sbatch: refuses partition "nope" as sbatch does, else accepts the array as job 4242
echo "$@" >> "{calls}"
if grep -q -- "--partition=nope" "$(eval echo \\${{$#}})"; then
  echo "sbatch: error: invalid partition specified: nope" >&2
  echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2
  exit 1
fi
echo "Submitted batch job 4242"
"""
FAKE_SACCT = """#!/bin/sh
# a stand-in for Slurm's sacct: the states written in {states}
echo "JobID|State|NodeList"
cat "{states}"
"""


def test_the_slurm_path_with_a_stand_in_sbatch_and_sacct(tmp_path):
    """--launcher slurm itself (sbatch, sacct) with stand-in commands on PATH: a partition sbatch refuses is one line
    and records nothing; an accepted array is recorded; a rerun while Slurm says the jobs are queued or running
    submits nothing; a job Slurm reports failed is submitted again. Each command is a fresh process, as a user's."""
    import stat
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, states = tmp_path / "sbatch_calls", tmp_path / "sacct_states"
    for name, text in (("sbatch", FAKE_SBATCH.format(calls=calls)), ("sacct", FAKE_SACCT.format(states=states))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "o"

    def fl(*args):  # (before srun is on PATH: submitit's own check of the cluster is one line too)
        return subprocess.run([sys.executable, "-m", "pflkit.core.cli", "compare", "--plugins", "fedavg", "--seeds",
                               "0,1", "--set", "rounds=2", "--set", "model.hidden=8", "--set",
                               "partition.num_clients=4", "--out", str(out), "--launcher", "slurm", *args],
                              env=env, capture_output=True, text=True, timeout=120)

    res = fl("--slurm-partition", "gpu")
    assert res.returncode == 2 and "--launcher slurm: Could not detect \"srun\"" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (out / "jobs.json").exists()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(stat.S_IRWXU)

    res = fl("--slurm-partition", "nope")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "submitting 2 job(s) failed: sbatch: error: Batch job submission failed: Invalid partition name" in (
        res.stderr), res.stderr
    assert "Traceback" not in res.stderr and not (out / "jobs.json").exists()

    res = fl("--slurm-partition", "gpu")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted 2 run(s) as slurm job(s): 4242_0, 4242_1" in res.stdout and "squeue --me" in res.stdout
    records = read_jobs(out)
    assert {name: r["job_id"] for name, r in records.items()} == {"fedavg-seed0": "4242_0", "fedavg-seed1": "4242_1"}
    assert len(calls.read_text().splitlines()) == 2

    states.write_text("4242_0|RUNNING|node1\n4242_1|PENDING|None\n")
    res = fl("--slurm-partition", "gpu")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 run(s) still queued or running from an earlier submission, left alone" in res.stdout
    assert len(calls.read_text().splitlines()) == 2  # nothing submitted twice

    states.write_text("4242_0|FAILED|node1\n4242_1|RUNNING|node2\n")
    res = fl("--slurm-partition", "gpu")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fedavg-seed0: job 4242_0 ended without finishing the run" in res.stdout + res.stderr
    assert "1 run(s) still queued or running from an earlier submission, left alone: fedavg-seed1" in res.stdout
    assert len(calls.read_text().splitlines()) == 3 and read_jobs(out)["fedavg-seed1"]["job_id"] == "4242_1"
