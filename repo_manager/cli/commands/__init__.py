"""Where each command lives. A command's module is imported only when that command runs (or for --help),
so `trm sync` does not pay for numpy, onnx or tritonclient imports it never uses.

Adding a command: write it in a module here with ``@cli.command("name")`` and add ``"name": "module"``.
``tests/test_cli.py`` checks that this table and the modules agree.
"""

COMMANDS: dict[str, str] = {
    "publish": "publish",
    "serve": "serve",
    "infer": "infer",
    "list": "repository",
    "show": "repository",
    "validate": "repository",
    "push": "store",
    "sync": "store",
    "export": "store",
    "tune-batching": "tune",
    "rollout": "rollout",
    "status": "rollout",
    "promote": "promote",
    "history": "promote",
    "specs": "promote",
    "plan": "llm",
    "doctor": "llm",
    "observe": "observe",
    "top": "observe",
}
