"""Execution on torch.distributed: every process replicates the simulation loop and runs its own clients.

``backend`` holds the execution backend, ``worker`` what one process of a distributed run does, ``launch`` how
``fl run --workers N`` and torchrun start those processes, ``signals`` how they stop. The client-to-rank
assignment and the file-less logger of the ranks that do not write the run directory are the engine's
(``engine.assign``, ``engine.silent``), which runs the same loop on one process or many. The layer above
``results``: it may import every layer below it, and only ``cli``, ``testing`` and the public API import it.
"""
from .backend import DistributedBackend, WorkerLost

__all__ = ["DistributedBackend", "WorkerLost"]
