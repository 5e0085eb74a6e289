"""Exact convex-hull membership (PCFL Eq. 9-10, 12): LP, prefilters and NNLS against qhull's Delaunay test."""
import numpy as np
import pytest
import torch
from scipy.spatial import ConvexHull, Delaunay

from pflkit.core import ConfigError, payload_nbytes
from pflkit_pcfl.hull import (INSIDE, OUTSIDE, UNDECIDED, Region, _extreme_by_lp, _Hull, build_region,
                              hull_vertices, in_box, in_hull, in_unshared, kmeans)


def reference(points, hull, margin=1e-9):
    """Delaunay's answer, and a mask of the points farther than ``margin`` from the hull's boundary."""
    eq = ConvexHull(hull).equations
    s = np.max(points @ eq[:, :-1].T + eq[:, -1], axis=1)   # signed distance to the nearest facet plane
    return Delaunay(hull).find_simplex(points) >= 0, np.abs(s) > margin


@pytest.mark.parametrize("dim", [2, 3])
def test_lp_and_every_prefilter_agree_with_delaunay(dim):
    rng = np.random.default_rng(dim)
    hull = rng.standard_normal((40, dim))
    q = np.concatenate([rng.standard_normal((150, dim)) * 1.3, rng.uniform(-4, 4, (50, dim))])
    truth, clear = reference(q, hull)
    assert 0.2 < truth.mean() < 0.9 and clear.all()
    for method in ("lp", "nnls"):
        for prefilters in (True, False):
            got = in_hull(q, hull, method=method, prefilters=prefilters)
            assert np.array_equal(got, truth), (method, prefilters)
    # each prefilter alone: whatever it decides is right
    h = _Hull(np.unique(hull, axis=0), 1e-9)
    qc = q - h.centre
    decided = {"box": h.box(qc), "equal": h.equal(q), "facets": h.facets(qc), "directions": h.directions(qc)}
    for name, state in decided.items():
        sure = state != UNDECIDED
        assert np.array_equal(state[sure] == INSIDE, truth[sure]), name
    assert (decided["facets"] != UNDECIDED).all()            # exact 2-D/3-D facets decide random points
    assert (decided["box"] == OUTSIDE).any() and (decided["directions"] == OUTSIDE).sum() > (~truth).sum() // 2
    assert not (decided["directions"] == INSIDE).any()       # Frank-Wolfe only certifies outside


def test_lp_in_four_dims_and_column_generation():
    rng = np.random.default_rng(4)
    hull = rng.standard_normal((60, 4))
    q = rng.standard_normal((120, 4)) * 0.9
    truth, clear = reference(q, hull)
    assert clear.all() and 0.1 < truth.mean() < 0.9
    assert np.array_equal(in_hull(q, hull), truth)
    assert np.array_equal(in_hull(q, hull, prefilters=False), truth)
    h = _Hull(hull, 1e-9)
    facets = h.facets(q - h.centre)
    assert (facets != UNDECIDED).all() and np.array_equal(facets == INSIDE, truth)
    # a hull large enough for column generation answers as the full LP does
    big = rng.standard_normal((700, 6))
    h = _Hull(big, 1e-9)
    qs = rng.standard_normal((25, 6)) * 0.8
    cg = [h.lp(p - h.centre) for p in qs]
    full = [h.lp(p - h.centre, column_generation=False) for p in qs]
    assert cg == full and 0 < sum(cg) < len(cg)


def test_lp_value_decides_when_no_certificate_holds(monkeypatch):
    """The fallback for points within solver precision of distance tol: the tight full LP's optimal value."""
    rng = np.random.default_rng(13)
    hull = rng.standard_normal((30, 3))
    q = rng.standard_normal((40, 3)) * 1.2
    truth, clear = reference(q, hull)
    assert clear.all()
    monkeypatch.setattr(_Hull, "_residual", lambda self, *a: np.inf)
    monkeypatch.setattr(_Hull, "_lower_bound", lambda self, *a: -np.inf)
    assert np.array_equal(in_hull(q, hull, prefilters=False), truth)
    assert np.array_equal(in_hull(q, hull, method="nnls", prefilters=False), truth)


