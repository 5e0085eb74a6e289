"""AG News loader on tiny files written here in the original release's format (ag_news_csv: quoted csv, classes.txt)."""
from __future__ import annotations

import csv

import pytest
import torch

from pflkit.core.api import registry as reg
from pflkit.core.common.errors import DataError
from pflkit.datasets.text import load_ag_news, tokenize

TRAIN = [(3, "Wall St. Bears Claw Back", "Reuters - Short-sellers, Wall Street's dwindling band, are seeing green."),
         (1, "Iraq talks", "Leaders meet (again) in Baghdad; talks go on."),
         (2, "Cup final", "The team won the cup final on Sunday!"),
         (4, "New chip", "A faster chip for phones \\ tablets."),
         (3, "Oil prices", "Oil prices rise again."),
         (2, "Match report", "The team lost the match.")]
TEST = [(4, "Quantum leap", "Researchers show a quantum computer."),
        (1, "Wall talks", "The talks went on in the capital.")]


def write_ag_news(root, train=TRAIN, test=TEST):
    folder = root / "ag_news_csv"
    folder.mkdir(parents=True)
    for name, rows in (("train.csv", train), ("test.csv", test)):
        with open(folder / name, "w", newline="") as fh:
            csv.writer(fh, quoting=csv.QUOTE_ALL).writerows([(str(c), t, d) for c, t, d in rows])
    (folder / "classes.txt").write_text("World\nSports\nBusiness\nSci/Tech\n")
    return folder


def test_tokenize_basic_english():
    assert tokenize("Wall St. Bears (Claw) Back!") == ["wall", "st", ".", "bears", "(", "claw", ")", "back", "!"]


def test_shapes_labels_and_train_only_vocabulary(tmp_path):
    write_ag_news(tmp_path)
    b = load_ag_news(root=str(tmp_path), max_len=12)
    assert b.x.shape == (8, 12) and b.x.dtype == torch.int64 and tuple(b.input_shape) == (12,)
    assert b.y.tolist() == [c - 1 for c, _, _ in TRAIN + TEST] and set(b.y.tolist()) == {0, 1, 2, 3}
    assert b.num_classes == 4 and b.class_names == ["World", "Sports", "Business", "Sci/Tech"]
    assert b.meta["train_rows"] == 6 and b.meta["test_rows"] == 2
    # ids: 0 padding, 1 unknown; words only in test.csv ("quantum", "researchers") are unknown
    quantum = b.x[6]
    assert quantum[0].item() == 1 and (quantum == 1).sum().item() >= 4
    assert b.x[7, 0].item() > 1  # "wall" is a training word
    assert b.x.max().item() < b.meta["vocabulary"]
    assert (b.x[4, 7:] == 0).all().item() and (b.x[4, :7] > 0).all().item()  # short texts are padded with 0
    full = load_ag_news(root=str(tmp_path))
    assert full.x.shape == (8, 200)
    # a vocabulary cap keeps the most frequent training tokens and maps the rest to 1
    small = load_ag_news(root=str(tmp_path), vocab_size=5)
    assert small.x.max().item() <= 4 and (small.x == 1).any()


def test_missing_files_one_line(tmp_path):
    with pytest.raises(DataError) as err:
        load_ag_news(root=str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and "ag_news_csv/train.csv" in msg and "classes.txt" in msg and "download" not in msg


def test_malformed_row(tmp_path):
    write_ag_news(tmp_path, train=[(7, "x", "y")])
    with pytest.raises(DataError, match="train.csv:1"):
        load_ag_news(root=str(tmp_path))


def test_one_round_fasttext_run(tmp_path):
    from pflkit.core import Simulation
    from pflkit.core.engine.config import resolve

    write_ag_news(tmp_path, train=TRAIN * 5, test=TEST * 5)
    assert "ag_news" in reg.DATASETS.names() and isinstance(reg.DATASETS.get("ag_news").params, dict)
    assert load_ag_news.defaults == {"model": {"name": "fasttext"}}
    cfg = resolve([{"rounds": 1, "seed": 0, "output_dir": str(tmp_path / "runs"),
                    "dataset": {"name": "ag_news", "root": str(tmp_path), "max_len": 16, "vocab_size": 64},
                    "model": {"name": "fasttext", "vocab_size": 64},
                    "partition": {"name": "iid", "num_clients": 2},
                    "train": {"lr": 0.1, "batch_size": 4}}], algorithm="fedavg")
    summary = Simulation(cfg).run()
    assert summary is not None
