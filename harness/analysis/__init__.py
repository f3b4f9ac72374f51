"""harness.analysis: see the module docstrings of its files."""