def test_nnls_agrees_with_lp_in_higher_dims():
    rng = np.random.default_rng(5)
    for dim, n in ((8, 150), (16, 200)):
        hull = rng.standard_normal((n, dim))
        q = np.concatenate([rng.standard_normal((40, dim)) * 0.6, hull[:5] * 0.999, hull[:5] * 1.001])
        lp = in_hull(q, hull, prefilters=False)
        assert np.array_equal(in_hull(q, hull, method="nnls", prefilters=False), lp)
        assert np.array_equal(in_hull(q, hull), lp)
        assert lp.any() and not lp.all()


def test_boundary_and_tolerance():
    square = np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    pts = np.array([[0.0, 0.0], [0.5, 0.0], [1.0, 0.7], [0.5, -1e-6], [0.5, 1e-6], [1 + 1e-12, 0.5],
                    [0.5, 1 + 1e-7], [-3.0, 0.5]])
    want = np.array([True, True, True, False, True, True, False, False])
    for method in ("lp", "nnls"):
        for prefilters in (True, False):
            assert np.array_equal(in_hull(pts, square, method=method, prefilters=prefilters), want)
    # tol is an L1 distance, scaled by the coordinates' magnitude
    assert in_hull(np.array([[0.5, -1e-4]]), square, tol=1e-3)[0]
    assert np.array_equal(in_hull(pts * 1e6, square * 1e6), want)


def test_points_of_the_set_are_inside_far_points_outside():
    rng = np.random.default_rng(6)
    for dim in (1, 2, 3, 5, 12):
        pts = rng.standard_normal((30, dim))
        assert in_hull(pts, pts).all()
        assert in_hull(pts, pts, prefilters=False).all()
        assert not in_hull(pts * 50 + 100, pts).any()
        assert in_hull(pts.mean(axis=0, keepdims=True), pts).all()


def test_near_facet_points_match_the_pure_lp():
    """Points 1e-7 .. 1e-3 either side of qhull's facets: the facet prefilter (with its guard band) stays exact."""
    rng = np.random.default_rng(7)
    hull = rng.standard_normal((30, 3))
    ch = ConvexHull(hull)
    q = []
    for f, eq in zip(ch.simplices[:20], ch.equations[:20]):
        centre = hull[f].mean(axis=0)
        for off in (1e-3, 1e-5, 1e-7, -1e-7, -1e-5):
            q.append(centre + off * eq[:3])
    q = np.array(q)
    truth = np.array([np.dot(eq[:3], p) + eq[3] <= 0 for p, eq in zip(q, np.repeat(ch.equations[:20], 5, 0))])
    assert np.array_equal(in_hull(q, hull), truth)
    assert np.array_equal(in_hull(q, hull, prefilters=False), truth)


def test_degenerate_hulls():
    # duplicates
    tri = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    dup = np.concatenate([tri, tri, tri[:1]])
    pts = np.array([[0.5, 0.5], [1.0, 1.0], [1.0, 1.0 + 1e-6], [-0.1, 0.0]])
    assert np.array_equal(in_hull(pts, dup), [True, True, False, False])
    assert np.array_equal(hull_vertices(dup), tri)
    # collinear points in 2-D: a segment (qhull cannot triangulate it; the LP answers)
    seg = np.array([[0.0, 0.0], [1.0, 1.0], [0.25, 0.25], [3.0, 3.0]])
    q = np.array([[2.0, 2.0], [0.5, 0.5], [2.0, 2.0 + 1e-6], [3.5, 3.5], [-1e-3, -1e-3], [1.5, 1.0]])
    want = [True, True, False, False, False, False]
    for method in ("lp", "nnls"):
        for prefilters in (True, False):
            assert np.array_equal(in_hull(q, seg, method=method, prefilters=prefilters), want)
    assert np.array_equal(hull_vertices(seg), [[0.0, 0.0], [3.0, 3.0]])
    # a square in a plane of R^3
    sq = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [0.5, 0.5, 0]], dtype=float)
    q3 = np.array([[0.3, 0.6, 0.0], [0.3, 0.6, 1e-6], [1.2, 0.5, 0.0]])
    assert np.array_equal(in_hull(q3, sq), [True, False, False])
    assert len(hull_vertices(sq)) == 4
    # one point, and a 1-D hull (an interval)
    assert np.array_equal(in_hull(np.array([[1.0, 2.0], [1.0, 2.1]]), np.array([[1.0, 2.0]])), [True, False])
    assert np.array_equal(in_hull(np.array([[0.5], [2.5], [-1.0]]), np.array([[0.0], [2.0], [1.0]])),
                          [True, False, False])


