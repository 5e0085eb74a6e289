"""An embedded feature-shift dataset: the bundled 8x8 digits rendered in six visually distinct domains, offline.

It stands in for Digit-5 / Office-10 (FedC2I's benchmarks) in offline runs and tests: every domain has the same
ten classes but its own look, the domain of each sample is its group, and the ``by_group`` partitioner gives one
domain per client. It is built deterministically from scikit-learn's 1,797 8x8 handwritten digits: the digits
are dealt to the domains (stratified by class; by default every domain gets *different* handwritten digits), each
image is upsampled to ``image_size`` and rendered in its domain's style (3 colour channels):

=================  ===============================================================  ========================
domain             rendering                                                        close to
=================  ===============================================================  ========================
original           white strokes on black, grey                                     thick
thick              strokes dilated by one pixel (3x3 max filter), white on black    original
textured           ``|texture - strokes|`` per channel on a smooth random colour    none (mixed polarity)
                   field, one per image (MNIST-M's blending)
inverted           black strokes on white, grey                                     inverted_colour
inverted_colour    dark strokes on a light, random per-image background colour      inverted
rotated            the original rendering turned by 90 degrees                      none (original's colours)
=================  ===============================================================  ========================

Two families with opposite stroke polarity -- bright strokes on a dark ground (original, thick) and dark strokes
on a light ground (inverted, inverted_colour) -- and two outliers: textured, whose strokes ``|t - 1| = 1 - t``
are darker than a bright patch of its background and brighter than a dark one (the polarity changes across the
image, as in MNIST-M), and rotated, which shares the original's colours but not its class shapes (a 6 turned by
90 degrees is no 6). Pairs inside a family are similar (a model of one transfers to the other); pairs across
families are not (a first-layer filter that detects a bright stroke answers with the wrong sign on a dark one).
This is the structure that influence-based aggregation (FedC2I) should discover, like the paper's SVHN /
SynthDigits pair on Digit-5.

``clients_per_domain = k`` splits every domain at random (stratified by class) into k groups named
``<domain>-1 .. <domain>-k``, so ``by_group`` gives k clients per domain (set ``partition.num_clients`` to
``k * len(domains)``). The rendering noise, texture and the assignment of digits to domains and groups are
seeded by ``dataset.seed`` alone (not the run seed): every run sees the same images.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pflkit.core.data.data import DatasetBundle
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param, positive
from pflkit.core.api.task import classification

from ._common import NormalizeUint8, channel_stats

DOMAINS = ("original", "thick", "textured", "inverted", "inverted_colour", "rotated")
#: which domains are meant to be alike (documentation and tests): the two stroke-polarity families
FAMILIES = {"bright strokes": ("original", "thick"), "dark strokes": ("inverted", "inverted_colour"),
            "mixed polarity": ("textured",), "rotated": ("rotated",)}


def _base_images(images: np.ndarray, size: int) -> torch.Tensor:
    """8x8 digits (0..16) -> float [N, 1, size, size] in [0, 1] (bilinear, antialiased when shrinking)."""
    x = torch.as_tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=size < 8)
    return x.clamp_(0.0, 1.0)


def _smooth_colour_field(n: int, size: int, g: torch.Generator) -> torch.Tensor:
    """One smooth random RGB texture per image: a 4x4 colour grid upsampled (bicubic) plus fine grain."""
    coarse = torch.rand(n, 3, 4, 4, generator=g)
    field = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    grain = 0.15 * (torch.rand(n, 3, size, size, generator=g) - 0.5)
    return (field + grain).clamp_(0.0, 1.0)


def render(domain: str, base: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Render grey base images [N, 1, S, S] in [0, 1] in ``domain``'s style -> float [N, 3, S, S] in [0, 1]."""
    n, _, size, _ = base.shape
    grey = base.expand(-1, 3, -1, -1)
    if domain == "original":
        out = grey
    elif domain == "thick":
        out = F.max_pool2d(base, kernel_size=3, stride=1, padding=1).expand(-1, 3, -1, -1)
    elif domain == "textured":  # MNIST-M's construction: |background - digit| per channel
        out = (_smooth_colour_field(n, size, g) - grey).abs()
    elif domain == "inverted":
        out = 1.0 - grey
    elif domain == "inverted_colour":
        background = 0.55 + 0.45 * torch.rand(n, 3, 1, 1, generator=g)  # light, one colour per image
        out = background * (1.0 - 0.85 * grey)
    elif domain == "rotated":
        out = torch.rot90(grey, k=1, dims=(2, 3))
    else:
        raise DataError(f"unknown digits_domains domain '{domain}'; domains are {', '.join(DOMAINS)}")
    return out.contiguous()


def _stratified_deal(labels: np.ndarray, parts: int, rng: np.random.Generator) -> np.ndarray:
    """Assign every index to one of ``parts`` parts, class by class, so each part gets a near-equal share of
    every class (part sizes differ by at most one per class)."""
    owner = np.empty(len(labels), dtype=np.int64)
    offset = 0
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        # rotate the starting part per class so the remainders do not always land on the first parts
        owner[idx] = (np.arange(len(idx)) + offset) % parts
        offset += len(idx)
    return owner


