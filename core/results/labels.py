"""How fl reproduce labels numbers that are not the paper's setting: one source for the code, the ``--help`` text
and the docs (a light module: ``fl --help`` imports it)."""
from __future__ import annotations

QUICK_LABEL = "quick scale, not the paper's setting"

#: ``--set`` keys that say where or how a cell runs, not what it computes: they leave a paper-scale run the paper's
#: setting (batched clients match the sequential numbers within float tolerance; tests/test_batched.py)
NEUTRAL_SET_KEYS = ("dataset.root", "dataset.download", "device", "clients.batched", "clients.stack")
