"""FedProto client: local training with the prototype regulariser, then local class prototypes as the only upload."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from pflkit.core import (ClientContext, ClientTrainer, ConfigError, Param, PflError, Space, host_copy, load_into,
                         make_optimizer, minibatches, non_negative, run_sgd)

from .equations import DISTANCES, dense_prototypes, local_prototypes, prototype_loss, prototype_scores

PROTOCOL = "fedproto"
PROTOTYPE_SOURCES = ("trained", "last_epoch")
INFERENCES = ("prototype", "classifier")


class FedProtoTrainer(ClientTrainer):
    """Trains its own model with CE + lambda * L_R; uploads only its class prototypes and class counts.

    Messages (protocol 'fedproto'):
      ``fit`` {prototypes?, classes?} -> {prototypes (k x d), classes (k), class_counts (k), num_samples,
      train_loss, metrics: {ce_loss, proto_loss}} -- k = the classes this client holds; no model weight travels
      ``evaluate`` {prototypes?, classes?} -> eval sums (nearest global prototype, or the local classifier)

    The model never leaves the client; it is the client's only persistent state. The global prototypes arrive
    with every message that needs them (the server keeps them), so the client stores none.
    """

    protocol = PROTOCOL
    declares_state = True  # runs pooled: one working trainer; each client's model is its declared state
    description = "trains its own model with CE + lambda * ||f(x) - global prototype of y||^2; uploads prototypes"
    params = {
        "lambda_proto": Param(1.0, "weight lambda of the prototype regulariser L_R in CE + lambda * L_R (the "
                                   "authors' value for MNIST and FEMNIST; 0.1 for CIFAR-10)", check=non_negative,
                              space=Space.real(0.01, 10.0, log=True,
                                               source="around the authors' 1 (MNIST, FEMNIST) and 0.1 (CIFAR-10); "
                                                      "no grid at hand")),
        "proto_distance": Param("mean", "squared L2 distance between an embedding and a prototype: mean = divided "
                                        "by the embedding size (the authors' nn.MSELoss, with which lambda was "
                                        "tuned), sum = the plain squared norm", choices=DISTANCES),
        "prototypes_from": Param("trained", "local prototypes = class means of the training embeddings of the "
                                            "trained model, in eval mode (the definition), or last_epoch = of the "
                                            "embeddings seen during the last local epoch's training steps (the "
                                            "authors' code)", choices=PROTOTYPE_SOURCES),
        "inference": Param("prototype", "prediction at test time: prototype = nearest global prototype of the "
                                        "embedding (the paper), classifier = the local model's own head",
                           choices=INFERENCES),
    }

    def __init__(self, ctx: ClientContext):
        super().__init__(ctx)
        if ctx.task.kind != "classification":
            raise ConfigError(f"algorithm fedproto: FedProto needs a classification task (one prototype per "
                              f"class); this dataset is {ctx.task.kind}")
        self.model = ctx.build_model()
        if not isinstance(getattr(self.model, "features", None), nn.Module) or \
                not isinstance(getattr(self.model, "head", None), nn.Module):
            raise ConfigError(f"model: FedProto needs a feature-extractor / head split (model.features gives the "
                              f"embedding whose class means are the prototypes); {type(self.model).__name__} "
                              f"has none")
        self.num_classes = ctx.task.output_dim
        self.last_losses = {"ce_loss": 0.0, "proto_loss": 0.0}

    # protocol ---------------------------------------------------------------------------------------------------
    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        glob = self.global_prototypes(payload)
        loss, seen = self.local_update(glob)
        protos, counts = seen if seen is not None else self.prototypes_of_trained_model()
        held = torch.nonzero(counts > 0).reshape(-1)  # only the classes this client holds travel
        return {
            "prototypes": protos[held].detach().clone(),
            "classes": held.cpu(),
            "class_counts": counts[held].cpu(),
            "num_samples": self.ctx.num_train,
            "train_loss": loss,
            "metrics": dict(self.last_losses),
        }

    def on_evaluate(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        glob = self.global_prototypes(payload)
        if self.ctx.hp.get("inference", "prototype") == "classifier" or glob is None:
            return self.evaluate_model(self.model)  # no global prototype yet: the classifier is all there is
        protos, present = glob
        distance = self.ctx.hp.get("proto_distance", "mean")
        return self.evaluate_model(
            lambda x: prototype_scores(self.model.features(x), protos, present, distance), modules=(self.model,))

    # local training ---------------------------------------------------------------------------------------------
    def local_update(self, glob: Optional[Tuple[torch.Tensor, torch.Tensor]]
                     ) -> Tuple[float, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
        """E epochs of CE + lambda * L_R (L_R only once global prototypes exist).

        Returns the mean training loss and, with ``prototypes_from=last_epoch``, the local prototypes collected
        from the last epoch's training embeddings (else None).
        """
        hp, cfg = self.ctx.hp, self.ctx.train_cfg
        lam = float(hp.get("lambda_proto", 1.0))
        distance = hp.get("proto_distance", "mean")
        collect = hp.get("prototypes_from", "trained") == "last_epoch"
        n, bs = self.ctx.num_train, cfg.batch_size
        first_collected = (cfg.local_epochs - 1) * (-(-n // bs))  # index of the last epoch's first step
        d = int(getattr(self.model, "feature_dim", 0) or 0)
        sums: Optional[torch.Tensor] = None
        counts = torch.zeros(self.num_classes, dtype=torch.long, device=self.ctx.device)
        parts: List[torch.Tensor] = []
        step = [0]

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            nonlocal sums
            z = self.model.features(x)
            ce = self.ctx.task.loss(self.model.head(z), y)
            # L_R is computed (and logged) even at lambda = 0, the ablation without the regulariser
            reg = prototype_loss(z, y, glob[0], glob[1], distance) if glob is not None else \
                torch.zeros((), device=z.device)
            if collect and step[0] >= first_collected:
                batch_protos, batch_counts = local_prototypes(z.detach(), y, self.num_classes)
                batch_sums = batch_protos * batch_counts.unsqueeze(1).to(z.dtype)
                sums = batch_sums if sums is None else sums + batch_sums
                counts.add_(batch_counts)
            step[0] += 1
            parts.append(torch.stack([ce.detach(), reg.detach()]))
            return ce + lam * reg

        self.model.train()
        total = run_sgd(self.batches(), loss, make_optimizer(self.model.parameters(), cfg))
        means = torch.stack(parts).mean(dim=0).tolist() if parts else [0.0, 0.0]
        self.last_losses = {"ce_loss": float(means[0]), "proto_loss": float(means[1])}
        if not collect:
            return total, None
        if sums is None:
            sums = torch.zeros(self.num_classes, d, device=self.ctx.device)
        return total, (sums / counts.clamp_min(1).to(sums.dtype).unsqueeze(1), counts)

    @torch.no_grad()
    def prototypes_of_trained_model(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """C_i^(j): the class means of the trained model's embeddings of the whole training split (eval mode)."""
        was_training = self.model.training
        self.model.eval()
        try:
            zs, ys = [], []
            for x, y in minibatches(self.ctx.train, self.ctx.train_cfg.eval_batch_size, shuffle=False):
                zs.append(self.model.features(x))
                ys.append(y)
        finally:
            self.model.train(was_training)
        if not zs:  # a client without training samples holds no class: it uploads no prototype
            d = int(getattr(self.model, "feature_dim", 0) or 0)
            return (torch.zeros(self.num_classes, d, device=self.ctx.device),
                    torch.zeros(self.num_classes, dtype=torch.long, device=self.ctx.device))
        return local_prototypes(torch.cat(zs), torch.cat(ys), self.num_classes)

    # helpers ----------------------------------------------------------------------------------------------------
    def global_prototypes(self, payload: Dict[str, Any]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Dense global prototypes and their 'defined' mask from a message, or None when it carries none."""
        if "prototypes" not in payload:
            return None
        rows, classes = payload["prototypes"], payload.get("classes")
        if not isinstance(rows, torch.Tensor) or not isinstance(classes, torch.Tensor):
            raise PflError("fedproto message: 'prototypes' and 'classes' must be tensors")
        try:
            protos, defined = dense_prototypes(classes, rows.to(self.ctx.device), self.num_classes)
        except ValueError as exc:
            raise PflError(f"fedproto message: {exc}") from exc
        if classes.numel() == 0:
            return None
        return protos, defined > 0

    def client_state(self) -> Dict[str, Any]:
        # the whole model (no weight is ever received); last_losses is set and read within one 'fit'
        return {"model": host_copy(self.model.state_dict())}

    def load_client_state(self, state: Dict[str, Any]) -> None:
        load_into(self.model, state["model"])

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
