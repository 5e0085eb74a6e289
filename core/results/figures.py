"""Readable pictures of per-client matrices (similarity, overlap, influence) for TensorBoard.

A raw N x N array logged as an image is N x N pixels with no axes and no scale; ``log_matrix_figure`` draws it as a
figure instead: a heat map with client ids on both axes, a colour bar with the values' meaning, and a title that
names the round. Any plugin calls it with its context's logger (``ctx.logger``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

MAX_TICK_LABELS = 25  # above this many clients, every k-th client is labelled (the labels would overlap)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed (servers, tests)
    import matplotlib.pyplot as plt

    return plt


def figure_rgb(fig: Any) -> np.ndarray:
    """A drawn matplotlib figure as an H x W x 3 float array in [0, 1] (what ``RunLogger.log_image`` takes)."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba(), dtype=np.float64)[:, :, :3] / 255.0


def matrix_figure_rgb(matrix: Any, title: str, labels: Optional[Sequence[Any]] = None,
                      row_labels: Optional[Sequence[Any]] = None, xlabel: str = "client", ylabel: str = "client",
                      colorbar_label: str = "", vmin: Optional[float] = None, vmax: Optional[float] = None,
                      cmap: str = "viridis") -> np.ndarray:
    """Heat map of ``matrix`` (rows x columns; NaN cells blank) as an RGB image: ``labels`` name the columns (and
    the rows unless ``row_labels`` is given), e.g. the client ids; the colour bar spans [vmin, vmax] (default: the
    finite values' range)."""
    arr = np.asarray(matrix, dtype=np.float64)
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"matrix_figure_rgb: expected a non-empty 2-D matrix, got shape {arr.shape}")
    rows, cols = arr.shape
    cols_named = list(labels) if labels is not None else list(range(cols))
    rows_named = list(row_labels) if row_labels is not None else (cols_named if rows == cols else list(range(rows)))
    if len(cols_named) != cols or len(rows_named) != rows:
        raise ValueError(f"matrix_figure_rgb: {len(rows_named)} x {len(cols_named)} labels for a {rows} x {cols} "
                         f"matrix")
    plt = _pyplot()
    side = min(10.0, 3.0 + 0.25 * max(rows, cols))
    fig, ax = plt.subplots(figsize=(side + 1.2, side), dpi=100)
    try:
        image = ax.imshow(np.ma.masked_invalid(arr), cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        for axis, n, names in ((ax.set_xticks, cols, cols_named), (ax.set_yticks, rows, rows_named)):
            every = max(1, -(-n // MAX_TICK_LABELS))
            axis(range(0, n, every), [str(names[i]) for i in range(0, n, every)], fontsize=7)
        ax.tick_params(axis="x", labelrotation=90)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        if colorbar_label:
            bar.set_label(colorbar_label)
        fig.tight_layout()
        return figure_rgb(fig)
    finally:
        plt.close(fig)


def log_matrix_figure(logger: Any, tag: str, matrix: Any, title: str, step: Optional[int] = None,
                      **figure: Any) -> None:
    """Draw ``matrix`` with ``matrix_figure_rgb(matrix, title, **figure)`` and log it as image ``tag``
    (nothing when the run has no logger or no TensorBoard writer)."""
    if logger is None or getattr(logger, "writer", True) is None:
        return
    logger.log_image(tag, matrix_figure_rgb(matrix, title, **figure), step=step)
