"""The ``fl`` command (click): one module per subcommand, ``main`` gathers them and ``common`` turns every
``PflError`` into one line and exit status 2. It sits above every other layer and may import any of them;
only ``testing`` and the public API (``pflkit.core``) are above it.
"""
