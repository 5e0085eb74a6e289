"""The pure mathematics of FedSA (Wang, Liao, Yuan, Zhang: "The Key of Parameter Skew in Federated Learning",
arXiv:2408.11278, 2024).

Everything here works on tensors and knows nothing about clients, messages or configuration; the aggregator in
``pflkit_fedsa`` wires it to the round protocol. Equation numbers are the paper's (Section 3).

Notation: one "layer" ``j`` is one state tensor (weights and biases separately), flattened to ``M`` entries; the
``K`` client copies are stacked into ``w_j`` of shape ``(K, M)``.

Reading of the badly typeset method section (also in the plugin README, "What is computed"):

* Eq. 2-4: ``mu = mean_k w``; ``s = (w - mu)^2`` (K x M, the "square deviation"); ``cv = sqrt(mean_k s) / |mu|``.
* Eq. 5-6: min-max normalise ``cv`` within the layer; high-dispersion where the normalised value exceeds ``cv_t``.
* Eq. 7: low-dispersion entries take the client mean ``mu``.
* Eq. 8-9: each client's deviation ``s`` on each high-dispersion entry is binned into one of ``C`` categories
  ``(c-1)/C < s' <= c/C``. The printed bins only make sense for ``s' in [0, 1]``, so ``s`` is first normalised per
  entry across the clients (``mic_norm``: "minmax" default; "max" and the literal "none" are options).
* Eq. 10: ``SIM(a, b) = 1 - #(high entries where MIC_a != MIC_b) / #(high entries)`` over the whole network.
* Macro-Classes: the greedy agglomerative procedure of the text (``cluster_clients``).
* Eq. 11: a cluster's MAC category = the most frequent MIC category of its members (ties: the lowest category).
* Eq. 12: cluster mean of the members' parameters.
* Eq. 14: printed without a normalisation that makes the weights sum to one. Our reading (default
  ``alpha_norm="normalized"``): per entry, cluster ``s`` weighs in proportion to how many clusters share its MAC
  category, normalised over clusters, so the majority tendency wins (the intent of Figure 2). The literal
  ``"printed"`` option divides the same counts by ``S x C`` instead (weights then sum to one only when every
  cluster agrees and S = C, and otherwise shrink the entry towards zero).
* Eq. 15 / 13: high-dispersion result = ``sum_s alpha_s * cluster_mean_s``; global = low part + high part.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

MIC_NORMS = ("minmax", "max", "none")
CV_NORMS = ("minmax", "rank")
ALPHA_NORMS = ("normalized", "printed")

# Entries per chunk of the similarity matmuls (keeps the K x chunk indicators in cache; < 2^24 for exactness).
_CHUNK = 1 << 15


# ---------------------------------------------------------------------------------------------------------
# Dispersion split (Eq. 2-7)
# ---------------------------------------------------------------------------------------------------------
ClientTensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _client_list(clients: ClientTensors) -> List[torch.Tensor]:
    """The K client copies of one layer as a list of flat tensors (a ``(K, ...)`` stack is unbound, no copy)."""
    seq = clients.unbind(0) if isinstance(clients, torch.Tensor) else clients
    return [x.reshape(-1) for x in seq]


def coefficient_of_variation(clients: ClientTensors, eps: float = 1e-12) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-entry client mean and coefficient of variation of one layer: ``(mu, cv)``, each ``(M,)``.

    ``clients``: a ``(K, M)`` stack or K flat tensors. Accumulated client by client (a loop over the K clients,
    vectorised over the M entries): this avoids materialising the K x M stack and is much faster on CPU than a
    reduction over the stack's first dimension. Two passes (mean, then squared deviations) keep the variance
    accurate when ``|mu|`` is far larger than the spread. The squared deviations ``s`` of Eq. 3 are formed, by
    ``squared_deviation``, for the high-dispersion columns only. An entry on which all clients agree has cv 0
    (also when its mean is 0); a non-zero spread around a zero mean gives a very large (finite) cv.
    """
    xs = _client_list(clients)
    mu = torch.zeros_like(xs[0])
    for x in xs:
        mu.add_(x)
    mu.div_(len(xs))                                           # Eq. 2
    var = torch.zeros_like(mu)
    dev = torch.empty_like(mu)  # one reusable buffer: no per-client allocation
    for x in xs:
        torch.sub(x, mu, out=dev)
        var.addcmul_(dev, dev)                                 # Eq. 3 summed over clients: 1_{1xK} s_j
    cv = var.div_(len(xs)).sqrt_().div_(mu.abs().clamp_min(eps))  # Eq. 4
    return mu, cv


