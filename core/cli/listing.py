"""``fl list`` and ``fl show``: what is installed, and what each algorithm's options mean."""
from __future__ import annotations

import shutil
import sys
from typing import Any, Dict, List, Optional

import click

from ..engine import compose
from ..api import registry as reg
from ..engine.config import CORE_SCHEMA, COMPONENT_SECTIONS, component_params, deep_merge
from ..api.params import Param
from .common import friendly_errors


NON_TERMINAL_WIDTH = 100  # characters per line of ``fl list`` when its output is not a terminal


def line_width() -> int:
    """The terminal's width, or NON_TERMINAL_WIDTH when the output is a pipe or file."""
    if sys.stdout.isatty():
        return max(40, shutil.get_terminal_size((NON_TERMINAL_WIDTH, 24)).columns)
    return NON_TERMINAL_WIDTH


def fit(line: str, width: int) -> str:
    """``line`` cut to ``width`` characters, ending in '...' when cut (``fl show NAME`` has the whole text)."""
    return line if len(line) <= width else line[:width - 3].rstrip() + "..."


# widest a column of ``fl list`` grows (a third-party plugin's 300-character name must not push every
# description off the line); a longer entry is cut and ends in '...'
COLUMN_LIMITS = {"name": 28, "dist": 24, "version": 12}


def cell(text: str, width: int) -> str:
    """``text`` padded to ``width``, or cut to it ending in '...' (the cut is marked, never silent)."""
    text = str(text)
    return text.ljust(width) if len(text) <= width else text[:max(0, width - 3)] + "..."


@click.command("list")
@click.argument("kind", required=False, type=click.Choice(sorted(reg.ALL_REGISTRIES)))
def list_command(kind: Optional[str]) -> None:
    """List every discovered plugin with its distribution and version; report plugins that fail to load.

    Columns are aligned over the whole listing (name, distribution, version, description); each line is cut to
    the terminal's width (100 characters when the output is not a terminal), a cut marked '...'; fl show NAME
    prints a component's whole description."""
    kinds = [kind] if kind else list(reg.ALL_REGISTRIES)
    width = line_width()
    failures = []
    sections = []  # (kind, [(name, dist, version, description)])
    for k in kinds:
        registry = reg.ALL_REGISTRIES[k]
        failures += registry.load_all()
        failed = {f.name for f in registry.failures()}
        rows = [(e.name, e.dist, e.version, reg.describe(e.obj)) for e in registry.entries() if e.name not in failed]
        for name, claimants in registry.conflicts().items():
            who = ", ".join(f"{e.dist} {e.version}" for e in claimants)
            rows.append((name, "CONFLICT:", "", f"claimed by {who}"))
        sections.append((k, rows))
    every = [row for _, rows in sections for row in rows]
    widths = [min(limit, max([len(str(row[i])) for row in every] + [1])) for i, limit in
              enumerate(COLUMN_LIMITS.values())]
    for k, rows in sections:
        click.echo(f"{k}:")
        for row in rows:
            cells = [cell(value, w) for value, w in zip(row[:3], widths)]
            click.echo(fit("  " + " ".join(cells) + " " + row[3], width).rstrip())
    if failures:
        click.echo("\nplugins that failed to load (the others above work):", err=True)
        for f in failures:
            click.echo(f"  {f}", err=True)


def _param_lines(params: Dict[str, Param], prefix: str, overrides: Dict[str, Any]) -> list:
    lines = []
    for key, p in params.items():
        default = overrides.get(key, p.default)
        note = f" (algorithm default; core default {p.default!r})" if key in overrides and overrides[key] != p.default else ""
        choices = f" [one of {', '.join(map(str, p.choices))}]" if p.choices else ""
        searched = f"\n      fl tune searches {p.space.describe()}" if p.space is not None else ""
        lines.append(f"  {prefix}{key} = {default!r}{note}\n      {p.help}{choices}{searched}")
    return lines


