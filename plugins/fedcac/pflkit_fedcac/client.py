"""FedCAC client (Algorithm 1, client side): train E epochs, score sensitivity (Eq. 5), upload model + mask (Eq. 6),
then load the personalised initialisation the server composed (Eq. 11)."""
from __future__ import annotations

from typing import Any, Dict, List

from easydict import EasyDict
from torch import nn

from pflkit.core import (BatchedForm, BatchedPhase, BitMask, LocalSGDTrainer, Param, PflError, Space, bn_keys,
                         load_into, trained_names, unit_interval)

from .equations import SELECTIONS, critical_masks, sensitivity

PROTOCOL = "fedcac"


class FedCACTrainer(LocalSGDTrainer):
    """Local SGD on the personal model; uploads its parameters and a 1-bit critical mask per parameter.

    Messages (protocol 'fedcac'):
      ``fit`` {} -> {params, mask: {key: BitMask}, num_samples, train_loss, metrics: {critical_fraction}}
      ``update`` {params} -> {}         the server's Eq. (11) result for this client; loaded in place
      ``evaluate`` {} -> eval sums      of the personal model

    Only trainable parameters travel. Buffers -- batch-norm running statistics above all -- never leave the
    client and are never overwritten (the paper, Section 4.2, keeps running_mean/var local like FedBN).
    """

    protocol = PROTOCOL
    description = "local SGD; uploads model + critical-parameter bit mask (Eq. 5-6); loads its Eq. 11 model"
    params = {
        "tau": Param(0.5, "fraction of each parameter tensor marked critical (Eq. 6); paper default 0.5",
                     check=unit_interval,
                     space=Space.real(0.1, 0.9, source="around the paper's 0.5 (Sec. 4.5, Fig. 5: best near 0.5); "
                                                       "the paper gives no grid")),
        "selection": Param("sensitivity", "how critical parameters are chosen (Figure 3): sensitivity = top-tau of "
                           "Eq. 5 (the method), random, reverse = least sensitive", choices=SELECTIONS),
    }

    # declared state: the whole personal model (no message brings it back: 'fit' carries nothing, 'update' only
    # the shared parameters); nothing else survives a call
    declares_state = True
    needs_shared_delivery = False

    def client_keys(self) -> List[str]:
        return list(self.model.state_dict())

    @classmethod
    def shared_keys(cls, model: nn.Module, hp: EasyDict) -> List[str]:
        """Trainable parameters, never a batch-norm statistic (those are buffers and stay local)."""
        local = set(bn_keys(model))
        return [k for k, p in model.named_parameters() if p.requires_grad and k not in local]

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        params = dict(self.model.named_parameters())
        start = {k: params[k].detach().clone() for k in self.shared}  # theta^{t,0}
        loss = self.local_update()  # E epochs of the core's run_sgd
        return self._reply(start, loss)

    def _reply(self, start: Dict[str, Any], loss: float) -> Dict[str, Any]:
        """The fit reply once the local update is done: the critical masks from theta^{t,0} -> theta^{t,E}."""
        params = dict(self.model.named_parameters())
        end = {k: params[k].detach() for k in self.shared}  # theta^{t,E}
        masks = critical_masks(sensitivity(start, end), self.ctx.hp.tau, self.ctx.hp.selection,
                               generator=self.ctx.generator)
        critical = sum(int(m.sum()) for m in masks.values())
        total = sum(m.numel() for m in masks.values())
        return {
            "params": self.upload(),
            "mask": {k: BitMask(m) for k, m in masks.items()},
            "num_samples": self.ctx.num_train,
            "train_loss": loss,
            "metrics": {"critical_fraction": critical / max(total, 1)},
        }

    # clients.batched: the base local update, batched; the sensitivity stays per client (after training)
    def batched_begin(self, payload: Dict[str, Any]) -> None:
        pass  # a fit brings nothing: the model holds w_i^t since the last 'update'

    def batched_form(self) -> BatchedForm:
        phase = BatchedPhase(self.loss, trained_names(self.model, "model"), int(self.ctx.train_cfg.local_epochs))
        names = set(dict(self.model.named_parameters()))

        def reply(losses, start, aux):
            return self._reply({k: start[f"model.{k}"] for k in self.shared if k in names}, losses[-1])

        return BatchedForm({"model": self.model}, [phase], reply)

    def on_update(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """Adopt the server-composed ``w_i^{t+1}`` (Eq. 11) for the shared parameters; buffers stay as they are."""
        params = payload.get("params")
        if not isinstance(params, dict):
            raise PflError("fedcac 'update' message carries no 'params'")
        missing = [k for k in self.shared if k not in params]
        if missing:
            raise PflError(f"fedcac 'update' message lacks parameters {missing[:3]}")
        load_into(self.model, {k: params[k] for k in self.shared})
        return {}