def test_hull_vertices_qhull_and_lp_paths_agree():
    rng = np.random.default_rng(8)
    for dim in (2, 3, 4):
        pts = rng.standard_normal((120, dim))
        qh = np.sort(ConvexHull(pts).vertices)
        assert np.array_equal(np.flatnonzero(_extreme_by_lp(pts, 1e-9)), qh)
        assert np.array_equal(hull_vertices(pts), pts[qh])
    # LP path (d' = 9): the vertices generate the set, and none lies in the hull of the others
    pts = rng.standard_normal((60, 9))
    v = hull_vertices(pts)
    assert 10 <= len(v) < 60
    assert in_hull(pts, v).all()
    for i in range(0, len(v), 7):
        assert not in_hull(v[i:i + 1], np.delete(v, i, axis=0))[0]
    # fewer points than d'+1 in general position: every point is extreme
    few = rng.standard_normal((6, 10))
    assert np.array_equal(hull_vertices(few), few)


def test_in_box_and_closure_rate():
    lo, hi = np.array([0.0, -1.0]), np.array([2.0, 1.0])
    pts = np.array([[0.0, -1.0], [1.0, 0.0], [2.0, 1.0 + 1e-12], [-1e-9, 0.0]])
    assert np.array_equal(in_box(pts, lo, hi), [True, True, False, False])
    codes = np.array([[0.0, -1.0], [2.0, -1.0], [0.0, 1.0]])
    box = build_region(codes, None, kind="box")
    assert np.array_equal(box.contains(pts), [True, True, False, False])
    # the authors' closure_rate: [min + (max-min)(1-r)/2, max - (max-min)(1-r)/2]
    shrunk = build_region(codes, None, kind="box", closure_rate=0.5)
    lo2, hi2 = shrunk.parts[0][1]
    assert np.allclose(lo2, [0.5, -0.5]) and np.allclose(hi2, [1.5, 0.5])
    assert np.array_equal(shrunk.contains(np.array([[0.6, 0.4], [0.4, 0.0]])), [True, False])
    # the box accepts the corners a triangle's hull leaves out
    hull = build_region(codes, None, kind="hull")
    corner = np.array([[1.9, 0.9]])
    assert box.contains(corner)[0] and not hull.contains(corner)[0]
    # a hull scales the same way about its box centre
    small = build_region(codes, None, kind="hull", closure_rate=0.5)
    assert sorted(map(tuple, small.parts[0][1].tolist())) == [(0.5, -0.5), (0.5, 0.5), (1.5, -0.5)]
    assert np.array_equal(small.contains(np.array([[0.1, -0.9], [0.7, -0.2]])), [False, True])
    with pytest.raises(ConfigError, match="closure_rate"):
        build_region(codes, None, kind="box", closure_rate=0.0)


def _two_label_codes(rng):
    a = rng.standard_normal((40, 2)) * 0.3 + [2.0, 0.0]
    b = rng.standard_normal((40, 2)) * 0.3 + [-2.0, 0.0]
    return np.concatenate([a, b]), np.array([0] * 40 + [1] * 40)


