"""fl new-plugin --kind algorithm|dataset|partitioner|model: every skeleton is a package whose setup.cfg entry
points make it discoverable, whose own tests pass and which a 1-round `fl run` uses; taken names are refused."""
import configparser
import importlib
import inspect
import json
import os
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pflkit.core.api import registry as reg
from pflkit.core.cli.main import cli

TINY = ["--set", "rounds=1", "--set", "partition.num_clients=4", "--set", "checkpoint.every=0", "--no-progress"]
USE = {  # how `fl run` picks the generated component
    "algorithm": ["--plugin", "{name}", "--set", "model.name=mlp", "--set", "model.hidden=[16]"],
    "dataset": ["--plugin", "fedavg", "--set", "dataset.name={name}"],  # the default model (cnn4) fits it
    "partitioner": ["--plugin", "fedavg", "--set", "partition.name={name}", "--set", "model.name=mlp"],
    "model": ["--plugin", "fedavg", "--set", "model.name={name}", "--set", "model.width=16"],
}


def fl(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def register_package(tmp_path, monkeypatch):
    """Make a generated package importable and register its setup.cfg entry points as an installed distribution
    would (a .dist-info with entry_points.txt on sys.path), without installing anything."""
    added = []

    def register(root, name):
        cfg = configparser.ConfigParser()
        cfg.read(root / "setup.cfg")
        groups = {g: v.strip() for g, v in cfg["options.entry_points"].items()}
        info = tmp_path / "site" / f"{cfg['metadata']['name'].replace('-', '_')}-0.1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {cfg['metadata']['name']}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text("".join(f"[{g}]\n{v}\n" for g, v in groups.items()))
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        importlib.invalidate_caches()
        reg.refresh_all()
        added.append(f"pflkit_{name}")
        return groups

    yield register
    monkeypatch.undo()
    for mod in [m for m in sys.modules if any(m == a or m.startswith(a + ".") for a in added)]:
        del sys.modules[mod]
    reg.refresh_all()  # forget the temporary distribution


@pytest.mark.parametrize("kind, group", [("algorithm", "pflkit.algorithms"), ("dataset", "pflkit.datasets"),
                                         ("partitioner", "pflkit.partitioners"), ("model", "pflkit.models")])
def test_each_kind_is_discovered_tested_and_runs(tmp_path, register_package, kind, group):
    name = f"my_{kind}_x"
    res = fl("new-plugin", name, "--kind", kind, "--dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    root = tmp_path / f"pflkit-{name.replace('_', '-')}"  # the distribution's name
    assert (root / "pyproject.toml").is_file() and (root / "README.md").is_file()
    groups = register_package(root, name)
    assert group in groups and groups[group].startswith(f"{name} = pflkit_{name}:")
    assert name in reg.ALL_REGISTRIES[group.split(".")[1]].names()
    listing = fl("list")
    assert listing.exit_code == 0 and name in listing.output and f"pflkit-{name.replace('_', '-')}" in listing.output
    assert fl("show", name).exit_code == 0
    # the package's own tests pass
    spec = importlib.util.spec_from_file_location(f"generated_test_{name}", root / "tests" / f"test_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    funcs = [getattr(module, f) for f in dir(module) if f.startswith("test_")]
    assert funcs
    for i, fn in enumerate(funcs):
        if "tmp_path" in inspect.signature(fn).parameters:
            fn(tmp_path / f"t{i}")
        else:
            fn()
    # and a 1-round `fl run` uses it
    args = [a.format(name=name) for a in USE[kind]]
    run = fl("run", *args, *TINY, "--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=r")
    assert run.exit_code == 0, run.output
    config = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    section = {"algorithm": "algorithm", "dataset": "dataset", "partitioner": "partition", "model": "model"}[kind]
    picked = config[section] if kind == "algorithm" else config[section]["name"]
    assert picked == name
    assert json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["rounds_completed"] == 1
    if kind == "algorithm":
        _its_table_checks_and_runs(tmp_path, name, groups)


def _its_table_checks_and_runs(tmp_path, name, groups):
    """The algorithm skeleton ships its paper's table as data (pflkit.tables, package data): fl reproduce --check
    passes over it, and a quick reproduction runs its own row."""
    assert groups["pflkit.tables"] == f"{name}:table1 = pflkit_{name}.tables:table1.toml"
    cfg = configparser.ConfigParser()
    cfg.read(tmp_path / f"pflkit-{name.replace('_', '-')}" / "setup.cfg")
    assert cfg["options.package_data"][f"pflkit_{name}.tables"] == "*.toml"
    assert f"pflkit_{name}.tables" in cfg["options"]["packages"].split()
    check = fl("reproduce", "--check")
    assert check.exit_code == 0, check.output
    assert f"{name}:table1: ok (2 rows x 1 columns, 2 cells resolved)" in check.output
    out = tmp_path / "reproduced"
    res = fl("reproduce", f"{name}:table1", "--scale", "quick", "--seeds", "0", "--rows", name, "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "estimate for " in res.output
    import csv

    (row,) = list(csv.DictReader((out / "results.csv").open()))
    assert row["row"] == name and row["paper_note"].startswith("not in the paper yet") and float(row["pflkit_mean"]) > 0


@pytest.mark.parametrize("args, fragment", [
    (["fedavg"], "algorithm 'fedavg' is already registered (by pflkit-fedavg)"),
    (["digits", "--kind", "dataset"], "dataset 'digits' is already registered (by pflkit)"),
    (["dirichlet", "--kind", "partitioner"], "partitioner 'dirichlet' is already registered"),
    (["cnn4", "--kind", "model"], "model 'cnn4' is already registered"),
    (["fedavg", "--kind", "model"], "distribution 'pflkit-fedavg' is already installed"),
    (["Bad-Name"], "use lowercase letters"),
    (["class", "--kind", "model"], "is a Python keyword"),
    (["fresh_name", "--kind", "optimizer"], "Invalid value for '--kind'"),
])
def test_taken_or_bad_names_are_refused_with_one_line(tmp_path, args, fragment):
    res = fl("new-plugin", *args, "--dir", str(tmp_path))
    assert res.exit_code == 2, res.output
    assert fragment in res.output and "Traceback" not in res.output
    assert not any(tmp_path.iterdir())  # nothing written


def test_existing_folder_is_refused(tmp_path):
    (tmp_path / "pflkit-taken-dir").mkdir()
    res = fl("new-plugin", "taken_dir", "--kind", "dataset", "--dir", str(tmp_path))
    assert res.exit_code == 2 and "already exists" in res.output


def test_dataset_scaffold_installs_and_runs_with_the_command_it_prints(tmp_path):
    """`fl new-plugin x --kind dataset`, pip install the package, then the exact `fl run` line it printed (the
    default run: 30 rounds, 20 clients, cnn4) succeeds. Installed into a folder under tmp_path put on PYTHONPATH,
    so the environment is left untouched and the install goes with tmp_path."""
    res = fl("new-plugin", "scaffold_ds", "--kind", "dataset", "--dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    lines = [ln.strip() for ln in res.output.splitlines()]
    install = [shlex.split(ln) for ln in lines if ln.startswith("pip install")]
    printed = [shlex.split(ln) for ln in lines if ln.startswith("fl run")]
    assert len(install) == 1 and len(printed) == 1, res.output
    package = install[0][-1]
    assert package == str(tmp_path / "pflkit-scaffold-ds")  # the folder is named after the distribution
    assert "distribution pflkit-scaffold-ds, import package pflkit_scaffold_ds" in res.output
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), package], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pflkit.core.cli", *printed[0][1:], "--no-progress"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    assert summary["dataset"] == "scaffold_ds" and config["model"]["name"] == "cnn4"
    assert summary["rounds_completed"] == config["rounds"] == 30
    assert summary["final"]["uniform"] > 0.5  # it learns (4 classes: chance is 0.25)
