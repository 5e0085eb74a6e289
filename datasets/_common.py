"""Shared helpers of the built-in dataset loaders: data roots, missing-file errors, downloads, on-disk readers
(idx ubyte, image folders) and the on-device uint8 -> normalised float transform."""
from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from pflkit.core.data.data import dataset_root, root_words
from pflkit.core.common.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def data_root(root: Optional[str]) -> Path:
    """``dataset.root`` resolved by the core's one rule (pflkit.core.data.data.dataset_root)."""
    return dataset_root(root)


def install_command(dataset: str, root: Optional[str]) -> str:
    """The ``fl data install`` command that puts ``dataset``'s files where a loader given ``root`` reads them."""
    return f"fl data install {dataset}" + (f" --root {root}" if root is not None and str(root) != "" else "")


def missing(paths: Sequence[Path]) -> List[Path]:
    """The paths of ``paths`` that do not exist (a ``.gz`` sibling counts as present)."""
    return [p for p in paths if not p.exists() and not Path(str(p) + ".gz").exists()]


def _shown(paths: Sequence[Path], base: Path) -> str:
    """The files, relative to ``base`` where they lie under it (the message names ``base`` once)."""
    names = []
    for p in paths:
        try:
            names.append(str(p.relative_to(base)))
        except ValueError:
            names.append(str(p))
    return ", ".join(names)


def _dirs_to_make(folder: Path) -> List[Path]:
    """``folder`` and those of its ancestors that do not exist yet, outermost first."""
    out = []
    for p in [folder, *folder.parents]:
        if p.exists() or p.is_symlink():
            break
        out.append(p)
    return out[::-1]