def test_region_per_label_semantics():
    rng = np.random.default_rng(9)
    codes, labels = _two_label_codes(rng)
    region = build_region(codes, labels, kind="hull")
    assert region.labels == [0, 1] and region.dim == 2
    pts = np.array([[2.0, 0.0], [2.0, 0.0], [-2.0, 0.0], [0.0, 0.0]])
    assert np.array_equal(region.contains(pts, np.array([0, 1, 1, 0])), [True, False, True, False])
    assert np.array_equal(region.contains(pts), [True, True, True, False])   # labels=None: any part
    assert np.array_equal(region.contains(pts, torch.tensor([1, 0, 0, 1])), [False, True, False, False])
    assert np.array_equal(region.contains(pts, [5, 5, 5, 5]), [False] * 4)  # a label the client lacks
    # clustering: one label, two blobs; the gap between them is inside the single hull, outside the two
    blobs = codes.copy()
    one = np.zeros(80, dtype=int)
    gap = np.array([[0.0, 0.0]])
    assert build_region(blobs, one, clusters=0).contains(gap, [0])[0]
    clustered = build_region(blobs, one, clusters=2, seed=3)
    assert len(clustered.parts) == 2 and not clustered.contains(gap, [0])[0]
    assert clustered.contains(blobs, one).all()
    again = build_region(blobs, one, clusters=2, seed=3)
    assert all(np.array_equal(x[1], y[1]) for x, y in zip(clustered.parts, again.parts))
    # the unshared region (Eq. 12): mine minus everyone else's
    other = build_region(codes[:40] + [0.3, 0.0], None, kind="hull")
    mine = build_region(codes[:40], None, kind="hull")
    q = np.array([[1.5, 0.0], [2.3, 0.0], [5.0, 0.0]])
    assert np.array_equal(in_unshared(q, mine, [other]), [True, False, False])


def test_kmeans_separates_blobs_deterministically():
    rng = np.random.default_rng(10)
    x = np.concatenate([rng.standard_normal((30, 3)) + 10, rng.standard_normal((20, 3)) - 10])
    a = kmeans(x, 2, seed=1)
    assert np.array_equal(a, [0] * 30 + [1] * 20)
    assert np.array_equal(kmeans(x, 5, seed=2), kmeans(x, 5, seed=2))
    assert np.array_equal(kmeans(np.ones((4, 2)), 3, seed=0), [0, 0, 0, 0])


def test_payload_round_trip():
    rng = np.random.default_rng(11)
    codes, labels = _two_label_codes(rng)
    q = rng.standard_normal((50, 2)) * 2
    ql = rng.integers(0, 2, 50)
    for kind in ("hull", "box"):
        for c in (codes, codes.astype(np.float32)):
            region = build_region(c, labels, kind=kind)
            payload = region.to_payload()
            assert set(payload) == {"kind", "dim", "tol", "labelled", "labels", "parts"}
            assert all(isinstance(t, torch.Tensor) for t in payload["parts"])
            want = torch.float32 if c.dtype == np.float32 else torch.float64
            assert all(t.dtype == want for t in payload["parts"])   # float32 only when exact
            back = Region.from_payload(payload)
            assert back.kind == kind and back.labels == [0, 1]
            assert np.array_equal(back.contains(q, ql), region.contains(q, ql))
            assert region.nbytes() == payload_nbytes(payload)
    hull = build_region(codes, labels, kind="hull")
    box = build_region(codes, labels, kind="box")
    assert box.nbytes() < hull.nbytes()
    assert sum(len(v) for _, v in hull.parts) < len(codes)   # only the extreme points travel
    unlabelled = build_region(codes, None, kind="hull")
    back = Region.from_payload(unlabelled.to_payload())
    assert back.parts[0][0] is None and np.array_equal(back.contains(q, ql), unlabelled.contains(q))


def test_too_few_points_for_a_hull_is_a_config_error():
    rng = np.random.default_rng(12)
    codes = rng.standard_normal((30, 4))
    labels = np.array([0] * 26 + [1] * 4)     # label 1: 4 codes < d'+1 = 5
    with pytest.raises(ConfigError, match=r"label 1 has 4 distinct .* d'\+1 = 5.*trainer\.overlap=box"):
        build_region(codes, labels, kind="hull")
    build_region(codes, labels, kind="box")    # boxes need no minimum
    dup = np.repeat(codes[:3], 5, axis=0)      # 15 codes but only 3 distinct
    with pytest.raises(ConfigError, match="cannot be full-dimensional"):
        build_region(dup, None, kind="hull")
    with pytest.raises(ConfigError, match="clustering off"):
        build_region(codes[:12], None, kind="hull", clusters=4)
    with pytest.raises(ConfigError, match="overlap"):
        build_region(codes, labels, kind="sphere")
    with pytest.raises(ConfigError, match="clusters"):
        build_region(codes, labels, clusters=-1)
