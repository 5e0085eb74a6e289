"""PCFL's manifold flow (pflkit_pcfl.flow): exact inverses, change of variables, the two-phase losses of
Algorithm 1, data layout, bad input, and a short training run."""
import math

import pytest
import torch

pytest.importorskip("zuko")

from pflkit.core import ConfigError, DataError, classification, regression  # noqa: E402
from pflkit_pcfl.flow import ManifoldFlow, _LULinear, flow_data, split_flow_data  # noqa: E402

VARIANTS = [  # (outer_coupling, inner_coupling, mixing)
    ("affine", "spline", "auto"), ("spline", "affine", "permutation"), ("affine", "affine", "none")]


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make(d=5, dp=2, classes=0, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("hidden", 16)
    return ManifoldFlow(d, dp, num_classes=classes, **kw).to(dtype)


def labels(n, classes, seed=1):
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed)) if classes else None


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,dp", [(3, 3), (3, 4), (3, 0), (3, -1), (5, 2.0)])
def test_latent_dim_out_of_range_is_a_config_error(d, dp):
    with pytest.raises(ConfigError) as e:
        ManifoldFlow(d, dp)
    msg = str(e.value)
    assert "latent_dim" in msg and "\n" not in msg


@pytest.mark.parametrize("kw", [{"outer_coupling": "cubic"}, {"inner_coupling": "x"}, {"mixing": "rotation"},
                                {"outer_transforms": 0}, {"hidden": 0}, {"num_classes": -1}])
def test_bad_options_are_config_errors(kw):
    with pytest.raises(ConfigError):
        ManifoldFlow(4, 2, **kw)


def test_labels_are_required_in_range_and_refused_when_unconditional():
    flow, z = make(classes=3), torch.randn(4, 5)
    with pytest.raises(ValueError):
        flow.encode(z)
    with pytest.raises(DataError):
        flow.encode(z, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError):
        make().encode(z, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError):
        make().encode(torch.randn(4, 6))


# -- exact inverses ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
@pytest.mark.parametrize("classes", [0, 3])
@pytest.mark.parametrize("outer_c,inner_c,mixing", VARIANTS)
def test_encode_decode_are_exact_inverses_on_the_manifold(dtype, tol, classes, outer_c, inner_c, mixing):
    flow = make(d=5, dp=2, classes=classes, dtype=dtype, outer_coupling=outer_c, inner_coupling=inner_c,
                mixing=mixing)
    n = 32
    z = torch.randn(n, 5, dtype=dtype, generator=torch.Generator().manual_seed(2))
    y = labels(n, classes)
    with torch.no_grad():
        assert torch.allclose(flow.outer_inverse(flow.outer(z, y), y), z, atol=tol, rtol=tol)
        u = flow.encode(z, y)
        assert u.shape == (n, 2) and u.dtype == dtype
        proj = flow.project(z, y)
        assert torch.allclose(flow.decode(u, y), proj, atol=tol, rtol=tol)
        # a generic point is not on the manifold: the projection moves it
        assert (proj - z).norm(dim=1).min() > 1e-3
        u_prime = flow.sample_base(n, torch.Generator().manual_seed(3))
        z_on = flow.decode(u_prime, y)
        assert torch.allclose(flow.encode(z_on, y), u_prime, atol=tol, rtol=tol)
        # decoded points lie on the manifold: projecting them changes nothing, their orthogonal coordinates are 0
        assert torch.allclose(flow.project(z_on, y), z_on, atol=tol, rtol=tol)
        assert flow.outer(z_on, y)[:, 2:].abs().max() < tol
        assert flow.reconstruction_loss(z_on, y) < 10 * tol


def test_one_dimensional_manifold_and_large_data_dim_round_trip():
    flow = make(d=3, dp=1, classes=2, dtype=torch.float64)
    y = labels(8, 2)
    u = flow.sample_base(8, torch.Generator().manual_seed(0))
    assert torch.allclose(flow.encode(flow.decode(u, y), y), u, atol=1e-10)
    # image-sized data: 'auto' mixing switches to permutations, both directions stay one pass per layer
    big = make(d=2048, dp=16, classes=10, hidden=8)
    assert not any(isinstance(m, _LULinear) for m in big.g.modules())
    assert any(isinstance(m, _LULinear) for m in big.h.modules())
    y = labels(4, 10)
    with torch.no_grad():
        u = big.sample_base(4, torch.Generator().manual_seed(0))
        z = big.decode(u, y)
        assert z.shape == (4, 2048)
        assert torch.allclose(big.encode(z, y), u, atol=1e-3)


