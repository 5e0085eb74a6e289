"""Local training: each client trains its own model on its own data; no parameter ever leaves a client.

The lower reference point of every pFL table ("Local" / "Local-only").
"""
from typing import Any, Dict

from pflkit.core import Algorithm, BatchedForm, BatchedPhase, LocalSGDTrainer, ServerAggregator, trained_names


class LocalTrainer(LocalSGDTrainer):
    """Trains the personal model locally each time it is selected; uploads only its loss and sample count."""

    protocol = "local"
    description = "trains alone; uploads nothing but its loss"
    declares_state = True
    needs_shared_delivery = False

    def client_keys(self):
        return list(self.model.state_dict())  # nothing is ever received: the whole model is the client's own

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        return {"num_samples": self.ctx.num_train, "train_loss": self.local_update()}

    def batched_begin(self, payload: Dict[str, Any]) -> None:
        pass  # nothing arrives: each client trains its own model

    def batched_form(self) -> BatchedForm:
        phase = BatchedPhase(self.loss, trained_names(self.model, "model"), int(self.ctx.train_cfg.local_epochs))
        return BatchedForm({"model": self.model}, [phase],
                           lambda losses, start, aux: {"num_samples": self.ctx.num_train, "train_loss": losses[-1]})


class NoAggregator(ServerAggregator):
    """Sends bare 'fit' instructions and aggregates nothing."""

    protocol = "local"
    description = "aggregates nothing (clients train alone)"


ALGORITHM = Algorithm(
    trainer="local", aggregator="none",
    description="Local: each client trains alone (no communication of parameters)",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
