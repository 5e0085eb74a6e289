"""The run directory and everything written into it or read back from it: its layout and lock (``rundir``),
checkpoints (``checkpoint``), what ran where (``runinfo``), TensorBoard and JSON-lines logs and per-round progress
(``monitor``), the printed and saved summary (``reporting``), and a finished run's records read back for plots,
exports and comparisons (``rundata``). Every file is opened through ``common.safefiles``. May import ``common``,
``api`` and ``data``.
"""
