"""Repository-wide pytest settings: tests share 2 cores, so torch uses one thread (intra-op threading on a busy
machine makes tiny models many times slower)."""
import os

import torch

torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")
# fl compare's key for verified.json lives in the user's state folder: tests use a folder of their own
if "PFLKIT_STATE" not in os.environ:
    import tempfile

    os.environ["PFLKIT_STATE"] = tempfile.mkdtemp(prefix="pflkit-test-state-")
