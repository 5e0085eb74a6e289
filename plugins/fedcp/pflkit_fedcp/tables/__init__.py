"""FedCP's paper tables as data (the ``pflkit.tables`` entry points of setup.cfg)."""
