"""The library version, written into saved cache files."""

__version__ = "0.1.0"
