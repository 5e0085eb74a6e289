"""Curves of existing run directories (``fl plot``): the task metric per evaluated round, uniform (mean over
clients) and weighted (pooled over test samples), with the across-client spread as a band, and the losses."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import ConfigError
from .rundata import RunData

# band name -> the per-round record keys (suffixes of ``<metric>/``) of its lower and upper edge
BANDS = {"p10-p90": ("p10", "p90"), "min-max": ("min", "max"), "std": ("std", "std"), "none": None}


def _band(run: RunData, metric: str, band: str):
    """Rounds, lower and upper edge of the across-client spread around the uniform mean."""
    spec = BANDS[band]
    if spec is None:
        return [], [], []
    mean = dict(run.series(f"{metric}/uniform"))
    lo_key, hi_key = spec
    lo, hi = dict(run.series(f"{metric}/{lo_key}")), dict(run.series(f"{metric}/{hi_key}"))
    rounds = [r for r in sorted(mean) if r in lo and r in hi]
    if band == "std":  # mean +- std over clients
        return rounds, [mean[r] - lo[r] for r in rounds], [mean[r] + hi[r] for r in rounds]
    return rounds, [lo[r] for r in rounds], [hi[r] for r in rounds]


def plot_runs(runs: Sequence[RunData], path: Path, band: str = "p10-p90") -> int:
    """Draw ``runs`` into ``path`` (format from its extension: png, pdf, svg, ...); the number of curves drawn.

    Left: the metric per evaluated round, uniform (solid, with the band) and weighted (dashed). Right: the
    training loss (sample-weighted over the clients that trained) and the uniform test loss.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if band not in BANDS:
        raise ConfigError(f"--band {band!r}: choose one of {', '.join(BANDS)}")
    metrics = {r.metric for r in runs}
    if len(metrics) > 1:
        raise ConfigError(f"the runs report different metrics ({', '.join(sorted(metrics))}); plot them separately")
    metric = runs[0].metric
    if not any(r.series(f"{metric}/uniform") for r in runs):
        raise ConfigError(f"no run has an evaluated round yet ({metric}/uniform is in no metrics.jsonl record)")
    fig, (ax_m, ax_l) = plt.subplots(1, 2, figsize=(12, 4.4))
    drawn = 0
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        uniform = run.series(f"{metric}/uniform")
        if uniform:
            xs, ys = zip(*uniform)
            ax_m.plot(xs, ys, color=color, marker="o" if len(xs) < 15 else None, markersize=3,
                      label=f"{run.label} uniform")
            drawn += 1
        weighted = run.series(f"{metric}/weighted")
        if weighted:
            xs, ys = zip(*weighted)
            ax_m.plot(xs, ys, color=color, linestyle="--", label=f"{run.label} weighted")
        rounds, lo, hi = _band(run, metric, band)
        if rounds:
            ax_m.fill_between(rounds, lo, hi, color=color, alpha=0.15, linewidth=0)
        for key, style in (("train_loss", "-"), ("test_loss/uniform", ":")):
            points = run.series(key)
            if points:
                xs, ys = zip(*points)
                ax_l.plot(xs, ys, color=color, linestyle=style,
                          label=f"{run.label} {'train' if key == 'train_loss' else 'test (uniform)'}")
    band_text = {"p10-p90": "10th-90th percentile", "min-max": "min-max", "std": "mean ± std",
                 "none": ""}[band]
    ax_m.set_title(f"test {metric}: uniform (solid), weighted (dashed)"
                   + (f"\nband: {band_text} over clients" if band_text else ""), fontsize=10)
    ax_m.set_ylabel(metric)
    ax_l.set_title("loss: train (solid), test uniform (dotted)", fontsize=10)
    ax_l.set_ylabel("loss")
    for ax in (ax_m, ax_l):
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except ValueError as exc:  # unknown extension
        raise ConfigError(f"--out {path}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return drawn
