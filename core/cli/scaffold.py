"""``fl new-plugin NAME [--kind algorithm|dataset|partitioner|model]``: write an installable plugin package a
third party can start from: entry points in setup.cfg, the package, a test that runs it end to end."""
from __future__ import annotations

import keyword
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

import click

from ..common.errors import ConfigError
from ..api.params import short_repr
from .common import friendly_errors

PYPROJECT = """[build-system]
requires = ["setuptools>=64", "wheel"]
build-backend = "setuptools.build_meta"
"""

SETUP_CFG = """[metadata]
name = {dist}
version = 0.1.0
description = {name}: a pflkit {kind} plugin

[options]
packages = {packages}
python_requires = >=3.10
install_requires =
    pflkit>=0.1

[options.entry_points]
{entry_points}{package_data}"""

# the entry-point groups (core/api/registry.py) each kind registers NAME in, and the object behind it
ENTRY_POINTS = {
    "algorithm": {"pflkit.algorithms": "{pkg}:ALGORITHM", "pflkit.trainers": "{pkg}:{cls}Trainer",
                  "pflkit.aggregators": "{pkg}:{cls}Aggregator"},
    "dataset": {"pflkit.datasets": "{pkg}:load_{name}"},
    "partitioner": {"pflkit.partitioners": "{pkg}:partition_{name}"},
    "model": {"pflkit.models": "{pkg}:build_{name}"},
}

INIT = '''"""{name}: a pflkit algorithm plugin.

Start from here: the trainer below is FedAvg plus an optional proximal term, the aggregator is the
sample-weighted mean. Change the hooks you need (see pflkit.core.LocalSGDTrainer and
pflkit.core.GlobalModelAggregator) and run it with:  fl run --plugin {name}
"""
from typing import List

import torch

from pflkit.core import (Algorithm, GlobalModelAggregator, LocalSGDTrainer, Param, State, proximal_term,
                         weighted_average)


class {cls}Trainer(LocalSGDTrainer):
    """Local SGD from the global model, with an optional proximal pull towards it."""

    params = {{**LocalSGDTrainer.params,
              "prox": Param(0.0, "weight of the proximal term prox/2 * ||w - w_global||^2",
                            check=lambda v: None if v >= 0 else "must be >= 0")}}

    def receive(self, params: State) -> None:
        super().receive(params)
        self.anchor = [p.detach().clone() for p in self.model.parameters()]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().loss(x, y)
        if self.ctx.hp.prox > 0:
            loss = loss + 0.5 * self.ctx.hp.prox * proximal_term(list(self.model.parameters()), self.anchor)
        return loss


class {cls}Aggregator(GlobalModelAggregator):
    """Sample-weighted mean of the uploads."""

    def combine(self, states: List[State], weights: List[float], cids: List[int]) -> State:
        return weighted_average(states, weights)


ALGORITHM = Algorithm(
    trainer="{name}", aggregator="{name}",
    description="{name}: describe your algorithm here",
    defaults={{"train": {{"lr": 0.05}}, "trainer": {{"prox": 0.0}}}},
)
'''

TEST = '''from pflkit.core.testing import check_table, installed_table
from pflkit.core.testing import quick_run


def test_{name}_runs_end_to_end(tmp_path):
    result = quick_run("{name}", tmp_path)
    assert result["rounds_completed"] == 2
    assert 0.0 <= result["final"]["uniform"] <= 1.0


def test_{name}_table_checks():
    """The table file is valid: every cell resolves to a config (fl reproduce --check)."""
    table = installed_table("{name}:table1")
    assert check_table(table) == len(table.rows) * len(table.columns)
'''

TABLES_INIT = '''"""{name}'s paper tables as data (the pflkit.tables entry points in setup.cfg): fl reproduce {name}:table1"""
'''