def group_names(domains: Optional[Sequence[str]] = None, clients_per_domain: int = 1, **_ignored) -> List[str]:
    """The dataset's group names for these options, computed without building the images (client/axis labels).

    Group ``k`` is client ``k`` under ``partition.name = by_group`` (its default ``assign = exact``).
    """
    chosen = list(DOMAINS if domains is None else domains)
    if clients_per_domain == 1:
        return chosen
    return [f"{d}-{j + 1}" for d in chosen for j in range(clients_per_domain)]


def load_digits_domains(root: Optional[str] = None, download: bool = False, domains: Optional[list] = None,
                        image_size: int = 16, clients_per_domain: int = 1, shared_digits: bool = False,
                        seed: int = 0) -> DatasetBundle:
    """Embedded feature-shift digits, offline: six rendered domains, one group (by_group client) per domain.

    The 8x8 digits drawn as original, thick, textured, inverted, inverted_colour and rotated RGB images (see the
    module docstring for which domains are alike).
    """
    from sklearn.datasets import load_digits as _load

    chosen = list(DOMAINS if domains is None else domains)
    unknown = [d for d in chosen if d not in DOMAINS]
    if unknown:
        raise DataError(f"dataset.domains: unknown domain(s) {unknown}; choose from {', '.join(DOMAINS)}")
    if not chosen:
        raise DataError("dataset.domains: give at least one domain")
    if len(set(chosen)) != len(chosen):
        raise DataError(f"dataset.domains: a domain is listed twice in {chosen}")
    if image_size < 8:
        raise DataError(f"dataset.image_size: {image_size} is below the digits' native 8 pixels")

    data = _load()
    labels = data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(int(seed))
    base_all = _base_images(data.images, image_size)
    if shared_digits:  # every domain renders all 1,797 digits (the same handwriting recurs across domains)
        members = [np.arange(len(labels))] * len(chosen)
    else:  # each domain gets its own digits: no handwritten sample appears in two domains
        owner = _stratified_deal(labels, len(chosen), rng)
        members = [np.flatnonzero(owner == k) for k in range(len(chosen))]

    xs, ys, gs = [], [], []
    sizes: Dict[str, int] = {}
    for k, domain in enumerate(chosen):
        idx = members[k]
        if clients_per_domain > len(idx) // 2:
            raise DataError(f"dataset.clients_per_domain: {clients_per_domain} groups cannot be cut from domain "
                            f"'{domain}' with {len(idx)} samples (each client needs at least 2)")
        img = render(domain, base_all[torch.as_tensor(idx)], g)
        xs.append((img * 255.0).round_().clamp_(0, 255).to(torch.uint8))
        ys.append(torch.as_tensor(labels[idx]))
        sub = _stratified_deal(labels[idx], clients_per_domain, rng) if clients_per_domain > 1 else \
            np.zeros(len(idx), dtype=np.int64)
        gs.append(torch.as_tensor(k * clients_per_domain + sub))
        sizes[domain] = int(len(idx))
    x = torch.cat(xs)
    mean, std = channel_stats(x)
    return DatasetBundle(
        x=x, y=torch.cat(ys), task=classification(10), input_shape=tuple(x.shape[1:]), groups=torch.cat(gs),
        group_names=group_names(chosen, clients_per_domain), transform=NormalizeUint8(mean, std),
        class_names=[str(i) for i in range(10)],
        meta={"source": "sklearn.datasets.load_digits rendered in feature-shift domains", "domain_sizes": sizes,
              "families": {f: [d for d in ds if d in chosen] for f, ds in FAMILIES.items()}})


def _domain_list(v) -> Optional[str]:
    unknown = [d for d in v if d not in DOMAINS]
    return f"unknown domain(s) {unknown}; choose from {', '.join(DOMAINS)}" if unknown else None


def _at_least_8(v) -> Optional[str]:
    return None if v >= 8 else "must be >= 8 (the digits' native size)"


load_digits_domains.params = {
    "domains": Param(None, "domains in group (client) order; default all six: " + ", ".join(DOMAINS), type=list,
                     check=_domain_list),
    "image_size": Param(16, "images are rendered at image_size x image_size (>= 8; 16 fits the LeNet of FedC2I's "
                            "Table 7 at a quarter of the cost of 32)", check=_at_least_8),
    "clients_per_domain": Param(1, "split every domain into this many groups (by_group: clients per domain; "
                                   "set partition.num_clients = clients_per_domain x domains)", check=positive),
    "shared_digits": Param(False, "render all 1,797 digits in every domain (more data per domain, but the same "
                                  "handwriting then appears in several domains); default: disjoint digits"),
    "seed": Param(0, "seed of the rendering (noise, textures, colours) and of dealing digits to domains/groups"),
}
#: data-free hook: group names (= client names under by_group) for given dataset options
load_digits_domains.group_names = group_names
