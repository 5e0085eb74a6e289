"""PCFL's manifold flow (Eq. 7-8; Brehmer & Cranmer, "Flows for simultaneous manifold learning and density
estimation", NeurIPS 2020), built on zuko.

The data manifold is charted by two bijections (paper section 4.3):

- the *outer* flow ``g`` on R^d, ``e = g(z)`` (Eq. 7); the first d' coordinates of ``e`` are the manifold
  coordinates ``u = Split(e)``, the remaining d - d' coordinates are those orthogonal to the manifold, which are 0
  on it (``Pad`` writes them back as zeros);
- the *inner* flow ``h`` on R^d', ``u' = h(u)`` (Eq. 8), with a standard normal base density for ``u'``.

Encoder ``h o Split o g``, decoder ``g^-1 o Pad o h^-1`` (the paper's ``g*`` and ``g*^-1``); ``project`` =
``g^-1 o Pad o Split o g`` maps any point onto the learned manifold. Training is the two phases of the paper's
Algorithm 1: ``reconstruction_loss`` (line 6) fits only ``g``; ``nll_loss`` (line 9) fits only ``h`` on the
fixed manifold coordinates. Classification labels are the conditioning context of both flows (one-hot), as in
the authors' code; regression data is modelled unconditionally with ``y`` inside ``z`` (``flow_data``).

Flow family and why. Generating synthetic samples runs ``decode`` (the inverse of ``g``) and encoding runs ``g``,
so both directions must be cheap even for d in the thousands: every layer is a *coupling* layer
(``zuko.flows.GeneralCouplingTransform``: half of the coordinates condition an MLP that transforms the other
half), so each direction costs one network evaluation per layer. Fully autoregressive flows (zuko's MAF/NSF with
default ``passes``) would need d sequential passes to invert. Couplings alternate between even and odd
coordinates; between them a mixing layer lets every coordinate interact with every other, as in
Brehmer & Cranmer's vector architecture (and the authors' code): ``mixing='lu'`` is a random permutation followed
by an LU-decomposed linear map initialised at the identity (d^2 parameters); ``mixing='permutation'`` only the
permutation (free); ``'auto'`` (default) takes 'lu' for flows of at most 256 features and 'permutation' above:
an LU layer has d^2 parameters, ~8x a coupling network's at d = 784 (FEMNIST) and ~10^7 at d = 3072 (CIFAR-10),
and every parameter of the flow crosses the network in Algorithm 1. Permutations are drawn from
a fixed seed, so every client builds the identical architecture, and they are not part of ``state_dict``.
Coupling transforms: the outer flow defaults to affine couplings (``outer_coupling='affine'``: RealNVP, the
authors' ``coupling_type`` default, valid on all of R, cheapest for large d; it only has to learn the chart, not a
density), the inner flow to monotonic rational-quadratic splines (``inner_coupling='spline'``: Brehmer & Cranmer's
choice; d' is small, and the density of u' is what synthetic samples are drawn from). On the paper's sine task
(4,800 points, 1,500 Adam steps per phase, one seed) spline inner couplings put decoded samples at a median
distance 0.07 from the nearest true curve (the label noise alone gives 0.067), affine ones at 0.18. Splines act
on [-10, 10] (the authors' ``splinerange``) and are the identity outside; either coupling is available for either
flow.

Written here rather than taken from zuko: ``Split``/``Pad``; the LU layer (with a positive, softplus-parametrised
diagonal so it stays invertible, and O(d^2) per sample in both directions instead of zuko's L @ U product); the
fixed-seed permutation; the two-phase losses; and the wrapper exposing encoder, decoder and projection.

Known deviation: for images the authors use a multi-scale convolutional outer flow; this module works on
flattened vectors for every data type.

Readings. Algorithm 1 line 6 prints ``||z - g^-1(g(z))||``, which is identically 0 for a bijection; the M-flow
loss it stands for is the projection error ``||z - g^-1(Pad(Split(g(z))))||`` (mean over the batch of the
Euclidean norm, the default); the authors' code uses the mean squared error instead (``kind='mse'``; they weight it
by 1000 and add ``0.01 * latent_l2``). Line 9 prints ``log p(u') - log det J_h``; with J_h the Jacobian of h at
u this has the wrong sign for a density of u, so ``inner_log_prob`` uses the change of variables
``log N(h(u)) + log|det dh/du|`` (the printed form is correct if J_h is read as the Jacobian of h^-1 at u').
"""
from __future__ import annotations

