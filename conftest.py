"""Repository-wide pytest settings: tests share 2 cores, so torch uses one thread (intra-op threading on a busy
machine makes tiny models many times slower)."""
import os

import torch

torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")