# an example table file (core/results/tables.py has the schema): the algorithm against FedAvg on the embedded digits
TABLE = '''# {name}'s paper table as data: a starting point. Put your paper's title, settings, methods and reported numbers
# here (the schema: fl reproduce's docs, "Writing a table file"). Check it offline: fl reproduce --check
# Run it:  fl reproduce {name}:table1 --scale quick   (then without --scale quick: the paper's setting)

[paper]
title = "{name}"
venue = "your paper's venue"
table = 1
caption = "accuracy (%) on the embedded 8x8 digits, 20 clients, Dir(0.1)"

[metric]                           # what the paper scores, and the pflkit key that computes it
model = "personal"
clients = "all"
mean = "uniform"
round = "last_k"
k = 5
fine_tuned = false
pflkit = "final_uniform"

[settings]                         # config overrides every cell shares
rounds = 20
dataset = {{ name = "digits" }}
partition = {{ name = "dirichlet", num_clients = 20, alpha = 0.1 }}
eval = {{ final_k = 5 }}

[quick]                            # --scale quick: a smoke test, labelled as such in every output
rounds = 2

[[columns]]
id = "digits"
label = "Digits, Dir(0.1)"

[[rows]]
id = "fedavg"
label = "FedAvg"
plugin = "fedavg"
source = "pflkit's defaults"

[[rows]]
id = "{name}"
label = "{name}"
plugin = "{name}"
options = {{ trainer = {{ prox = 0.01 }} }}
source = "the proximal weight of your paper"

[numbers]                          # your paper's [mean, std] per cell, or a string saying why it has none
fedavg = {{ digits = "not in the paper yet: write its [mean, std]" }}
{name} = {{ digits = "not in the paper yet: write its [mean, std]" }}

[[chosen]]                         # what you chose where the paper leaves a setting open, and why
setting = "partition.seed"
value = "the run seed"
why = "the paper does not say whether its partition changes with the seed"
'''

README = """# {name}

A pflkit algorithm plugin.

    pip install -e .
    fl run --plugin {name}
    fl show {name}
    python -m pytest tests

Its paper's table as data, {pkg}/tables/table1.toml (an entry point of pflkit.tables in setup.cfg):

    fl reproduce --check
    fl reproduce {name}:table1 --scale quick
"""

DATASET_INIT = '''"""{name}: a pflkit dataset plugin.

``load_{name}`` returns the pooled samples of one task as a DatasetBundle (inputs, targets, task, input shape);
the core partitions them among clients and splits each client's share into train and test. This skeleton
generates a seeded synthetic image classification task (one noisy prototype image per class), so it runs offline
with the default model (cnn4, which takes channels x height x width images): replace the generation with reading
your files from ``root``. Run it with:  fl run --plugin fedavg --set dataset.name={name}
If your samples are feature vectors rather than images, return ``input_shape=(num_features,)`` and run with
``--set model.name=mlp`` (cnn4 needs images).
"""
from typing import Optional

import numpy as np
import torch

from pflkit.core import DataError, DatasetBundle, Param, classification


def load_{name}(root: Optional[str] = None, download: bool = True, num_samples: int = 1000, image_size: int = 8,
                channels: int = 1, num_classes: int = 4, noise: float = 2.0, seed: int = 0) -> DatasetBundle:
    """{name}: describe your dataset here (what the samples are, how many, where they come from)."""
    if num_samples < 2 * num_classes:
        raise DataError(f"dataset.num_samples = {{num_samples}} is too small for {{num_classes}} classes")
    rng = np.random.default_rng(seed)  # the data depend on dataset.seed only, never on the run seed
    shape = (channels, image_size, image_size)
    prototypes = rng.normal(0.0, 1.0, size=(num_classes, *shape))
    y = rng.integers(0, num_classes, size=num_samples)
    x = prototypes[y] + rng.normal(0.0, noise, size=(num_samples, *shape))
    return DatasetBundle(x=torch.tensor(x, dtype=torch.float32), y=torch.tensor(y, dtype=torch.long),
                         task=classification(num_classes), input_shape=shape,
                         class_names=[f"class{{k}}" for k in range(num_classes)],
                         meta={{"source": "synthetic prototype images plus Gaussian noise", "seed": seed}})


def _positive(v):
    return None if v > 0 else "must be > 0"


# every option is declared, so `fl show {name}` documents it and a typo in --set is an error
load_{name}.params = {{
    "num_samples": Param(1000, "samples generated", check=_positive),
    "image_size": Param(8, "height and width of each image in pixels", check=_positive),
    "channels": Param(1, "channels of each image", check=_positive),
    "num_classes": Param(4, "classes", check=lambda v: None if v >= 2 else "must be >= 2"),
    "noise": Param(2.0, "standard deviation of the per-pixel noise around each class prototype",
                   check=lambda v: None if v >= 0 else "must be >= 0"),
    "seed": Param(0, "generation seed"),
}}
'''

