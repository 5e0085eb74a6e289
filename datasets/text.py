"""AG News topic classification (Zhang, Zhao & LeCun, NeurIPS 2015) from the original release's ``ag_news_csv``
folder: ``train.csv`` (120,000 rows) and ``test.csv`` (7,600 rows), three quoted columns -- class index 1-4, title,
description -- and ``classes.txt`` (World, Sports, Business, Sci/Tech). No package of any registry holds these
files, so there is no download: place the folder under the data root (``ROOT/ag_news_csv/``).

The text of a row is its title and description joined by a space (torchtext's ``AG_NEWS``, which PFLlib's
``generate_agnews.py`` and FedCP use), tokenised as torchtext's ``basic_english`` tokenizer does (lower case,
punctuation split off). The vocabulary is built from ``train.csv`` only: the ``vocab_size - 2`` most frequent
training tokens (ties by the token's text), id 0 = padding (the ``fasttext`` model ignores it), id 1 = any token
not in the vocabulary. Every text becomes ``max_len`` ids, cut or padded with 0 (PFLlib: ``max_len = 200``). The
default ``vocab_size`` (98635) is PFLlib's vocabulary size and the ``fasttext`` model's default, so the two agree
without a setting; a smaller ``dataset.vocab_size`` needs the same ``model.vocab_size``.

Training and test rows are pooled (train first), as FedCP pools a data set before partitioning it among clients and
splitting each client 75/25; labels are the class index minus one (0-3).
"""
from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from pflkit.core.api.params import Param, positive
from pflkit.core.api.task import classification
from pflkit.core.common.errors import DataError
from pflkit.core.data.data import DatasetBundle

from ._common import data_root, ensure_files

FOLDER = "ag_news_csv"
FILES = ("train.csv", "test.csv", "classes.txt")
PAD, UNK = 0, 1
#: torchtext's basic_english normalisation, in its order
_PATTERNS = [(re.compile(p), r) for p, r in (
    (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "), (r"\(", " ( "), (r"\)", " ) "),
    (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "), (r"\:", " "), (r"\s+", " "))]


def tokenize(text: str) -> List[str]:
    """torchtext's ``basic_english``: lower case, quotes and punctuation split off or dropped, split on spaces."""
    text = text.lower()
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text.split()


def read_rows(path: Path) -> Tuple[List[int], List[str]]:
    """(labels 0-3, texts) of one AG News csv file; a malformed row is a DataError naming file and line."""
    labels, texts = [], []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            for line, row in enumerate(csv.reader(fh), 1):
                if not row:
                    continue
                if len(row) < 3 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= 4:
                    raise DataError(f"{path}:{line}: expected three columns (class index 1-4, title, description), "
                                    f"got {row[:3]!r}")
                labels.append(int(row[0]) - 1)
                # backslash escapes of the original release: "\n" and "\" inside the description
                texts.append(" ".join(row[1:]).replace("\\n", " ").replace("\\", " "))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    return labels, texts


def build_vocab(texts: List[List[str]], vocab_size: int) -> Dict[str, int]:
    """token -> id for the ``vocab_size - 2`` most frequent tokens (ties by text); ids start at 2."""
    counts = Counter(tok for toks in texts for tok in toks)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:max(0, vocab_size - 2)]
    return {tok: i + 2 for i, tok in enumerate(ranked)}


def encode(tokens: List[List[str]], vocab: Dict[str, int], max_len: int) -> np.ndarray:
    out = np.zeros((len(tokens), max_len), dtype=np.int64)
    for i, toks in enumerate(tokens):
        ids = [vocab.get(t, UNK) for t in toks[:max_len]]
        out[i, :len(ids)] = ids
    return out


def load_ag_news(root: Optional[str] = None, download: bool = False, max_len: int = 200,
                 vocab_size: int = 98635) -> DatasetBundle:
    """AG News from ``ROOT/ag_news_csv/{train,test}.csv`` and ``classes.txt``: token ids (``max_len`` per row, 0 =
    padding, 1 = unknown), vocabulary from the training file only, labels 0-3; train rows first, then test rows."""
    base = data_root(root)
    folder = base / FOLDER
    ensure_files("ag_news", root, [folder / f for f in FILES], False, None,
                 hint="(the original release's ag_news_csv folder, e.g. from ag_news_csv.tar.gz; no package of "
                      "any registry holds it)")
    class_names = [ln.strip() for ln in (folder / "classes.txt").read_text(encoding="utf-8").splitlines()
                   if ln.strip()]
    if len(class_names) != 4:
        raise DataError(f"{folder / 'classes.txt'}: expected the 4 class names, one a line, got {len(class_names)}")
    y_tr, t_tr = read_rows(folder / "train.csv")
    y_te, t_te = read_rows(folder / "test.csv")
    if not y_tr:
        raise DataError(f"{folder / 'train.csv'} holds no rows")
    tok_tr = [tokenize(t) for t in t_tr]
    tok_te = [tokenize(t) for t in t_te]
    vocab = build_vocab(tok_tr, vocab_size)
    x = torch.from_numpy(np.concatenate([encode(tok_tr, vocab, max_len), encode(tok_te, vocab, max_len)]))
    y = torch.tensor(y_tr + y_te, dtype=torch.int64)
    return DatasetBundle(x=x, y=y, task=classification(4), input_shape=(max_len,), class_names=class_names,
                         meta={"source": str(folder), "train_rows": len(y_tr), "test_rows": len(y_te),
                               "vocabulary": len(vocab) + 2, "max_len": max_len,
                               "ids": "0 = padding, 1 = unknown token, 2.. = training tokens by frequency"})


load_ag_news.params = {
    "max_len": Param(200, "token ids per text: longer texts are cut, shorter ones padded with 0 (PFLlib: 200)",
                     check=positive),
    "vocab_size": Param(98635, "ids incl. padding 0 and unknown 1: the most frequent training tokens fill the rest "
                               "(98635 = PFLlib's AG News vocabulary and the fasttext model's default; set "
                               "model.vocab_size to the same value)", check=lambda v: None if isinstance(v, int)
                        and v >= 3 else "must be an integer >= 3"),
}
load_ag_news.defaults = {"model": {"name": "fasttext"}}
