"""Fixtures of the op tests: ``recorder`` (tests/_recorder.py)."""

from _recorder import recorder

__all__ = ["recorder"]