DATASET_TEST = '''import torch

from pflkit.core.testing import quick_run
from {pkg} import load_{name}


def test_{name}_is_deterministic_and_well_formed():
    a, b = load_{name}(seed=1), load_{name}(seed=1)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert a.x.shape == (1000, 1, 8, 8) and a.input_shape == (1, 8, 8) and set(a.y.tolist()) == set(range(4))


def test_{name}_runs_end_to_end_with_the_default_model(tmp_path):
    # the default model (cnn4), as `fl run --plugin fedavg --set dataset.name={name}` uses it
    result = quick_run("fedavg", tmp_path, {{"dataset": {{"name": "{name}"}}, "model": {{"name": "cnn4"}}}})
    assert result["rounds_completed"] == 2 and result["dataset"] == "{name}"
    assert 0.0 <= result["final"]["uniform"] <= 1.0
'''

PARTITIONER_INIT = '''"""{name}: a pflkit partitioner plugin.

A partitioner divides the pooled dataset's sample indices among the clients:
``(labels, num_clients, rng, groups=None, **params) -> one index array per client``, a true partition (no sample
on two clients); the core then splits each client's share into train and test. ``groups`` holds each sample's
natural owner when the dataset has one. Draw every random number from ``rng``: the run's partition seed fixes it.
This skeleton is a quantity skew: client sizes are Dirichlet(beta) shares on top of a guaranteed ``min_size``, the
samples random (labels stay IID). Run it with:  fl run --plugin fedavg --set partition.name={name}
"""
from typing import List, Optional

import numpy as np

from pflkit.core import DataError, Param


def partition_{name}(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
                     groups: Optional[np.ndarray] = None, beta: float = 0.5, min_size: int = 10) -> List[np.ndarray]:
    """{name}: quantity skew, client sizes ~ Dirichlet(beta) shares above min_size, labels IID."""
    n = len(labels)
    if n < num_clients * min_size:
        raise DataError(f"cannot give {{num_clients}} clients at least {{min_size}} samples each from {{n}} samples")
    shares = rng.dirichlet(np.full(num_clients, beta))
    sizes = min_size + rng.multinomial(n - num_clients * min_size, shares)
    order = rng.permutation(n)
    return [np.sort(part) for part in np.split(order, np.cumsum(sizes)[:-1])]


partition_{name}.params = {{
    "beta": Param(0.5, "Dirichlet concentration of the client sizes (smaller = more unequal)",
                  check=lambda v: None if v > 0 else "must be > 0"),
    "min_size": Param(10, "minimum samples per client (guaranteed)",
                      check=lambda v: None if v >= 2 else "must be >= 2 (one train and one test sample)"),
}}
'''

PARTITIONER_TEST = '''import json

import numpy as np

from pflkit.core.testing import quick_run
from {pkg} import partition_{name}


def test_{name}_is_a_true_partition():
    labels = np.arange(500) % 10
    parts = partition_{name}(labels, 7, np.random.default_rng(0), min_size=20)
    together = np.concatenate(parts)
    assert len(parts) == 7 and min(len(p) for p in parts) >= 20
    assert np.array_equal(np.sort(together), np.arange(500))  # every sample exactly once


def test_{name}_runs_end_to_end(tmp_path):
    result = quick_run("fedavg", tmp_path, {{"partition": {{"name": "{name}"}}}})
    assert result["rounds_completed"] == 2
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["partition"]["name"] == "{name}"
'''

