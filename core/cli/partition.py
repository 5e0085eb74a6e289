"""``fl partition``: draw and summarise the clients' label distribution for a config (no training)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import click
import numpy as np

from ..engine.config import load_file, parse_sets, resolve
from ..common.errors import ConfigError
from .common import friendly_errors


def bubble_plot(counts: np.ndarray, path: Path, title: str) -> None:
    """Clients on x, labels on y, bubble area proportional to the sample count (as in the papers' appendices)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_clients, n_labels = counts.shape
    cx, ly = np.nonzero(counts)
    sizes = counts[cx, ly]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * n_clients), max(3, 0.35 * n_labels)))
    ax.scatter(cx, ly, s=sizes * (600.0 / max(1, sizes.max())), alpha=0.6, color="tab:red", edgecolors="none")
    ax.set_xlabel("client")
    ax.set_ylabel("label")
    ax.set_xticks(range(n_clients))
    ax.set_yticks(range(n_labels))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@click.command("partition")
@click.option("--plugin", "-p", "plugin", default=None, help="Algorithm whose defaults apply (optional).")
@click.option("--config", "-c", "config_file", type=click.Path(dir_okay=False))
@click.option("--set", "-s", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--out", "out", default="partition.png", show_default=True, type=click.Path(dir_okay=False),
              help="PNG file for the bubble plot.")
@friendly_errors
def partition_command(plugin: Optional[str], config_file: Optional[str], sets: Tuple[str, ...], out: str) -> None:
    """Partition the configured dataset, print label counts per client and draw them as a bubble plot."""
    from ..data.data import build_federated_data

    layers = [load_file(config_file)] if config_file else []
    layers.append(parse_sets(sets))
    cfg = resolve(layers, algorithm=plugin)
    fed = build_federated_data(cfg)
    summary = fed.summary()
    val = fed.has_validation  # split.val: the validation rows are a client's too
    counts = np.array([[a + b + v for a, b, v in zip(c["train_label_counts"], c["test_label_counts"],
                                                     c.get("val_label_counts") or [0] * len(c["test_label_counts"]))]
                       for c in summary["clients"]])
    click.echo(f"{cfg.dataset.name}: {fed.num_clients} clients, partitioner {cfg.partition.name}")
    click.echo(f"client  train  test{'   val' if val else ''}  label counts (train+test{'+val' if val else ''})")
    for c, row in zip(summary["clients"], counts):
        held = f"  {c['val']:>4}" if val else ""
        click.echo(f"{c['client']:>6}  {c['train']:>5}  {c['test']:>4}{held}  {' '.join(str(v) for v in row)}")
    out_path = Path(out)
    if out_path.parent and not out_path.parent.exists():
        raise ConfigError(f"--out: folder {out_path.parent} does not exist")
    bubble_plot(counts, out_path, f"{cfg.dataset.name} / {cfg.partition.name} / {fed.num_clients} clients")
    click.echo(f"bubble plot: {out_path}")
