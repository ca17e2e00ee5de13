"""Kiln's version (kiln.__version__), which every engine file records."""

__version__ = "0.1.0"