def test_context_changes_the_chart_and_architecture_is_seed_independent():
    a, b = make(classes=3, seed=0), make(classes=3, seed=1)
    z = torch.randn(6, 5)
    with torch.no_grad():
        assert not torch.allclose(a.encode(z, torch.zeros(6, dtype=torch.long)),
                                  a.encode(z, torch.ones(6, dtype=torch.long)))
    # permutations come from a fixed seed (identical on every client) and are not state
    def orders(f):
        return [m.order for m in f.modules() if isinstance(getattr(m, "order", None), torch.Tensor)]

    assert orders(a) and all(torch.equal(p, q) for p, q in zip(orders(a), orders(b)))
    assert not any(k.endswith(".order") for k in a.state_dict())
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert torch.equal(a.encode(z, torch.zeros(6, dtype=torch.long)), b.encode(z, torch.zeros(6, dtype=torch.long)))


# -- change of variables -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("classes", [0, 4])
@pytest.mark.parametrize("inner_c", ["spline", "affine"])
def test_inner_log_prob_matches_autograd_change_of_variables(dp, classes, inner_c):
    flow = make(d=dp + 2, dp=dp, classes=classes, dtype=torch.float64, inner_coupling=inner_c)
    n = 6
    u = 1.5 * torch.randn(n, dp, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y = labels(n, classes)
    got = flow.inner_log_prob(u, y)
    assert got.shape == (n,)
    base = torch.distributions.MultivariateNormal(torch.zeros(dp, dtype=torch.float64),
                                                  torch.eye(dp, dtype=torch.float64))
    for i in range(n):
        yi = None if y is None else y[i:i + 1]
        h = lambda v: flow.inner(v[None], yi)[0]  # noqa: E731
        jac = torch.autograd.functional.jacobian(h, u[i])
        want = base.log_prob(h(u[i])) + torch.linalg.slogdet(jac).logabsdet
        assert torch.allclose(got[i], want, atol=1e-9), (i, got[i].item(), want.item())


def test_nll_loss_is_minus_mean_inner_log_prob_of_the_manifold_coordinates():
    flow = make(classes=3, dtype=torch.float64)
    z, y = torch.randn(10, 5, dtype=torch.float64), labels(10, 3)
    u = flow.outer(z, y)[:, :2]
    assert torch.allclose(flow.nll_loss(z, y), -flow.inner_log_prob(u, y).mean())


# -- Algorithm 1: the two phases touch disjoint parameters ---------------------------------------------------
def test_reconstruction_loss_is_mean_euclidean_projection_error():
    flow = make(dtype=torch.float64)
    z = torch.randn(12, 5, dtype=torch.float64)
    e = flow.outer(z)
    back = flow.outer_inverse(torch.cat([e[:, :2], torch.zeros(12, 3, dtype=torch.float64)], 1))
    assert torch.allclose(flow.reconstruction_loss(z), (z - back).norm(dim=1).mean())
    assert torch.allclose(flow.reconstruction_loss(z, kind="mse"), (z - back).square().mean())
    with pytest.raises(ConfigError):
        flow.reconstruction_loss(z, kind="l1")


def _grads(params):
    return [p.grad for p in params]


@pytest.mark.parametrize("classes", [0, 3])
def test_phase_losses_reach_only_their_own_parameters(classes):
    flow = make(classes=classes)
    z, y = torch.randn(16, 5), labels(16, classes)
    assert set(map(id, flow.outer_parameters())).isdisjoint(map(id, flow.inner_parameters()))
    assert len(flow.outer_parameters()) + len(flow.inner_parameters()) == len(list(flow.parameters()))

    flow.reconstruction_loss(z, y).backward()
    assert all(g is None for g in _grads(flow.inner_parameters()))
    assert any(g is not None and g.abs().sum() > 0 for g in _grads(flow.outer_parameters()))
    flow.zero_grad(set_to_none=True)

    flow.nll_loss(z, y).backward()
    assert all(g is None for g in _grads(flow.outer_parameters()))
    assert all(g is not None for g in _grads(flow.inner_parameters()))
    assert any(g.abs().sum() > 0 for g in _grads(flow.inner_parameters()))


def test_sample_base_is_seeded_and_follows_the_flow_dtype():
    flow = make(dp=3, dtype=torch.float64)
    a = flow.sample_base(5, torch.Generator().manual_seed(7))
    b = flow.sample_base(5, torch.Generator().manual_seed(7))
    assert a.shape == (5, 3) and a.dtype == torch.float64 and torch.equal(a, b)
    assert not torch.equal(a, flow.sample_base(5, torch.Generator().manual_seed(8)))


# -- data layout ---------------------------------------------------------------------------------------------
def test_flow_data_sine_task_is_x_zero_y_and_splits_back():
    x = torch.tensor([[0.5], [2.0], [4.0]])
    y = torch.tensor([[0.48], [0.9], [-0.75]])
    z, ctx = flow_data(x, y, regression(1))
    assert ctx is None
    assert torch.equal(z, torch.tensor([[0.5, 0.0, 0.48], [2.0, 0.0, 0.9], [4.0, 0.0, -0.75]]))
    x2, y2 = split_flow_data(z, regression(1), (1,))
    assert torch.equal(x2, x) and torch.equal(y2, y)
    z0, _ = flow_data(x, y, regression(1), pad=0)
    assert z0.shape == (3, 2)
    with pytest.raises(ConfigError):
        flow_data(x, y, regression(1), pad=-1)
    with pytest.raises(ValueError):
        split_flow_data(torch.zeros(3, 1), regression(1), (1,))


def test_flow_data_classification_flattens_and_keeps_labels_as_context():
    x = torch.randint(0, 255, (4, 1, 3, 3), dtype=torch.uint8)
    y = torch.tensor([0, 2, 1, 2])
    z, ctx = flow_data(x, y, classification(3))
    assert z.shape == (4, 9) and z.is_floating_point() and torch.equal(ctx, y)
    assert torch.equal(z, x.reshape(4, 9).float())
    x2, y2 = split_flow_data(z, classification(3), (1, 3, 3))
    assert y2 is None and torch.equal(x2, x.float())


def test_sine_data_decodes_back_to_x_and_y():
    flow = make(d=3, dp=2, dtype=torch.float64)
    u = flow.sample_base(5, torch.Generator().manual_seed(0))
    x, y = split_flow_data(flow.decode(u), regression(1), (1,))
    assert x.shape == (5, 1) and y.shape == (5, 1)
    z, _ = flow_data(x, y, regression(1))
    # x and y are the first and last coordinates; flow_data puts them back around a zero pad (an untrained chart's
    # decoded pad coordinate is not 0 -- phase 1 of Algorithm 1 is what makes it so)
    assert torch.equal(flow.decode(u)[:, [0, 2]], z[:, [0, 2]]) and torch.equal(z[:, 1], torch.zeros(5, dtype=z.dtype))


# -- a short run of Algorithm 1 ------------------------------------------------------------------------------
RING_ROT = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(5)))[0]
RING_SHIFT = torch.tensor([0.5, -0.3, 0.2])