import math
from functools import partial
from math import prod
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Transform, constraints
from zuko.flows import ElementWiseTransform, GeneralCouplingTransform, LazyTransform
from zuko.transforms import ComposedTransform, MonotonicAffineTransform, MonotonicRQSTransform, \
    PermutationTransform

from pflkit.core import ConfigError, DataError, Task

COUPLINGS = ("affine", "spline")
MIXINGS = ("auto", "lu", "permutation", "none")
SPLINE_BOUND = 10.0  # splines act on [-B, B] and are the identity outside (the authors' code: 10)
LU_MAX_FEATURES = 256  # mixing='auto' uses LU layers up to this many features (d^2 parameters each)
_PERMUTATION_SEED = 20230501  # fixed, so every client builds the same architecture


# ------------------------------------------------------------------------------------------------ building blocks
class _LUTransform(Transform):
    """``y = L U x`` with L lower triangular (positive diagonal) and U unit upper triangular."""

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(self, lower: torch.Tensor, upper: torch.Tensor, log_diag: torch.Tensor) -> None:
        super().__init__()
        self.lower, self.upper, self.log_diag = lower, upper, log_diag

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        # two matrix-vector products, never the d x d x d product L @ U
        return (x @ self.upper.T) @ self.lower.T

    def _inverse(self, y: torch.Tensor) -> torch.Tensor:
        shape = y.shape
        rhs = y.reshape(-1, shape[-1]).T
        v = torch.linalg.solve_triangular(self.lower, rhs, upper=False)
        x = torch.linalg.solve_triangular(self.upper, v, upper=True, unitriangular=True)
        return x.T.reshape(shape)

    def log_abs_det_jacobian(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.log_diag.sum().expand(x.shape[:-1])


class _LULinear(LazyTransform):
    """Learned invertible linear layer, LU-parametrised and initialised at the identity."""

    def __init__(self, features: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(features, features))  # strict lower part -> L, strict upper -> U
        # softplus(raw) + eps = 1 at initialisation
        self.raw_diag = nn.Parameter(torch.full((features,), math.log(math.expm1(1.0 - eps))))

    def forward(self, c: Optional[torch.Tensor] = None) -> Transform:
        diag = F.softplus(self.raw_diag) + self.eps  # positive: the map can never become singular
        eye = torch.eye(self.weight.shape[0], dtype=self.weight.dtype, device=self.weight.device)
        lower = torch.tril(self.weight, -1) + torch.diag(diag)
        upper = torch.triu(self.weight, 1) + eye
        return _LUTransform(lower, upper, diag.log())


class _Permutation(LazyTransform):
    """A fixed permutation of the coordinates (a non-persistent buffer: rebuilt identically from the seed)."""

    def __init__(self, order: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("order", order, persistent=False)

    def forward(self, c: Optional[torch.Tensor] = None) -> Transform:
        return PermutationTransform(self.order)


class _Chain(LazyTransform):
    """Composition of lazy transforms, first to last, sharing one context."""

    def __init__(self, steps: Sequence[LazyTransform]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)

    def forward(self, c: Optional[torch.Tensor] = None) -> Transform:
        return ComposedTransform(*(t(c) for t in self.steps))


def _build_flow(features: int, context: int, transforms: int, hidden: int, coupling: str, mixing: str,
                bins: int, seed: int) -> _Chain:
    """``transforms`` x [mixing, coupling] + a final mixing layer (the layout of Brehmer & Cranmer's vector flows)."""
    if mixing == "auto":
        mixing = "lu" if features <= LU_MAX_FEATURES else "permutation"
    if coupling == "affine":
        univariate, shapes = MonotonicAffineTransform, [(), ()]
    else:
        univariate = partial(MonotonicRQSTransform, bound=SPLINE_BOUND, slope=1e-3)
        shapes = [(bins,), (bins,), (bins - 1,)]
    gen = torch.Generator().manual_seed(seed)

    def mix() -> List[LazyTransform]:
        if mixing == "none" or features == 1:
            return []
        out: List[LazyTransform] = [_Permutation(torch.randperm(features, generator=gen))]
        return out + [_LULinear(features)] if mixing == "lu" else out

    steps: List[LazyTransform] = []
    for k in range(transforms):
        steps += mix()
        if features == 1:  # nothing to couple with: an element-wise transform (conditioned on the context)
            steps.append(ElementWiseTransform(1, context, univariate=univariate, shapes=shapes,
                                              hidden_features=(hidden, hidden)))
        else:  # alternating checkered masks: every coordinate is transformed every other layer
            mask = torch.arange(features) % 2 == k % 2
            steps.append(GeneralCouplingTransform(features, context, mask=mask, univariate=univariate,
                                                  shapes=shapes, hidden_features=(hidden, hidden)))
    steps += mix()
    return _Chain(steps)


def _standard_normal_log_prob(x: torch.Tensor) -> torch.Tensor:
    return -0.5 * (x.square().sum(-1) + x.shape[-1] * math.log(2 * math.pi))


# ------------------------------------------------------------------------------------------------ the manifold flow
class ManifoldFlow(nn.Module):
    """M-flow ``z = g^-1(Pad(h^-1(u')))`` with outer flow g on R^d and inner flow h on R^d' (Eq. 7-8).

    ``num_classes > 0``: labels ``y`` (class indices) are the conditioning context of both flows (one-hot);
    ``num_classes = 0``: unconditional (regression/tabular: ``y`` is part of ``z``, see ``flow_data``).
    ``outer_coupling``/``inner_coupling`` ('affine' | 'spline'), ``mixing`` ('auto' | 'lu' | 'permutation' |
    'none') and ``bins`` (spline bins) choose the layers (module docstring); ``hidden`` is the width of the two
    hidden layers of every coupling network.
    """

    def __init__(self, data_dim: int, latent_dim: int, num_classes: int = 0, outer_transforms: int = 4,
                 inner_transforms: int = 4, hidden: int = 64, outer_coupling: str = "affine",
                 inner_coupling: str = "spline", mixing: str = "auto", bins: int = 8) -> None:
        super().__init__()
        for key, value, low in (("data_dim", data_dim, 2), ("num_classes", num_classes, 0),
                                ("outer_transforms", outer_transforms, 1), ("inner_transforms", inner_transforms, 1),
                                ("hidden", hidden, 1), ("bins", bins, 2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")
        if isinstance(latent_dim, bool) or not isinstance(latent_dim, int) or not 0 < latent_dim < data_dim:
            raise ConfigError(f"latent_dim must be an integer with 0 < latent_dim < data_dim = {data_dim} "
                              f"(the manifold is lower-dimensional than the data), got {latent_dim!r}")
        for key, value in (("outer_coupling", outer_coupling), ("inner_coupling", inner_coupling)):
            if value not in COUPLINGS:
                raise ConfigError(f"{key} must be one of {', '.join(COUPLINGS)}, got {value!r}")
        if mixing not in MIXINGS:
            raise ConfigError(f"mixing must be one of {', '.join(MIXINGS)}, got {mixing!r}")
        self.data_dim, self.latent_dim, self.num_classes = data_dim, latent_dim, num_classes
        self.g = _build_flow(data_dim, num_classes, outer_transforms, hidden, outer_coupling, mixing, bins,
                             _PERMUTATION_SEED)
        self.h = _build_flow(latent_dim, num_classes, inner_transforms, hidden, inner_coupling, mixing, bins,
                             _PERMUTATION_SEED + 1)

    # -- context, Split, Pad ---------------------------------------------------------------------------------
    def _context(self, y: Optional[torch.Tensor], ref: torch.Tensor) -> Optional[torch.Tensor]:
        if self.num_classes == 0:
            if y is not None:
                raise ValueError("this ManifoldFlow is unconditional (num_classes=0): pass y=None")
            return None
        if y is None:
            raise ValueError(f"this ManifoldFlow is conditioned on {self.num_classes} classes: pass the labels y")
        y = y.reshape(-1).long()
        if len(y) != len(ref):
            raise ValueError(f"{len(y)} labels for {len(ref)} points")
        if len(y) and bool(((y < 0) | (y >= self.num_classes)).any()):
            raise DataError(f"labels must lie in [0, {self.num_classes}) for the flow's context, got "
                            f"[{int(y.min())}, {int(y.max())}]")
        return F.one_hot(y, self.num_classes).to(ref.dtype)

    def split(self, e: torch.Tensor) -> torch.Tensor:
        """Split (Eq. 8): the first d' coordinates of ``e`` -- the manifold coordinates u."""
        return e[..., : self.latent_dim]

    def pad(self, u: torch.Tensor) -> torch.Tensor:
        """Pad: the inverse of Split on the manifold, the d - d' orthogonal coordinates set to 0."""
        return torch.cat([u, u.new_zeros(*u.shape[:-1], self.data_dim - self.latent_dim)], dim=-1)

    def _check(self, x: torch.Tensor, dim: int, name: str) -> None:
        if x.ndim != 2 or x.shape[1] != dim:
            raise ValueError(f"{name} must have shape (n, {dim}), got {tuple(x.shape)}")

    # -- maps ------------------------------------------------------------------------------------------------
    def outer(self, z: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """e = g(z) (Eq. 7), R^d -> R^d."""
        self._check(z, self.data_dim, "z")
        return self.g(self._context(y, z))(z)

    def outer_inverse(self, e: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """z = g^-1(e)."""
        self._check(e, self.data_dim, "e")
        return self.g(self._context(y, e)).inv(e)

    def inner(self, u: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """u' = h(u) (Eq. 8), R^d' -> R^d'."""
        self._check(u, self.latent_dim, "u")
        return self.h(self._context(y, u))(u)

    def inner_inverse(self, u_prime: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """u = h^-1(u')."""
        self._check(u_prime, self.latent_dim, "u_prime")
        return self.h(self._context(y, u_prime)).inv(u_prime)

    def encode(self, z: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """u' = h(Split(g(z))) (Eq. 8), shape (n, latent_dim)."""
        return self.inner(self.split(self.outer(z, y)), y)

    def decode(self, u_prime: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """z = g^-1(Pad(h^-1(u'))), a point on the learned manifold, shape (n, data_dim)."""
        return self.outer_inverse(self.pad(self.inner_inverse(u_prime, y)), y)

    def project(self, z: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """g^-1(Pad(Split(g(z)))): the projection of z onto the learned manifold."""
        return self.outer_inverse(self.pad(self.split(self.outer(z, y))), y)

    # -- densities and losses --------------------------------------------------------------------------------
    def inner_log_prob(self, u: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """log p(u) = log N(h(u); 0, I) + log|det dh/du| per sample, shape (n,)."""
        self._check(u, self.latent_dim, "u")
        u_prime, ladj = self.h(self._context(y, u)).call_and_ladj(u)
        return _standard_normal_log_prob(u_prime) + ladj

    def reconstruction_loss(self, z: torch.Tensor, y: Optional[torch.Tensor] = None,
                            kind: str = "norm") -> torch.Tensor:
        """Algorithm 1 line 6: mean over the batch of ||z_i - project(z_i)|| (Euclidean norm).

        Depends on the outer parameters only. ``kind='mse'`` is the authors' code: the mean squared error over
        all coordinates.
        """
        residual = z - self.project(z, y)
        if kind == "norm":
            return torch.linalg.vector_norm(residual, dim=1).mean()
        if kind == "mse":
            return residual.square().mean()
        raise ConfigError(f"reconstruction loss kind must be 'norm' or 'mse', got {kind!r}")

    def latent_l2(self, z: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """mean(g(z)^2): the authors' code adds 0.01 x this to phase 1 to keep g's outputs bounded (not in the
        paper)."""
        return self.outer(z, y).square().mean()

    def nll_loss(self, z: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Algorithm 1 line 9: -mean_i log p(Split(g(z_i))) with g fixed (no gradient reaches the outer flow)."""
        with torch.no_grad():
            u = self.split(self.outer(z, y))
        return -self.inner_log_prob(u, y).mean()

    # -- parameters and sampling -----------------------------------------------------------------------------
    def outer_parameters(self) -> List[nn.Parameter]:
        """theta: the parameters of g (phase 1)."""
        return list(self.g.parameters())

    def inner_parameters(self) -> List[nn.Parameter]:
        """phi: the parameters of h (phase 2)."""
        return list(self.h.parameters())

    def sample_base(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """u' ~ N(0, I_d'), shape (n, latent_dim), drawn from ``generator`` on the flow's device and dtype."""
        ref = next(self.parameters())
        u = torch.randn(n, self.latent_dim, generator=generator, device=generator.device, dtype=ref.dtype)
        return u.to(ref.device)


# ------------------------------------------------------------------------------------------------ data <-> flow input
def flow_data(x: torch.Tensor, y: torch.Tensor, task: Task, pad: int = 1) -> Tuple[torch.Tensor,
                                                                                   Optional[torch.Tensor]]:
    """How a batch becomes flow input: returns ``(z, context_labels)``.

    Classification: ``z`` = flattened ``x`` as floats, the labels are the context. Regression:
    ``z = (flatten(x), 0 x pad, flatten(y))`` with no context -- the paper's sine task is ``z = (x, 0, y)``
    (d = 3, d' = 2, section 5.1 / appendix E.4): ``pad`` zeros keep the manifold lower-dimensional than the data;
    use ``pad=0`` when d already exceeds d'.
    """
    n = len(x)
    xf = x.reshape(n, -1)
    if not xf.is_floating_point():
        xf = xf.to(torch.get_default_dtype())
    if task.kind == "classification":
        return xf, y
    if task.kind != "regression":
        raise ValueError(f"unknown task kind {task.kind!r}")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ConfigError(f"pad must be an integer >= 0, got {pad!r}")
    yf = y.reshape(n, -1).to(xf.dtype)
    return torch.cat([xf, xf.new_zeros(n, pad), yf], dim=1), None


def split_flow_data(z: torch.Tensor, task: Task, input_shape: Sequence[int]) -> Tuple[torch.Tensor,
                                                                                      Optional[torch.Tensor]]:
    """Inverse of ``flow_data``: ``(x, y)`` from flow points (e.g. decoded samples).

    Regression: ``x`` = the first prod(input_shape) coordinates reshaped to ``input_shape``, ``y`` = the last
    ``task.output_dim`` coordinates, shape (n, output_dim); the padding in between is dropped. Classification:
    ``(x, None)`` -- the labels are the context the caller decoded with.
    """
    n, dx = len(z), prod(input_shape)
    if task.kind == "classification":
        return z.reshape(n, *input_shape), None
    dy = task.output_dim
    if z.ndim != 2 or z.shape[1] < dx + dy:
        raise ValueError(f"flow points of shape {tuple(z.shape)} cannot hold {dx} inputs and {dy} targets")
    return z[:, :dx].reshape(n, *input_shape), z[:, z.shape[1] - dy:]
