"""Built-in partitioners: IID, Dirichlet label skew, pathological (n classes per client).

Every partitioner is a function ``(labels, num_clients, rng, groups=None, **params) -> list of index arrays``
returning a true partition (no sample on two clients) and declares its ``params`` for config validation.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param, positive


def _check_enough(n: int, num_clients: int, min_size: int) -> None:
    if n < num_clients * min_size:
        raise DataError(f"cannot give {num_clients} clients at least {min_size} samples each from {n} samples")


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None) -> List[np.ndarray]:
    """Uniformly random, equal-sized shards (sizes differ by at most one)."""
    _check_enough(len(labels), num_clients, 1)
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


iid.params = {}


def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None, alpha: float = 0.1,
              min_size: int = 10, min_rule: str = "move") -> List[np.ndarray]:
    """Label skew: each class is split across clients with proportions ~ Dir(alpha).

    ``min_rule = move`` (default): a minimum size without unbounded resampling -- proportions are drawn once per
    class, then clients below ``min_size`` take samples from the largest clients (from the classes those hold most
    of), which always terminates and keeps the partition exact. ``min_rule = pfllib``: PFLlib's rule, which the
    papers that used PFLlib (FedCP, FedSA) partitioned with -- a client that already holds N / num_clients samples
    gets none of the classes dealt after that, and the whole partition is drawn again until every client holds
    ``min_size`` (PFLlib's ``least_samples``: batch_size / (1 - train ratio) = 40 at batch 10 and a 75/25 split).
    """
    n = len(labels)
    _check_enough(n, num_clients, min_size)
    if min_rule == "pfllib":
        return _dirichlet_pfllib(labels, num_clients, rng, alpha, min_size)
    owner = np.empty(n, dtype=np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
        for client, part in enumerate(np.split(idx, cuts)):
            owner[part] = client
    counts = np.bincount(owner, minlength=num_clients)
    for client in np.flatnonzero(counts < min_size):
        while counts[client] < min_size:
            donor = int(np.argmax(counts))
            donor_idx = np.flatnonzero(owner == donor)
            need = min(min_size - counts[client], counts[donor] - min_size)
            if need <= 0:  # cannot happen given the size check, kept as a guard against infinite loops
                raise DataError("dirichlet partition cannot satisfy min_size")
            # take the donor's samples of the class it holds most of, so the skew is preserved
            donor_labels = labels[donor_idx]
            order = np.argsort(-np.bincount(donor_labels)[donor_labels], kind="stable")
            moved = donor_idx[order[:need]]
            owner[moved] = client
            counts[donor] -= len(moved)
            counts[client] += len(moved)
    return [np.flatnonzero(owner == k) for k in range(num_clients)]


PFLLIB_MAX_DRAWS = 10_000  # PFLlib redraws without a bound; a setting that never fits is one line, not a hang


def _dirichlet_pfllib(labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float,
                      min_size: int) -> List[np.ndarray]:
    """PFLlib's Dirichlet partition (``min_rule = pfllib``): classes dealt in label order, each with fresh
    proportions ~ Dir(alpha) restricted to the clients below N / num_clients samples; redrawn until the smallest
    client holds ``min_size``."""
    n, classes = len(labels), np.unique(labels)
    cap = n / num_clients
    for _ in range(PFLLIB_MAX_DRAWS):
        parts: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha)) * (sizes < cap)
            cuts = (np.cumsum(props / props.sum()) * len(idx)).astype(int)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(p)) for p in parts]
    raise DataError(f"partition.min_rule=pfllib: no Dir({alpha}) draw in {PFLLIB_MAX_DRAWS:,} gave every one of "
                    f"{num_clients} clients {min_size} samples; lower partition.min_size or raise partition.alpha")


dirichlet.params = {
    "alpha": Param(0.1, "Dirichlet concentration (smaller = more skew)", check=positive),
    "min_size": Param(10, "minimum samples per client (guaranteed)", check=lambda v: None if v >= 1 else "must be >= 1"),
    "min_rule": Param("move", "how min_size is met: move (samples move from the largest clients, one draw) or "
                              "pfllib (PFLlib's: full clients take no further class, redraw until every client "
                              "holds min_size)", choices=("move", "pfllib")),
}


def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None,
                 classes_per_client: int = 2, balance: bool = True,
                 size_sigma: Optional[float] = None, class_draw: str = "deal") -> List[np.ndarray]:
    """Each client holds ``classes_per_client`` classes; each class is divided among the clients holding it.

    ``class_draw = deal`` (default): classes are dealt round-robin over a shuffled class order, so every class is
    used and every client gets exactly ``classes_per_client`` distinct classes (when there are at least that many
    classes). ``class_draw = independent``: each client draws its ``classes_per_client`` distinct classes uniformly
    at random, independently of the others (FedCAC's authors' code: "each client is randomly assigned two
    classes"), so clients' class sets overlap partially and at random and a class may go unused.
    ``size_sigma`` (PCFL's "K clients, S classes each, log-normal sizes"): client k draws w_k ~ LogNormal(0, sigma)
    and every class is divided among its holders in proportion to their w_k, so client sizes are log-normally
    spread; it takes precedence over ``balance``.
    """
    classes = np.unique(labels)
    if classes_per_client > len(classes):
        raise DataError(f"classes_per_client={classes_per_client} exceeds the {len(classes)} classes available")
    holders = {int(c): [] for c in classes}
    if class_draw == "independent":
        for client in range(num_clients):
            for c in rng.choice(classes, size=classes_per_client, replace=False):
                holders[int(c)].append(client)
    else:
        order = rng.permutation(classes)
        slot = 0
        for client in range(num_clients):
            for _ in range(classes_per_client):
                holders[int(order[slot % len(order)])].append(client)
                slot += 1
    parts: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
    weight = rng.lognormal(0.0, size_sigma, num_clients) if size_sigma is not None else None
    for c, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == c))
        if not owners:
            continue
        if weight is not None:
            w = weight[owners]
            cuts = (np.cumsum(w / w.sum())[:-1] * len(idx)).astype(int)
            chunks = np.split(idx, cuts)
        elif balance:
            chunks = np.array_split(idx, len(owners))
        else:
            props = rng.uniform(0.5, 1.5, len(owners))
            cuts = (np.cumsum(props / props.sum())[:-1] * len(idx)).astype(int)
            chunks = np.split(idx, cuts)
        for client, chunk in zip(owners, chunks):
            parts[client].append(chunk)
    out = [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]
    empty = [k for k, p in enumerate(out) if len(p) == 0]
    if empty:
        raise DataError(f"pathological partition left clients {empty} empty: too few samples per class")
    return out


pathological.params = {
    "classes_per_client": Param(2, "distinct classes per client", check=positive),
    "balance": Param(True, "split each class equally among its holders (else random sizes)"),
    "size_sigma": Param(None, "log-normal client sizes: each class is split among its holders in proportion to "
                              "w_k ~ LogNormal(0, size_sigma) (PCFL's CIFAR-10/FEMNIST setting); null = off",
                        type=float, check=lambda v: None if v > 0 else "must be > 0 (or null for off)"),
    "class_draw": Param("deal", "how clients get their classes: deal (round-robin over a shuffled order: every "
                                "class used, as evenly as possible) or independent (each client draws its own at "
                                "random: partial, random overlaps, as FedCAC's authors)",
                        choices=("deal", "independent")),
}


# Natural groups -------------------------------------------------------------------------------------------
def by_group(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups: Optional[np.ndarray] = None,
             assign: str = "exact", shuffle: bool = False) -> List[np.ndarray]:
    """One natural group (domain, writer, generating device) per client, from the dataset's ``groups``.

    ``assign``: ``exact`` needs as many groups as clients (client k = k-th group in sorted order, so clients line
    up with ``bundle.group_names``); ``merge`` deals groups round-robin onto fewer clients; ``split`` deals clients
    round-robin onto fewer groups and divides each group's samples at random among its clients; ``auto`` picks
    exact, merge or split from the counts. ``shuffle`` randomises the group order first.
    """
    if groups is None:
        raise DataError("partitioner 'by_group' needs a dataset that defines groups (domains, writers, devices); "
                        "this dataset has none -- pick another partition.name")
    uniq, codes = np.unique(np.asarray(groups), return_inverse=True)
    n_groups = len(uniq)
    order = rng.permutation(n_groups) if shuffle else np.arange(n_groups)  # order[pos] = group at position pos
    mode = assign
    if mode == "auto":
        mode = "exact" if n_groups == num_clients else ("merge" if n_groups > num_clients else "split")
    if mode == "exact":
        if n_groups != num_clients:
            raise DataError(f"partitioner 'by_group': the dataset has {n_groups} groups but partition.num_clients = "
                            f"{num_clients}; set num_clients = {n_groups}, or partition.assign = merge/split/auto")
        return [np.flatnonzero(codes == order[k]) for k in range(num_clients)]
    if mode == "merge":
        if n_groups < num_clients:
            raise DataError(f"partitioner 'by_group': assign=merge needs at least as many groups ({n_groups}) as "
                            f"clients ({num_clients}); use assign=split")
        client_of_group = np.empty(n_groups, dtype=np.int64)
        client_of_group[order] = np.arange(n_groups) % num_clients
        owner = client_of_group[codes]
        return [np.flatnonzero(owner == k) for k in range(num_clients)]
    if num_clients < n_groups:
        raise DataError(f"partitioner 'by_group': assign=split needs at least as many clients ({num_clients}) as "
                        f"groups ({n_groups}); use assign=merge")
    parts: List[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_clients
    for pos in range(n_groups):
        clients = list(range(pos, num_clients, n_groups))
        idx = rng.permutation(np.flatnonzero(codes == order[pos]))
        if len(idx) < len(clients):
            raise DataError(f"partitioner 'by_group': group {uniq[order[pos]]!r} has {len(idx)} samples, too few "
                            f"to split among {len(clients)} clients")
        for client, chunk in zip(clients, np.array_split(idx, len(clients))):
            parts[client] = np.sort(chunk)
    return parts


by_group.params = {
    "assign": Param("exact", "groups -> clients: exact (one each), merge (round-robin onto fewer clients), split "
                             "(each group divided among several clients), auto",
                    choices=("exact", "merge", "split", "auto")),
    "shuffle": Param(False, "shuffle the group order before assigning (default: sorted group ids)"),
}


# Fixed client sizes with label skew -------------------------------------------------------------------------
def _fill_clients(labels: np.ndarray, sizes: np.ndarray, rng: np.random.Generator,
                  alpha: Optional[float]) -> List[np.ndarray]:
    """Give client k exactly ``sizes[k]`` samples without replacement.

    alpha=None: uniformly at random. Otherwise client k draws class proportions q_k ~ Dir(alpha * C * p), p the
    class frequencies (= Dir(alpha) on balanced data), and takes its samples by multinomial draws from q_k; a
    class that runs out is dropped and q_k renormalised over the remaining classes (clients are served in
    random order so no client is systematically left with the leftovers).
    """
    num_clients = len(sizes)
    if alpha is None:
        perm = rng.permutation(len(labels))
        cuts = np.cumsum(sizes)[:-1]
        return [np.sort(p) for p in np.split(perm[: sizes.sum()], cuts)]
    classes, codes = np.unique(labels, return_inverse=True)
    pools = [rng.permutation(np.flatnonzero(codes == c)) for c in range(len(classes))]
    supply = np.array([len(p) for p in pools], dtype=np.int64)
    prior = supply / supply.sum()
    taken = np.zeros(len(classes), dtype=np.int64)
    q = rng.dirichlet(alpha * len(classes) * prior, size=num_clients)
    parts: List[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_clients
    for k in rng.permutation(num_clients):
        need = int(sizes[k])
        counts = np.zeros(len(classes), dtype=np.int64)
        while need > 0:
            left = supply - taken - counts
            weights = q[k] * (left > 0)
            if weights.sum() <= 0:  # every class this client prefers is used up: take what remains, pro rata
                weights = left.astype(np.float64)
            draw = np.minimum(rng.multinomial(need, weights / weights.sum()), left)
            counts += draw
            need -= int(draw.sum())
        parts[k] = np.sort(np.concatenate([pools[c][taken[c]: taken[c] + counts[c]] for c in range(len(classes))]))
        taken += counts
    return parts


def _alpha_check(v) -> Optional[str]:
    return None if v > 0 else "must be > 0 (or null for IID)"


def dirichlet_lognormal(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None,
                        alpha: float = 0.5, sigma: float = 0.3, min_size: int = 10) -> List[np.ndarray]:
    """Unbalanced label skew (Acar et al.'s FedDyn setting, PCFL's "log-normal client sizes"): every sample is used;
    client k's share of the data is proportional to w_k ~ LogNormal(0, sigma) on top of ``min_size``, and its
    classes follow q_k ~ Dir(alpha * C * p) (see ``_fill_clients``). sigma=0 gives equal sizes."""
    n = len(labels)
    _check_enough(n, num_clients, min_size)
    w = rng.lognormal(0.0, sigma, num_clients)
    quota = w / w.sum() * (n - num_clients * min_size)
    sizes = np.floor(quota).astype(np.int64)
    for i in np.argsort(-(quota - sizes))[: n - num_clients * min_size - sizes.sum()]:
        sizes[i] += 1
    return _fill_clients(labels, sizes + min_size, rng, alpha)


dirichlet_lognormal.params = {
    "alpha": Param(0.5, "Dirichlet concentration of each client's label distribution", check=positive),
    "sigma": Param(0.3, "log-normal sigma of client sizes (0 = equal sizes)",
                   check=lambda v: None if v >= 0 else "must be >= 0"),
    "min_size": Param(10, "minimum samples per client (guaranteed)", check=lambda v: None if v >= 1 else "must be >= 1"),
}


def fixed(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None,
          samples_per_client: int = 600, alpha: Optional[float] = None) -> List[np.ndarray]:
    """Exactly ``samples_per_client`` distinct samples per client (FedCAC: 500 train + 100 test = 600, with
    split.train_size=500, split.test_size=100); IID when alpha is null, else label-skewed by Dir(alpha) as in
    ``dirichlet_lognormal``. Samples not needed stay unused."""
    n = len(labels)
    if n < num_clients * samples_per_client:
        raise DataError(f"partitioner 'fixed': {num_clients} clients x {samples_per_client} samples = "
                        f"{num_clients * samples_per_client} exceeds the {n} samples of the dataset")
    return _fill_clients(labels, np.full(num_clients, samples_per_client, dtype=np.int64), rng, alpha)


fixed.params = {
    "samples_per_client": Param(600, "samples per client (train + test; pair with split.train_size/test_size)",
                                check=positive),
    "alpha": Param(None, "Dirichlet label-skew concentration (null = IID)", type=float, check=_alpha_check),
}


# FedAvg shards ----------------------------------------------------------------------------------------------
def shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None,
           shards_per_client: int = 2, within_class: bool = False) -> List[np.ndarray]:
    """McMahan et al.'s pathological split: sort by label, cut into num_clients * shards_per_client equal shards
    (sizes differ by at most one), give each client shards_per_client random shards. Every sample is used.

    ``within_class``: every shard holds one class -- each class is cut into num_clients * shards_per_client /
    num_classes equal shards (FedRep's ``noniid``, which the PCFL authors' CIFAR-10 clients come from: 150 clients x 5
    shards of 66-67 images); a client may draw two shards of one class, as there."""
    n = len(labels)
    num_shards = num_clients * shards_per_client
    if n < num_shards:
        raise DataError(f"partitioner 'shards': {num_shards} shards need at least {num_shards} samples, "
                        f"the dataset has {n}")
    if within_class:
        pieces = _class_shards(labels, num_shards, rng)
    else:
        order = np.lexsort((rng.random(n), labels))  # by label, random within a label
        pieces = np.array_split(order, num_shards)
    deal = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])) for row in deal]


def _class_shards(labels: np.ndarray, num_shards: int, rng: np.random.Generator) -> List[np.ndarray]:
    classes = np.unique(labels)
    if num_shards % len(classes):
        raise DataError(f"partitioner 'shards': within_class needs num_clients * shards_per_client ({num_shards}) to "
                        f"be a multiple of the {len(classes)} classes")
    per_class = num_shards // len(classes)
    pieces: List[np.ndarray] = []
    for c in classes:
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < per_class:
            raise DataError(f"partitioner 'shards': class {int(c)} has {len(idx)} samples, fewer than its "
                            f"{per_class} shards")
        pieces += np.array_split(idx, per_class)
    return pieces


shards.params = {
    "shards_per_client": Param(2, "label-sorted shards per client (FedAvg: 2)", check=positive),
    "within_class": Param(False, "cut each class into its own equal shards (FedRep's noniid; PCFL's CIFAR-10 "
                                 "clients), instead of cutting the label-sorted samples"),
}


# Natural clients in reading order -----------------------------------------------------------------------------
def natural(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups: Optional[np.ndarray] = None,
            test_fraction: float = 0.2):
    """One client per natural group (a speaker, a writer), its samples split in dataset order: the first
    ``1 - test_fraction`` train, the rest (at least one) test -- the FedAvg paper's split of a Shakespeare role
    into its first 80% and last 20% of lines. With fewer clients than groups, a seeded choice of groups."""
    from pflkit.core.data.data import ClientSplit

    if groups is None:
        raise DataError("partitioner 'natural' needs a dataset that defines groups (speakers, writers); this dataset "
                        "has none -- pick another partition.name")
    codes = np.asarray(groups)
    uniq = np.unique(codes)
    if num_clients > len(uniq):
        raise DataError(f"partitioner 'natural': the dataset has {len(uniq)} groups, fewer than partition.num_clients "
                        f"= {num_clients}")
    chosen = uniq if num_clients == len(uniq) else np.sort(rng.choice(uniq, size=num_clients, replace=False))
    out = []
    for g in chosen:
        idx = np.flatnonzero(codes == g)  # ascending: the dataset's reading order
        if len(idx) < 2:
            raise DataError(f"partitioner 'natural': group {int(g)} has {len(idx)} sample; each client needs at "
                            f"least one training and one test sample")
        n_test = min(len(idx) - 1, max(1, int(np.ceil(test_fraction * len(idx)))))
        out.append(ClientSplit(idx[:len(idx) - n_test], idx[len(idx) - n_test:]))
    return out


natural.params = {
    "test_fraction": Param(0.2, "fraction of each client's samples, the last ones in reading order, that it tests on",
                           check=lambda v: None if 0 < v < 1 else "must lie in (0, 1)"),
}