def _ring_in_3d(n, gen):
    """Points near a circle (radius 1, noise 0.05) in a tilted plane of R^3: a 2-D manifold suffices."""
    t = torch.rand(n, generator=gen) * 2 * math.pi
    r = 1 + 0.05 * torch.randn(n, generator=gen)
    p = torch.stack([r * torch.cos(t), r * torch.sin(t), torch.zeros(n)], 1)
    return p @ RING_ROT.T + RING_SHIFT


STEPS, STEP_LR = 100, 5e-3


def test_two_phase_training_fits_the_manifold_then_the_density():
    gen = torch.Generator().manual_seed(0)
    z = _ring_in_3d(300, gen)
    flow = make(d=3, dp=2, hidden=32, outer_transforms=3, inner_transforms=3)
    with torch.no_grad():
        rec0, nll0 = flow.reconstruction_loss(z).item(), flow.nll_loss(z).item()
    for phase, (params, loss) in enumerate(((flow.outer_parameters(), flow.reconstruction_loss),
                                            (flow.inner_parameters(), flow.nll_loss))):
        opt = torch.optim.Adam(params, lr=STEP_LR)
        for _ in range(STEPS):
            idx = torch.randint(0, len(z), (64,), generator=gen)
            opt.zero_grad()
            loss(z[idx]).backward()
            opt.step()
        if phase == 0:
            with torch.no_grad():
                rec1, nll_mid = flow.reconstruction_loss(z).item(), flow.nll_loss(z).item()
    with torch.no_grad():
        nll1 = flow.nll_loss(z).item()
        # decoded samples land near the ring: distance to the plane and to the circle
        s = flow.decode(flow.sample_base(200, torch.Generator().manual_seed(1)))
    print(f"reconstruction {rec0:.3f} -> {rec1:.4f}; nll {nll0:.3f} -> {nll_mid:.3f} -> {nll1:.3f}")
    assert rec1 < 0.1 * rec0, (rec0, rec1)
    assert nll1 < nll_mid - 1.0, (nll_mid, nll1)
    assert torch.isfinite(torch.tensor([rec0, nll0])).all()
    local = (s - RING_SHIFT) @ RING_ROT  # back to the ring's own frame
    assert local[:, 2].abs().median() < 0.05
    assert (local[:, :2].norm(dim=1) - 1).abs().median() < 0.3