MODEL_INIT = '''"""{name}: a pflkit model plugin.

A model builder takes the dataset's ``input_shape`` and ``num_classes`` (plus its declared options) and returns
a SplitModel: ``features`` ending in a flat vector of ``feature_dim`` values, then a ``head``. Personalisation
algorithms (FedPer, FedRep, FedCP, ...) rely on that split. This skeleton is a two-layer MLP feature extractor
with a linear head. Run it with:  fl run --plugin fedavg --set model.name={name}
"""
import math
from typing import Sequence

from torch import nn

from pflkit.core import Param, SplitModel


def build_{name}(input_shape: Sequence[int], num_classes: int, width: int = 64) -> SplitModel:
    """{name}: flatten -> 2 x (Linear -> ReLU) features -> Linear head."""
    features = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                             nn.Linear(width, width), nn.ReLU())
    return SplitModel(features, nn.Linear(width, num_classes), width)


build_{name}.params = {{
    "width": Param(64, "hidden width (= feature_dim)", check=lambda v: None if v > 0 else "must be > 0"),
}}
'''

MODEL_TEST = '''import torch

from pflkit.core.testing import quick_run
from {pkg} import build_{name}


def test_{name}_has_a_feature_head_split():
    model = build_{name}((1, 8, 8), 10, width=32)
    x = torch.zeros(3, 1, 8, 8)
    assert model.features(x).shape == (3, 32) == (3, model.feature_dim)
    assert model(x).shape == (3, 10)


def test_{name}_runs_end_to_end(tmp_path):
    result = quick_run("fedavg", tmp_path, {{"model": {{"name": "{name}"}}}})
    assert result["rounds_completed"] == 2
    assert 0.0 <= result["final"]["uniform"] <= 1.0
'''

KIND_README = """# {name}

A pflkit {kind} plugin.

    pip install -e .
    {run}
    fl show {name}
    python -m pytest tests
"""

# per kind: (package __init__, test, the command that uses it, what the skeleton holds)
KINDS = {
    "algorithm": (INIT, TEST, "fl run --plugin {name}", "trainer, aggregator, algorithm, an example paper table, "
                  "test"),
    "dataset": (DATASET_INIT, DATASET_TEST, "fl run --plugin fedavg --set dataset.name={name}",
                "dataset loader with declared options, test"),
    "partitioner": (PARTITIONER_INIT, PARTITIONER_TEST, "fl run --plugin fedavg --set partition.name={name}",
                    "partitioner with declared options, test"),
    "model": (MODEL_INIT, MODEL_TEST, "fl run --plugin fedavg --set model.name={name}",
              "model builder with a feature/head split, test"),
}


def _taken(name: str, kind: str, pkg: str, dist: str) -> Optional[str]:
    """Why NAME cannot be used for a KIND plugin, or None: the name is registered in one of the kind's groups,
    or the package or distribution exists (installing the new one would replace it)."""
    from importlib.util import find_spec

    from ..api.registry import ALL_REGISTRIES, metadata

    for group in ENTRY_POINTS[kind]:
        registry = ALL_REGISTRIES[group.split(".", 1)[1]]
        if name in registry.names():
            owners = [e.dist for e in registry.entries() if e.name == name] or \
                [e.dist for e in registry.conflicts().get(name, [])]
            return (f"{registry.kind} '{name}' is already registered (by {', '.join(owners) or 'another package'}); "
                    f"a second one would clash with it: choose another name")
    try:
        metadata.distribution(dist)
        return f"a distribution '{dist}' is already installed; installing '{name}' would replace it: choose another name"
    except metadata.PackageNotFoundError:
        pass
    if find_spec(pkg) is not None:
        return f"a package '{pkg}' is already importable; choose another name"
    return None


MAX_NAME = 64


