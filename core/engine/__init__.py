"""Configuring, starting, resuming and running a simulation: configuration resolution (``config``) and
composition of algorithms (``compose``), ``fl run --dry-run`` (``dryrun``), resuming from a checkpoint
(``resume``), the execution backends (``backend``) and the assignment of clients to processes (``assign``),
client-server communication with its privacy checks (``comm``, ``privacy``), the rounds (``rounds``), evaluation
maths (``evaluation``), the global model's evaluation beside the personal one (``globaleval``), the silent logger of processes that write no files (``silent``) and ``Simulation``
itself (``simulation``). May import every layer below it: ``common``, ``api``, ``data`` and ``storage``.
"""
