"""Building the federated data set: loading a registered data set, splitting it into clients and train/test
(``data``), and the files and archives a data set is read from, checked by size and SHA-256 (``datasources``).
May import ``common`` and ``api``.
"""
