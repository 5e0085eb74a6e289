"""Reading and presenting finished runs: a run directory's records (``rundata``), plots of runs (``runplot``),
matrix figures for TensorBoard (``figures``) and the comparison of methods over seeds (``compare``, behind
``fl compare``). May import every layer below it; nothing below imports it.
"""
