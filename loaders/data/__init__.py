"""Packaged data files (read with ``importlib.resources``); see README.md here for their origin."""
