"""trm: a Triton Inference Server model-repository manager.

Four layers, one folder each, imports in one direction only (tests/test_layers.py checks it):

- ``cli``: parse the command line, call one operation, render its result (the only place that imports click);
- ``ops``: operations, one module or package per command family (request -> plan -> frozen result);
- ``adapters``: the outside world (the local repository, processes, Triton, stores, the blob cache, engines);
- ``core``: shared vocabulary with no I/O beyond files (errors, settings, manifest, model config, paths).
"""

__version__ = "0.1.0"