def _write_package(root: Path, files: Dict[Path, str]) -> None:
    """Write ``files`` under ``root`` all or nothing: into a hidden temporary folder beside it, renamed to ``root``
    once complete; a failure (a full disk, a name too long for the file system, no permission) removes what was
    written and is one line."""
    parent = root.parent
    made = []  # the folders above root this command creates, deepest first
    for folder in [parent, *parent.absolute().parents]:
        if os.path.lexists(folder):
            break
        made.append(folder)
    tmp = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name[:20]}-", suffix=".new", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # a plain folder, as mkdir makes it (mkdtemp's is private)
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        os.rename(tmp, root)  # fails if root appeared meanwhile (a non-empty folder is never replaced)
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise ConfigError(f"cannot create {root}: {exc.strerror or exc}; nothing was written") from None


@click.command("new-plugin")
@click.argument("name")
@click.option("--kind", "kind", type=click.Choice(sorted(KINDS)), default="algorithm", show_default=True,
              help="What the package provides.")
@click.option("--dir", "parent", default=".", type=click.Path(file_okay=False), show_default=True,
              help="Folder in which the package folder (named after the distribution, pflkit-NAME) is created.")
@friendly_errors
def new_plugin_command(name: str, kind: str, parent: str) -> None:
    """Write a working, installable plugin package skeleton with a test.

    --kind algorithm: trainer, aggregator, algorithm; dataset: a loader; partitioner: a partition function;
    model: a model builder with a feature/head split. NAME must not be registered already.
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ConfigError(f"plugin name {short_repr(name)}: use lowercase letters, digits and '_', starting with a "
                          f"letter")
    if len(name) > MAX_NAME:  # it names a folder, a package and a distribution: file names have a length limit
        raise ConfigError(f"plugin name {short_repr(name)}: {len(name)} characters is too long; use at most "
                          f"{MAX_NAME}")
    if keyword.iskeyword(name):  # it names a Python function or class in the package
        raise ConfigError(f"plugin name {name!r} is a Python keyword; choose another name")
    pkg = f"pflkit_{name}"
    dist = f"pflkit-{name.replace('_', '-')}"
    reason = _taken(name, kind, pkg, dist)
    if reason is not None:
        raise ConfigError(f"new-plugin {name}: {reason}")
    root = Path(parent) / dist  # the folder is named after the distribution it holds, as pip and PyPI name it
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or --dir")
    cls = "".join(part.capitalize() for part in name.split("_"))
    fields = {"name": name, "pkg": pkg, "cls": cls, "dist": dist, "kind": kind}
    init, test, run, holds = KINDS[kind]
    fields["run"] = run.format(**fields)
    fields["entry_points"] = "".join(f"{group} =\n    {name} = {target.format(**fields)}\n"
                                     for group, target in ENTRY_POINTS[kind].items())
    fields["packages"], fields["package_data"] = pkg, ""
    files = {Path(pkg) / "__init__.py": init.format(**fields)}
    if kind == "algorithm":  # its paper's table as data: fl reproduce NAME:table1
        fields["packages"] = f"{pkg}\n    {pkg}.tables"
        fields["entry_points"] += f"pflkit.tables =\n    {name}:table1 = {pkg}.tables:table1.toml\n"
        fields["package_data"] = f"\n[options.package_data]\n{pkg}.tables = *.toml\n"
        files[Path(pkg) / "tables" / "__init__.py"] = TABLES_INIT.format(**fields)
        files[Path(pkg) / "tables" / "table1.toml"] = TABLE.format(**fields)
    files.update({Path("pyproject.toml"): PYPROJECT, Path("setup.cfg"): SETUP_CFG.format(**fields),
                  Path("tests") / f"test_{name}.py": test.format(**fields),
                  Path("README.md"): (README if kind == "algorithm" else KIND_README).format(**fields)})
    _write_package(root, files)
    click.echo(f"created {kind} plugin package {root}: distribution {dist}, import package {pkg} ({holds})\nnext:\n  pip install -e {root}\n  {fields['run']}")
