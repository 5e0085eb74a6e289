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
