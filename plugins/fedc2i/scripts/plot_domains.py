"""Draw a few samples of every digits_domains domain (the picture in the FedC2I README and docs/).

    python plugins/fedc2i/scripts/plot_domains.py docs/digits_domains.png
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pflkit.datasets.feature_shift import load_digits_domains  # noqa: E402


def main(out: str, per_domain: int = 8) -> None:
    bundle = load_digits_domains()
    groups = bundle.groups.numpy()
    labels = bundle.y.numpy()
    names = bundle.group_names
    fig, axes = plt.subplots(len(names), per_domain, figsize=(per_domain * 0.62, len(names) * 0.72))
    for g, name in enumerate(names):
        for j in range(per_domain):
            # the first sample of digit j (0..7) in this domain
            idx = np.flatnonzero((groups == g) & (labels == j % 10))[0]
            ax = axes[g, j]
            ax.imshow(bundle.x[idx].permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle("digits_domains: digits 0-7 in each domain (16x16 RGB)", fontsize=9)
    fig.tight_layout(pad=0.3)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"wrote {out} ({Path(out).stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/digits_domains.png")
