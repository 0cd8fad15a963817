"""Runnable experiments that compose the `tide` library and write results (see README.md here)."""