@click.command("show")
@click.argument("name")
@friendly_errors
def show_command(name: str) -> None:
    """Show an algorithm's (or any component's) options, their defaults and meaning."""
    if name in reg.ALGORITHMS.names():
        algo = reg.ALGORITHMS.get(name)
        defaults = dict(algo.defaults or {})
        click.echo(f"algorithm {name}: {algo.description}")
        if algo.paper:
            click.echo(f"paper: {algo.paper}")
        # an algorithm augmenting another (core/engine/compose.py) is shown composed with its default base
        objs = {"trainer": reg.TRAINERS.get(algo.trainer), "aggregator": reg.AGGREGATORS.get(algo.aggregator)}
        section_of_base = compose.base_section(objs["trainer"], objs["aggregator"])
        base = (defaults.get(section_of_base) or {}).get(compose.BASE_KEY) if section_of_base else None
        compo = compose.compose(objs["trainer"], objs["aggregator"], base)
        if compo.wrapped:
            defaults = deep_merge(compose.base_defaults(compo), defaults)
            defaults.setdefault(compo.section, {}).setdefault(compose.BASE_KEY, compo.base)
        for section, comp_name in (("trainer", algo.trainer), ("aggregator", algo.aggregator)):
            comp = objs[section]
            built = compo.trainer if section == "trainer" else compo.aggregator
            wraps = ""
            if section in compo.wraps:
                base_algo = reg.ALGORITHMS.get(compo.base)
                wraps = f" over {section} '{getattr(base_algo, section)}' of base algorithm '{compo.base}'"
            click.echo(f"\n{section} '{comp_name}'{wraps} (protocol {getattr(built, 'protocol', '?')!r}): "
                       f"{reg.describe(comp)}")
            lines = _param_lines(compose.section_params(section, comp, compo), f"{section}.",
                                 defaults.get(section, {}))
            click.echo("\n".join(lines) if lines else "  (no options)")
            if section == "aggregator":
                click.echo(aggregation_line(built))
                from ..api.client import client_state_backend
                plan = client_state_backend(compo.trainer, built)
                click.echo(f"  client state: {plan['path']} ({plan['reason']})")
            else:
                click.echo(batched_line(built))
        # bases whose run starts with these defaults (the run's own start checks, core/engine/dryrun.py)
        from ..engine import dryrun  # here, not at import: it needs torch, which `fl --help` does not

        if compo.wrapped:
            runs, refused = dryrun.runnable_bases(name)
            click.echo(f"\nbase algorithms it can wrap ({compo.section}.{compose.BASE_KEY}; their defaults apply "
                       f"beneath this algorithm's): {', '.join(runs) or '(none)'}")
            for base, reason in refused.items():
                click.echo(f"  not with these defaults: {base} ({reason})")
            click.echo(batched_bases_line(objs["trainer"], objs["aggregator"], runs))
        click.echo(f"\n{dryrun.global_model_line(name)}")
        other = {k: v for k, v in defaults.items() if k not in ("trainer", "aggregator")}
        if other:
            click.echo("\nother defaults this algorithm sets:")
            for section, values in other.items():
                if isinstance(values, dict):
                    for k, v in values.items():
                        click.echo(f"  {section}.{k} = {v!r}")
                else:
                    click.echo(f"  {section} = {values!r}")
        click.echo("\ncore options: fl show core")
        return
    if name == "core":
        def walk(spec, prefix=""):
            for k, v in spec.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}{k}.")
                else:
                    click.echo(_param_lines({k: v}, prefix, {})[0])
        walk(CORE_SCHEMA)
        for section, (_, common) in COMPONENT_SECTIONS.items():
            walk(common, f"{section}.")
        return
    for kind, registry in reg.ALL_REGISTRIES.items():
        if kind != "algorithms" and name in registry.names():
            comp = registry.get(name)
            click.echo(f"{registry.kind} {name}: {reg.describe(comp)}")
            if kind == "tables":  # data, not a component: no options
                click.echo(f"  from {comp.origin}; run it: fl reproduce {name} (its columns and data: "
                           f"fl reproduce --list)")
                return
            section = {"datasets": "dataset", "partitioners": "partition", "models": "model",
                       "trainers": "trainer", "aggregators": "aggregator"}[kind]
            lines = _param_lines(component_params(comp), f"{section}.", {})
            click.echo("\n".join(lines) if lines else "  (no options)")
            return
    every = sorted({n for r in reg.ALL_REGISTRIES.values() for n in r.names()} | {"core"})
    raise reg.unknown_name_of_any_length("plugin or component", name, every)


def batched_line(trainer: Any) -> str:
    """Whether the trainer's clients can be trained as one vectorised model (clients.batched)."""
    from ..engine.batched import trainer_batches

    _, how = trainer_batches(trainer)
    return (f"  clients.batched: {how}; with the default clients.batched=auto, batched on CUDA and one after "
            f"another on CPU" if how.startswith("batched") else f"  clients.batched: {how}")


def batched_bases_line(trainer: Any, aggregator: Any, bases: List[str]) -> str:
    """For an augmenting algorithm: over which of ``bases`` its clients can be trained as one vectorised model."""
    from ..engine.batched import form_reason

    batched, sequential = [], []
    for base in bases:
        reason = form_reason(compose.compose(trainer, aggregator, base).trainer)
        if reason is None:
            batched.append(base)
        else:
            sequential.append(f"{base} ({reason.split(' (a LocalSGDTrainer')[0]})")  # the cause, not the advice
    return (f"  clients.batched over each: batched over {', '.join(batched) or '(none)'}"
            + (f"; sequential over {'; '.join(sequential)}" if sequential else ""))


def aggregation_line(aggregator: Any) -> str:
    """How a strategy receives a round's uploads (core/api/fold.py): streamed into running means, or all at once."""
    fields = getattr(aggregator, "reduced_fields", tuple)()
    if fields:
        return (f"  aggregation: streaming -- the weighted mean of {', '.join(repr(f) for f in fields)} is folded "
                f"as each reply arrives (a round holds one running sum, not every upload)")
    return "  aggregation: all replies at once -- the strategy needs every upload together (a round holds them all)"
