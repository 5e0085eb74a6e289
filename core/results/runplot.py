"""Curves of existing run directories (``fl plot``): the task metric per evaluated round, uniform (mean over
clients) and weighted (pooled over test samples), with the across-client spread as a band, and the losses.

Legends sit below the axes, never over the curves. Bands get lighter as runs are added (``band_alpha``)
and each band's edges are drawn as thin lines of its run's colour, so overlapping bands of many runs stay
distinguishable instead of adding up to one grey area.

``grouped_figure`` draws runs grouped (by algorithm): one colour per group, the mean over its runs (seeds) with a
std band -- the figure ``fl compare`` writes as ``curves.png`` and ``fl plot --group algorithm`` draws, one code
path for both. Every accuracy axis shows percent (``metric_axis``), as every table prints it.
"""
from __future__ import annotations

import io
from pathlib import Path
import math
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

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


def metric_axis(ax: Any, metric: str, label: bool = True) -> None:
    """Label ``ax``'s y axis with the metric; accuracy (logged as a fraction) is shown in percent."""
    if metric == "accuracy":
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    if label:
        ax.set_ylabel("accuracy (%)" if metric == "accuracy" else metric)


Curve = Mapping[str, List[float]]  # {"rounds": [...], "uniform": [...], "weighted": [...]}: one run's evaluations


def mean_band(curves: Sequence[Curve], key: str) -> Tuple[List[int], np.ndarray, np.ndarray]:
    """Mean and std over runs (seeds) of ``key`` on the rounds every run evaluated."""
    common = sorted(set.intersection(*(set(c["rounds"]) for c in curves))) if curves else []
    if not common:
        return [], np.array([]), np.array([])
    stacked = np.array([[dict(zip(c["rounds"], c[key]))[r] for r in common] for c in curves], dtype=np.float64)
    return common, stacked.mean(axis=0), stacked.std(axis=0)


def run_curve(run: RunData) -> Dict[str, List[float]]:
    """A run directory's evaluations as a ``Curve`` (weighted NaN where a round logged only the uniform value)."""
    uniform = run.series(f"{run.metric}/uniform")
    weighted = dict(run.series(f"{run.metric}/weighted"))
    return {"rounds": [r for r, _ in uniform], "uniform": [v for _, v in uniform],
            "weighted": [weighted.get(r, math.nan) for r, _ in uniform]}


def grouped_figure(groups: Sequence[Tuple[str, Sequence[Curve]]], metric: str, title: str) -> Any:
    """The uniform (left) and weighted (right) metric per round, one line per group in one colour on both panels:
    the mean over the group's runs, shaded band = std over them (population std, ddof=0) when it has several.
    Legend labels are ``<group> (n=<runs>)``. Returns the figure (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    alpha = band_alpha(sum(len(curves) > 1 for _, curves in groups))
    for ax, key in zip(axes, ("uniform", "weighted")):
        for i, (name, curves) in enumerate(groups):
            rounds, mean, std = mean_band(curves, key)
            if not rounds:
                continue
            color = f"C{i % 10}"
            # line styles cycle too, so coinciding curves (e.g. FedProx with a tiny mu over FedAvg) stay visible
            ax.plot(rounds, mean, color=color, marker="o" if len(rounds) < 15 else None, markersize=3,
                    linestyle=("-", "--", "-.", ":")[i % 4], label=f"{name} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(rounds, mean - std, mean + std, color=color, linewidth=0, alpha=alpha)
        ax.set_title(f"test {metric}, " + ("mean over clients" if key == "uniform" else "pooled over test samples"))
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes:
        metric_axis(ax, metric, label=ax is axes[0])
    legend_outside(axes[0], fontsize=8)  # below the axes, never over a curve (nothing when no run finished)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_groups(runs: Sequence[RunData], path: Path, group: str = "algorithm") -> int:
    """``fl plot --group algorithm``: ``runs`` grouped by their config's algorithm (in first-seen order) and drawn
    with ``grouped_figure`` into ``path``; the number of groups drawn."""
    metric = _one_metric(runs)
    groups: Dict[str, List[Dict[str, List[float]]]] = {}
    for run in runs:
        name = run.config.get(group) if isinstance(run.config.get(group), str) else None
        groups.setdefault(name or f"{run.label} (no {group})", []).append(run_curve(run))
    seeds = sorted({str(r.config.get("seed")) for r in runs if r.config.get("seed") is not None})
    title = (f"mean over the runs of each {group}" + (f" (seeds {', '.join(seeds)})" if seeds else "")
             + "; band: std over runs")
    import matplotlib.pyplot as plt

    fig = grouped_figure(list(groups.items()), metric, title)
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return sum(bool(mean_band(c, "uniform")[0]) for c in groups.values())


def _one_metric(runs: Sequence[RunData]) -> str:
    metrics = {r.metric for r in runs}
    if len(metrics) > 1:
        raise ConfigError(f"the runs report different metrics ({', '.join(sorted(metrics))}); plot them separately")
    metric = runs[0].metric
    if not any(r.series(f"{metric}/uniform") for r in runs):
        raise ConfigError(f"no run has an evaluated round yet ({metric}/uniform is in no metrics.jsonl record)")
    return metric


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
    metric = _one_metric(runs)
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
    metric_axis(ax_m, metric)
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
