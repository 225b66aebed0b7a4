"""Adapters of the outside world, each behind one typed interface.

The local model repository (``repository``), child processes (``process``), the Triton launcher and client
(``triton``), stores (``storage``: folder and S3), the node's blob cache and its ranged downloads (``cache``),
LLM engine processes (``engines``), trm's own metrics (``metrics``) and the load generator (``loadgen``).
Adapters import ``core`` and each other, never ``ops`` or ``cli`` (tests/test_layers.py checks it).
"""
