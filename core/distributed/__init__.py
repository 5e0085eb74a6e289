"""Execution on torch.distributed: every process replicates the simulation loop and runs its own clients.

``backend`` holds the execution backend, ``assign`` the client-to-rank assignment, ``worker`` what one process of
a distributed run does, ``launch`` how ``fl run --workers N`` and torchrun start those processes, ``silent`` the
file-less logger and reporter of the processes that do not write the run directory. Only ``assign`` and
``backend`` are imported here, so ``core.simulation`` can import this package without a cycle.
"""
from .assign import assign_clients
from .backend import DistributedBackend, WorkerLost

__all__ = ["assign_clients", "DistributedBackend", "WorkerLost"]
