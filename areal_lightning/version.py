"""The package version (one place: ``setup.cfg`` reads it, ``areal_lightning.__version__`` re-exports it)."""

__version__ = "0.2.0"
