"""trm: a Triton Inference Server model-repository manager.

Layers, in one direction: ``cli`` (parse, call, render) -> operations (``publish``, ``serve``, …: typed
arguments, frozen dataclass results) -> adapters (``triton`` process and client, ``storage``, the local
``repository``). Nothing below ``cli`` imports click. Errors live in ``errors``; settings in ``settings``.
"""

__version__ = "0.1.0"
