"""The influence matrix as a picture (the paper's Figure 3): row m = client m's influence vector lambda_m."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_matrix(ax, matrix: np.ndarray, names: Sequence[str], title: str, annotate: bool = True,
                vmax: Optional[float] = None):
    """Heat map of an M x M influence matrix on ``ax``; NaN rows (clients that did not report) stay blank."""
    m = matrix.shape[0]
    masked = np.ma.masked_invalid(matrix)
    top = vmax if vmax is not None else (float(np.nanmax(matrix)) if np.isfinite(matrix).any() else 1.0)
    im = ax.imshow(masked, cmap="viridis", vmin=0.0, vmax=max(top, 1e-9))
    ax.set_xticks(range(m))
    ax.set_yticks(range(m))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("influencing client i", fontsize=8)
    ax.set_ylabel("client m (lambda_m)", fontsize=8)
    ax.set_title(title, fontsize=9)
    if annotate and m <= 12:
        for r in range(m):
            for c in range(m):
                if np.isfinite(matrix[r, c]):
                    ax.text(c, r, f"{matrix[r, c]:.2f}", ha="center", va="center", fontsize=6,
                            color="white" if matrix[r, c] < 0.6 * top else "black")
    return im


def influence_figure(matrix: np.ndarray, names: Sequence[str], title: str):
    plt = _plt()
    m = matrix.shape[0]
    side = min(9.0, 2.6 + 0.45 * m)
    fig, ax = plt.subplots(figsize=(side + 0.8, side))
    im = draw_matrix(ax, matrix, names, title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def figure_rgb(fig) -> np.ndarray:
    """A drawn matplotlib figure as an H x W x 3 float array in [0, 1] (for TensorBoard)."""
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba(), dtype=np.float64) / 255.0
    return rgba[:, :, :3]


def save_influence_png(matrix: np.ndarray, names: Sequence[str], title: str, path: Path, logger=None,
                       tag: str = "fedc2i/influence_matrix") -> None:
    """Write the matrix picture to ``path`` and, when ``logger`` is given, to TensorBoard as an image."""
    plt = _plt()
    fig = influence_figure(matrix, names, title)
    try:
        if logger is not None:
            logger.log_image(tag, figure_rgb(fig))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
