"""Network Lasso (Hallac, Leskovec, Boyd: "Network Lasso: Clustering and Optimization in Large Graphs", KDD 2015)
as a personalised FL method: every client i has its own model x_i, coupled to its neighbours in a client graph by
the unsquared norm of Eq. 1, lambda sum_{(j,k) in E} w_jk ||x_j - x_k||_2, which fuses the models of similar
clients (clusters) and leaves the others apart. Solved by the paper's ADMM (Sec. 3.1-3.2, ``equations``):

* client (x-update): local SGD on f_i(x) + (rho d_i / 2) ||x - m_i||^2 from its current x_i, where m_i is the mean
  of the centres z_ik - u_ik over its d_i neighbours (the sum of the d_i proximal terms of Sec. 3.1, exactly);
  uploads x_i (its parameters, one flat vector); evaluation scores x_i;
* server, per edge (j,k): the closed-form z-update (Sec. 3.2's group soft-threshold with threshold
  lambda w_jk / rho), then the u-update; from them the centres of both ends for the next x-update.

The server keeps, per client, in the core's server-side per-client store (``ServerAggregator.client_store``:
memory budget ``server.state_memory``, spill to disk, lean checkpoints): its last model x_i ("x"), its next
x-update centre m_i ("centre") and the duals u_jk of its edges to higher-numbered clients ("duals", one [m, P]
tensor; u_kj = -u_jk, see ``equations``). Clients that did not reply this round (partial participation, failures)
keep their last x_i in the z- and u-updates, as if their x-update had returned it.

Cluster recovery: an edge is fused when ||z_jk - z_kj|| <= ``aggregator.fuse_tol`` (0: exactly equal, which the
soft-threshold produces); the connected components of the fused edges are the clusters, logged each round
(``netlasso/clusters``, ``netlasso/fused_edges``) and, when the dataset's meta holds the true clusters, scored by
the adjusted Rand index (``netlasso/ari``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from pflkit.core import (Algorithm, LocalSGDTrainer, Message, Param, ServerAggregator, Space, non_negative, positive,
                         proximal_term)

from .equations import edge_step, fused_components, running_mean_step, u_update, z_update
from .graph import complete_graph, degrees, knn_graph, out_edges
from .recovery import adjusted_rand_index, true_clusters

__all__ = ["NetLassoTrainer", "NetLassoAggregator", "ALGORITHM", "z_update", "u_update", "edge_step",
           "flat_params"]

GRAPHS = ("complete", "knn")


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """x_i: the model's parameters as one flat vector (buffers such as BN statistics stay with the client)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to("cpu", copy=True)