def squared_deviation(stacked: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Eq. 3: ``s_j = SD(w_j) = (w_j - mu_j)^2``, ``(K, M)``."""
    return (stacked - mu).square_()


def high_dispersion_mask(cv: torch.Tensor, cv_t: float, norm: str = "minmax") -> torch.Tensor:
    """Eq. 5 (and its complement Eq. 6): normalise ``cv`` within the layer, high-dispersion where ``> cv_t``.

    ``norm``: "minmax" -- ``(cv - min) / (max - min)`` as printed (default). Because cv divides by ``|mu|``, a few
    entries with a mean near zero can own the maximum and push every other entry towards 0, so the high share can
    be small; it is logged every round. "rank" -- the entry's rank within the layer divided by ``M - 1`` (its
    quantile), robust to that tail: the high share is then about ``1 - cv_t``.
    A layer whose cv is constant (e.g. a single entry, or identical uploads) has no high-dispersion entry.
    """
    if norm not in CV_NORMS:
        raise ValueError(f"cv_norm must be one of {CV_NORMS}, got {norm!r}")
    lo, hi = torch.aminmax(cv)
    span = hi - lo
    if not torch.isfinite(span) or span <= 0:
        return torch.zeros_like(cv, dtype=torch.bool)
    if norm == "minmax":
        return (cv - lo) / span > cv_t                         # Eq. 5; r^l (Eq. 6) is its negation
    # rank(i) / (M - 1) > cv_t  <=>  cv_i exceeds the value of rank floor(cv_t * (M - 1)): a selection (O(M)), not a
    # sort; entries tied with that value are all low-dispersion (no arbitrary tie order)
    k = int(cv_t * (cv.numel() - 1))
    return cv > torch.kthvalue(cv, k + 1).values


# ---------------------------------------------------------------------------------------------------------
# Micro-Classes (Eq. 8-9)
# ---------------------------------------------------------------------------------------------------------
def micro_classes(sq_dev: torch.Tensor, num_categories: int, norm: str = "minmax") -> torch.Tensor:
    """Eq. 8-9: bin each client's squared deviation on each (high-dispersion) entry into ``1..C``.

    ``sq_dev``: ``(K, M')`` squared deviations of the high-dispersion entries only (the ``r^h`` mask of Eq. 9 is
    applied by the caller's column selection). Bins are ``(c-1)/C < s' <= c/C`` on the normalised deviation
    ``s'``; ``s' = 0`` (the lowest deviation, under "minmax") belongs to category 1 and values above 1 (possible
    only with ``norm="none"``) to category C.

    ``norm``: "minmax" -- ``(s - min_k s) / (max_k s - min_k s)`` per entry (default: uses the whole [0, 1] range,
    so the C bins separate the clients of every entry); "max" -- ``s / max_k s``; "none" -- the raw squared
    deviation, as printed (parameters are small, so nearly everything lands in category 1).
    Returns a ``(K, M')`` uint8 tensor.
    """
    if norm not in MIC_NORMS:
        raise ValueError(f"mic_norm must be one of {MIC_NORMS}, got {norm!r}")
    tiny = torch.finfo(sq_dev.dtype).tiny
    scaled = sq_dev.clone()
    if norm in ("minmax", "max"):
        # per-entry extremes across the K clients, row by row (much faster on CPU than a reduction over dim 0)
        lo, hi = scaled[0].clone(), scaled[0].clone()
        for row in scaled[1:]:
            torch.minimum(lo, row, out=lo)
            torch.maximum(hi, row, out=hi)
        if norm == "minmax":
            scaled.sub_(lo).div_((hi - lo).clamp_min_(tiny))
        else:
            scaled.div_(hi.clamp_min_(tiny))
    # Eq. 8: category c where (c-1)/C < s' <= c/C, i.e. c = ceil(C * s'), clamped into 1..C
    return scaled.mul_(num_categories).ceil_().clamp_(1, num_categories).to(torch.uint8)


def mic_agreement(mic: torch.Tensor, num_categories: int) -> torch.Tensor:
    """``A[a, b]`` = number of entries where clients a and b share a MIC category (float64, ``(K, K)``).

    Vectorised as ``sum_c 1[mic = c] 1[mic = c]^T`` (indicator matmuls), in cache-sized chunks of entries.
    """
    k, m = mic.shape
    agree = torch.zeros(k, k, dtype=torch.float64, device=mic.device)
    for start in range(0, m, _CHUNK):
        block = mic[:, start:start + _CHUNK]
        part = torch.zeros(k, k, dtype=torch.float32, device=mic.device)
        for c in range(1, num_categories + 1):
            onehot = (block == c).to(torch.float32)                   # K x chunk indicator of category c
            part.addmm_(onehot, onehot.T)
        agree += part.double()  # exact: a chunk's counts stay below float32's 2^24
    return agree


def similarity_from_agreement(agreement: torch.Tensor, num_high: int) -> torch.Tensor:
    """Eq. 10: ``SIM(a, b) = 1 - #mismatch / #high = #agree / #high`` over the whole network."""
    if num_high <= 0:
        return torch.ones_like(agreement)
    return agreement / float(num_high)


def client_similarity(mics: Sequence[torch.Tensor], num_categories: int) -> torch.Tensor:
    """Eq. 10 for MIC maps given layer by layer (each ``(K, M'_j)``)."""
    if not mics:
        raise ValueError("client_similarity needs at least one MIC map")
    agree = sum(mic_agreement(m, num_categories) for m in mics)
    return similarity_from_agreement(agree, sum(int(m.shape[1]) for m in mics))


# ---------------------------------------------------------------------------------------------------------
# Macro-Classes: the clustering procedure
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Clustering:
    clusters: List[List[int]]                       # client indices (rows of the stack) of each Macro-Class
    unclustered: List[int] = field(default_factory=list)


def cluster_clients(sim: torch.Tensor, max_clusters: int, sim_t: float) -> Clustering:
    """The greedy agglomerative Macro-Class procedure (Section 3, "Macro-Classes", Steps 1-3).

    A cluster's similarity to a client is the mean of its members' similarities to that client (Step 1).
    Step 1: the two most similar clients form the first cluster.
    Step 2 (while fewer than ``S`` clusters exist): take the strongest remaining link; if it joins an unassigned
        client to an existing cluster, the client joins that cluster, otherwise (a client-client link) the two
        clients form a new cluster. Ties prefer joining an existing cluster.
    Step 3 (``S`` clusters exist): repeatedly take the unassigned client with the highest similarity to any
        cluster; it joins when that similarity exceeds ``sim_t``, else it and every client left are unclustered.
    With a single client, that client is the only cluster.
    """
    k = int(sim.shape[0])
    if k == 0:
        return Clustering([])
    if k == 1:
        return Clustering([[0]])
    sim = sim.detach().double().cpu()  # K x K: tiny; the greedy steps below are index bookkeeping
    s = sim.clone()
    s.fill_diagonal_(float("-inf"))
    unassigned = list(range(k))
    clusters: List[List[int]] = []

    def cluster_links() -> Optional[Tuple[float, int, int]]:
        """Best (similarity, client, cluster) over unassigned clients and existing clusters."""
        if not clusters or not unassigned:
            return None
        u = torch.tensor(unassigned)
        # mean similarity of each cluster's members to each unassigned client: (num_clusters, len(u))
        links = torch.stack([sim[c][:, u].mean(dim=0) for c in clusters])
        best = int(torch.argmax(links))
        ci, ui = divmod(best, len(unassigned))
        return float(links[ci, ui]), unassigned[ui], ci

    def pair_link() -> Optional[Tuple[float, int, int]]:
        if len(unassigned) < 2:
            return None
        u = torch.tensor(unassigned)
        sub = s[u][:, u]
        best = int(torch.argmax(sub))
        a, b = divmod(best, len(unassigned))
        return float(sub[a, b]), unassigned[a], unassigned[b]

    # Step 1
    _, a, b = pair_link()
    clusters.append([a, b])
    unassigned = [c for c in unassigned if c not in (a, b)]
    # Step 2
    while unassigned and len(clusters) < max_clusters:
        join, pair = cluster_links(), pair_link()
        if pair is None or (join is not None and join[0] >= pair[0]):
            _, client, ci = join
            clusters[ci].append(client)
            unassigned.remove(client)
        else:
            _, a, b = pair
            clusters.append([a, b])
            unassigned = [c for c in unassigned if c not in (a, b)]
    # Step 3
    unclustered: List[int] = []
    while unassigned:
        value, client, ci = cluster_links()
        if value > sim_t:
            clusters[ci].append(client)
            unassigned.remove(client)
        else:
            unclustered = sorted(unassigned)
            break
    return Clustering([sorted(c) for c in clusters], unclustered)


# ---------------------------------------------------------------------------------------------------------
# Cluster categories, means and weights (Eq. 11-15)
# ---------------------------------------------------------------------------------------------------------
def membership_matrix(clusters: Sequence[Sequence[int]], num_clients: int, client_weights: Optional[torch.Tensor],
                      device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(S, K)`` rows averaging over each cluster's members (uniformly, or by ``client_weights``)."""
    member = torch.zeros(len(clusters), num_clients, dtype=dtype, device=device)
    for si, members in enumerate(clusters):
        member[si, list(members)] = 1.0
    if client_weights is not None:
        member = member * client_weights.to(device=device, dtype=dtype)
    return member / member.sum(dim=1, keepdim=True)


def macro_categories(mic: torch.Tensor, clusters: Sequence[Sequence[int]], num_categories: int) -> torch.Tensor:
    """Eq. 11: ``MAC^s`` = most frequent MIC category among cluster s's members, per entry (``(S, M')`` uint8).

    Ties go to the lowest category. Counted per cluster and category with vectorised compare-and-sum.
    """
    out = torch.empty(len(clusters), mic.shape[1], dtype=torch.uint8, device=mic.device)
    for si, members in enumerate(clusters):
        sub = mic.index_select(0, torch.as_tensor(list(members), device=mic.device))
        count_dtype = torch.int16 if len(members) < 32767 else torch.int32
        best_count = (sub == 1).sum(dim=0, dtype=count_dtype)
        best = torch.ones(mic.shape[1], dtype=torch.uint8, device=mic.device)
        for c in range(2, num_categories + 1):
            count = (sub == c).sum(dim=0, dtype=count_dtype)
            best.masked_fill_(count > best_count, c)  # strict: ties keep the lower category
            torch.maximum(best_count, count, out=best_count)
        out[si] = best
    return out


def cluster_weights(mac: torch.Tensor, num_categories: int, norm: str = "normalized") -> torch.Tensor:
    """Eq. 14: per entry, a cluster's weight grows with the number of clusters sharing its MAC category.

    ``n_s = sum_{s'} 1[MAC^{s'} = MAC^s]``. "normalized" (default): ``alpha_s = n_s / sum_{s'} n_{s'}``, which sums
    to one per entry, so the result is a convex combination of cluster means dominated by the majority category.
    "printed": ``alpha_s = n_s / (S x C)`` as Eq. 14 is typeset (does not sum to one in general).
    Returns ``(S, M')`` float32 weights.
    """
    if norm not in ALPHA_NORMS:
        raise ValueError(f"alpha_norm must be one of {ALPHA_NORMS}, got {norm!r}")
    num_clusters = mac.shape[0]
    shared = torch.zeros(mac.shape, dtype=torch.float32, device=mac.device)
    for other in mac:  # n_s = number of clusters whose category equals cluster s's, per entry
        shared.add_(mac == other)
    if norm == "normalized":
        return shared / shared.sum(dim=0, keepdim=True)
    return shared / float(num_clusters * num_categories)


def high_dispersion_result(stacked_high: torch.Tensor, mic: torch.Tensor, clusters: Sequence[Sequence[int]],
                           num_categories: int, alpha_norm: str = "normalized",
                           client_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. 11, 12, 14, 15 for one layer's high-dispersion entries: ``sum_s alpha_s * w_bar^s``.

    ``stacked_high``: ``(K, M')`` client values; ``mic``: their ``(K, M')`` categories. Unclustered clients (in no
    cluster) do not contribute.
    """
    mac = macro_categories(mic, clusters, num_categories)                       # Eq. 11
    member = membership_matrix(clusters, stacked_high.shape[0], client_weights,
                               stacked_high.device, stacked_high.dtype)
    cluster_means = member @ stacked_high                                       # Eq. 12, S x M'
    alpha = cluster_weights(mac, num_categories, alpha_norm).to(stacked_high.dtype)  # Eq. 14
    return (alpha * cluster_means).sum(dim=0)                                   # Eq. 15


# ---------------------------------------------------------------------------------------------------------
# The whole aggregation
# ---------------------------------------------------------------------------------------------------------
@dataclass
class FedSAReport:
    """Diagnostics of one aggregation (for logging and tests)."""

    high_share: Dict[str, float]      # per layer: fraction of entries classed high-dispersion
    num_high: int                     # high-dispersion entries over the network
    num_entries: int                  # entries that went through the dispersion split
    clustering: Optional[Clustering]  # None when nothing was high-dispersion
    similarity: Optional[torch.Tensor]


def fedsa_aggregate(layers: Iterable[Tuple[str, ClientTensors]], cv_t: float, sim_t: float, num_categories: int,
                    max_clusters: int, mic_norm: str = "minmax", alpha_norm: str = "normalized",
                    cv_norm: str = "minmax", client_weights: Optional[torch.Tensor] = None
                    ) -> Tuple[Dict[str, torch.Tensor], FedSAReport]:
    """FedSA over named layers: Algorithm 1, lines 5-13.

    ``layers`` yields ``(name, clients)``: the K client copies of that tensor, as a ``(K, ...)`` stack or a
    sequence of K equally shaped tensors (e.g. a dict's ``.items()``, or a generator). No K x M stack is built:
    only the high-dispersion columns are gathered and kept for the second pass.
    ``client_weights`` (``(K,)``, optional): weights of the low-dispersion mean (Eq. 7) and of the cluster means
    (Eq. 12); ``None`` (the paper's ``Mean``) is the uniform mean. The dispersion statistics (Eq. 2-4) always use
    the uniform mean. Returns the aggregated tensors (original shapes) and a report.
    """
    if client_weights is not None:
        client_weights = client_weights / client_weights.sum()
    results: Dict[str, torch.Tensor] = {}
    shapes: Dict[str, torch.Size] = {}
    highs: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name -> (index, mic, w[:, index])
    high_share: Dict[str, float] = {}
    agreement: Optional[torch.Tensor] = None
    num_high = num_entries = 0
    for name, clients in layers:  # loop over layers (tensors), never over entries
        shapes[name] = (clients.shape[1:] if isinstance(clients, torch.Tensor) else clients[0].shape)
        xs = _client_list(clients)
        mu, cv = coefficient_of_variation(xs)                                   # Eq. 2-4
        mask = high_dispersion_mask(cv, cv_t, cv_norm)                          # Eq. 5-6
        if client_weights is None:
            results[name] = mu                                                  # Eq. 7 (uniform Mean)
        else:
            mean = torch.zeros_like(mu)
            for x, wk in zip(xs, client_weights.tolist()):
                mean.add_(x, alpha=wk)
            results[name] = mean                                                # Eq. 7 (sample-weighted)
        num_entries += mask.numel()
        index = mask.nonzero().squeeze(1)
        n_high = int(index.numel())
        high_share[name] = n_high / max(1, mask.numel())
        if n_high == 0:
            continue
        w_high = torch.empty(len(xs), n_high, dtype=mu.dtype, device=mu.device)  # K x M' (r^h columns)
        for row, x in zip(w_high, xs):
            torch.index_select(x, 0, index, out=row)
        mic = micro_classes(squared_deviation(w_high, mu.index_select(0, index)), num_categories,
                            mic_norm)                                           # Eq. 3, 8-9
        part = mic_agreement(mic, num_categories)
        agreement = part if agreement is None else agreement + part
        highs[name] = (index, mic, w_high)
        num_high += n_high

    clustering: Optional[Clustering] = None
    sim: Optional[torch.Tensor] = None
    if num_high > 0:
        sim = similarity_from_agreement(agreement, num_high)                    # Eq. 10
        clustering = cluster_clients(sim, max_clusters, sim_t)                  # Macro-Classes
        for name, (index, mic, w_high) in highs.items():
            high = high_dispersion_result(w_high, mic, clustering.clusters, num_categories, alpha_norm,
                                          client_weights)                        # Eq. 11, 12, 14, 15
            results[name].index_copy_(0, index, high.to(results[name].dtype))   # Eq. 13: w^l + w^h
    out = {name: results[name].reshape(shapes[name]) for name in results}
    return out, FedSAReport(high_share, num_high, num_entries, clustering, sim)
