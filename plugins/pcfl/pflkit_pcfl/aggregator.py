"""PCFL, server side: federated flow training (Algorithm 1), the region relay (Algorithm 2 lines 1-2) and the
routing of the overlap term (Algorithm 2 lines 3-16), around any base algorithm's aggregator.

``PcflAggregator`` is a wrapper (core/engine/compose.py): for ``trainer.base = B`` the core builds
``PCFL[BAggregator] = (PcflServerMixin, BAggregator)``.

Set-up (``setup_steps``, resumable: the core checkpoints after every yielded step)
  1. Flow training, ``flow_epochs`` steps T_m (Algorithm 1). Step t: a seeded subset of ``flow_join_ratio`` of
     the clients each computes the gradient of its loss on one mini-batch of ``flow_batch_size`` samples; the
     server averages the gradients weighted by the clients' batch sizes (= the gradient of the pooled mini-batch's
     mean loss) and takes one Adam step. Steps t < T_m / 2 fit the outer flow g by reconstruction, the others fit
     the inner flow h by likelihood with g frozen. Losses go to TensorBoard as ``pcfl/flow/recon`` and
     ``pcfl/flow/nll`` at steps t - T_m (negative: set-up precedes round 1).
  2. Regions (Eq. 9): every client replies its region's payload (hull vertices or boxes of its latent codes).
  3. Relay (Eq. 10, 12): the server sends every region to every client (real downlink, counted); each client
     keeps D^{i,k} and its synthetic set and replies only counts |D^{i,k}|, which the server keeps to route.

Round t
  1. ``pcfl_fit`` to each selected client i: the base's fit payload; i runs the base's local update with the beta
     term and replies its personal model f_i (or, when no client holds an overlap with it, or alpha = 0, the
     base's reply right away).
  2. ``pcfl_alpha`` to each client k that holds a non-empty D^{i,k} for some selected i: one message carrying every
     such f_i; k replies one update (or gradient) per owner.
  3. ``pcfl_apply`` to each i: the Eq. 11 average of its contributions; i applies it and replies the base's fit
     reply, which (4.) the base's ``aggregate_fit`` combines as usual.
Every message is counted in the run's communication totals by the core.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from pflkit.core import (ConfigError, GlobalModelAggregator, Message, Param, PflError, ServerAggregator, SetupStep,
                         derive_seed, open_unit_interval, payload_nbytes, positive)

from .equations import AVERAGES, average_overlap_terms, default_latent_dim
from .flow import flow_data
from .trainer import BASE_PROTOCOLS, PROTOCOL_PREFIX, build_flow

log = logging.getLogger("pflkit")
# the flow's two phases (Algorithm 1: g fitted first, then h with g frozen), as set-up progress names them
FLOW_LOSS_NAMES = {"recon": "reconstruction loss of g", "nll": "NLL of h"}
FLOW_TRAININGS = ("algorithm1", "authors")
SHARED_FLOW = "pcfl-flow"  # the trained flow's name among the run's shared artifacts (core.api.artifacts)

AGGREGATOR_PARAMS = {
    "latent_dim": Param(None, "manifold dimension d' (Eq. 8); default: the paper's value for the dataset (pcfl_sine "
                              "2, emnist/FEMNIST 12, adult 32, cifar10 256), else 2", type=int, check=positive),
    "flow_training": Param("algorithm1", "algorithm1 = Algorithm 1 as printed: flow_epochs steps, each one "
                                         "mini-batch from each of a flow_join_ratio subset of the clients and one "
                                         "Adam step at a constant flow_lr; authors = the authors' train_manifold.py: "
                                         "flow_recon_epochs then flow_density_epochs passes over the pooled training "
                                         "rows of every client in mini-batches of flow_batch_size (each client "
                                         "computes the gradient on its rows of a batch), AdamW with "
                                         "flow_weight_decay, a cosine learning rate per phase, the gradient norm "
                                         "clipped at flow_clip, their loss weights (1000 x MSE + 0.01 x mean g(z)^2; "
                                         "NLL in bits per dimension)", choices=FLOW_TRAININGS),
    "flow_epochs": Param(400, "algorithm1: Algorithm 1's T_m, flow training steps, each one mini-batch per selected "
                              "client and one server Adam step; the first half fits g (reconstruction), the second "
                              "h (NLL)", check=positive),
    "flow_recon_epochs": Param(70, "authors: passes over the pooled rows fitting g (their Adult and CIFAR-10 "
                                   "scripts: 70 and 50)", check=positive),
    "flow_density_epochs": Param(70, "authors: passes over the pooled rows fitting h with g fixed (their scripts: "
                                     "70)", check=positive),
    "flow_weight_decay": Param(1e-5, "authors: AdamW's decoupled weight decay (their default 1e-5)",
                               check=lambda v: None if v >= 0 else "must be >= 0"),
    "flow_clip": Param(10.0, "authors: the flow's gradient norm is clipped to this (their default 10)",
                       check=positive),
    "flow_batch_size": Param(50, "Algorithm 1's B_m: samples per client mini-batch (authors' code: 50; 100 for "
                                 "CIFAR-10 and FEMNIST)", check=positive),
    "flow_lr": Param(3e-4, "Adam learning rate of the flow (authors' CIFAR-10 script: 3e-4; their synthetic run "
                           "uses 1e-2)", check=positive),
    "flow_seed": Param(None, "seed of the flow's initialisation, pass order and mini-batches; null: the run's seed "
                             "(every seed trains its own flow); a fixed value gives every run the same flow, as the "
                             "authors train it once (train_manifold.py) and load it in each classification run. Runs "
                             "given a shared folder (fl compare, fl reproduce: OUT/artifacts; fl run --artifacts "
                             "DIR) train a flow once and load it where the flow's seed, options, data and code are "
                             "the same", type=int,
                       check=lambda v: None if v is None or v >= 0 else "must be >= 0"),
    "flow_join_ratio": Param(0.1, "fraction of clients drawn for each flow step (Algorithm 1, line 2: 'a subset')",
                             check=open_unit_interval),
    "flow_transforms": Param(4, "coupling layers of the outer flow g (and of h, see flow_inner_transforms)",
                             check=positive),
    "flow_inner_transforms": Param(4, "coupling layers of the inner flow h", check=positive),
    "flow_hidden": Param(64, "hidden width of the flows' coupling networks", check=positive),
    "flow_recon_loss": Param("norm", "Algorithm 1 line 6: norm = mean ||z - proj(z)|| (the paper); mse = mean "
                                     "squared error (the authors' code)", choices=("norm", "mse")),
    "flow_pad": Param(1, "regression only: zeros between x and y in z = (x, 0, y) (paper section 5.1)",
                      check=lambda v: None if v >= 0 else "must be >= 0"),
    "setup_block": Param(50, "algorithm1: flow steps between set-up checkpoints (a resumed run continues from the "
                             "last one); authors: one checkpoint per pass", check=positive),
    "alpha_average": Param("all", "Eq. 11's mean over k != i: all = 1/(N-1) with empty overlaps counting 0 (as "
                                  "printed); contributing = the mean over the clients that hold D^{i,k}",
                           choices=AVERAGES),
    "figure": Param(True, "draw Figure 5(e) (regions in latent space, coloured by client objective when the "
                          "dataset knows it) into the run directory and TensorBoard; only for d' = 2"),
}


def flow_arch(hp, data_info: Dict[str, Any], task, dataset: str) -> Dict[str, Any]:
    """The flow every party builds: data dimension d from the data's shape, d' checked against it."""
    shape = tuple(data_info.get("input_shape") or ())
    if not shape:
        raise ConfigError("PCFL needs the dataset's input shape (ServerContext.data_info) to build its flow")
    x = torch.zeros(1, *shape)
    y = torch.zeros(1, dtype=torch.long) if task.kind == "classification" else torch.zeros(1, task.output_dim)
    z, _ = flow_data(x, y, task, pad=int(hp.flow_pad))
    d = int(z.shape[1])
    latent = hp.latent_dim if hp.get("latent_dim") is not None else default_latent_dim(dataset, d)
    if not 0 < latent < d:
        form = "flattened inputs" if task.kind == "classification" else f"z = (x, 0 x {hp.flow_pad}, y)"
        raise ConfigError(f"aggregator.latent_dim: {latent} is invalid: the manifold dimension d' must be below the "
                          f"data dimension d = {d} ({form} of dataset '{dataset}')")
    return {"data_dim": d, "latent_dim": int(latent),
            "num_classes": task.output_dim if task.kind == "classification" else 0,
            "outer_transforms": int(hp.flow_transforms), "inner_transforms": int(hp.flow_inner_transforms),
            "hidden": int(hp.flow_hidden), "pad": int(hp.flow_pad)}


class PcflServerMixin:
    """The PCFL server behaviour, placed before a base aggregator in the MRO (see the module docstring)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        hp = ctx.hp
        self.arch = flow_arch(hp, ctx.data_info, ctx.task, str(ctx.cfg.dataset.name))
        # the flow's own seed: the run's, or aggregator.flow_seed (one flow for every run, the authors' protocol)
        self.flow_seed = int(hp.flow_seed) if hp.get("flow_seed") is not None else int(ctx.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.flow_seed, "pcfl-flow-init"))
            self.flow = build_flow(self.arch, ctx.device)
        self.authors = hp.flow_training == "authors"
        if self.authors:  # one AdamW for both phases = their fresh one per phase: the phases' parameters are
            # disjoint, and AdamW skips (and never decays) a parameter without a gradient
            self.flow_opt = torch.optim.AdamW(self.flow.parameters(), lr=float(hp.flow_lr),
                                              weight_decay=float(hp.flow_weight_decay))
        else:
            self.flow_opt = torch.optim.Adam(self.flow.parameters(), lr=float(hp.flow_lr))
        self.flow_step = 0
        self.flow_done = False  # trained here or loaded from a shared artifact
        self.flow_sizes: Dict[int, int] = {}  # authors' schedule: each client's training rows
        self.regions_done = False
        n = ctx.num_clients
        self.counts = torch.zeros(n, n, dtype=torch.long)   # counts[i, k] = |D^{i,k}|, reported by k
        self.report: Dict[str, float] = {}                   # set-up measurements (tests, README)
        self.report_pending = False
        self.last_round: Dict[str, Any] = {}

    # -- set-up --------------------------------------------------------------------------------------------
    def setup_steps(self, comm) -> Iterator[SetupStep]:
        """Algorithm 1, then Algorithm 2 lines 1-2; yields after each resumable block (see core simulation) a
        line with the block's mean losses; progress is counted in flow steps plus one for the regions. A flow
        another run trained with the same seed, options, data and code (``ctx.artifacts``) is loaded instead."""
        total, block = int(self.ctx.hp.flow_epochs), int(self.ctx.hp.setup_block)
        units = total + 1
        if self.authors:
            units = int(self.ctx.hp.flow_recon_epochs) + int(self.ctx.hp.flow_density_epochs) + 1
        if not self.flow_done and self.flow_step == 0 and self._load_shared_flow():
            yield SetupStep(f"PCFL flow loaded from a shared artifact ({self.shared_from}), not trained again: the "
                            f"same flow seed ({self.flow_seed}), options, data and code", units - 1, units)
        if self.authors and not self.flow_done:
            yield from self._authors_flow(comm)
        while not self.authors and not self.flow_done and self.flow_step < total:
            first, stop = self.flow_step, min(total, self.flow_step + block)
            losses: Dict[str, list] = {}
            while self.flow_step < stop:
                phase, loss = self._flow_step(comm, total)
                losses.setdefault(phase, []).append(loss)
            means = ", ".join(f"{FLOW_LOSS_NAMES[p]} {np.mean(v):.4f}" for p, v in losses.items())
            yield SetupStep(f"PCFL flow steps {first + 1}-{stop} of {total} (Algorithm 1): mean {means}",
                            stop, units)
        if not self.flow_done:
            self.flow_done = True
            self.ctx.artifacts.save(SHARED_FLOW, self._shared_key(), self._shared_tensors())
        if not self.regions_done:
            self._regions(comm)
            self.regions_done = True
            r = self.report
            yield SetupStep(f"PCFL regions (Eq. 9-10, 12): {int(r.get('overlap_pairs', 0))} client pairs overlap "
                            f"({100 * r.get('overlap_pair_fraction', 0.0):.1f}%), synthetic samples "
                            f"{int(r.get('synthetic_got', 0))} of {int(r.get('synthetic_wanted', 0))} wanted",
                            units, units)

    def _authors_flow(self, comm) -> Iterator[SetupStep]:
        """The authors' train_manifold.py, federated: pass e over the pooled rows is a seeded permutation cut into
        mini-batches of B_m; a batch's rows stay on their clients, each computes its mean loss and gradient on
        them, and the sample-weighted average the server forms is the pooled batch's gradient. One AdamW step per
        batch at the pass's cosine learning rate (their CosineAnnealingLR, stepped per pass, per phase), the
        phase's gradient norm clipped. A checkpoint after every pass."""
        hp = self.ctx.hp
        recon, density = int(hp.flow_recon_epochs), int(hp.flow_density_epochs)
        if not self.flow_sizes:
            replies = comm.send({c: Message("pcfl_flow_size", {}) for c in comm.client_ids})
            self.flow_sizes = {int(c): int(replies[c]["n"]) for c in sorted(replies)}
        cids = sorted(self.flow_sizes)
        sizes = torch.tensor([self.flow_sizes[c] for c in cids], dtype=torch.long)
        pooled, batch = int(sizes.sum()), int(hp.flow_batch_size)
        if pooled == 0:
            raise PflError("PCFL flow (authors' schedule): no client holds a training row")
        ends = sizes.cumsum(0)
        starts = ends - sizes
        per_pass = -(-pooled // batch)
        while self.flow_step < (recon + density) * per_pass:
            epoch, first = divmod(self.flow_step, per_pass)
            phase, k, length = ("recon", epoch, recon) if epoch < recon else ("nll", epoch - recon, density)
            lr = float(hp.flow_lr) * (1 + math.cos(math.pi * k / length)) / 2 if length > 1 else float(hp.flow_lr)
            order = torch.randperm(pooled, generator=torch.Generator().manual_seed(
                derive_seed(self.flow_seed, "pcfl-flow-pass", epoch)))
            losses = []
            for b in range(first, per_pass):
                rows = order[b * batch:(b + 1) * batch]
                owner = torch.searchsorted(ends, rows, right=True)
                shares = {cids[int(j)]: rows[owner == j] - starts[j] for j in torch.unique(owner).tolist()}
                losses.append(self._flow_update(comm, phase, {c: {"rows": r} for c, r in shares.items()}, lr))
            yield SetupStep(f"PCFL flow pass {epoch + 1} of {recon + density} (the authors' schedule, "
                            f"{per_pass} batches, lr {lr:.3g}): mean {FLOW_LOSS_NAMES[phase]} "
                            f"{np.mean(losses):.4f}", epoch + 1, recon + density + 1)
            if self.ctx.logger is not None:
                self.ctx.logger.log_scalar(f"pcfl/flow/{phase}", float(np.mean(losses)),
                                           step=epoch + 1 - (recon + density))

    # -- the flow shared between runs (core.api.artifacts) ------------------------------------------------------
    def _shared_key(self) -> Dict[str, Any]:
        """What determines the trained flow besides the data and code (which the core adds): the architecture,
        every aggregator option but those read only after the flow (routing, figure, checkpoint blocks), and the
        flow's seed."""
        hp = {k: v for k, v in self.ctx.hp.items() if k not in ("alpha_average", "figure", "setup_block")}
        return {"arch": self.arch, "aggregator": hp, "flow_seed": self.flow_seed}

    def _shared_tensors(self) -> Dict[str, torch.Tensor]:
        losses = {f"report.{k}": torch.tensor(float(v), dtype=torch.float64)
                  for k, v in self.report.items() if k.startswith("flow_")}
        return {**{f"flow.{k}": v for k, v in self._flow_state().items()}, **losses}

    def _load_shared_flow(self) -> bool:
        """Load a flow trained by another run sharing this one's artifacts folder; False when there is none."""
        tensors = self.ctx.artifacts.load(SHARED_FLOW, self._shared_key())
        if tensors is None:
            return False
        state = {k[len("flow."):]: v for k, v in tensors.items() if k.startswith("flow.")}
        own = self.flow.state_dict()
        if set(state) != set(own) or any(state[k].shape != own[k].shape or state[k].dtype != own[k].dtype
                                         for k in own):
            log.warning("PCFL: the shared flow does not fit this run's flow (keys, shapes or dtypes); training it")
            return False
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v.to(own[k].device))
        self.report.update({k[len("report."):]: float(v) for k, v in tensors.items() if k.startswith("report.")})
        events = self.ctx.artifacts.events
        self.shared_from = events[-1].get("made_by") or "another run" if events else "another run"
        self.flow_done = True
        return True

    def _flow_state(self) -> Dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.flow.state_dict().items()}

    def _flow_step(self, comm, total: int) -> Tuple[str, float]:
        """Algorithm 1, one iteration t: seeded client subset, their gradients averaged, one Adam step."""
        hp, t = self.ctx.hp, self.flow_step
        phase = "recon" if t < total / 2 else "nll"
        ids = list(comm.client_ids)
        rng = np.random.default_rng(derive_seed(self.flow_seed, "pcfl-flow-step", t))
        m = max(1, min(len(ids), int(round(float(hp.flow_join_ratio) * len(ids)))))
        chosen = sorted(int(c) for c in rng.choice(ids, size=m, replace=False))
        # with a fixed flow seed the clients draw their mini-batches from it too (else from their own generator,
        # seeded by the run's seed), so the flow is the same in every run
        fixed = self.ctx.hp.get("flow_seed") is not None
        loss = self._flow_update(comm, phase, {c: ({"batch_seed": derive_seed(self.flow_seed, "pcfl-flow-batch", t, c)}
                                                   if fixed else {}) for c in chosen})
        if self.ctx.logger is not None:
            self.ctx.logger.log_scalar(f"pcfl/flow/{phase}", loss, step=t + 1 - total)
        return phase, loss

    def _flow_update(self, comm, phase: str, extra: Dict[int, Dict[str, Any]], lr: Optional[float] = None
                     ) -> float:
        """Send ``pcfl_flow_grad`` to the clients of ``extra`` (with their extra payload fields), average their
        gradients weighted by their batch sizes (Algorithm 1 line 13) and take one optimiser step; the authors'
        schedule sets the learning rate and clips the phase's gradient norm. Returns the weighted mean loss."""
        hp, t = self.ctx.hp, self.flow_step
        payload = {"flow": self._flow_state(), "arch": self.arch, "phase": phase,
                   "batch_size": int(hp.flow_batch_size), "recon_loss": hp.flow_recon_loss}
        if self.authors:
            payload["objective"] = "authors"
        replies = comm.send({c: Message("pcfl_flow_grad", {**payload, **more}) for c, more in extra.items()})
        if not replies:
            raise PflError(f"PCFL flow step {t}: every selected client failed (run with -v for tracebacks)")
        cids = sorted(replies)
        weights = torch.tensor([float(replies[c]["n"]) for c in cids], dtype=torch.float64)
        weights = weights / weights.sum()
        params = dict(self.flow.named_parameters())
        self.flow_opt.zero_grad(set_to_none=True)
        for name in replies[cids[0]]["grads"]:
            acc = None
            for w, c in zip(weights.tolist(), cids):  # sum in sorted client order
                g = replies[c]["grads"][name].to(self.ctx.device, torch.float64) * w
                acc = g if acc is None else acc + g
            params[name].grad = acc.to(params[name].dtype)
        if self.authors:
            for group in self.flow_opt.param_groups:
                group["lr"] = lr
            torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None],
                                           float(hp.flow_clip))
        self.flow_opt.step()
        self.flow_opt.zero_grad(set_to_none=True)
        loss = float(sum(w * float(replies[c]["loss"]) for w, c in zip(weights.tolist(), cids)))
        self.flow_step += 1
        self.report[f"flow_{phase}"] = loss
        return loss

    def _regions(self, comm) -> None:
        """Eq. 9 (regions up), their relay (down), Eq. 10/12 on the clients; counts kept for routing."""
        flow = self._flow_state()
        ids = list(comm.client_ids)
        replies = comm.send({c: Message("pcfl_region", {"flow": flow, "arch": self.arch}) for c in ids})
        errors = [replies[c]["pcfl_error"] for c in sorted(replies) if "pcfl_error" in replies[c]]
        if errors:
            raise ConfigError(errors[0])
        regions = {c: replies[c]["region"] for c in sorted(replies)}
        if not regions:
            raise PflError("PCFL set-up: no client returned its region (run with -v for tracebacks)")
        region_bytes = payload_nbytes(regions)
        out = comm.send({c: Message("pcfl_overlap", {"flow": flow, "arch": self.arch, "regions": regions})
                         for c in ids})
        self.counts.zero_()
        wanted = got = draws = 0
        for k in sorted(out):
            for i, n in out[k]["overlap_counts"].items():
                self.counts[int(i), k] = int(n)
            wanted += int(out[k]["wanted"])
            got += int(out[k]["synthetic"])
            draws += int(out[k]["draws"])
        n = len(ids)
        pairs = int((self.counts > 0).sum())
        self.report.update({
            "region_bytes_up": float(region_bytes), "region_bytes_down": float(region_bytes * len(ids)),
            "overlap_pairs": float(pairs), "overlap_pair_fraction": pairs / max(1, n * (n - 1)),
            "overlap_mean_size": float(self.counts.sum()) / max(1, pairs),
            "synthetic_wanted": float(wanted), "synthetic_got": float(got),
            "synthetic_acceptance": got / draws if draws else 0.0,
        })
        from .synthetic_eval import draw_regions, overlap_quality

        quality = overlap_quality(self, comm)
        if quality:
            self.report.update(quality)
        self.report_pending = True  # logged with round 1's record (a pause right after set-up keeps it)
        logger = self.ctx.logger
        if logger is not None:
            if self.ctx.hp.figure and self.arch["latent_dim"] == 2:
                image = draw_regions(regions, self.ctx.data_info.get("meta") or {}, self.ctx.cfg,
                                     getattr(logger, "run_dir", None))
                if image is not None:
                    logger.log_image("pcfl/manifold", image)

    # -- rounds --------------------------------------------------------------------------------------------
    def run_round(self, rnd: int, selected: Sequence[int], comm) -> None:
        if self.report_pending and self.ctx.logger is not None:
            for key, value in self.report.items():
                if not key.startswith("flow_"):
                    self.ctx.logger.log_scalar(f"pcfl/{key}", value)
        self.report_pending = False
        alpha = float(self.ctx.cfg.trainer.get("alpha", 0.0))
        base = self.configure_fit(rnd, selected)
        n = len(comm.client_ids)
        holds = (self.counts > 0)
        defer = {i: bool(alpha > 0 and holds[i].any()) for i in base}
        msgs = {i: Message("pcfl_fit", {"kind": m.kind, "payload": m.payload, "defer": defer[i]})
                for i, m in base.items()}
        replies = comm.send(msgs)
        final = {i: r for i, r in replies.items() if not defer[i]}
        personal = {i: r for i, r in sorted(replies.items()) if defer[i]}
        jobs: Dict[int, Message] = {}
        if personal:
            for k in comm.client_ids:  # Algorithm 2 line 9: f_i goes to the clients holding D^{i,k}
                owners = [i for i in personal if i != k and bool(holds[i, k])]
                if owners:
                    jobs[k] = Message("pcfl_alpha", {"models": {i: {"state": personal[i]["personal"],
                                                                    "steps": int(personal[i]["steps"])}
                                                                for i in owners}})
            contrib = comm.send(jobs) if jobs else {}
            applies = {}
            for i in personal:  # Algorithm 2 line 13 / Eq. 11, per owner
                parts = [contrib[k]["updates"][i] for k in sorted(contrib) if i in contrib[k].get("updates", {})]
                applies[i] = Message("pcfl_apply",
                                     {"update": average_overlap_terms(parts, n, self.ctx.hp.alpha_average)})
            final.update(comm.send(applies))
        self.last_round = {"round": rnd, "deferred": sorted(personal), "alpha_jobs": sorted(jobs)}
        if self.ctx.logger is not None:
            self.ctx.logger.log_scalar("pcfl/round/overlap_clients", float(len(jobs)))
        push = self.aggregate_fit(rnd, final)
        if push:
            comm.send(push)

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"base": super().state_dict(),
                "pcfl": {"flow": self._flow_state(), "flow_opt": self.flow_opt.state_dict(),
                         "flow_step": self.flow_step, "flow_done": self.flow_done,
                         "flow_sizes": dict(self.flow_sizes),
                         "regions_done": self.regions_done,
                         "counts": self.counts.clone(), "report": dict(self.report),
                         "report_pending": self.report_pending}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state["base"])
        own = state["pcfl"]
        self.flow.load_state_dict(own["flow"])
        self.flow_opt.load_state_dict(own["flow_opt"])
        self.flow_step = int(own["flow_step"])
        # .get: a checkpoint from before the key existed is done once its regions are (or resumes the training)
        self.flow_done = bool(own.get("flow_done", own["regions_done"]))
        self.flow_sizes = {int(c): int(n) for c, n in own.get("flow_sizes", {}).items()}
        self.regions_done = bool(own["regions_done"])
        self.counts = own["counts"].clone()
        self.report = dict(own["report"])
        self.report_pending = bool(own["report_pending"])


