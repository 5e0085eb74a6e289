import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.core.cli.main import cli

TINY_SETS = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
             "--set", "model.hidden=[16]", "--set", "checkpoint.every=0"]


def fl(*args, cwd=None):
    runner = CliRunner()
    old = os.getcwd()
    if cwd:
        os.chdir(cwd)
    try:
        return runner.invoke(cli, list(args), catch_exceptions=False)
    finally:
        os.chdir(old)


def test_run_prints_summary_and_how_to_open_tensorboard(tmp_path):
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}",
             "--set", "run_name=r", *TINY_SETS)
    assert res.exit_code == 0, res.output
    assert "final accuracy, uniform" in res.output and "best accuracy" in res.output
    assert f"tensorboard --logdir {tmp_path / 'r' / 'tb'}" in res.output
    run = tmp_path / "r"
    assert json.loads((run / "config.json").read_text())["rounds"] == 2
    assert (run / "partition.json").exists() and (run / "summary.json").exists()
    assert any((run / "tb").iterdir())  # TensorBoard event file


@pytest.mark.parametrize("args, fragment", [
    (["run", "--plugin", "fedavgx"], "unknown algorithm 'fedavgx'. Did you mean 'fedavg'?"),
    (["run", "--plugin", "fedavg", "--set", "train.lrr=1"], "Did you mean 'lr'"),
    (["run", "--plugin", "fedavg", "--set", "rounds=0"], "rounds: 0 is invalid: must be > 0"),
    (["run", "--plugin", "fedavg", "--set", "dataset.name=cifar1O"], "unknown dataset 'cifar1O'"),
    (["run", "--plugin", "fedavg", "--config", "/nonexistent.toml"], "does not exist"),
    (["run"], "name an algorithm"),
    (["run", "--plugin", "fedavg", "--set", "model.name=lenet"], "model 'lenet' cannot be built for inputs of shape (1, 8, 8)"),
    (["run", "--plugin", "fedavg", "--set", "model.name=fasttext"], "model 'fasttext' does not fit dataset 'digits'"),
    (["run", "--resume", "/nonexistent-run"], "not a run directory"),
    (["show", "fedavgg"], "unknown plugin or component"),
])
def test_bad_input_gives_one_clear_line_and_status_2(args, fragment):
    res = fl(*args)
    assert res.exit_code == 2
    assert fragment in res.output and "Traceback" not in res.output


def test_unwritable_output_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={locked}", *TINY_SETS)
        assert res.exit_code == 2 and "cannot create run directory" in res.output
    finally:
        locked.chmod(0o700)


def test_output_dir_that_is_a_file(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={afile}", *TINY_SETS)
    assert res.exit_code == 2 and "cannot create run directory" in res.output and "Traceback" not in res.output


def test_corrupt_checkpoint_via_cli(tmp_path):
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=r",
             *TINY_SETS)
    assert res.exit_code == 0
    (tmp_path / "r" / "checkpoint.pt").write_bytes(b"\x00garbage")
    res = fl("run", "--resume", str(tmp_path / "r"))
    assert res.exit_code == 2 and "corrupt" in res.output and "Traceback" not in res.output


def test_list_and_show():
    res = fl("list")
    assert res.exit_code == 0 and "fedavg" in res.output and "pflkit-fedavg" in res.output
    res = fl("show", "fedavg")
    assert res.exit_code == 0 and "trainer.bn_stats" in res.output and "train.lr = 0.05" in res.output
    res = fl("show", "core")
    assert "participation.random_join_ratio" in res.output
    res = fl("show", "dirichlet")
    assert "partition.alpha = 0.1" in res.output


