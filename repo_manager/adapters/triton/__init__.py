"""Adapters for Triton: the launcher (``server``), the client wrapper (``client``), and ``connect``."""
