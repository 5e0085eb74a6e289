"""FedFomo client: weigh the downloaded models on a held-out validation split, move toward the ones that help
(first-order weights, ``equations.py``), then train on the rest of the training split.

Messages (protocol 'fedfomo'):
  ``fit`` {candidates: {cid: model state}} -> {params, num_samples, train_loss, weights, weighed, metrics}
  ``evaluate`` {} -> eval sums of the client's own model

The validation split is the paper's: ``trainer.val_ratio`` (default 0.2) of the client's training split, held out
by a permutation seeded from (run seed, client id) alone -- the same split every round, serially or with
``--workers`` -- and never trained on. The test split is untouched (it is what pflkit scores).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from pflkit.core import (ClientContext, ClientTrainer, Param, PflError, TensorData, derive_seed, evaluate, host_copy,
                         load_into, make_optimizer, minibatches, run_sgd)

from .equations import fomo_update, fomo_weights, state_distance

PROTOCOL = "fedfomo"


def _val_ratio(v: Any) -> Optional[str]:
    return None if 0 <= v < 1 else "must lie in [0, 1)"


def validation_split(n: int, ratio: float, seed: int, cid: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices) of a client's ``n`` training samples: round(ratio n) samples held out
    (at least 1 when ratio > 0 and n >= 2, never all), chosen by a permutation seeded from (seed, cid) only."""
    n_val = int(round(ratio * n)) if ratio > 0 else 0
    if ratio > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    elif n < 2:
        n_val = 0
    gen = torch.Generator().manual_seed(derive_seed(seed, "fedfomo-validation", cid))
    order = torch.randperm(n, generator=gen)
    return order[n_val:].sort().values, order[:n_val].sort().values


def subset(data: TensorData, idx: torch.Tensor) -> TensorData:
    idx = idx.to(data.y.device)
    return TensorData(data.x[idx], data.y[idx], data.transform)


class FedFomoTrainer(ClientTrainer):
    """Combines the downloaded models with first-order weights, trains, uploads its model and the weights."""

    protocol = PROTOCOL
    declares_state = True  # runs pooled: a client keeps only its own model between calls
    description = ("weighs M downloaded models by validation-loss improvement per unit distance, moves toward the "
                   "improving ones, trains on the rest of its training split")
    params = {
        "val_ratio": Param(0.2, "share of the client's training split held out as its validation split for the "
                                "first-order weights (default 0.2: the paper's 80/20 train/validation split, as in "
                                "the official code, PFLlib and FL-bench); seeded by (seed, client), never trained "
                                "on; 0 only with aggregator.candidates=0", check=_val_ratio),
    }

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        self.model = ctx.build_model()
        self.scratch = ctx.build_model()  # holds one candidate at a time while it is scored
        sd = self.model.state_dict()
        self.float_keys = [k for k, v in sd.items() if v.is_floating_point()]
        self.param_keys = [k for k, _ in self.model.named_parameters()]  # the distance ||theta_n - theta_i||
        self._split: Optional[Tuple[int, TensorData, TensorData]] = None

    # -- data -------------------------------------------------------------------------------------------------
    def splits(self) -> Tuple[TensorData, TensorData]:
        """This client's (train part, validation part): derived from (seed, cid), so a pooled trainer re-derives
        it for each client instead of keeping it as state."""
        cid = self.ctx.cid
        if self._split is None or self._split[0] != cid:
            ratio = float(self.ctx.hp.get("val_ratio", 0.2))
            if ratio == 0:
                self._split = (cid, self.ctx.train, subset(self.ctx.train, torch.zeros(0, dtype=torch.long)))
            else:
                tr, va = validation_split(len(self.ctx.train), ratio, self.ctx.seed, cid)
                self._split = (cid, subset(self.ctx.train, tr), subset(self.ctx.train, va))
        return self._split[1], self._split[2]

    def validation_loss(self, module: torch.nn.Module) -> float:
        _, val = self.splits()
        res = evaluate(module, val, self.ctx.task, self.ctx.train_cfg.eval_batch_size)
        return res.loss

    # -- protocol ---------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        candidates = payload.get("candidates", {})
        if not isinstance(candidates, Mapping):
            raise PflError("fedfomo 'fit' message: 'candidates' must map client ids to model states")
        weighed = sorted(int(c) for c in candidates)
        weights = self.first_order_update([candidates[c] for c in weighed])
        train, _ = self.splits()
        self.model.train()
        opt = make_optimizer(self.model.parameters(), self.ctx.train_cfg)
        cfg = self.ctx.train_cfg
        batches = minibatches(train, cfg.batch_size, cfg.local_epochs, generator=self.ctx.generator,
                              drop_last=bool(cfg.get("drop_last", False)))
        loss = run_sgd(batches, lambda x, y: self.ctx.task.loss(self.model(x), y), opt)
        return {
            "params": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "num_samples": len(train),
            "train_loss": loss,
            "weights": weights.to(torch.float32),
            "weighed": weighed,
            "metrics": {"improving_candidates": int((weights > 0).sum()), "candidates": len(weighed)},
        }

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        return self.evaluate_model(self.model)

    @torch.no_grad()
    def first_order_update(self, candidates: List[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """Score the client's model and each candidate on the validation split, compute w_n and load the updated
        model (integer buffers stay the client's own). Returns w (float64, candidates' order)."""
        if not candidates:
            return torch.zeros(0, dtype=torch.float64)
        own = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for n, state in enumerate(candidates):
            if not isinstance(state, Mapping) or set(state) != set(own):
                raise PflError(f"fedfomo: candidate model {n} does not match this client's model")
        own_loss = self.validation_loss(self.model)
        losses, distances = [], []
        dev = self.ctx.device
        moved = [{k: v.to(dev) for k, v in state.items()} for state in candidates]
        for state in moved:
            load_into(self.scratch, state)
            losses.append(self.validation_loss(self.scratch))
            distances.append(state_distance(own, state, self.param_keys))
        weights = fomo_weights(own_loss, losses, distances)
        if float(weights.sum()) > 0:
            load_into(self.model, {k: fomo_update(own[k], [s[k] for s in moved], weights) for k in self.float_keys})
        return weights

    # -- declared state: the client's own model (candidates arrive with every fit message) -----------------------
    def client_state(self) -> Dict[str, Any]:
        return {"model": host_copy(self.model.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        load_into(self.model, state["model"])

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