def test_partition_command_draws_bubble_plot(tmp_path):
    out = tmp_path / "p.png"
    res = fl("partition", "--set", "partition.num_clients=5", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res.output.count("\n") >= 7


def _env(extra_path=None):
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # tiny models on a shared machine: intra-op threads only add contention
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return env


def test_third_party_plugin_is_built_installed_discovered_and_run(tmp_path):
    """fl new-plugin -> pip install (into a private target dir) -> fl list / fl run, no repo edit."""
    res = fl("new-plugin", "mytest_algo", "--dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(tmp_path / "pflkit-mytest-algo")], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    # a broken third-party plugin next to it must not break discovery
    broken = site / "broken_thing-1.0.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-thing\nVersion: 1.0\n")
    (broken / "entry_points.txt").write_text("[pflkit.algorithms]\nbroken = no_such_module_xyz:ALGO\n")
    fl_cmd = [sys.executable, "-m", "pflkit.core.cli"]
    listing = subprocess.run(fl_cmd + ["list", "algorithms"], capture_output=True, text=True, env=_env(site))
    assert listing.returncode == 0
    assert "mytest_algo" in listing.stdout and "pflkit-mytest-algo" in listing.stdout
    assert "broken" in listing.stderr and "broken-thing" in listing.stderr and "ModuleNotFoundError" in listing.stderr
    run = subprocess.run(fl_cmd + ["run", "--plugin", "mytest_algo", "--no-progress", "--set",
                                   f"output_dir={tmp_path / 'runs'}", "--set", "trainer.prox=0.01", *TINY_SETS],
                         capture_output=True, text=True, env=_env(site))
    assert run.returncode == 0, run.stderr
    assert "mytest_algo (trainer mytest_algo, aggregator mytest_algo)" in run.stdout


def test_ctrl_c_leaves_a_resumable_run_with_identical_results(tmp_path):
    sets = ["--set", "rounds=6", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
            "--set", "model.hidden=[16]", "--set", "checkpoint.every=100", "--set", "participation.join_ratio=0.5",
            "--set", "train.local_epochs=20", "--set", f"output_dir={tmp_path}"]
    fl_cmd = [sys.executable, "-m", "pflkit.core.cli", "run", "--plugin", "fedavg", "--no-progress"]
    proc = subprocess.Popen(fl_cmd + sets + ["--set", "run_name=cut"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)  # first Ctrl-C: finish the round, checkpoint, stop
    out, err = proc.communicate(timeout=120)
    done = len(metrics.read_text().splitlines())
    if done == 6:
        pytest.skip("the run finished before the interrupt arrived")
    assert proc.returncode == 130, err  # interrupted: 'fl run ... && next' must not go on
    assert "fl run --resume" in out and 1 <= done < 6
    res = subprocess.run([sys.executable, "-m", "pflkit.core.cli", "run", "--resume", str(tmp_path / "cut"),
                          "--no-progress"], capture_output=True, text=True, env=_env())
    assert res.returncode == 0, res.stderr
    full = subprocess.run(fl_cmd + sets + ["--set", "run_name=full"], capture_output=True, text=True, env=_env())
    assert full.returncode == 0, full.stderr
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    whole = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert cut["rounds_completed"] == 6 and cut["final"] == whole["final"] and cut["best"] == whole["best"]


def test_rejected_input_leaves_no_run_directory_and_default_names_never_collide(tmp_path):
    res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={tmp_path}", "--set", "model.name=lenet")
    assert res.exit_code == 2 and not any(tmp_path.iterdir())
    for _ in range(2):  # two runs within the same second get distinct directories
        res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}",
                 *TINY_SETS)
        assert res.exit_code == 0, res.output
    assert len(list(tmp_path.iterdir())) == 2


HEAVY_MODULES = ("torch", "matplotlib", "sklearn", "tensorboard", "torch.utils.tensorboard")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["data", "--help"], ["reproduce", "--help"],
                                  ["compare", "--help"], ["data", "list", "--help"]])
def test_help_imports_no_heavy_library(args):
    """Issue 36: `fl --help` took 6.5 s importing torch (and more) it never uses. The command line's start and its
    help import what a command needs only when it runs; checked on what is imported, not on a timing."""
    code = ("import sys\nfrom click.testing import CliRunner\nimport pflkit.core.cli.main as m\n"
            f"res = CliRunner().invoke(m.cli, {args!r})\n"
            "assert res.exit_code == 0 and 'Usage:' in res.output, res.output\n"
            f"print(sorted(n for n in {HEAVY_MODULES!r} if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_help_text_of_run_still_names_the_keys_a_resume_may_change():
    from pflkit.core.engine.config import RESUME_SAFE_KEYS

    res = fl("run", "--help")
    assert res.exit_code == 0 and "--resume DIRECTORY" in res.output
    assert all(k in " ".join(res.output.split()) for k in RESUME_SAFE_KEYS)
