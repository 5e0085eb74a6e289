"""How much an exact convex hull accepts as d' grows, versus the authors' bounding box (README table).

n codes ~ N(0, I_d') make a client's region; fresh points from the same distribution are tested for membership.
The fraction inside is what a client of that size would share (Eq. 10) or could sample from (Eq. 12).

    python plugins/pcfl/scripts/hull_acceptance.py [--n 300] [--fresh 1000] [--dims 2,4,8,16,32,64]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from pflkit_pcfl.hull import hull_vertices, in_box, in_hull


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="codes per region")
    ap.add_argument("--fresh", type=int, default=1000, help="fresh points tested")
    ap.add_argument("--dims", default="2,4,8,16,32,64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"| d' | hull vertices of {args.n} | inside the hull | inside the box | hull test, s |")
    print("|---:|---:|---:|---:|---:|")
    for d in [int(v) for v in args.dims.split(",")]:
        rng = np.random.default_rng(args.seed + d)
        codes = rng.standard_normal((args.n, d))
        fresh = rng.standard_normal((args.fresh, d))
        start = time.perf_counter()
        vertices = hull_vertices(codes)
        inside = in_hull(fresh, vertices).mean()
        seconds = time.perf_counter() - start
        box = in_box(fresh, codes.min(axis=0), codes.max(axis=0)).mean()
        print(f"| {d} | {len(vertices)} | {100 * inside:.1f}% | {100 * box:.1f}% | {seconds:.1f} |")


if __name__ == "__main__":
    main()