class NetLassoTrainer(LocalSGDTrainer):
    """The x-update: local SGD on the client's loss plus (weight / 2) ||x - centre||^2, weight = rho d_i; keeps
    its whole model between rounds and scores it."""

    protocol = "netlasso"
    description = ("Network Lasso client (x-update): local SGD on f_i(x) + (rho d_i / 2)||x - m_i||^2 from its own "
                   "x_i; uploads x_i, evaluates x_i")
    params: Dict[str, Param] = {}
    needs_shared_delivery = False  # the whole model is the client's own; the server sends a centre, never params
    declares_state = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self._prox: Optional[tuple] = None  # (weight, centre views) during one fit call only

    def client_keys(self) -> List[str]:
        return list(self.model.state_dict())

    def on_fit(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        weight = float(payload.get("weight", 0.0))
        if weight > 0.0:
            centre = payload["centre"]
            params = list(self.model.parameters())
            numel = sum(p.numel() for p in params)
            if not isinstance(centre, torch.Tensor) or centre.numel() != numel:
                raise ValueError(f"the x-update centre must be a flat vector of the model's {numel} parameters")
            views = [c.view_as(p).to(p.device, p.dtype)
                     for c, p in zip(centre.split([p.numel() for p in params]), params)]
            self._prox = (weight, views)
        try:
            loss = self.local_update()
        finally:
            self._prox = None
        return {"params": flat_params(self.model), "num_samples": self.ctx.num_train, "train_loss": loss}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        data = self.data_loss(self.model, x, y)
        if self._prox is None:
            return data
        weight, centre = self._prox  # Sec. 3.1's x-update: sum_k (rho/2)||x - c_k||^2 = (rho d/2)||x - m||^2 + const
        return data + 0.5 * weight * proximal_term(list(self.model.parameters()), centre)


class NetLassoAggregator(ServerAggregator):
    """Per edge: z-update (closed form) and u-update; per client: the centre of its next x-update."""

    protocol = "netlasso"
    description = ("Network Lasso server: per edge the closed-form z-update (group soft-threshold lambda w / rho) "
                   "and the u-update; sends each client the mean of its centres z_ik - u_ik and rho * degree")
    params = {
        "lam": Param(0.04, "lambda of Eq. 1: weight of sum_{(j,k)} w_jk ||x_j - x_k||_2 (0: the clients are "
                           "decoupled, see the README). Neither the paper (tuned per task) nor PCFL gives one for "
                           "neural models; 0.04 with rho 0.02 fuses the cnn4 models of two clients when "
                           "||x_j + u_jk - x_k - u_kj|| <= 2 lambda / rho = 4 (README: how it was chosen)",
                     check=non_negative,
                     space=Space.real(0.005, 0.2, log=True,
                                      source="around pflkit's 0.04, fusion thresholds 0.5-20 at rho 0.02; the "
                                             "paper tunes lambda per task, no grid for neural models")),
        "rho": Param(0.02, "rho: the ADMM penalty, the x-update's proximal weight per edge (rho * degree in all) "
                           "and the z-update's threshold lambda w / rho; not given by the paper or PCFL (0.02: a "
                           "FedProx-sized pull of 0.38 on the complete graph of 20 clients)", check=positive),
        "graph": Param("complete", "the client graph: complete = every pair, unit weights (default: the server "
                                   "knows nothing of the clients); knn = each client linked to its graph_k nearest "
                                   "clients by the distance of their models after round 1 (union, unit weights; "
                                   "round 1 runs on no edges, i.e. plain local training)", choices=GRAPHS),
        "graph_k": Param(3, "k of graph=knn", check=positive),
        "fuse_tol": Param(0.0, "an edge counts as fused (its two clients in one cluster) when ||z_jk - z_kj|| is "
                               "at most this (0: exactly equal, as the soft-threshold makes them)",
                          check=non_negative),
    }

    def __init__(self, ctx):
        super().__init__(ctx)
        self.num_clients = int(ctx.num_clients)
        self.x0 = flat_params(ctx.build_model())  # x^0 = z^0: the common initial model; u^0 = 0
        self.edges = complete_graph(self.num_clients) if ctx.hp.get("graph", "complete") == "complete" else None
        self.models = self.client_store("x")  # client -> its last x_i (replies, or x^0 before any)
        self.centres = self.client_store("centre")  # client -> m_i for its next x-update (x^0 before any)
        self.duals = self.client_store("duals")  # client j -> [u_jk for its edges (j,k), k > j] as one tensor
        self.report: Dict[str, float] = {}
        self.labels: List[int] = list(range(self.num_clients))  # the fused clusters of the last round
        self.truth = true_clusters(ctx.data_info.get("meta"), ctx.cfg, self.num_clients)

    # -- the graph -------------------------------------------------------------------------------------------
    def _degrees(self) -> List[int]:
        return degrees(self.num_clients, self.edges or [])

    def configure_fit(self, rnd: int, selected: Sequence[int]) -> Dict[int, Message]:
        rho = float(self.ctx.hp.rho)
        deg = self._degrees()
        msgs = {}
        for cid in selected:
            if deg[cid] == 0:  # no edge (knn before its graph exists): no proximal term, nothing to send
                msgs[cid] = Message("fit", {"weight": 0.0})
            else:
                msgs[cid] = Message("fit", {"centre": self.centres.get(cid, self.x0), "weight": rho * deg[cid]})
        return msgs

    def aggregate_fit(self, rnd: int, replies: Dict[int, Dict[str, Any]]) -> None:
        for cid in sorted(replies):
            x = replies[cid]["params"]
            if not isinstance(x, torch.Tensor) or x.shape != self.x0.shape:
                raise ValueError(f"client {cid} uploaded no flat parameter vector of {self.x0.numel()} values")
            self.models.put(cid, x.detach().to("cpu", self.x0.dtype))
        xs = [self.models.get(i, self.x0) for i in range(self.num_clients)]
        if self.edges is None:
            self.edges = knn_graph(xs, int(self.ctx.hp.graph_k))
        self._admm_step(xs)
        self._log()
        return None

    def _admm_step(self, xs: List[torch.Tensor]) -> None:
        """Sec. 3.1's z- and u-updates on every edge, in a fixed order (ascending j, then k), and the centres of
        the next x-updates (a running mean per client, over its edges in that order)."""
        hp = self.ctx.hp
        lam, rho, tol = float(hp.lam), float(hp.rho), float(hp.fuse_tol)
        n = self.num_clients
        means: List[Optional[torch.Tensor]] = [None] * n
        counts = [0] * n
        fused, thetas, dists, residual = [], [], [], 0.0
        for j, peers in out_edges(n, self.edges).items():
            if not peers:
                continue
            old = self.duals.get(j)
            new = torch.empty(len(peers), self.x0.numel(), dtype=self.x0.dtype)
            for row, (k, w) in enumerate(peers):
                u = old[row] if old is not None else torch.zeros_like(self.x0)
                new_u, c_j, c_k, theta, gap, dist = edge_step(xs[j], xs[k], u, lam * w / rho)
                new[row] = new_u
                means[j], counts[j] = running_mean_step(means[j], counts[j], c_j)
                means[k], counts[k] = running_mean_step(means[k], counts[k], c_k)
                residual += 2.0 * float(torch.linalg.vector_norm(new_u - u)) ** 2  # ||x - z||^2 at both ends
                thetas.append(theta)
                dists.append(dist)
                if gap <= tol:
                    fused.append((j, k))
            self.duals.put(j, new)
        for i in range(n):
            if means[i] is not None:
                self.centres.put(i, means[i])
        labels = fused_components(n, fused)
        self.labels = labels
        self.report = {"fused_edges": len(fused) / max(1, len(self.edges)), "clusters": float(len(set(labels))),
                       "primal_residual": residual ** 0.5,
                       "mean_theta": sum(thetas) / len(thetas) if thetas else 1.0,
                       "mean_edge_distance": sum(dists) / len(dists) if dists else 0.0}
        if self.truth is not None:
            self.report["ari"] = adjusted_rand_index(self.truth, labels)

    def _log(self) -> None:
        logger = self.ctx.logger
        if logger is not None:
            for key, value in self.report.items():
                logger.log_scalar(f"netlasso/{key}", value)

    # the edge variables live in the core's stores (checkpointed by the core); the graph is the aggregator's
    def state_dict(self) -> Dict[str, Any]:
        if self.edges is None:
            return {"edges": None}
        return {"edges": torch.tensor([[j, k] for j, k, _ in self.edges], dtype=torch.long).reshape(-1, 2),
                "weights": torch.tensor([w for _, _, w in self.edges], dtype=torch.float64)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("edges") is None:
            self.edges = None if self.ctx.hp.get("graph", "complete") == "knn" else self.edges
            return
        pairs, weights = state["edges"].tolist(), state["weights"].tolist()
        self.edges = [(int(j), int(k), float(w)) for (j, k), w in zip(pairs, weights)]


ALGORITHM = Algorithm(
    trainer="netlasso", aggregator="netlasso",
    description="Network Lasso: personal models coupled over a client graph by lambda sum w_jk ||x_j - x_k||_2, "
                "solved by ADMM (client x-update by local SGD with a proximal term; per-edge closed-form z-update "
                "and dual update on the server) (Hallac, Leskovec, Boyd, KDD 2015). Defaults: complete graph, unit "
                "weights, lambda 0.04, rho 0.02; model and local training as pflkit's FedAvg (cnn4, SGD lr 0.05, "
                "batch 32, 1 local epoch). Evaluates each client's x_i.",
    paper="Hallac, Leskovec, Boyd: Network Lasso: Clustering and Optimization in Large Graphs, KDD 2015",
    defaults={"model": {"name": "cnn4"}, "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1}},
)
