"""``fl results``: re-make the results tables of documents from their CSVs under ``results/``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import click

from ..common.errors import ConfigError
from .common import friendly_errors


@click.command("results")
@click.argument("documents", nargs=-1, type=click.Path(dir_okay=False), metavar="[DOCUMENT...]")
@click.option("--root", default=".", show_default=True, type=click.Path(file_okay=False),
              help="The repository root: where the markers' CSV paths start and the default documents are.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 naming every table that differs from its CSV, "
                                            "every CSV whose runs do not come from one clean commit (unless its "
                                            "notes say 'not re-measured'), and every mean ± std table outside a "
                                            "marker.")
@friendly_errors
def results_command(documents: Tuple[str, ...], root: str, check: bool) -> None:
    """Re-make every table between <!-- results: results/NAME.csv --> and <!-- /results --> from its CSV.

    DOCUMENT defaults to the published ones under --root: README.md, docs/*.md and plugins/*/README.md. A results
    CSV is written by the command that measured it (fl compare --out, fl reproduce --out: results.csv, with the
    command, commit, date, machine and seeds); copy it under results/ and mark where a document shows it. A marker
    may name the columns to show: <!-- results: results/NAME.csv | column | column -->.
    """
    from ..results.published import provenance_problem, published_documents, render_document, \
        unmarked_result_tables

    base = Path(root)
    paths = [Path(d) for d in documents] or published_documents(base)
    if not paths:
        raise ConfigError(f"no documents under {base} (README.md, docs/*.md, plugins/*/README.md)")
    stale, unmarked, rewritten, tables = [], [], [], 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
        new, changed, shown = render_document(text, base, where=str(path))
        tables += len(shown)
        stale += [f"{path}: the table of {rel} differs from its CSV" for rel in changed]
        stale += [p for p in (provenance_problem(base / rel) for rel in dict.fromkeys(shown)) if p is not None]
        unmarked += [f"{path}, line {n}: a mean ± std table outside <!-- results: ... -->" for n in
                     unmarked_result_tables(new)]
        if changed and not check:
            target = path.resolve()  # never through a link to outside the repository
            if base.resolve() not in target.parents:
                raise ConfigError(f"{path} resolves to {target}, outside --root {base}; nothing written")
            path.write_text(new, encoding="utf-8")
            rewritten.append(str(path))
    if check:
        for line in stale + unmarked:
            click.echo(line)
        if stale or unmarked:
            raise SystemExit(1)
        click.echo(f"{tables} table(s) in {len(paths)} document(s) match their CSVs")
        return
    for line in unmarked:
        click.echo(line, err=True)
    click.echo(f"{tables} table(s) in {len(paths)} document(s); rewritten: {', '.join(rewritten) or 'none'}")
