"""``fl new-plugin NAME``: write an installable plugin package a third party can start from."""
from __future__ import annotations

import re
from pathlib import Path

import click

from ..errors import ConfigError
from .common import friendly_errors

PYPROJECT = """[build-system]
requires = ["setuptools>=64", "wheel"]
build-backend = "setuptools.build_meta"
"""

SETUP_CFG = """[metadata]
name = {dist}
version = 0.1.0
description = {name}: a pflkit algorithm plugin

[options]
packages = {pkg}
python_requires = >=3.10
install_requires =
    pflkit>=0.1

[options.entry_points]
pflkit.trainers =
    {name} = {pkg}:{cls}Trainer
pflkit.aggregators =
    {name} = {pkg}:{cls}Aggregator
pflkit.algorithms =
    {name} = {pkg}:ALGORITHM
"""

INIT = '''"""{name}: a pflkit algorithm plugin.

Start from here: the trainer below is FedAvg plus an optional proximal term, the aggregator is the
sample-weighted mean. Change the hooks you need (see pflkit.core.client.LocalSGDTrainer and
pflkit.core.server.GlobalModelAggregator) and run it with:  fl run --plugin {name}
"""
from typing import List

import torch

from pflkit.core import Algorithm, GlobalModelAggregator, LocalSGDTrainer, Param
from pflkit.core.state import State, proximal_term, weighted_average


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

TEST = '''from pflkit.core.testing import quick_run


def test_{name}_runs_end_to_end(tmp_path):
    result = quick_run("{name}", tmp_path)
    assert result["rounds_completed"] == 2
    assert 0.0 <= result["final"]["uniform"] <= 1.0
'''

README = """# {name}

A pflkit algorithm plugin.

    pip install -e .
    fl run --plugin {name}
    fl show {name}
    python -m pytest tests
"""


@click.command("new-plugin")
@click.argument("name")
@click.option("--dir", "parent", default=".", type=click.Path(file_okay=False), show_default=True,
              help="Folder in which the package folder is created.")
@friendly_errors
def new_plugin_command(name: str, parent: str) -> None:
    """Write a working plugin package skeleton (trainer, aggregator, algorithm, test)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ConfigError(f"plugin name {name!r}: use lowercase letters, digits and '_', starting with a letter")
    root = Path(parent) / name
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or --dir")
    pkg = f"pflkit_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    fields = {"name": name, "pkg": pkg, "cls": cls, "dist": f"pflkit-{name.replace('_', '-')}"}
    try:
        (root / pkg).mkdir(parents=True)
        (root / "tests").mkdir()
    except OSError as exc:
        raise ConfigError(f"cannot create {root}: {exc.strerror}") from exc
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "setup.cfg").write_text(SETUP_CFG.format(**fields))
    (root / pkg / "__init__.py").write_text(INIT.format(**fields))
    (root / "tests" / f"test_{name}.py").write_text(TEST.format(**fields))
    (root / "README.md").write_text(README.format(**fields))
    click.echo(f"created plugin package {root}\nnext:\n  pip install -e {root}\n  fl run --plugin {name}")
