"""The run directory and everything written into it: its layout and lock (``rundir``), checkpoints
(``checkpoint``), what ran where (``runinfo``), TensorBoard and JSON-lines logs and per-round progress
(``monitor``), and the printed and saved summary (``reporting``). Every file is written through
``common.safefiles``. May import ``common``, ``api`` and ``data``.
"""
