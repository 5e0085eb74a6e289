"""What a finished (or paused) run reports: its summary table and where its files are, printed, and
``summary.json`` as strict JSON.

Below both the ``fl`` command (``core/cli``) and the processes of a distributed run (``core/distributed``), which
print the same report, so neither imports the other.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict

import click


def strict_json(obj: Any) -> Any:
    """``obj`` with NaN/Infinity replaced by null, so the file is strict JSON (other tools reject bare NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def format_summary(result: Dict[str, Any]) -> str:
    m = result["metric"]
    fin, best = result["final"], result["best"]
    last = result.get("last", {})
    pct = (lambda v: f"{100 * v:.2f}%") if m == "accuracy" else (lambda v: f"{v:.5f}")
    fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else pct(v)
    rows = [
        ("algorithm", f"{result['algorithm']} (trainer {result['trainer']}, aggregator {result['aggregator']}"
                      + "".join(f"; {key} = {name}" for key, name in (result.get("base") or {}).items()) + ")"),
        ("dataset / clients", f"{result['dataset']} / {result['num_clients']}"),
        ("rounds completed", f"{result['rounds_completed']} of {result['rounds']}"),
        (f"final {m}, uniform (mean of last {fin['k']} evals)", fmt(fin["uniform"])),
        (f"final {m}, sample-weighted", fmt(fin["weighted"])),
        (f"final {m}, std across clients", fmt(fin["std"])),
        (f"best {m}, uniform (round {best['round']})", fmt(best["uniform"])),
        *([(f"best {m}, sample-weighted (round {result['best_weighted']['round']})",
            fmt(result["best_weighted"]["weighted"]))] if "best_weighted" in result else []),
        *_selected_rows(result, m, fmt),
        *(_global_rows(result["global"], m, fmt) if "global" in result else []),
        (f"last round {m}, min / max client",
         f"{fmt(last.get(f'{m}/min'))} / {fmt(last.get(f'{m}/max'))}"),
        ("communication up / down", f"{result['bytes_up_total'] / 2**20:.1f} MiB / "
                                    f"{result['bytes_down_total'] / 2**20:.1f} MiB"),
        ("client failures", str(result["client_failures"])),
        *([("clients trained", f"{result['clients_batched']['path']} ({result['clients_batched']['reason']})")]
          if isinstance(result.get("clients_batched"), dict) else []),
        *([("client state", f"{result['clients_state']['path']} ({result['clients_state']['reason']})")]
          if isinstance(result.get("clients_state"), dict) else []),
        ("checkpoint", "none written" if result.get("checkpoint_bytes") is None
         else f"{result['checkpoint_bytes'] / 2**20:.2f} MiB"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line] + [f"{k.ljust(width)}  {v}" for k, v in rows] + [line])


def _selected_rows(result: Dict[str, Any], m: str, fmt) -> list:
    """split.val: the test metric at the evaluation chosen on the validation split (not on the test data, as best
    is), and each client's at its own best validation evaluation."""
    rows = []
    sel, sel_w, per_client = (result.get(k) for k in ("selected", "selected_weighted", "selected_per_client"))
    if isinstance(sel, dict):
        rows.append((f"selected {m}, uniform (round {sel.get('round')}, best validation)", fmt(sel.get("uniform"))))
    if isinstance(sel_w, dict):
        rows.append((f"selected {m}, sample-weighted (round {sel_w.get('round')})", fmt(sel_w.get("weighted"))))
    if isinstance(per_client, dict):
        rows.append((f"selected {m}, each client at its best validation", fmt(per_client.get("uniform"))))
    return rows


def _global_rows(section: Any, m: str, fmt) -> list:
    """The global model's numbers (summary.json's ``global``, core/engine/globaleval.py): its plain evaluation on
    every client's test split, beside the personal numbers above."""
    if not isinstance(section, dict):
        return [("global model", "none (this algorithm has no global model)")]
    fin, best, best_w = section.get("final") or {}, section.get("best") or {}, section.get("best_weighted") or {}
    same = " (the personal model is the global one)" if section.get("source") == "personal" else ""
    return [(f"global {m}, final uniform / weighted", f"{fmt(fin.get('uniform'))} / {fmt(fin.get('weighted'))}{same}"),
            (f"global {m}, best uniform (round {best.get('round')})", fmt(best.get("uniform"))),
            (f"global {m}, best weighted (round {best_w.get('round')})", fmt(best_w.get("weighted"))),
            *([(f"global {m}, selected uniform (round {section['selected'].get('round')})",
                fmt(section["selected"].get("uniform")))] if isinstance(section.get("selected"), dict) else [])]


def report_result(result: Dict[str, Any], run_dir: Path) -> bool:
    """Print a finished (or interrupted) run's summary and where its files are; True when it was interrupted."""
    click.echo(format_summary(result))
    click.echo(f"metrics: {run_dir / 'metrics.jsonl'}\n"
               f"watch in TensorBoard: tensorboard --logdir {run_dir / 'tb'}")
    if result.get("interrupted"):
        click.echo(f"interrupted after round {result['rounds_completed']}; continue with:\n"
                   f"  fl run --resume {run_dir}")
        return True
    return False
