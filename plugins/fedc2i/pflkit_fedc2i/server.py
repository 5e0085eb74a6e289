"""FedC2I server (Algorithm 1, "Server executes"): it aggregates nothing -- it keeps every client's latest upload
and relays them, and logs the influence vectors the clients report.

Downlink: a selected client receives the latest model of every *other* client in its relay set (its own model
is the one it holds), i.e. (M - 1) full models per client per round at full participation -- M (M - 1) models per
round in total, against M for FedAvg. The core counts these bytes (``bytes_down``); evaluation messages are
empty (each client scores the model it holds).

Partial participation (the paper uses all clients every round; ``relay`` defines what a client sees otherwise):

- ``relay = all`` (default): every client's latest upload, whether or not that client was selected this round
  (a client not selected since round r contributes its round-r model; one never selected contributes the common
  initial model, which Algorithm 1's line 1 distributes to everybody). M stays the whole federation.
- ``relay = selected``: only the latest uploads of this round's selected clients (M = the round's participants).

Clients that are not selected receive nothing and keep their model; all uploads of a round are collected before
the next round is relayed (clients train "in parallel", Algorithm 1 line 3).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from pflkit.core import (ConfigError, Message, Param, PflError, ServerAggregator, ServerContext, clone_state,
                         non_negative)

from .client import PROTOCOL, check_model

log = logging.getLogger("pflkit")
RELAYS = ("all", "selected")


def client_names(ctx: ServerContext) -> List[str]:
    """Names for the influence matrix axes: ``aggregator.client_names``; else names the core provides
    (``ctx.client_names``); else the dataset's group names when ``by_group`` maps group k to client k and the
    dataset offers a data-free ``group_names`` hook (``digits_domains`` does); else 'client k'."""
    n = ctx.num_clients
    given = (ctx.hp or {}).get("client_names")
    if given is not None:
        if len(given) != n:
            raise ConfigError(f"aggregator.client_names: {len(given)} names for {n} clients")
        return [str(x) for x in given]
    names = getattr(ctx, "client_names", None)
    if names is not None and len(names) == n:
        return [str(x) for x in names]
    try:
        cfg = ctx.cfg
        part = cfg.partition
        if part.name == "by_group" and part.get("assign", "exact") == "exact" and not part.get("shuffle", False):
            from pflkit.core import DATASETS

            hook = getattr(DATASETS.get(cfg.dataset.name), "group_names", None)
            if callable(hook):
                names = hook(**{k: v for k, v in cfg.dataset.items() if k not in ("name", "root", "download")})
                if len(names) == n:
                    return [str(x) for x in names]
    except (AttributeError, KeyError, TypeError, PflError):
        pass  # a partial test config, or a dataset without names: fall back to ids
    return [f"client {c}" for c in range(n)]


def _names_check(v) -> Optional[str]:
    return None if all(isinstance(x, str) for x in v) else "must be a list of strings"


class FedC2IRelay(ServerAggregator):
    """Relays every client's latest upload to each selected client; records and draws the influence matrix."""

    protocol = PROTOCOL
    description = "relays the latest uploads (no server aggregation); logs and draws the influence matrix"
    params = {
        "relay": Param("all", "what a selected client receives under partial participation: all = the latest "
                              "upload of every client (stale or initial for non-participants, default); selected = "
                              "only this round's participants' latest uploads", choices=RELAYS),
        "client_names": Param(None, "names of the clients for the influence-matrix axes (default: the dataset's "
                                    "domain names under by_group, else 'client k')", type=list, check=_names_check),
        "plot_every": Param(5, "draw the influence matrix (TensorBoard image + PNG in the run directory) in round 1, "
                               "every N rounds and in the last round; 0 = never", check=non_negative),
    }

    def reply_layout(self, kind: str, field: str):
        """A fit reply's ``params`` are the client's whole model state (checked by the core before it is relayed)."""
        if kind == "fit" and field == "params":
            return self.model_layout("state")
        return super().reply_layout(kind, field)

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        model = ctx.build_model()
        check_model(model)
        self.initial = clone_state(model.state_dict())  # Algorithm 1, line 1: the same start for every client
        self.latest: Dict[int, Dict[str, torch.Tensor]] = {}  # cid -> latest upload (absent: initial model)
        self.names = client_names(ctx)
        self.matrix = np.full((ctx.num_clients, ctx.num_clients), np.nan)  # last reported lambda_m per row
        self.last_round: Dict[str, Any] = {}

    def model_of(self, cid: int) -> Dict[str, torch.Tensor]:
        return self.latest.get(cid, self.initial)

    # -- round ------------------------------------------------------------------------------------------------
    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        pool = list(range(self.ctx.num_clients)) if self.ctx.hp.get("relay", "all") == "all" else list(selected)
        pool = sorted(pool)
        self.last_round = {"round": rnd, "selected": sorted(selected), "pool": pool}
        # the payloads share the stored tensors (no copies); clients only read them
        return {m: Message("fit", {"uploads": {c: self.model_of(c) for c in pool if c != m}})
                for m in sorted(selected)}

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> Dict[int, Message]:
        return {cid: Message("evaluate") for cid in clients}  # each client scores the model it holds

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        keys = set(self.initial)
        rows: Dict[int, np.ndarray] = {}
        for cid in sorted(replies):
            reply = replies[cid]
            params = reply.get("params")
            if not isinstance(params, dict) or set(params) != keys:
                raise PflError(f"client {cid}: fedc2i reply does not carry a full model state")
            self.latest[cid] = {k: v.detach().to(self.ctx.device) for k, v in params.items()}
            row = np.full(self.ctx.num_clients, np.nan)
            lam = reply.get("influence")
            others = reply.get("influence_clients")
            if isinstance(lam, torch.Tensor) and isinstance(others, (list, tuple)) and len(others) == lam.numel():
                row[np.asarray(others, dtype=np.int64)] = lam.double().cpu().numpy()
            rows[cid] = row
        for cid, row in rows.items():
            self.matrix[cid] = row
        self.last_round["replied"] = sorted(replies)
        self._log(rnd, rows)
        return None

    # -- logging ----------------------------------------------------------------------------------------------
    def _log(self, rnd: int, rows: Dict[int, np.ndarray]) -> None:
        logger = self.ctx.logger
        if logger is None:
            return
        for m, row in rows.items():  # each client's influence vector, one scalar per entry (metrics.jsonl + TB)
            for i in np.flatnonzero(np.isfinite(row)):
                logger.log_scalar(f"fedc2i/influence/{m}/{int(i)}", float(row[i]))
        every = self.ctx.hp.get("plot_every", 5)
        last = getattr(getattr(self.ctx, "cfg", None), "rounds", None)
        if not every or not (rnd == 1 or rnd % every == 0 or rnd == last):
            return
        run_dir = getattr(logger, "run_dir", None)
        if run_dir is None:
            return
        from .plots import save_influence_png

        title = f"FedC2I influence vectors (rows), round {rnd}"
        path = Path(run_dir) / "influence" / f"round_{rnd:03d}.png"
        try:
            save_influence_png(self.matrix.copy(), self.names, title, path, logger)
            (Path(run_dir) / "influence_matrix.png").write_bytes(path.read_bytes())
        except OSError as exc:  # a full disk must not end the run over a picture
            log.warning("fedc2i: could not write the influence matrix picture: %s", exc)

    # -- checkpoint -------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"latest": self.latest, "matrix": self.matrix.copy()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.latest = {int(c): clone_state(s) for c, s in state["latest"].items()}
        self.matrix = np.array(state["matrix"], dtype=np.float64)
