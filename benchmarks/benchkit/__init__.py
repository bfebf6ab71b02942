"""Helpers shared by the benchmark scripts (``overhead.py``, ``gpu_check.py``); not part of the package."""
