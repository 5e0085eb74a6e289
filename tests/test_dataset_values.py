"""A dataset's labels and values are checked when it is loaded (one line, exit 2), and the privacy guard's cost
does not grow with NaN rows (issue 36: negative labels were an np.bincount traceback; 60 NaN samples made every
round 20-400x slower in the guard's row search)."""
import pytest
import torch
from click.testing import CliRunner

from pflkit.core import DatasetBundle, classification, regression
from pflkit.core.cli.main import cli
from pflkit.core.engine import privacy as pv


def _images(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, 8, 8, generator=g) * 16).floor(), torch.arange(n) % 10


def _register(reg, name, make):
    def loader(root=None, download=True):
        return make()
    reg.DATASETS.register(name, loader)


def _run(tmp_path, name):
    return CliRunner().invoke(cli, ["run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path / 'o'}",
                                    "--set", f"dataset.name={name}", "--set", "partition.name=iid",
                                    "--set", "partition.num_clients=2", "--set", "rounds=1"])


def _one_line(res) -> str:
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert "Traceback" not in res.output
    return lines[0]


def _with_labels(y):
    x, _ = _images(len(y))
    return DatasetBundle(x=x, y=y, task=classification(10), input_shape=(1, 8, 8))


@pytest.mark.parametrize("labels, words", [
    (lambda y: torch.where(torch.arange(len(y)) == 7, -1, y), ["label -1 of sample 7", "0 .. 9", "1 label(s)"]),
    (lambda y: torch.where(torch.arange(len(y)) >= 190, 10, y), ["label 10 of sample 190", "0 .. 9",
                                                                  "10 label(s)"]),
    (lambda y: y.float(), ["labels are torch.float32", "integer labels 0 .. 9"]),
    (lambda y: y.float() + 0.5, ["labels are torch.float32"]),
    (lambda y: y > 4, ["labels are torch.bool"]),
])
def test_bad_labels_are_one_line_at_load_naming_the_dataset(tmp_path, registries_snapshot, labels, words):
    _register(registries_snapshot, "badlabels", lambda: _with_labels(labels(_images()[1])))
    line = _one_line(_run(tmp_path, "badlabels"))
    assert "dataset 'badlabels'" in line and "pooled samples" in line
    for w in words:
        assert w in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").rglob("checkpoint.pt"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_are_refused_at_load(tmp_path, registries_snapshot, value):
    def make():
        x, y = _images()
        x[[3, 50, 51]] = x[[3, 50, 51]].index_fill(-1, torch.tensor([2]), value)
        return DatasetBundle(x=x, y=y, task=classification(10), input_shape=(1, 8, 8))
    _register(registries_snapshot, "nanx", make)
    line = _one_line(_run(tmp_path, "nanx"))
    assert "dataset 'nanx'" in line and "3 of 200 samples hold NaN or infinite input values" in line
    assert "the first is sample 3" in line


def test_non_finite_regression_targets_are_refused_at_load(tmp_path, registries_snapshot):
    def make():
        x = torch.linspace(0, 6, 300).reshape(-1, 1)
        y = torch.sin(x).squeeze(1)
        y[120] = float("nan")
        return DatasetBundle(x=x, y=y, task=regression(1), input_shape=(1,))
    _register(registries_snapshot, "nany", make)
    line = _one_line(_run(tmp_path, "nany"))
    assert "1 of 300 samples hold NaN or infinite target values (the first is sample 120)" in line


def test_valid_labels_and_integer_inputs_pass(tmp_path, registries_snapshot):
    """Integer inputs (token ids, uint8 images) are not checked for finiteness; labels 0..9 load as before."""
    def make():
        x, y = _images()
        return DatasetBundle(x=x.to(torch.uint8), y=y, task=classification(10), input_shape=(1, 8, 8),
                             transform=lambda t: t.float())
    _register(registries_snapshot, "fine", make)
    res = _run(tmp_path, "fine")
    assert res.exit_code == 0, res.output


class _CountingIndex(dict):
    """A client's row index that counts exact look-ups (each one is a candidate confirmed row by row)."""
    lookups = 0

    def __getitem__(self, key):
        type(self).lookups += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("many_values", [False, True])
def test_guard_cost_does_not_grow_with_nan_rows(many_values):
    """60 all-NaN rows and a model gone NaN: before, every window of the reply hashed to the NaN rows' print and
    was compared exactly against each of them (16260 look-ups x 60 rows in the measured case); now no NaN row is
    fingerprinted, so the exact search is never entered. With few distinct values the shortcut still applies."""
    x, y = _images(300)
    if many_values:
        x = torch.randn(300, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    x[:60] = float("nan")
    x[60:62, 0, 0, :3] = float("nan")  # partly NaN rows too
    guard = pv.PrivacyGuard()
    guard.register(0, [x[:200], x[200:]], [y[:200], y[200:]])
    client = guard._clients[0]
    assert (client.values is None) == many_values  # few pixel values: NaN no longer disables the shortcut
    assert sum(len(v) for v in client.index.values()) == 300 - 62  # NaN rows are not fingerprinted
    _CountingIndex.lookups = 0
    client.index = _CountingIndex(client.index)
    for reply in ({"w": torch.full((64, 128), float("nan"))},
                  {"w": torch.full((40, 64), float("nan")), "list": [float("nan")] * 500}):
        assert guard.violation(0, reply) is None
    assert _CountingIndex.lookups == 0
    # a finite raw row is still caught, in a NaN tensor
    leak = torch.full((3, 64), float("nan"))
    leak[1] = x[100].reshape(-1)
    assert "an input row" in guard.violation(0, {"w": leak})
