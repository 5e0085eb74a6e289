"""FedPHP (Li, Zhan, Shao, Li, Song: "FedPHP: Federated Personalization with Inherited Private Models",
ECML-PKDD 2021).

FedAvg whose clients each keep a historical personalised model (HPM), a moving average of their past local models.
A selected client trains the received global model on (1 - lambda) * CE + lambda * KT, where KT transfers the
HPM's knowledge (KD on logits or MMD on features, ``equations.py``); after its last step the HPM inherits the new
local model with momentum mu_i, which grows with the client's participation count. The upload and the server are
FedAvg's; the HPM is the model that is evaluated.

Client state (declared, hence pooled and spillable): the HPM (every state key) and the participation count. The
HPM starts as the initial model w^0 (the authors' code), so a client never selected is scored on w^0.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from pflkit.core import (Algorithm, ConfigError, LocalSGDTrainer, Message, Param, Space, host_copy, load_into,
                         positive, unit_interval)
from pflkit_fedavg import FedAvgAggregator

from .equations import hpm_momentum, hpm_update, kd_transfer, local_objective, mmd_rbf

__all__ = ["FedPHPTrainer", "FedPHPAggregator", "ALGORITHM", "expected_participations"]

TRANSFERS = ("kd", "mmd")


def expected_participations(join_ratio: float, rounds: int) -> int:
    """max(1, floor(c_ratio * T)): how often an average client takes part in the run (the authors' mean_sam)."""
    return max(int(join_ratio * rounds), 1)


class FedPHPTrainer(LocalSGDTrainer):
    """Local SGD on (1 - lambda) CE + lambda KT(HPM -> local), then HPM <- mu_i HPM + (1 - mu_i) w_local."""

    description = ("FedAvg's local update on (1 - lambda) CE + lambda * KT, KT transferring the client's historical "
                   "personalised model (KD or MMD); the HPM, a participation-weighted moving average of the local "
                   "models, is evaluated")
    params = {
        **LocalSGDTrainer.params,
        "transfer": Param("kd", "knowledge transfer from the HPM: kd (logits, temperature on the teacher) or mmd "
                                "(RBF MMD between features); default kd with lambda 0.05, the first setting of the "
                                "authors' grid (KD 0.05, MMD 0.1, MMD 0.05); PFLlib has MMD only",
                          choices=TRANSFERS),
        "lam": Param(0.05, "lambda of L = (1 - lambda) CE + lambda KT (default 0.05: the authors' KD setting; "
                           "PFLlib's default -lam 1 drops the cross-entropy); 0 = FedAvg's training",
                     check=unit_interval,
                     space=Space.real(0.01, 0.5, log=True,
                                      source="around the authors' grid values 0.05 (KD) and 0.1, 0.05 (MMD)")),
        "temperature": Param(4.0, "KD temperature, applied to the HPM's logits only (default 4: the authors' code)",
                             check=positive),
        "mu_max": Param(0.9, "cap of the HPM momentum mu_i = min(mu_max, mu_max n_i / (c_ratio T)) (default 0.9: "
                             "the authors' code); 0 = the HPM is the last local model", check=unit_interval,
                        space=Space.real(0.5, 0.99, source="around the authors' 0.9; no grid at hand")),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.task.kind != "classification" and ctx.hp.transfer == "kd":
            raise ConfigError("algorithm fedphp: trainer.transfer=kd distils class probabilities and needs a "
                              "classification task; use trainer.transfer=mmd")
        if ctx.hp.transfer == "mmd" and not (hasattr(self.model, "features") and hasattr(self.model, "head")):
            raise ConfigError(f"algorithm fedphp: trainer.transfer=mmd compares features(x) of a model whose forward "
                              f"is head(features(x)); model {type(self.model).__name__} has no 'features'/'head'")
        self.hpm = ctx.build_model().requires_grad_(False)  # w^0 until the first participation
        self.participations = 0

    # protocol ------------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        expected = payload.get("expected_participations")
        if expected is None:
            raise RuntimeError("FedPHP's trainer needs 'expected_participations' (c_ratio * T) with each fit "
                               "message: pair it with the fedphp aggregator")
        self._expected = int(expected)
        self._transfer_sum, self._steps = 0.0, 0
        reply = super().on_fit(payload)
        reply["metrics"] = {"transfer_loss": self._transfer_sum / max(1, self._steps), "hpm_mu": self._mu}
        return reply

    def local_update(self) -> float:
        self.hpm.eval()  # the teacher is run in eval mode and without gradients
        loss = super().local_update()
        # after the last step: HPM <- mu_i HPM + (1 - mu_i) w_local, n_i counting the earlier participations
        self._mu = hpm_momentum(self.participations, self._expected, float(self.ctx.hp.mu_max))
        self.hpm.load_state_dict(hpm_update(self.hpm.state_dict(), self.model.state_dict(), self._mu))
        self.participations += 1
        return loss

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hp = self.ctx.hp
        lam = float(hp.lam)
        if lam == 0.0:  # no transfer: FedAvg's objective exactly (and no teacher forward)
            return self.data_loss(self.model, x, y)
        if hp.transfer == "kd":
            logits = self.model(x)
            with torch.no_grad():
                teacher = self.hpm(x)
            transfer = kd_transfer(logits, teacher, float(hp.temperature))
        else:
            z = self.model.features(x)
            logits = self.model.head(z)
            with torch.no_grad():
                teacher = self.hpm.features(x)
            transfer = mmd_rbf(z, teacher)
        self._transfer_sum += float(transfer.detach())
        self._steps += 1
        return local_objective(self.ctx.task.loss(logits, y), transfer, lam)

    def personal_forward(self):
        return self.hpm  # FedPHP scores the inherited private model

    # state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "hpm": self.hpm.state_dict(), "participations": self.participations}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.hpm.load_state_dict(state["hpm"])
        self.participations = int(state["participations"])

    # declared state: the HPM and the participation count (plus the model keys never sent, if any)
    declares_state = True

    def client_state(self) -> Dict[str, Any]:
        return {**super().client_state(), "hpm": host_copy(self.hpm.state_dict()),
                "participations": self.participations}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        super().load_client_state(state)
        load_into(self.hpm, state["hpm"])
        self.participations = int(state["participations"])


class FedPHPAggregator(FedAvgAggregator):
    """FedAvg's server; each fit message also carries c_ratio * T, which the clients' HPM momentum needs."""

    description = "FedAvg's sample-weighted mean; fit messages carry the expected participation count c_ratio * T"
    mean_fields = ("params",)  # only the weighted mean of the uploads is needed
    sends_params_always = True  # every message still carries the global model

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        part = self.ctx.cfg.participation
        ratio = part.join_ratio if part.get("random_join_ratio") is None else sum(part.random_join_ratio) / 2.0
        expected = expected_participations(float(ratio), int(self.ctx.cfg.rounds))
        return {cid: Message("fit", {"params": self.global_state, "expected_participations": expected})
                for cid in selected}


ALGORITHM = Algorithm(
    trainer="fedphp", aggregator="fedphp",
    description="FedPHP: FedAvg whose clients keep a historical personalised model (a participation-weighted moving "
                "average of their local models), transfer its knowledge into local training and are scored on it "
                "(Li et al., 2021). Defaults: KD transfer, lambda 0.05, temperature 4, mu capped at 0.9 (the "
                "authors' code); model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, batch 32, 1 "
                "local epoch).",
    paper="Li, Zhan, Shao, Li, Song: FedPHP: Federated Personalization with Inherited Private Models, ECML-PKDD 2021",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
