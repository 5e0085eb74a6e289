"""FedCP server (Algorithm 1, lines 4-5 and 18-21)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from easydict import EasyDict

from pflkit.core import Layout, Message, Param, ServerAggregator, ServerContext, State, clone_state, layout_of

from .modules import check_options, initial_shared_state


class FedCPAggregator(ServerAggregator):
    """Sample-weighted averages of the uploaded extractors, averaged heads (Eq. 6) and CPNs (lines 18-21).

    ``sync=paper`` (default, Algorithm 1 line 5): each round the selected clients receive W^fe, W^hd and Theta
    with their fit instruction. ``sync=reference`` (authors' servercp.py): fit instructions carry nothing; after
    aggregation the new extractor is pushed to *every* client and the new head and CPN only to the clients that
    trained this round, who are then evaluated with them.
    """

    protocol = "fedcp"
    mean_fields = ("params",)  # lines 18-21 are sample-weighted means: folded as the replies arrive (core/api/fold.py)
    description = "sample-weighted averaging of extractor, (global+personal)/2 head and CPN"
    params = {
        "sync": Param("paper", "who receives the new global modules: paper (selected clients, at the start of "
                               "their round) or reference (after aggregation: extractor to all clients, head and "
                               "CPN to the clients that trained)", choices=("paper", "reference")),
    }

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        trainer_hp = EasyDict({k: v for k, v in ctx.cfg.trainer.items() if k != "name"})
        check_options(trainer_hp)
        # W^{fe,0}, W^{hd,0}, Theta^0: the same seeded initial weights every client starts from (lines 1-2)
        self.global_state: State = initial_shared_state(ctx.build_model(), trainer_hp, ctx.seed)

    def reply_layout(self, kind: str, field: str) -> Optional[Layout]:
        """Uploads hold the global modules (extractor, head and CPN: ``initial_shared_state``), not the model's
        state: the core checks every upload against them."""
        if field == "params":
            return layout_of(self.global_state)
        return super().reply_layout(kind, field)

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        if self.ctx.hp.sync == "reference":
            return {cid: Message("fit") for cid in selected}
        return {cid: Message("fit", {"params": self.global_state}) for cid in selected}  # line 5

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> Optional[Dict[int, Message]]:
        if not replies:
            return None
        cids = sorted(replies)
        self.global_state.update(self.mean_of(replies))  # n_i / n^t-weighted (lines 18-21), streamed
        if self.ctx.hp.sync != "reference":
            return None
        features = {k: v for k, v in self.global_state.items() if k.startswith("features.")}
        trained = set(cids)
        return {cid: Message("sync", {"params": self.global_state if cid in trained else features})
                for cid in range(self.ctx.num_clients)}

    def state_dict(self) -> Dict[str, Any]:
        return {"global_state": self.global_state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.global_state = clone_state(state["global_state"])
