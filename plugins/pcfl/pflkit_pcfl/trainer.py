"""PCFL, client side: Algorithm 1's gradient steps, Eq. 9-10 and 12 (regions, overlaps, synthetic samples), and
Eq. 14's two extra terms around any base algorithm's local update (Algorithm 2, client lines).

``PcflTrainer`` is a *wrapper* (core/engine/compose.py): it is never built itself. For ``trainer.base = B`` the core
builds ``PCFL[BTrainer] = (PcflClientMixin, BTrainer)``, whose messages are the base's plus:

set-up (round 0, see aggregator.py)
  ``pcfl_flow_size`` {} -> {n}
        the number of training rows (only for ``aggregator.flow_training = authors``: pooled epochs are cut from it).
  ``pcfl_flow_grad`` {flow, arch, phase, batch_size, [rows], [batch_seed], [objective]} -> {grads, loss, n}
        Algorithm 1 lines 4-10: one mini-batch (``batch_size`` rows the client draws, or the server's ``rows`` of a
        pooled batch), the gradient of the reconstruction loss w.r.t. g (phase 'recon') or of the NLL w.r.t. h with
        g fixed (phase 'nll'); ``objective`` 'authors' uses the authors' loss weights.
  ``pcfl_region`` {flow, arch} -> {region}
        Eq. 9: the latent codes of the client's training data, their convex hull(s) (hull vertices only) or
        boxes -- never a sample.
  ``pcfl_overlap`` {flow, arch, regions: {i: region}} -> {overlap_counts: {i: |D^{i,k}|}, synthetic, wanted, draws}
        Eq. 10: the client keeps the indices D^{i,k} of its own samples inside every other client's region;
        Eq. 12: it keeps synthetic samples decoded from u' inside its own region and in no other.
rounds
  ``pcfl_fit`` {kind, payload, defer} -> the base's reply, or {personal, steps} when ``defer``
        Algorithm 2 lines 7-8: the base's own local update, with beta * loss on synthetic samples added to the
        objective of the personal model (through ``data_loss``, Eq. 14). With ``defer`` the client keeps the base
        reply's scalars and returns its personal model f_i instead, to be sent to the clients holding D^{i,k}.
  ``pcfl_alpha`` {models: {i: {state, steps}}} -> {updates: {i: {name: tensor}}}
        Algorithm 2 lines 9-12 on client k: alpha * loss of f_i on D^{i,k}, as an update or a gradient.
  ``pcfl_apply`` {update} -> the base's fit reply
        Algorithm 2 line 14: apply the server's Eq. 11 average to f_i, then reply what the base would have
        (its upload recomputed from the updated model).

What the client keeps between calls (``state_dict``): the base's state, the index lists D^{i,k}, the synthetic
set and, between ``pcfl_fit`` and ``pcfl_apply`` of one round, the base reply's scalars. The flow is not kept:
each set-up message carries it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from pflkit.core import (BatchedForm, ClientTrainer, ConfigError, LocalSGDTrainer, Message, Param, PflError, Space,
                         StepInputs, TensorData, derive_seed, make_optimizer, non_negative, positive, run_sgd,
                         state_declared)

from .equations import overlap_indices, sample_unshared
from .flow import ManifoldFlow, flow_data, split_flow_data
from .hull import KINDS, Region, build_region

PROTOCOL_PREFIX = "pcfl/"
ALPHA_MODES = ("update", "gradient")
BASE_PROTOCOLS = ("global-model", "local")
_ENCODE_CHUNK = 4096
# the authors' train_manifold.py loss weights (--msefactor, --uvl2reg)
AUTHORS_MSE_FACTOR = 1000.0
AUTHORS_LATENT_L2 = 0.01

TRAINER_PARAMS = {
    "alpha": Param(0.5, "Eq. 14 alpha: weight of the loss of client i's model on the overlaps D^{i,k} held by "
                        "the other clients (paper: 0.5; 1 for FEMNIST and eICU); 0 = the Table 5 ablation without "
                        "it", check=non_negative,
                   space=Space.real(0.1, 2.0, log=True,
                                    source="around the paper's 0.5 and 1: Appendix E.3 grid-searches alpha and beta "
                                           "on a validation set but prints no grid")),
    "beta": Param(0.5, "Eq. 14 beta: weight of the loss on synthetic samples of the client's unshared region "
                       "(Eq. 12-13; paper: 0.5); 0 = the Table 5 ablation without it", check=non_negative,
                  space=Space.real(0.1, 2.0, log=True,
                                   source="around the paper's 0.5: Appendix E.3 grid-searches alpha and beta on a "
                                          "validation set but prints no grid")),
    "overlap": Param("hull", "projected local manifold (Eq. 9): hull = exact convex hull of the latent codes (the "
                             "paper); box = per-label axis-aligned bounding box (the authors' released code)",
                     choices=KINDS),
    "clusters": Param(0, "k-means clusters of each label's codes before taking hulls (Section 4.3: 'we could "
                         "also firstly cluster U'^i'); 0 = no clustering", check=non_negative),
    "alpha_mode": Param("update", "what client k sends back for D^{i,k} (Algorithm 2 lines 9-14): update = it "
                                  "runs as many SGD steps on alpha * loss(f_i; D^{i,k}) as client i ran on its own "
                                  "objective and replies the parameter update (lines 11 and 13: k updates f^i, the "
                                  "server aggregates parameters); gradient = it replies the gradient of "
                                  "loss(f_i; D^{i,k}) and client i takes one SGD step of lr * alpha on the average",
                        choices=ALPHA_MODES),
    "synthetic_region": Param("unshared", "where synthetic samples are drawn: unshared = inside the client's region "
                                          "and no other client's (Eq. 12, the paper); own = anywhere in the client's "
                                          "region (the authors' code, which never excludes the others)",
                              choices=("unshared", "own")),
    "synthetic_ratio": Param(0.5, "synthetic samples wanted per local training sample (Eq. 12-14; the paper does "
                                  "not say, the authors' code uses 0.5)", check=non_negative),
    "synthetic_draws": Param(200, "rejection-sampling budget: draws of u' ~ N(0, I) per wanted synthetic sample "
                                  "(the acceptance rate is logged as pcfl/synthetic_acceptance)", check=positive),
}


def _state_copy(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def build_flow(arch: Dict[str, Any], device: torch.device) -> ManifoldFlow:
    """The flow described by ``arch`` (what the server sends): same architecture on every client."""
    kwargs = {k: v for k, v in arch.items() if k not in ("pad",)}
    return ManifoldFlow(**kwargs).to(device)


class PcflClientMixin:
    """The PCFL client behaviour, placed before a LocalSGDTrainer base in the MRO (see the module docstring)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        personal = self.personal_forward()
        if not isinstance(personal, nn.Module):
            raise ConfigError(f"trainer.base: PCFL needs the base's personal model as a module (personal_forward "
                              f"of {type(self).__mro__[2].__name__} returns {type(personal).__name__})")
        if set(personal.state_dict()) != set(ctx.build_model().state_dict()):
            raise ConfigError("trainer.base: the base's personal model is not the configured model, so client k "
                              "cannot evaluate client i's model on D^{i,k}")
        self.overlaps: Dict[int, torch.Tensor] = {}   # i -> indices of this client's samples in D^{i,k} (Eq. 10)
        self.syn_x = torch.zeros(0)                    # synthetic set of the unshared region (Eq. 12)
        self.syn_y = torch.zeros(0)
        self._pending: Dict[str, Any] = {}             # the base reply's scalars between pcfl_fit and pcfl_apply
        self._augment = False
        self._personal_steps = 0
        self._syn_gen: Optional[torch.Generator] = None
        self._flow: Optional[ManifoldFlow] = None      # working modules, rebuilt from messages (never state)
        self._flow_arch: Optional[Dict[str, Any]] = None
        self._flow_tensors: Dict[str, torch.Tensor] = {}
        self._scratch: Optional[nn.Module] = None
        self._batched_defer = False                    # clients.batched: the pcfl_fit being prepared defers
        self._batched_step: Optional[_SyntheticStep] = None  # inside a batched step's loss
        self._batched_calls: Dict[tuple, List[int]] = {}     # per form: the personal model's data losses per step

    # -- Eq. 14's beta term, through the core's objective hook --------------------------------------------
    def data_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().data_loss(model, x, y)
        step = self._batched_step
        if step is not None:  # clients.batched: this step's synthetic batch arrives as an input of the loss
            if model is step.personal:
                at = step.calls
                step.calls += 1
                if step.extra:
                    sx, sy = step.extra
                    if step.per_step > 1:  # the at-th draw of this step
                        m = sx.shape[0] // step.per_step
                        sx, sy = sx[at * m:(at + 1) * m], sy[at * m:(at + 1) * m]
                    loss = loss + float(self.ctx.hp.beta) * super().data_loss(model, sx, sy)
            return loss
        if self._augment and model is self.personal_forward():
            self._personal_steps += 1
            beta = float(self.ctx.hp.beta)
            n = len(self.syn_y)
            if beta > 0 and n:
                # E_{(x,y) ~ p^i_z} l(f(x), y) of Eq. 14, estimated on a mini-batch of the synthetic set
                idx = torch.randperm(n, generator=self._syn_gen)[: self.ctx.train_cfg.batch_size].to(self.syn_y.device)
                loss = loss + beta * super().data_loss(model, self.syn_x[idx], self.syn_y[idx])
        return loss

    def _personal(self) -> nn.Module:
        return self.personal_forward()

    # -- clients.batched: the base's batched form with the beta term ---------------------------------------
    # The sequential loss draws the synthetic mini-batch of each call on the personal model from the client's own
    # generator (seeded from its call seed, independent of the batch order): the batched form draws the same
    # sequence before the stacked steps and passes step s's batch to the loss as an input (BatchedPhase.inputs).
    # The alpha term (pcfl_alpha) and Eq. 11 (pcfl_apply) are other messages, one client at a time.
    batched_wraps = True

    @classmethod
    def batched_message(cls, message: Message) -> bool:
        payload = message.payload
        return (message.kind == "pcfl_fit" and isinstance(payload, dict) and isinstance(payload.get("kind"), str)
                and super().batched_message(Message(payload["kind"], payload.get("payload") or {})))

    def batched_begin(self, payload: Dict[str, Any]) -> None:
        """What ``on_pcfl_fit`` does before the base's local update."""
        self._syn_gen = torch.Generator().manual_seed(derive_seed(self.ctx.generator.initial_seed(), "pcfl-syn"))
        self._batched_defer = bool(payload.get("defer"))
        super().batched_begin(payload.get("payload") or {})

    def batched_form(self) -> Optional[BatchedForm]:
        form = super().batched_form()
        if form is None or any(ph.inputs is not None for ph in form.phases):
            return None  # a base whose losses take inputs of their own: not composed (none of the bases today)
        personal = self.personal_forward()
        calls = self._personal_calls(form, personal)
        beta, n = float(self.ctx.hp.beta), len(self.syn_y)
        m = min(int(self.ctx.train_cfg.batch_size), n)
        synthetic = TensorData(self.syn_x, self.syn_y)
        gen, defer = self._syn_gen, self._batched_defer
        steps = [0]  # the personal model's data losses in this fit (the sequential path's _personal_steps)

        def phase_of(phase, per_step: int):
            def loss(x, y, *extra):
                self._batched_step = _SyntheticStep(personal, per_step, extra)
                try:
                    return phase.loss(x, y)
                finally:
                    self._batched_step = None

            def inputs(count: int) -> Optional[StepInputs]:
                steps[0] += per_step * count
                if not (per_step and beta > 0 and n and gen is not None):
                    return None  # no synthetic term, no draw (as sequentially)
                draws = [torch.randperm(n, generator=gen)[:m] for _ in range(per_step * count)]
                index = torch.stack(draws).view(count, per_step * m) if draws else \
                    torch.zeros(0, per_step * m, dtype=torch.long)
                return StepInputs(synthetic, index.to(self.syn_y.device))

            return dataclasses.replace(phase, loss=loss, inputs=inputs)

        base_reply = form.reply

        def reply(losses, start, aux):
            out = base_reply(losses, start, aux)
            if beta > 0 and n and steps[0] == 0:
                raise ConfigError(f"trainer.base: {type(self).__mro__[2].__name__} trained its personal model "
                                  f"without LocalSGDTrainer.data_loss, so PCFL cannot add Eq. 14's beta term to it")
            if not defer:
                return out
            self._pending = {k: v for k, v in out.items() if k != "params"}
            self._pending["_upload"] = "params" in out
            return {"personal": _state_copy(self._personal()), "steps": steps[0]}

        return dataclasses.replace(form, phases=[phase_of(ph, c) for ph, c in zip(form.phases, calls)],
                                   reply=reply)

    def _personal_calls(self, form: BatchedForm, personal: nn.Module) -> List[int]:
        """Per phase of the base's form, how many times one step's loss takes the personal model's data loss (each
        such call draws a synthetic batch): counted once on two samples, the modules' tensors and the random
        generators' states restored after."""
        key = tuple(tuple(ph.trains) for ph in form.phases)
        if key in self._batched_calls:
            return self._batched_calls[key]
        data = self.ctx.train
        if len(data) == 0:
            return [0] * len(form.phases)
        modules = list(form.modules.values()) + [personal]
        saved = [(t, t.detach().clone()) for mod in modules for t in list(mod.parameters()) + list(mod.buffers())]
        x, y = data.batch(torch.arange(min(2, len(data)), device=data.y.device))
        counts = []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for ph in form.phases:
                    self._batched_step = _SyntheticStep(personal, 1, ())
                    ph.loss(x, y)
                    counts.append(self._batched_step.calls)
        finally:
            self._batched_step = None
            with torch.no_grad():
                for t, value in saved:
                    t.copy_(value)
        self._batched_calls[key] = counts
        return counts

    # -- rounds --------------------------------------------------------------------------------------------
    def on_pcfl_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Algorithm 2 lines 7-8: the base's local update on the beta-augmented objective."""
        self._augment, self._personal_steps = True, 0
        self._syn_gen = torch.Generator().manual_seed(derive_seed(self.ctx.generator.initial_seed(), "pcfl-syn"))
        try:
            reply = self.handle(Message(payload["kind"], payload.get("payload") or {}))
        finally:
            self._augment = False
        if float(self.ctx.hp.beta) > 0 and len(self.syn_y) and self._personal_steps == 0:
            raise ConfigError(f"trainer.base: {type(self).__mro__[2].__name__} trained its personal model without "
                              f"LocalSGDTrainer.data_loss, so PCFL cannot add Eq. 14's beta term to it")
        if not payload.get("defer"):
            return reply
        self._pending = {k: v for k, v in reply.items() if k != "params"}
        self._pending["_upload"] = "params" in reply
        return {"personal": _state_copy(self._personal()), "steps": self._personal_steps}

    def on_pcfl_alpha(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Algorithm 2 lines 9-12 on this client k: the alpha term of each owner i's model on D^{i,k}."""
        hp = self.ctx.hp
        updates: Dict[int, Dict[str, torch.Tensor]] = {}
        losses: List[float] = []
        owners = [int(i) for i in sorted(payload["models"]) if len(self.overlaps.get(int(i), ())) > 0]
        if hp.alpha_mode == "update" and len(owners) > 1 and self._can_vectorize():
            updates, losses = self._vectorized_updates(owners, payload["models"])
            owners = []
        for i in owners:
            idx = self.overlaps[i]
            job = payload["models"][i]
            model = self._scratch_model()
            model.load_state_dict(job["state"])
            model.train()
            params = dict(model.named_parameters())
            if hp.alpha_mode == "gradient":
                grads, loss = self._overlap_gradient(model, idx)
                updates[int(i)] = grads
            else:
                start = {k: p.detach().clone() for k, p in params.items()}
                opt = make_optimizer(model.parameters(), self.ctx.train_cfg)
                alpha = float(hp.alpha)
                loss = run_sgd(self._cycled_batches(idx, int(job["steps"])),
                               lambda x, y: alpha * self.data_loss(model, x, y), opt)
                updates[int(i)] = {k: p.detach() - start[k] for k, p in params.items()}
            losses.append(loss)
        return {"updates": updates, "metrics": {"overlap_loss": float(np.mean(losses)) if losses else 0.0}}

    def on_pcfl_apply(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Algorithm 2 line 14: apply the averaged overlap term to f_i, then reply as the base would have."""
        update = payload.get("update") or {}
        params = dict(self._personal().named_parameters())
        with torch.no_grad():
            for k, v in update.items():
                if self.ctx.hp.alpha_mode == "gradient":
                    params[k].sub_(float(self.ctx.train_cfg.lr) * float(self.ctx.hp.alpha) * v.to(params[k]))
                else:
                    params[k].add_(v.to(params[k]))
        reply = {k: v for k, v in self._pending.items() if k != "_upload"}
        if self._pending.get("_upload"):
            reply["params"] = self.upload()
        self._pending = {}
        return reply

    def _can_vectorize(self) -> bool:
        """Plain, unclipped SGD on a buffer-free, dropout-free model through the core's data loss: owners can
        share every step (vmap)."""
        cfg = self.ctx.train_cfg
        model = self._scratch_model()
        plain_loss = getattr(super(PcflClientMixin, self).data_loss, "__func__", None) is LocalSGDTrainer.data_loss
        random_layers = any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())
        return (cfg.optimizer == "sgd" and float(cfg.momentum) == 0.0 and not cfg.get("max_grad_norm")
                and plain_loss and not random_layers
                and len(list(model.buffers())) == 0 and all(p.requires_grad for p in model.parameters()))

    def _vectorized_updates(self, owners: List[int], jobs: Dict[Any, Dict[str, Any]]
                            ) -> Tuple[Dict[int, Dict[str, torch.Tensor]], List[float]]:
        """The update-mode loop of ``on_pcfl_alpha`` for all owners at once: the same mini-batches (drawn owner
        by owner, as the loop draws them), one ``torch.func.vmap`` forward/backward per step for every owner
        that still has steps, and SGD's update p <- p - lr * (grad + weight_decay * p)."""
        from torch.func import functional_call, grad_and_value, vmap

        cfg, task, alpha = self.ctx.train_cfg, self.ctx.task, float(self.ctx.hp.alpha)
        model = self._scratch_model()
        model.train()
        names = [n for n, _ in model.named_parameters()]
        dev = next(model.parameters()).device
        plans = [[b for b in self._cycled_indices(self.overlaps[i], int(jobs[i]["steps"]))] for i in owners]
        params = {n: torch.stack([jobs[i]["state"][n].to(dev) for i in owners]) for n in names}
        start = {n: v.clone() for n, v in params.items()}

        def batch_loss(p, x, y, w):
            out = functional_call(model, p, (x,))
            per = task.loss(out, y, reduction="none")
            per = per.reshape(per.shape[0], -1).mean(dim=1) if per.ndim > 1 else per
            return alpha * (per * w).sum() / w.sum()

        step_fn = vmap(grad_and_value(batch_loss))
        totals = [0.0] * len(owners)
        for s in range(max(len(p) for p in plans)):
            live = [o for o, plan in enumerate(plans) if s < len(plan)]
            width = max(len(plans[o][s]) for o in live)
            xs, ys, ws = [], [], []
            for o in live:
                idx = plans[o][s]
                pad = idx[torch.zeros(width - len(idx), dtype=torch.long)] if width > len(idx) else idx[:0]
                x, y = self.ctx.train.batch(torch.cat([idx, pad]))
                xs.append(x)
                ys.append(y)
                ws.append(torch.cat([torch.ones(len(idx)), torch.zeros(len(pad))]).to(x.device))
            sel = torch.tensor(live, device=dev)
            p_live = {n: params[n][sel] for n in names}
            X, Y, W = torch.stack(xs), torch.stack(ys), torch.stack(ws)
            g, values = step_fn(p_live, X, Y, W)
            for o, value in zip(live, values.tolist()):
                totals[o] += value
            with torch.no_grad():
                for n in names:
                    params[n][sel] = p_live[n] - float(cfg.lr) * (g[n] + float(cfg.weight_decay) * p_live[n])
        updates = {i: {n: (params[n][o] - start[n][o]).clone() for n in names} for o, i in enumerate(owners)}
        return updates, [totals[o] / max(1, len(plans[o])) for o in range(len(owners))]

    def _cycled_indices(self, idx: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
        """The index mini-batches of ``_cycled_batches`` (same generator draws)."""
        bs, n, done = self.ctx.train_cfg.batch_size, len(idx), 0
        idx = idx.to(self.ctx.train.y.device)
        while done < steps:
            order = idx[torch.randperm(n, generator=self.ctx.generator).to(idx.device)]
            for s in range(0, n, bs):
                if done == steps:
                    return
                yield order[s:s + bs]
                done += 1

    def _scratch_model(self) -> nn.Module:
        if self._scratch is None:
            self._scratch = self.ctx.build_model()
        return self._scratch

    def _cycled_batches(self, idx: torch.Tensor, steps: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` mini-batches of the samples ``idx``: reshuffled passes, as many as needed."""
        for part in self._cycled_indices(idx, steps):
            yield self.ctx.train.batch(part)

    def _overlap_gradient(self, model: nn.Module, idx: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], float]:
        """Gradient of the mean loss of ``model`` over all of D^{i,k} (accumulated over mini-batches)."""
        model.zero_grad(set_to_none=True)
        total, n = 0.0, len(idx)
        idx = idx.to(self.ctx.train.y.device)
        for s in range(0, n, self.ctx.train_cfg.eval_batch_size):
            part = idx[s:s + self.ctx.train_cfg.eval_batch_size]
            x, y = self.ctx.train.batch(part)
            loss = self.data_loss(model, x, y) * (len(part) / n)
            loss.backward()
            total += float(loss.detach())
        grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for k, p in model.named_parameters()}
        return grads, total

    # -- set-up: Algorithm 1 and Eq. 9, 10, 12 -------------------------------------------------------------
    def _load_flow(self, payload: Dict[str, Any]) -> ManifoldFlow:
        arch = dict(payload["arch"])
        if self._flow is None or arch != self._flow_arch:
            self._flow, self._flow_arch = build_flow(arch, self.ctx.device), arch
            self._flow_tensors = self._flow.state_dict()  # views of the flow's parameters and buffers
        incoming = payload["flow"]
        own = self._flow_tensors
        if isinstance(incoming, dict) and incoming.keys() == own.keys() and all(
                isinstance(t, torch.Tensor) and t.shape == own[k].shape and t.dtype == own[k].dtype
                for k, t in incoming.items()):
            with torch.no_grad():  # the same values as load_state_dict, without its walk over ~100 modules a step
                for k, t in incoming.items():
                    own[k].copy_(t)
        else:
            self._flow.load_state_dict(incoming)  # its own error names what does not match
        return self._flow

    def _flow_input(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return flow_data(x, y, self.ctx.task, pad=int(self._flow_arch.get("pad", 1)))

    def on_pcfl_flow_size(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """How many training rows the client holds (the authors' schedule cuts pooled epochs from the counts)."""
        return {"n": int(self.ctx.num_train)}

    def _flow_rows(self, payload: Dict[str, Any]) -> torch.Tensor:
        """The mini-batch's row indices: the server's share of a pooled batch (``rows``, authors' schedule), or
        ``batch_size`` rows drawn by the client (Algorithm 1 line 4)."""
        n = self.ctx.num_train
        rows = payload.get("rows")
        if rows is None:  # the server's batch_seed with a fixed aggregator.flow_seed, else this call's generator
            seed = payload.get("batch_seed")
            gen = self.ctx.generator if seed is None else torch.Generator().manual_seed(int(seed))
            return torch.randperm(n, generator=gen)[: int(payload["batch_size"])]
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.long or rows.ndim != 1 or not len(rows) \
                or bool(((rows < 0) | (rows >= n)).any()):
            raise ValueError(f"pcfl_flow_grad: 'rows' must be a non-empty 1-D int64 tensor of indices in [0, {n})")
        return rows

    def on_pcfl_flow_grad(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Algorithm 1 lines 4-10: gradients of one mini-batch's loss for the phase's parameters. ``objective``
        'authors' is the authors' train_manifold.py loss: 1000 x MSE + 0.01 x mean g(z)^2 for g, the NLL in bits
        per latent dimension for h."""
        flow = self._load_flow(payload)
        flow.train()
        idx = self._flow_rows(payload)
        x, y = self.ctx.train.batch(idx.to(self.ctx.train.y.device))
        z, c = self._flow_input(x, y)
        phase, authors = payload["phase"], payload.get("objective") == "authors"
        if phase == "recon":  # line 6: ||z - g^-1(Pad(Split(g(z))))||, gradients w.r.t. theta (g)
            if authors:
                loss = AUTHORS_MSE_FACTOR * flow.reconstruction_loss(z, c, kind="mse") \
                    + AUTHORS_LATENT_L2 * flow.latent_l2(z, c)
            else:
                loss = flow.reconstruction_loss(z, c, kind=payload.get("recon_loss", "norm"))
            prefix = "g."
        elif phase == "nll":  # line 9: negative log-likelihood of Split(g(z)) under h, g fixed; w.r.t. phi (h)
            loss = flow.nll_loss(z, c)
            if authors:  # nats -> bits per latent dimension (their nat_to_bit_per_dim)
                loss = loss / (math.log(2) * flow.latent_dim)
            prefix = "h."
        else:
            raise ValueError(f"unknown flow phase {phase!r}")
        named = [(k, p) for k, p in flow.named_parameters() if k.startswith(prefix)]
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        return {"grads": {k: (g.detach() if g is not None else torch.zeros_like(p))
                          for (k, p), g in zip(named, grads)},
                "loss": float(loss.detach()), "n": int(len(idx))}

    @torch.no_grad()
    def _codes(self, flow: ManifoldFlow) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """U'^i of Eq. 9: the latent codes of the training split (float64), and the labels when conditioned."""
        flow.eval()
        x, y = self.ctx.train.all()
        z, c = self._flow_input(x, y)
        parts = [flow.encode(z[s:s + _ENCODE_CHUNK], None if c is None else c[s:s + _ENCODE_CHUNK])
                 for s in range(0, len(z), _ENCODE_CHUNK)]
        codes = torch.cat(parts) if parts else z.new_zeros(0, flow.latent_dim)
        labels = None if c is None else c.detach().cpu().numpy()
        return codes.detach().cpu().numpy().astype(np.float64), labels

    def on_pcfl_region(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Eq. 9: the projected local manifold; only hull vertices (or box corners) leave the client."""
        flow = self._load_flow(payload)
        codes, labels = self._codes(flow)
        hp = self.ctx.hp
        try:
            region = build_region(codes, labels, kind=hp.overlap, clusters=int(hp.clusters),
                                  seed=derive_seed(self.ctx.seed, "pcfl-kmeans", self.ctx.cid) % (2 ** 32))
        except PflError as exc:  # bad input (e.g. too few codes for a hull): the server stops the run with it
            return {"pcfl_error": f"client {self.ctx.cid}: {exc}"}
        return {"region": region.to_payload(), "n": int(len(codes))}

    def on_pcfl_overlap(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Eq. 10 (D^{i,k} for every other client i) and Eq. 12 (this client's synthetic set)."""
        flow = self._load_flow(payload)
        codes, labels = self._codes(flow)
        me = self.ctx.cid
        regions = {int(i): Region.from_payload(r) for i, r in payload["regions"].items()}
        self.overlaps = {}
        counts: Dict[int, int] = {}
        for i in sorted(regions):
            if i == me:
                continue
            idx = overlap_indices(regions[i], codes, labels)
            if len(idx):
                self.overlaps[i] = idx
                counts[i] = int(len(idx))
        wanted, got, draws = self._synthesize(flow, regions, labels)
        return {"overlap_counts": counts, "synthetic": got, "wanted": wanted, "draws": draws}

    @torch.no_grad()
    def _synthesize(self, flow: ManifoldFlow, regions: Dict[int, Region],
                    labels: Optional[np.ndarray]) -> Tuple[int, int, int]:
        """Eq. 12-13: u' ~ N(0, I) kept inside this client's region and no other, decoded to (x, y)."""
        hp, me, task = self.ctx.hp, self.ctx.cid, self.ctx.task
        own = regions.get(me)
        xs, ys = [], []
        wanted_total = drawn_total = 0
        if own is not None and float(hp.synthetic_ratio) > 0:
            others = [regions[i] for i in sorted(regions) if i != me] if hp.synthetic_region == "unshared" else []
            gen = torch.Generator().manual_seed(derive_seed(self.ctx.generator.initial_seed(), "pcfl-eq12"))
            if labels is None:
                groups = [(None, self.ctx.num_train)]
            else:
                vals, cnt = np.unique(labels, return_counts=True)
                groups = [(int(v), int(c)) for v, c in zip(vals, cnt)]
            flow.eval()
            for label, n_label in groups:
                wanted = int(round(float(hp.synthetic_ratio) * n_label))
                if wanted == 0:
                    continue
                u, drawn = sample_unshared(flow.sample_base, own, others, wanted, wanted * int(hp.synthetic_draws),
                                           gen, label=label)
                wanted_total += wanted
                drawn_total += drawn
                if len(u) == 0:
                    continue
                c = None if label is None else torch.full((len(u),), label, dtype=torch.long, device=u.device)
                z = flow.decode(u, c)
                x, y = split_flow_data(z, task, self.ctx.train.x.shape[1:])
                if label is not None:
                    y = c
                keep = torch.isfinite(z).all(dim=1)  # a decode that overflowed is dropped, not trained on
                xs.append(x[keep])
                ys.append(y[keep].to(self.ctx.train.y.dtype).reshape(-1, *self.ctx.train.y.shape[1:]))
        if xs:
            self.syn_x = torch.cat(xs).to(self.ctx.device)
            self.syn_y = torch.cat(ys).to(self.ctx.device)
        else:
            self.syn_x, self.syn_y = torch.zeros(0), torch.zeros(0)
        return wanted_total, int(len(self.syn_y)), drawn_total

    # -- evaluation instrumentation (never used for training) ----------------------------------------------
    def on_pcfl_truth(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Counts of this client's D^{i,k} against the dataset's ground truth (synthetic_eval.py)."""
        from .synthetic_eval import truth_counts

        x = self.ctx.train.x.detach().reshape(len(self.ctx.train.x), -1)[:, 0].cpu()
        return truth_counts(self.ctx.cid, x, self.overlaps, payload)

    # -- persistent state ----------------------------------------------------------------------------------
    def _pcfl_state(self, device: Optional[str] = None) -> Dict[str, Any]:
        """PCFL's own per-client part: D^{i,k} indices, the synthetic set, and the base reply deferred between
        ``pcfl_fit`` and ``pcfl_apply``; tensors copied (to ``device`` when given)."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device, copy=True) if device is not None else t.detach().clone()

        return {"overlaps": {int(i): copy(v) for i, v in self.overlaps.items()},
                "syn_x": copy(self.syn_x), "syn_y": copy(self.syn_y), "pending": dict(self._pending)}

    def _load_pcfl_state(self, own: Dict[str, Any]) -> None:
        self.overlaps = {int(i): v.clone() for i, v in own["overlaps"].items()}
        self.syn_x, self.syn_y = (own[k].detach().to(self.ctx.device, copy=True) for k in ("syn_x", "syn_y"))
        self._pending = dict(own["pending"])

    def client_state(self) -> Dict[str, Any]:
        return {"base": super().client_state(), "pcfl": self._pcfl_state(device="cpu")}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state["base"])
        self._load_pcfl_state(state["pcfl"])

    def state_dict(self) -> Dict[str, Any]:
        return {"base": super().state_dict(), "pcfl": self._pcfl_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state["base"])
        self._load_pcfl_state(state["pcfl"])


class _SyntheticStep:
    """Inside one batched step's loss: the personal model, its data losses per step, the step's synthetic batch
    (``(x, y)`` holding ``per_step`` draws; empty: no beta term) and the calls so far."""

    __slots__ = ("personal", "per_step", "extra", "calls")

    def __init__(self, personal: nn.Module, per_step: int, extra: Sequence[torch.Tensor]) -> None:
        self.personal, self.per_step, self.extra, self.calls = personal, per_step, tuple(extra), 0


class PcflTrainer(ClientTrainer):
    """PCFL's client side around a base algorithm's trainer (a wrapper: see core/engine/compose.py)."""

    description = ("PCFL client: the base algorithm's local update plus Eq. 14's terms -- alpha on the overlaps "
                   "D^{i,k} other clients hold (computed there), beta on synthetic samples of the unshared region")
    params = TRAINER_PARAMS
    default_base = "local"
    wrapper_name = "PCFL"

    @classmethod
    def can_wrap(cls, base: type) -> Optional[str]:
        """Why PCFL cannot augment trainer class ``base`` (None: it can)."""
        if not (isinstance(base, type) and issubclass(base, LocalSGDTrainer)):
            return "its trainer is not a LocalSGDTrainer (PCFL needs personal_forward, upload and data_loss)"
        if getattr(base, "protocol", None) not in BASE_PROTOCOLS:
            return f"its trainer speaks protocol {getattr(base, 'protocol', None)!r}, not one of {BASE_PROTOCOLS}"
        for klass in base.__mro__:
            if klass is LocalSGDTrainer:
                break
            if "loss" in vars(klass):
                return (f"its trainer overrides loss() ({klass.__name__}), so its objective does not go through "
                        f"LocalSGDTrainer.data_loss where PCFL adds Eq. 14's terms")
        return None

    @classmethod
    def wrap(cls, base: type) -> type:
        """``PCFL[Base]``: the mixin before ``base``; params = the base's, then PCFL's."""
        return type(f"PCFL[{base.__name__}]", (PcflClientMixin, base), {
            # pooled when the base is, unless the base relies on the server re-sending its shared part: its
            # deferred upload is computed in 'pcfl_fit' and sent in a later 'pcfl_apply', so that part would
            # have to be declared too
            "declares_state": state_declared(base) and not getattr(base, "needs_shared_delivery", False),
            "protocol": PROTOCOL_PREFIX + str(base.protocol),
            "params": {**dict(getattr(base, "params", {}) or {}), **TRAINER_PARAMS},
            "description": cls.description,
            "__module__": __name__,
        })