class PcflAggregator(ServerAggregator):
    """PCFL's server side around a base algorithm's aggregator (a wrapper: see core/engine/compose.py)."""

    description = ("PCFL server: federated manifold-flow training (Algorithm 1), region relay (Eq. 9-10, 12), "
                   "routing of the overlap term between clients (Algorithm 2)")
    params = AGGREGATOR_PARAMS
    default_base = "local"
    wrapper_name = "PCFL"

    @classmethod
    def can_wrap(cls, base: type) -> Optional[str]:
        if not (isinstance(base, type) and issubclass(base, ServerAggregator)):
            return "its aggregator is not a ServerAggregator"
        if getattr(base, "protocol", None) not in BASE_PROTOCOLS:
            return f"its aggregator speaks protocol {getattr(base, 'protocol', None)!r}, not one of {BASE_PROTOCOLS}"
        if base.protocol == "global-model" and not issubclass(base, GlobalModelAggregator):
            return "its aggregator is not a GlobalModelAggregator"
        for klass in base.__mro__:
            if klass in (ServerAggregator, GlobalModelAggregator):
                break
            if "run_round" in vars(klass):
                return (f"its aggregator drives its own rounds ({klass.__name__}.run_round), which PCFL's round "
                        f"would bypass")
        return None

    @classmethod
    def wrap(cls, base: type) -> type:
        return type(f"PCFL[{base.__name__}]", (PcflServerMixin, base), {
            "protocol": PROTOCOL_PREFIX + str(base.protocol),
            "params": {**dict(getattr(base, "params", {}) or {}), **AGGREGATOR_PARAMS},
            "description": cls.description,
            "__module__": __name__,
        })
