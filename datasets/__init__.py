"""Built-in datasets and partitioners, registered through the same entry points third parties use."""
