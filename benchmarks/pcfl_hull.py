"""PCFL's overlap test (Eq. 10): exact convex-hull membership versus the authors' bounding box.

Two tables, one process, one torch/BLAS thread:

1. Membership tests per second at d' = 2, 8, 32 with 1,000 and 10,000 hull points (standard-Gaussian hull and
   queries), every method timed on the same data side by side: the box (``in_box``, the authors' code), the
   default exact test (``in_hull``: prefilters, then LP for the undecided), the LP alone on every query (column
   generation, as ``in_hull`` uses it), the plain full-size LP alone (fewer queries: it is slow), and the
   certified NNLS alone. "to LP" is the share of queries the prefilters leave undecided.
2. Acceptance rates: the fraction of fresh standard-Gaussian points inside the exact hull, and inside the
   bounding box, of n = 300 standard-Gaussian points, at d' = 2, 4, 8, 16, 32 (mean over trials), with the
   number of hull vertices (what a client sends) and the payload bytes of the hull versus the box.

    python benchmarks/pcfl_hull.py            # both tables (about 2 minutes on 2 cores)
    python benchmarks/pcfl_hull.py --quick    # fewer queries and trials (about 30 s)
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")   # before numpy loads its BLAS

import argparse
import statistics
import time

import numpy as np
import scipy
import torch

from pflkit_pcfl.hull import _Hull, build_region, hull_vertices, in_box, in_hull


def rate(fn, count: int, repeats: int = 1) -> float:
    """Tests per second: ``count`` tests per call of ``fn``, median over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return count / statistics.median(times)


def throughput(args: argparse.Namespace) -> None:
    print(f"membership tests per second (hull and queries ~ N(0, I); LP-side columns: {args.lp_queries} queries, "
          f"plain LP: {args.plain_queries}, box: {args.box_queries})")
    head = (f"{'d_prime':>7} {'hull_pts':>8} | {'box':>11} {'in_hull':>9} {'LP alone':>9} {'plain LP':>9} "
            f"{'NNLS':>9} | {'to LP':>6} {'inside':>7} {'in box':>7}")
    print(head)
    print("-" * len(head))
    rng = np.random.default_rng(args.seed)
    for d in (2, 8, 32):
        for n in (1000, 10000):
            hull = rng.standard_normal((n, d))
            q = rng.standard_normal((args.lp_queries, d))
            qb = rng.standard_normal((args.box_queries, d))
            lo, hi = hull.min(axis=0), hull.max(axis=0)
            h = _Hull(np.unique(hull, axis=0), 1e-9)
            state = {}
            # interleaved, so that all methods see the same machine load
            r_box = rate(lambda: in_box(qb, lo, hi), len(qb), repeats=5)
            r_def = rate(lambda: state.setdefault("def", in_hull(q, hull)), len(q))
            r_lp = rate(lambda: state.setdefault("lp", in_hull(q, hull, prefilters=False)), len(q))
            qp = q[:args.plain_queries]
            r_plain = rate(lambda: state.setdefault(
                "plain", [h.lp(p - h.centre, column_generation=False) for p in qp]), len(qp))
            r_nnls = rate(lambda: state.setdefault("nnls", in_hull(q, hull, method="nnls", prefilters=False)),
                          len(q))
            assert np.array_equal(state["def"], state["lp"]) and np.array_equal(state["lp"], state["nnls"])
            assert list(state["lp"][:len(qp)]) == state["plain"]
            # how many queries the prefilters leave to the LP
            qc = np.unique(q, axis=0) - h.centre
            st = np.full(len(qc), -1, dtype=np.int8)
            for name in ("box", "equal", "facets", "directions"):
                open_ = np.flatnonzero(st == -1)
                arg = qc[open_] + h.centre if name == "equal" else qc[open_]
                st[open_] = getattr(h, name)(arg)
            print(f"{d:>7} {n:>8} | {r_box:>11,.0f} {r_def:>9,.0f} {r_lp:>9,.1f} {r_plain:>9,.1f} {r_nnls:>9,.1f} "
                  f"| {np.mean(st == -1):>6.0%} {np.mean(state['lp']):>7.1%} {np.mean(in_box(q, lo, hi)):>7.1%}")


def acceptance(args: argparse.Namespace) -> None:
    print(f"\nfresh N(0, I) points inside the region of n = {args.points} N(0, I) points "
          f"({args.accept_queries} queries x {args.trials} trials)")
    head = (f"{'d_prime':>7} | {'in hull':>8} {'in box':>8} | {'vertices':>8} {'hull bytes':>10} {'box bytes':>9} "
            f"| {'seconds':>7}")
    print(head)
    print("-" * len(head))
    for d in (2, 4, 8, 16, 32):
        hull_rate, box_rate, verts, hb, bb = [], [], [], [], []
        t = time.perf_counter()
        for trial in range(args.trials):
            rng = np.random.default_rng([args.seed, d, trial])
            pts = rng.standard_normal((args.points, d)).astype(np.float32)   # codes from a float32 flow
            q = rng.standard_normal((args.accept_queries, d))
            hull, box = build_region(pts, None, kind="hull"), build_region(pts, None, kind="box")
            hull_rate.append(hull.contains(q).mean())
            box_rate.append(box.contains(q).mean())
            # the exact test against all points and against the vertices only agree
            assert np.array_equal(hull.contains(q[:50]), in_hull(q[:50], pts.astype(np.float64)))
            verts.append(len(hull.parts[0][1]))
            hb.append(hull.nbytes())
            bb.append(box.nbytes())
        print(f"{d:>7} | {np.mean(hull_rate):>8.1%} {np.mean(box_rate):>8.1%} | {np.mean(verts):>8.0f} "
              f"{np.mean(hb):>10,.0f} {np.mean(bb):>9,.0f} | {time.perf_counter() - t:>7.1f}")
    assert len(hull_vertices(np.eye(3))) == 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer queries and trials")
    ap.add_argument("--lp-queries", type=int, default=200, help="queries for the exact methods")
    ap.add_argument("--plain-queries", type=int, default=20, help="queries for the plain (full-size) LP")
    ap.add_argument("--box-queries", type=int, default=100000)
    ap.add_argument("--points", type=int, default=300, help="points per hull in the acceptance table")
    ap.add_argument("--accept-queries", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["throughput", "acceptance"], default=None)
    args = ap.parse_args()
    if args.quick:
        args.lp_queries, args.plain_queries, args.accept_queries, args.trials = 50, 5, 300, 1
    torch.set_num_threads(1)
    print(f"numpy {np.__version__}, scipy {scipy.__version__}, torch threads {torch.get_num_threads()}, "
          f"BLAS threads {os.environ['OMP_NUM_THREADS']}, {os.cpu_count()} CPUs")
    if args.only in (None, "throughput"):
        throughput(args)
    if args.only in (None, "acceptance"):
        acceptance(args)


if __name__ == "__main__":
    main()