def _remove_empty_tree(folder: Path) -> None:
    """Remove ``folder`` when it holds folders only (what a download that fetched nothing leaves behind)."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for dirpath, _dirs, files in os.walk(folder, topdown=False):
        if files:
            return
        try:
            os.rmdir(dirpath)
        except OSError:
            return


def ensure_files(name: str, root: Optional[str], required: Sequence[Path], download: bool,
                 fetch: Optional[Callable[[Path], None]], hint: str = "", install: Optional[str] = None) -> None:
    """Make sure every file of ``required`` exists, else one-line DataError naming the files to place and how to get
    them. ``root`` is ``dataset.root`` as given (None: the core's default); ``install`` names the ``fl data
    install`` data set that provides the files. Only with ``download`` (``dataset.download=true``, an explicit
    request) is ``fetch`` called; a download that fails leaves no folder it made behind."""
    base = data_root(root)
    absent = missing(required)
    if not absent:
        return
    reason = ""
    if download and fetch is not None:
        made = _dirs_to_make(base)
        before = {p.name for p in base.iterdir()} if base.is_dir() else set()
        try:
            base.mkdir(parents=True, exist_ok=True)
            fetch(base)
        except Exception as exc:  # no network, checksum mismatch, disk full ...: all become one clear error
            text = " ".join(str(exc).split())[:160]
            reason = f"the download failed ({type(exc).__name__}: {text}); "
        absent = missing(required)
        if not absent:
            return
        if base.is_dir():
            for entry in base.iterdir():
                if entry.name not in before:
                    _remove_empty_tree(entry)
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                break
    ways = []
    if install:
        ways.append(f"get them with `{install_command(install, root)}`")
    ways.append(f"place them there{' ' + hint if hint else ''}")
    if fetch is not None and not download:
        ways.append("set dataset.download=true to download them (needs internet)")
    raise DataError(f"dataset '{name}': {reason}{len(absent)} file(s) missing in {root_words(root)}: "
                    f"{_shown(absent, base)}; " + ", or ".join(ways))


def open_maybe_gz(path: Path):
    if path.exists():
        return open(path, "rb")
    return gzip.open(str(path) + ".gz", "rb")


def read_idx(path: Path) -> np.ndarray:
    """Read an idx ubyte file (the MNIST family's format: magic, dims, big-endian payload)."""
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    with open_maybe_gz(path) as fh:
        data = fh.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in dtypes:
        raise DataError(f"{path} is not an idx ubyte file (bad magic number)")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=dtypes[data[2]], offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but the file holds {arr.size} values (truncated?)")
    return arr.reshape(dims).astype(arr.dtype.newbyteorder("=")) if arr.dtype.byteorder == ">" else arr.reshape(dims)


def resize_uint8(x: torch.Tensor, size: Tuple[int, int], chunk: int = 4096) -> torch.Tensor:
    """Resize a uint8 NCHW batch (bilinear, antialiased), chunked to bound memory."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    out = []
    for part in torch.split(x, chunk):
        y = F.interpolate(part.float(), size=size, mode="bilinear", antialias=True, align_corners=False)
        out.append(y.round_().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out) if out else x.new_zeros((0, x.shape[1], *size))


def to_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 NCHW with 1 or 3 channels -> ``channels`` channels (grey replicated, or ITU-R 601 luma)."""
    if x.shape[1] == channels:
        return x
    if x.shape[1] == 1 and channels == 3:
        return x.expand(-1, 3, -1, -1).contiguous()
    if x.shape[1] == 3 and channels == 1:
        w = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        return (x.float() * w).sum(1, keepdim=True).round_().clamp_(0, 255).to(torch.uint8)
    raise DataError(f"cannot convert {x.shape[1]}-channel images to {channels} channels")


class NormalizeUint8:
    """Per-batch transform on the device: uint8 images -> float in [0, 1] -> per-channel standardised.

    A plain class (not a closure) so bundles stay picklable; the mean/std tensors are cached per device.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self._cache: Dict[Tuple[str, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = (str(x.device), x.dim())
        if key not in self._cache:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            self._cache[key] = (torch.tensor(self.mean, device=x.device).view(shape),
                                torch.tensor(self.std, device=x.device).view(shape))
        mean, std = self._cache[key]
        return (x.float() / 255.0 - mean) / std

    def __getstate__(self):
        return {"mean": self.mean, "std": self.std}

    def __setstate__(self, state):
        self.__init__(state["mean"], state["std"])

    def __repr__(self) -> str:
        return f"NormalizeUint8(mean={self.mean}, std={self.std})"


def channel_stats(x: torch.Tensor, max_samples: int = 20000) -> Tuple[List[float], List[float]]:
    """Per-channel mean/std in [0, 1] units of a uint8 NCHW set (on a fixed, evenly spaced subsample)."""
    if len(x) == 0:
        return [0.5] * x.shape[1], [0.5] * x.shape[1]
    idx = torch.linspace(0, len(x) - 1, min(len(x), max_samples)).long()
    s = x[idx].float().div_(255).transpose(0, 1).reshape(x.shape[1], -1)
    std = s.std(dim=1).clamp_min(1e-3)
    return s.mean(dim=1).tolist(), std.tolist()


def load_image(path: Path, size: Tuple[int, int], channels: int) -> np.ndarray:
    """Decode one image file to uint8 HxWxC at ``size`` (bilinear)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert("RGB" if channels == 3 else "L")
            if img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read image {path}: {exc}") from exc
    return arr[:, :, None] if arr.ndim == 2 else arr


def load_images(paths: Sequence[Path], size: Tuple[int, int], channels: int) -> torch.Tensor:
    """Decode files into one uint8 NCHW tensor (decoding is per file; everything after is vectorised)."""
    if not paths:
        return torch.zeros((0, channels, *size), dtype=torch.uint8)
    arr = np.stack([load_image(p, size, channels) for p in paths])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


def list_images(folder: Path) -> List[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def size_pair(image_size) -> Tuple[int, int]:
    if isinstance(image_size, (list, tuple)):
        if len(image_size) != 2:
            raise DataError(f"image_size must be one integer or [height, width], got {image_size!r}")
        return int(image_size[0]), int(image_size[1])
    return int(image_size), int(image_size)

