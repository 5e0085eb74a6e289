"""Evaluation of PCFL on the synthetic sine task (paper section 5.1, Figure 5): overlap quality against the ground
truth the dataset knows, and Figure 5(e).

Ground truth. ``pcfl_sine`` records, per generating client, its objective (``meta['sign']``: +1 for y = sin x,
-1 for y = -sin x) and its intervals (``meta['intervals']``, of width ``meta['interval_width']``). A sample of
client k is *truly useful* to client i when k has i's objective and the sample's x lies in one of i's intervals.
Precision = |D^{i,k} and useful| / |D^{i,k}|, recall = |D^{i,k} and useful| / |useful|, both pooled over all pairs
i != k (micro averages).

Where it is computed, and why that keeps the privacy boundary: the server knows the dataset's metadata (the
experimenter's ground truth, ``ServerContext.data_info``) but not the samples; each client knows its samples and
its D^{i,k} but not the ground truth. The server sends the metadata to every client in an *instrumentation*
message (``accounted=False``: not part of the algorithm's cost, never used for training) and each client replies
three counts. No sample and no index leaves a client.

This needs client k to be generating client k: partition ``by_group`` with ``assign = exact`` and no shuffle (the
paper's setting). Otherwise the overlap quality is not computed (logged once).

Figure 5(e): what the server legitimately holds after set-up -- every client's region in the 2-D latent space
(hull vertices and outlines, or boxes) -- coloured by the client's objective when known.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch

from pflkit.core import Message

log = logging.getLogger("pflkit")

META_KEYS = ("sign", "intervals", "interval_width")
FIGURE_NAME = "pcfl_manifold.png"


def ground_truth_problem(meta: Mapping[str, Any], cfg: Mapping[str, Any], num_clients: int) -> Optional[str]:
    """Why the sine ground truth cannot be matched to the clients of this run, or None when it can."""
    if not all(k in meta for k in META_KEYS):
        return "the dataset records no per-client objective and intervals"
    part = cfg["partition"]
    if part["name"] != "by_group" or part.get("assign", "exact") != "exact" or part.get("shuffle", False):
        return "client k is generating client k only with partition by_group, assign=exact, shuffle=false"
    if len(meta["sign"]) != num_clients:
        return f"the dataset has {len(meta['sign'])} generating clients, the run {num_clients}"
    return None


def truth_payload(meta: Mapping[str, Any]) -> Dict[str, Any]:
    return {"sign": [int(s) for s in meta["sign"]], "intervals": [[int(v) for v in row] for row in meta["intervals"]],
            "width": float(meta["interval_width"])}


def truth_counts(cid: int, x: torch.Tensor, overlaps: Mapping[int, torch.Tensor],
                 truth: Mapping[str, Any]) -> Dict[str, int]:
    """Client k's counts: true positives, predicted (sum |D^{i,k}|) and truly useful samples, over all i != k."""
    sign, intervals = truth["sign"], truth["intervals"]
    slot = torch.floor(x.to(torch.float64) / float(truth["width"])).long()
    tp = pred = true = 0
    for i in range(len(sign)):
        if i == cid:
            continue
        useful = torch.isin(slot, torch.tensor(intervals[i], dtype=torch.long)) & (sign[i] == sign[cid])
        idx = overlaps.get(i)
        true += int(useful.sum())
        if idx is not None and len(idx):
            pred += int(len(idx))
            tp += int(useful[idx.cpu()].sum())
    return {"tp": tp, "pred": pred, "true": true}


def overlap_quality(server, comm) -> Dict[str, float]:
    """Pooled precision and recall of every client's D^{i,k} (instrumentation; empty when not applicable)."""
    ctx = server.ctx
    meta = (ctx.data_info or {}).get("meta") or {}
    ids = list(comm.client_ids)
    problem = ground_truth_problem(meta, ctx.cfg, len(ids))
    if problem is not None:
        if all(k in meta for k in META_KEYS):
            log.warning("PCFL overlap precision/recall not computed: %s", problem)
        return {}
    payload = truth_payload(meta)
    replies = comm.send({c: Message("pcfl_truth", payload) for c in ids}, accounted=False)
    tp = sum(int(replies[c]["tp"]) for c in sorted(replies))
    pred = sum(int(replies[c]["pred"]) for c in sorted(replies))
    true = sum(int(replies[c]["true"]) for c in sorted(replies))
    return {"overlap_precision": tp / pred if pred else 0.0, "overlap_recall": tp / true if true else 0.0,
            "overlap_true_pairs_samples": float(true), "overlap_shared_samples": float(pred)}


def _convex_polygon(points: np.ndarray) -> np.ndarray:
    """The vertices of a 2-D convex hull, ordered around their centroid (hull vertices come unordered)."""
    c = points.mean(axis=0)
    return points[np.argsort(np.arctan2(points[:, 1] - c[1], points[:, 0] - c[0]))]


def draw_regions(regions: Mapping[int, Mapping[str, Any]], meta: Mapping[str, Any], cfg: Mapping[str, Any],
                 run_dir: Optional[Path]) -> Optional[np.ndarray]:
    """Figure 5(e): the clients' regions in the latent space; saved as ``pcfl_manifold.png`` in ``run_dir``.

    Returns the image (H, W, 3) in [0, 1] for TensorBoard, or None when the latent space is not 2-D.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon, Rectangle

    from .hull import Region

    parsed = {int(c): Region.from_payload(p) for c, p in regions.items()}
    if not parsed or any(r.dim != 2 for r in parsed.values()):
        return None
    known = ground_truth_problem(meta, cfg, int(cfg["partition"]["num_clients"])) is None
    fig, ax = plt.subplots(figsize=(6.4, 5.6), dpi=100)
    cmap = plt.get_cmap("tab20")
    for cid, region in sorted(parsed.items()):
        if known:
            colour = "tab:blue" if int(meta["sign"][cid]) > 0 else "tab:red"
        else:
            colour = cmap(cid % 20)
        for _, part in region.parts:
            if region.kind == "box":
                lo, hi = part
                ax.add_patch(Rectangle(lo, *(hi - lo), fill=False, edgecolor=colour, alpha=0.35, lw=0.8))
                ax.scatter([lo[0], hi[0]], [lo[1], hi[1]], s=4, color=colour, alpha=0.6)
                continue
            ax.scatter(part[:, 0], part[:, 1], s=5, color=colour, alpha=0.7)
            if len(part) >= 3:
                ax.add_patch(Polygon(_convex_polygon(part), closed=True, fill=False, edgecolor=colour,
                                     alpha=0.35, lw=0.8))
    ax.autoscale_view()
    title = "client regions in the latent space u' (Eq. 9)"
    if known:
        ax.plot([], [], color="tab:blue", label="y = sin(x) clients")
        ax.plot([], [], color="tab:red", label="y = -sin(x) clients")
        ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("u'_1")
    ax.set_ylabel("u'_2")
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(np.float64) / 255.0
    if run_dir is not None:
        fig.savefig(Path(run_dir) / FIGURE_NAME)
    plt.close(fig)
    return image
