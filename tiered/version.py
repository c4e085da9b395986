"""The package version, in a module of its own so that any layer can name it without importing
the package (whose `__init__` imports the engine)."""

__version__ = "0.3.0"
