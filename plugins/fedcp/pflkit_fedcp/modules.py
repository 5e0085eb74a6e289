"""FedCP building blocks: the Conditional Policy Network (Eq. 3-4), the client-specific vector, the MMD loss
(Eq. 7) and the set of modules the server shares (extractor, head, CPN).

Equation numbers refer to Zhang et al., "FedCP: Separating Feature Information for Personalized Federated
Learning via Conditional Policy", KDD 2023.
"""
from __future__ import annotations

from typing import Mapping, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pflkit.core import ConfigError, State, bn_keys, derive_seed, module_keys

CPN_PREFIX = "cpn."

NORMS = ("layernorm", "batchnorm", "groupnorm", "none")
ACTIVATIONS = ("relu", "tanh", "sigmoid")
POLICIES = ("softmax", "gumbel", "gumbel_train")


class ConditionalPolicyNetwork(nn.Module):
    """CPN: [FC(K->K)-ReLU] x (layers-1), FC(K->2K), normalisation, activation; softmax over each pair (Eq. 3-4).

    The paper's default (Sec. 3.2.1) is one FC layer, LayerNorm and ReLU. Appendix C (Table 10) varies the number
    of FC layers, the normalisation (BN, GN with two groups -- one per half a_{i,1}, a_{i,2}) and the activation.
    """

    def __init__(self, dim: int, layers: int = 1, norm: str = "layernorm", activation: str = "relu"):
        super().__init__()
        if norm not in NORMS:
            raise ConfigError(f"trainer.cpn_norm: {norm!r} is not one of {', '.join(NORMS)}")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"trainer.cpn_activation: {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        self.dim = int(dim)
        mods: list[nn.Module] = []
        for _ in range(layers - 1):  # extra FC layers process the input before the policy layer (Table 10)
            mods += [nn.Linear(dim, dim), nn.ReLU()]
        mods.append(nn.Linear(dim, 2 * dim))
        mods.append({"layernorm": lambda: nn.LayerNorm(2 * dim), "batchnorm": lambda: nn.BatchNorm1d(2 * dim),
                     "groupnorm": lambda: nn.GroupNorm(2, 2 * dim), "none": nn.Identity}[norm]())
        mods.append({"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[activation]())
        self.net = nn.Sequential(*mods)

    def forward(self, c: torch.Tensor, gumbel: bool = False, tau: float = 1.0
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Policy ``(r, s)`` for CPN input ``c`` (B, K): r + s = 1 per feature, both in (0, 1).

        ``a`` (B, 2, K) are the intermediates a_i^k = {a_{i,1}^k, a_{i,2}^k}; Eq. (4) is a softmax over the pair.
        ``gumbel`` adds Gumbel noise first (the reference code's ``F.gumbel_softmax(tau=1)``).
        """
        a = self.net(c).view(c.shape[0], 2, self.dim)
        p = F.gumbel_softmax(a, tau=tau, dim=1) if gumbel else torch.softmax(a, dim=1)  # Eq. (4)
        return p[:, 0], p[:, 1]


def head_matrix(head: nn.Module) -> torch.Tensor:
    """The head as one C x K matrix: its weight for an FC head (the paper's case, Sec. 3.2.1).

    For a stack of FC layers the product of their weights is used (what PFLlib does; activations between them are
    ignored, so the vector is then only an approximation of the head's client-specific direction).
    """
    if isinstance(head, nn.Linear):
        return head.weight
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError(f"model: FedCP derives the client-specific vector from a fully connected head, but the "
                          f"model's head is {type(head).__name__} without nn.Linear layers")
    mat = linears[-1].weight
    for lin in reversed(linears[:-1]):
        mat = mat @ lin.weight
    return mat


def client_vector(head: nn.Module) -> torch.Tensor:
    """v_i = sum_c w_c^T over the rows w_c of W_i^hd (Sec. 3.2.1): shape (K,), a constant (no gradient)."""
    return head_matrix(head).detach().sum(dim=0).clone()


def cpn_input(h: torch.Tensor, v: torch.Tensor | None, use_sample_vector: bool) -> torch.Tensor:
    """C_i := (v_i / ||v_i||_2) (.) h_i (Sec. 3.2.1); ablations of Table 1 drop one factor.

    ``v`` is the client-specific vector (None: w.o. cs); ``use_sample_vector=False`` (w.o. ss) feeds v alone, the
    same for every sample. The w.o. cs & ss variant passes a frozen random vector as ``v`` without ``h``.
    """
    if v is None:
        if not use_sample_vector:
            raise ValueError("cpn_input needs the sample-specific or the client-specific vector")
        return h
    v_hat = F.normalize(v.reshape(1, -1), p=2, dim=1)
    return h * v_hat if use_sample_vector else v_hat.expand(h.shape[0], -1)


def mmd_rbf(x: torch.Tensor, y: torch.Tensor, bandwidths: Sequence[float] = (10.0, 15.0, 20.0, 50.0)
            ) -> torch.Tensor:
    """Biased squared MMD between samples ``x`` and ``y`` (B, K) with a sum of RBF kernels (Eq. 7).

    k(a, b) = sum_s exp(-||a - b||^2 / (2 s)) over the bandwidths s (the authors' code: 10, 15, 20, 50);
    MMD^2 = mean k(x, x') + mean k(y, y') - 2 mean k(x, y). One Gram matrix over [x; y], no Python loop.
    """
    z = torch.cat([x, y], dim=0)
    sq = (z * z).sum(dim=1)
    dist = (sq[:, None] + sq[None, :] - 2.0 * (z @ z.t())).clamp_min(0.0)
    s = torch.as_tensor(list(bandwidths), dtype=z.dtype, device=z.device).view(-1, 1, 1)
    k = torch.exp(-dist.unsqueeze(0) / (2.0 * s)).sum(dim=0)
    n = x.shape[0]
    return k[:n, :n].mean() + k[n:, n:].mean() - 2.0 * k[:n, n:].mean()


def build_cpn(feature_dim: int, hp: Mapping, seed: int) -> ConditionalPolicyNetwork:
    """The initial CPN Theta^0, identical on the server and on every client (Algorithm 1, line 2)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "fedcp-cpn-init"))
        return ConditionalPolicyNetwork(feature_dim, int(hp.get("cpn_layers", 1)),
                                        hp.get("cpn_norm", "layernorm"), hp.get("cpn_activation", "relu"))


def check_options(hp: Mapping) -> None:
    """Combinations of the ablation switches that do not define a model (Sec. 5.3)."""
    if hp.get("use_cpn", True) and not hp.get("use_global_head", True):
        raise ConfigError("trainer.use_global_head: false needs trainer.use_cpn=false -- the CPN and the frozen "
                          "global head are a union (paper Sec. 5.3: keeping the CPN without the global head is "
                          "invalid)")


def shared_model_keys(model: nn.Module, hp: Mapping) -> list[str]:
    """Model state keys exchanged with the server: the extractor, and the head unless w.o. GH (FedPer-like)."""
    keys = module_keys(model, "features")
    if hp.get("use_global_head", True):
        keys += module_keys(model, "head")
    if hp.get("bn_stats", "shared") == "local":
        local = set(bn_keys(model))
        keys = [k for k in keys if k not in local]
    return keys


def initial_shared_state(model: nn.Module, hp: Mapping, seed: int) -> State:
    """W^{fe,0}, W^{hd,0} and Theta^0 as the server holds them (CPN keys prefixed ``cpn.``)."""
    sd = model.state_dict()
    out: State = {k: sd[k].detach().clone() for k in shared_model_keys(model, hp)}
    if hp.get("use_cpn", True):
        feature_dim = getattr(model, "feature_dim", None)
        if feature_dim is None:
            raise ConfigError(f"model: FedCP needs a feature-extractor / head split (SplitModel with feature_dim); "
                              f"{type(model).__name__} has none")
        cpn = build_cpn(int(feature_dim), hp, seed).to(next(model.parameters()).device)
        out.update({CPN_PREFIX + k: v.detach().clone() for k, v in cpn.state_dict().items()})
    return out
