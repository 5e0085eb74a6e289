"""Tiny models run fastest on one thread; several intra-op threads on a shared 2-core box mostly contend."""
import torch

torch.set_num_threads(1)
