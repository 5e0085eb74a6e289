"""FedCP client (paper Sec. 3.2 and Algorithm 1, lines 7-16)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from pflkit.core import (BN_PARAM, BatchedForm, BatchedPhase, ClientContext, ClientTrainer, ConfigError, Param, Space,
                         State, derive_seed, host_copy, load_into, make_optimizer, non_negative, positive, run_sgd,
                         trained_names)

from .modules import (ACTIVATIONS, CPN_PREFIX, NORMS, POLICIES, build_cpn, check_options, client_vector,
                      cpn_input, mmd_rbf, shared_model_keys)


def _bandwidths(v: Any) -> Optional[str]:
    if not v or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in v):
        return "must be a non-empty list of positive numbers"
    return None


def _cpn_layers(v: int) -> Optional[str]:
    return None if 1 <= v <= 4 else "must lie in 1..4 (paper Table 10)"


class FedCPTrainer(ClientTrainer):
    """FedCP client: personalized extractor W_i^fe, personalized head W_i^hd and CPN Theta_i are trained; the
    received global extractor W^fe and global head W^hd are frozen (Algorithm 1, lines 7-14).

    Defaults follow the paper; where the authors' code (TsingZ0/FedCP, PFLlib) differs, the paper is the default:
    ``policy=softmax`` (Eq. 4; the code's Gumbel noise, also at test time, is ``policy=gumbel``),
    ``client_vector_init=head`` (v_i from the personal head from the first iteration, Algorithm 1 line 10; the
    code's uniform random first vector is ``random``). Which clients receive the new global modules is the
    aggregator's ``sync`` option. Ablations of Table 1: ``use_cpn``, ``use_gfm``, ``use_global_head``,
    ``use_client_vector``, ``use_sample_vector``; CPN variants of Table 10: ``cpn_layers``, ``cpn_norm``,
    ``cpn_activation``.
    """

    protocol = "fedcp"
    description = "conditional policy splits each feature between a frozen global head and a personal head"
    params = {
        "lambda_mmd": Param(5.0, "weight lambda of the MMD feature-alignment loss (Eq. 8); paper: 5 for the "
                                 "4-layer CNN, 1 for ResNet-18 / fastText", check=non_negative,
                           space=Space.choice([0.0, 0.1, 1.0, 5.0, 10.0],
                                              source="the paper's grid, Appendix D")),
        "mmd_bandwidths": Param([10.0, 15.0, 20.0, 50.0], "RBF kernel bandwidths s of k = sum_s exp(-d/(2s)) "
                                "(Eq. 7; values of the authors' code)", type=list, check=_bandwidths),
        "policy": Param("softmax", "policy from the CPN intermediates: softmax (paper, Eq. 4), gumbel (authors' "
                                   "code: Gumbel-softmax in training and evaluation), gumbel_train (noise in "
                                   "training only)", choices=POLICIES),
        "gumbel_tau": Param(1.0, "temperature of the Gumbel-softmax policies", check=positive),
        "client_vector_init": Param("head", "client-specific vector before the first training: head (paper: "
                                            "from the personal head, Algorithm 1 line 10) or random (authors' "
                                            "code: uniform [0,1)^K)", choices=("head", "random")),
        "use_cpn": Param(True, "false = w.o. CPN (Table 1): fixed policy r = s = 1/2"),
        "use_gfm": Param(True, "false = w.o. GFM (Table 1): no frozen global extractor and no MMD loss"),
        "use_global_head": Param(True, "false = w.o. GH (Table 1, only with use_cpn=false): personal head only, "
                                       "the head is not shared (FedPer-like)"),
        "use_client_vector": Param(True, "false = w.o. cs (Table 1): CPN input without the client-specific "
                                         "vector"),
        "use_sample_vector": Param(True, "false = w.o. ss (Table 1): CPN input without the feature vector h_i; "
                                         "with use_client_vector=false too, a frozen random vector (w.o. cs & ss)"),
        "cpn_layers": Param(1, "FC layers in the CPN (Appendix C, Table 10)", check=_cpn_layers),
        "cpn_norm": Param("layernorm", "CPN normalisation (Appendix C)", choices=NORMS),
        "cpn_activation": Param("relu", "CPN activation (Appendix C)", choices=ACTIVATIONS),
        "bn_stats": BN_PARAM,
    }

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        hp = ctx.hp
        check_options(hp)
        self.model = ctx.build_model()  # personal: features = W_i^fe, head = W_i^hd
        if getattr(self.model, "feature_dim", None) is None or not hasattr(self.model, "head"):
            raise ConfigError(f"model: FedCP needs a feature-extractor / head split (SplitModel); "
                              f"{type(self.model).__name__} has none")
        self.feature_dim = int(self.model.feature_dim)
        self.global_model = ctx.build_model()  # frozen: features = W^fe, head = W^hd
        self.global_model.requires_grad_(False)
        self.cpn = build_cpn(self.feature_dim, hp, ctx.seed).to(ctx.device)  # Theta_i
        self.shared = shared_model_keys(self.model, hp)
        self.vector = _Vector()  # holds v_i: a module, so clients.batched stacks each client's v_i with its model
        self.v = None  # client-specific vector, constant within a round
        self.random_input = self._random_input()  # w.o. cs & ss: frozen random CPN input (else None)
        self.fits_done = 0
        self._share_sum: Optional[torch.Tensor] = None
        self._share_count = 0

    @property
    def v(self) -> Optional[torch.Tensor]:
        return self.vector.v

    @v.setter
    def v(self, value: Optional[torch.Tensor]) -> None:
        self.vector.v = value

    # protocol ------------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        if "params" in payload:
            self.receive(payload["params"])  # Algorithm 1, lines 7-9
        self.v = self.make_client_vector()  # line 10
        loss, share = self.local_update()  # lines 11-14
        self.fits_done += 1
        reply: Dict[str, Any] = {"params": self.upload(), "num_samples": self.ctx.num_train, "train_loss": loss}
        if share is not None:
            reply["metrics"] = {"personal_share": share}
        return reply

    def on_sync(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Push after aggregation (aggregator ``sync=reference``): overwrite with the new global modules."""
        params = payload.get("params", {})
        self.receive(params)
        if any(k.startswith("head.") for k in params):  # the authors' code recomputes v_i when the head arrives
            self.v = self.make_client_vector()
        return {}

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Score the personalized model W_i = {W_i^fe, W^hd, W_i^hd, Theta_i} with the latest v_i (Sec. 3.2.1)."""
        if self.v is None:
            self.v = self.make_client_vector()
        return self.evaluate_model(lambda x: self.forward(x, training=False)[0],
                                   modules=(self.model, self.cpn, self.global_model))

    # the model ------------------------------------------------------------------------------------------------
    def receive(self, params: State) -> None:
        """W_i^fe, W^fe <- W^{fe,t} (line 7); W^hd <- W^{hd,t} (line 8); Theta_i <- Theta^t (line 9)."""
        feats = {k: v for k, v in params.items() if k.startswith("features.") and k in self.shared}
        load_into(self.model, feats)
        load_into(self.global_model, feats)
        load_into(self.global_model, {k: v for k, v in params.items() if k.startswith("head.") and k in self.shared})
        cpn = {k[len(CPN_PREFIX):]: v for k, v in params.items() if k.startswith(CPN_PREFIX)}
        if cpn:
            load_into(self.cpn, cpn)

    def make_client_vector(self) -> Optional[torch.Tensor]:
        hp = self.ctx.hp
        if not hp.use_cpn or not hp.use_client_vector:
            return None
        if hp.client_vector_init == "random" and self.fits_done == 0:  # authors' code: random until trained
            if self.v is not None:
                return self.v
            return torch.rand(self.feature_dim, generator=self.ctx.generator).to(self.ctx.device)
        return client_vector(self.model.head)

    def policy(self, h: torch.Tensor, training: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """(r, s): shares of each feature for the global and the personal head (Eq. 3-4)."""
        hp = self.ctx.hp
        if not hp.use_cpn:  # w.o. CPN: no separation, each head sees half of every feature
            half = torch.full_like(h, 0.5)
            return half, half
        if self.random_input is not None:
            c = self.random_input.reshape(1, -1).expand(h.shape[0], -1)
        else:
            c = cpn_input(h, self.v if hp.use_client_vector else None, hp.use_sample_vector)
        gumbel = hp.policy == "gumbel" or (hp.policy == "gumbel_train" and training)
        return self.cpn(c, gumbel=gumbel, tau=hp.gumbel_tau)

    def forward(self, x: torch.Tensor, training: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output of the personalized model, the feature vector h_i (Eq. 2) and the personal share s_i."""
        h = self.model.features(x)  # Eq. (2)
        if not self.ctx.hp.use_global_head:
            return self.model.head(h), h, torch.ones_like(h)
        r, s = self.policy(h, training)
        out = self.global_model.head(r * h) + self.model.head(s * h)  # out_i^r + out_i^s (Sec. 3.2.2)
        return out, h, s

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """F_i = CE(g(r.h; W^hd) + g(s.h; W_i^hd), y) + lambda * MMD(h_i, f(x; W^fe))  (Eq. 5, 7, 8), and s_i."""
        hp = self.ctx.hp
        out, h, s = self.forward(x, training=True)
        loss = self.ctx.task.loss(out, y)  # Eq. (5)
        if hp.use_gfm and hp.lambda_mmd > 0:
            with torch.no_grad():  # W^fe is frozen: data only flows forward through it (Fig. 2a)
                h_global = self.global_model.features(x)
            loss = loss + hp.lambda_mmd * mmd_rbf(h, h_global, hp.mmd_bandwidths)  # Eq. (7)-(8)
        return loss, s

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss, s = self.objective(x, y)
        if self.ctx.hp.use_cpn:
            share = s.detach().mean(dim=1).sum()
            self._share_sum = share if self._share_sum is None else self._share_sum + share
            self._share_count += int(s.shape[0])
        return loss

    def _batched_loss(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``loss`` for clients.batched: the personal share's sums come back as values, not trainer state."""
        loss, s = self.objective(x, y)
        return loss, {"share_sum": s.detach().mean(dim=1).sum(), "share_count": torch.tensor(float(s.shape[0]))}

    def local_update(self) -> Tuple[float, Optional[float]]:
        """One call of the core loop over W_i^fe, W_i^hd and Theta_i together (lines 11-14)."""
        self.model.train()
        self.cpn.train()
        self.global_model.train()  # as the authors' code: frozen, but its BN layers use batch statistics
        params: List[nn.Parameter] = list(self.model.parameters()) + list(self.cpn.parameters())
        opt = make_optimizer(params, self.ctx.train_cfg)
        # BatchNorm in the CPN cannot normalise a batch of one; drop a trailing singleton batch in that case
        drop_last = self.ctx.hp.cpn_norm == "batchnorm" and self.ctx.hp.use_cpn
        batches = self.batches(drop_last=drop_last)
        self._share_sum, self._share_count = None, 0
        loss = run_sgd(batches, self.loss, opt)
        share = None
        if self._share_sum is not None and self._share_count:
            share = float(self._share_sum.item()) / self._share_count
        return loss, share

    # clients.batched (core/api/batching.py): on_fit's local update as one phase over W_i^fe, W_i^hd and Theta_i
    def batched_begin(self, payload: Dict[str, Any]) -> None:
        self.receive(payload["params"])  # Algorithm 1, lines 7-9
        self.v = self.make_client_vector()  # line 10

    def batched_form(self) -> Optional[BatchedForm]:
        if self.random_input is not None:  # the w.o. cs & ss ablation's CPN input is a per-client attribute
            return None
        drop_last = self.ctx.hp.cpn_norm == "batchnorm" and self.ctx.hp.use_cpn
        trains = trained_names(self.model, "model") + trained_names(self.cpn, "cpn")
        phase = BatchedPhase(self._batched_loss, trains, int(self.ctx.train_cfg.local_epochs), drop_last=drop_last,
                             aux=True)

        def reply(losses, start, aux):
            self.fits_done += 1
            out: Dict[str, Any] = {"params": self.upload(), "num_samples": self.ctx.num_train,
                                   "train_loss": losses[0]}
            if self.ctx.hp.use_cpn and aux.get("share_count"):
                out["metrics"] = {"personal_share": aux["share_sum"] / aux["share_count"]}
            return out

        return BatchedForm({"model": self.model, "global_model": self.global_model, "cpn": self.cpn,
                            "vector": self.vector}, [phase], reply)

    def upload(self) -> State:
        """{W_i^fe, hat W_i^hd, Theta_i} (line 16) with hat W_i^hd = (W^hd + W_i^hd) / 2 (Eq. 6)."""
        own = self.model.state_dict()
        glob = self.global_model.state_dict()
        out: State = {}
        for k in self.shared:
            if k.startswith("head.") and own[k].is_floating_point():
                out[k] = (glob[k] + own[k]) / 2  # Eq. (6)
            else:
                out[k] = own[k].detach().clone()
        if self.ctx.hp.use_cpn:
            out.update({CPN_PREFIX + k: v.detach().clone() for k, v in self.cpn.state_dict().items()})
        return out

    # checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "global_model": self.global_model.state_dict(),
                "cpn": self.cpn.state_dict(), "v": self.v, "random_input": self.random_input,
                "fits_done": self.fits_done}

    # declared per-client state: one pooled trainer serves every client (core/api/clientstate.py) ----------------
    declares_state = True

    def _random_input(self) -> Optional[torch.Tensor]:
        """The w.o. cs & ss ablation's frozen CPN input: a function of (run seed, client), so it is re-derived when
        the pooled trainer is bound to a client rather than stored."""
        hp = self.ctx.hp
        if not (hp.use_cpn and not hp.use_client_vector and not hp.use_sample_vector):
            return None
        g = torch.Generator().manual_seed(derive_seed(self.ctx.seed, "fedcp-random-input", self.ctx.cid))
        return torch.rand(self.feature_dim, generator=g).to(self.ctx.device)

    def client_state(self) -> Dict[str, Any]:
        """Everything a FedCP client keeps: W_i (personal extractor and head), its copy of the global modules
        (their BN statistics move during local training), Theta_i, v_i and the fit counter."""
        return {"model": host_copy(self.model.state_dict()), "global_model": host_copy(self.global_model.state_dict()),
                "cpn": host_copy(self.cpn.state_dict()),
                "v": None if self.v is None else self.v.detach().to("cpu", copy=True), "fits_done": self.fits_done}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.global_model.load_state_dict(state["global_model"])
        self.cpn.load_state_dict(state["cpn"])
        self.v = None if state["v"] is None else state["v"].to(self.ctx.device)
        self.fits_done = int(state.get("fits_done", 0))

    def swapped_in(self) -> None:
        self.random_input = self._random_input()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.global_model.load_state_dict(state["global_model"])
        self.cpn.load_state_dict(state["cpn"])
        self.v = None if state["v"] is None else state["v"].to(self.ctx.device)
        self.random_input = self._random_input()  # a function of (seed, client): the stored copy is not needed
        self.fits_done = int(state.get("fits_done", 0))


class _Vector(nn.Module):
    """The client-specific vector v_i as a buffer (None until made)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("v", None)
