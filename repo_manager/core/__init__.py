"""Shared vocabulary: what every layer speaks, with no knowledge of the outside world.

Errors and their exit codes (``errors``), settings (``settings``; their defaults and the option names the
quick path of `trm sync` shares, ``defaults``), the version manifest (``manifest``) and the
files it localizes per install (``localized``), Triton's model config (``config``), safe paths inside a folder
(``paths``), bounded documents (``documents``), redaction of secrets (``redact``) and progress reporting
(``progress``). Nothing here imports from ``adapters``, ``ops`` or ``cli`` (tests/test_layers.py checks it).
"""
