"""Presenting finished runs: plots of runs (``runplot``), matrix figures for TensorBoard (``figures``) and the
comparison of methods over seeds (``compare``, behind ``fl compare``). It reads runs through ``storage.rundata``.
May import every layer below it; nothing below imports it.
"""
