"""Curves of existing run directories (``fl plot``): the task metric per evaluated round, uniform (mean over
clients) and weighted (pooled over test samples), with the across-client spread as a band, and the losses.

Legends sit below the axes, never over the curves. Bands get lighter as runs are added (``band_alpha``)
and each band's edges are drawn as thin lines of its run's colour, so overlapping bands of many runs stay
distinguishable instead of adding up to one grey area.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from ..common.errors import ConfigError
from ..storage.rundata import RunData, write_output

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


def band_alpha(n_bands: int) -> float:
    """Fill opacity of one band when ``n_bands`` are drawn: 0.2 alone, down to 0.04 (eight or more overlapping
    bands at 0.2 would cover the axes)."""
    return max(0.04, 0.2 / max(1, n_bands) ** 0.75)


def legend_outside(ax: Any, fontsize: int = 7) -> None:
    """The axes' legend below them, outside the plotted area (the figure is saved with ``bbox_inches='tight'``,
    which makes room for it); below rather than beside, so that side-by-side axes do not cover each other."""
    labels = ax.get_legend_handles_labels()[1]
    if labels:
        import matplotlib
        from matplotlib.font_manager import FontProperties
        from matplotlib.transforms import offset_copy

        rc = matplotlib.rcParams
        points = lambda key: FontProperties(size=rc[key]).get_size_in_points()  # noqa: E731
        # below the tick labels and the axis label by an offset in points, whatever the axes' height (a fraction
        # of the axes lands on the label when tight_layout makes the axes short)
        drop = (rc["xtick.major.size"] + rc["xtick.major.pad"] + points("xtick.labelsize") + rc["axes.labelpad"]
                + points("axes.labelsize") + 6)
        anchor = offset_copy(ax.transAxes, fig=ax.figure, y=-drop, units="points")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=anchor, borderaxespad=0.0,
                  fontsize=fontsize, ncol=1 if max(map(len, labels)) > 60 else 2, frameon=False)


def save_figure(fig: Any, path: Path, option: str = "--out") -> None:
    """Render ``fig`` in memory (format from the extension), then write it whole: an unknown extension, a device
    such as /dev/full or a full disk is one line and leaves no half-written image."""
    fmt = path.suffix[1:].lower() or "png"
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=fmt, dpi=120, bbox_inches="tight")
    except ValueError as exc:  # unknown extension
        raise ConfigError(f"{option} {path}: {str(exc).splitlines()[0]}") from None
    write_output(path, buf.getvalue(), option)


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
    alpha = band_alpha(sum(bool(_band(r, metric, band)[0]) for r in runs))
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
            ax_m.fill_between(rounds, lo, hi, color=color, alpha=alpha, linewidth=0)
            for edge in (lo, hi):  # the band's own edges: which band is whose stays visible where they overlap
                ax_m.plot(rounds, edge, color=color, linewidth=0.5, alpha=0.6)
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
        legend_outside(ax)
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return drawn
