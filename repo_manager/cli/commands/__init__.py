"""Where each command lives. A command's module is imported only when that command runs (or for its own
--help), so `trm sync` does not pay for numpy, onnx or tritonclient imports it never uses, and `trm --help`
imports no command module at all: it prints the one-line help from ``SHORT_HELP``.

Adding a command: write it in a module here with ``@cli.command("name")`` (heavy imports inside the
function), add ``"name": "module"`` to ``COMMANDS`` and its one-line help to ``SHORT_HELP``.
``tests/test_cli_views.py`` checks that these tables and the modules agree.
"""

COMMANDS: dict[str, str] = {
    "publish": "publish",
    "serve": "serve",
    "infer": "infer",
    "list": "repository",
    "show": "repository",
    "diff": "repository",
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
    "adopt": "adopt",
    "plan": "llm",
    "doctor": "llm",
    "agent": "agent",
    "observe": "observe",
    "top": "observe",
}

# The first sentence of each command's docstring, as click would print it (a command missing here is
# imported for `trm --help`, which still works, only slower).
SHORT_HELP: dict[str, str] = {
    "doctor": "Check this serving node: GPU, driver CUDA, and every engine of the repository (architecture, "
              "TensorRT/TensorRT-LLM versions, memory plan).",
    "adopt": "Adopt the Triton repository REPO_DIR: every model version gets a manifest (files, sha256, original "
             "config, verification).",
    "agent": "Keep the Triton server at --url serving what ENV in STORE says: sync through the node cache, roll "
             "out with zero failed requests, refuse versions that fail.",
    "observe": "Alerting rules and dashboards for the models trm serves.",
    "top": "Live view of Triton servers (http://host:8000, or a .../metrics URL; default: settings' triton_url): "
           "per model and version, request rate, p50/p99, queue vs compute time, pending requests, executed batch "
           "sizes, rejections and failures; for LLM models (vLLM's metrics), running and waiting requests, "
           "KV-cache use, output tokens/s and TTFT/ITL p50/p99; with --agent, each agent's state and versions.",
    "diff": "What changed between versions A and B of NAME: config fields, files, source, verification, "
            "tuning.",
    "export": "Write a plain Triton layout (<model>/config.pbtxt, <model>/<N>/files) to DEST (folder or s3://), "
              "for a stock Triton pointed at it.",
    "history": "Every promotion and rollback of ENV (of model NAME only, if given), oldest first.",
    "infer": "Send one request to NAME (embedded server on the repository, or --url) and print the outputs.",
    "list": "One line per model: backend, latest version, verified, size, environments serving it.",
    "plan": "Plan GPU memory for CHECKPOINT (a folder or config.json, or an engine folder: its limits are the "
            "defaults): weights, overhead, KV cache.",
    "promote": "Point environment --to at version --version of NAME after its gates pass; exit 9 when a gate "
               "fails, 8 when another promotion won the race (nothing is changed in either case).",
    "publish": "Publish checkpoints as new versions of the repository.",
    "push": "Upload complete versions to STORE (s3://bucket/prefix or a folder): missing blobs, then manifests.",
    "rollout": "Move running Triton servers to version N of NAME: zero failed requests, automatic rollback.",
    "serve": "Start a real tritonserver (explicit model control) on the repository until Ctrl-C / SIGTERM.",
    "show": "A model's versions (created, source, size, verification, tuning, environments) and its config.",
    "specs": "The environments (and the store of each) and the model specs in configs/, for pipelines.",
    "status": "Each server's loaded models and versions against the repository's latest.",
    "sync": "Make the local repository serve what ENV in STORE says: only missing blobs are downloaded, "
            "verified, and each version folder appears complete or not at all.",
    "tune-batching": "Choose NAME's dynamic-batching settings (max batch, instances, queue delay, preferred "
                     "sizes) by measuring candidates on a real Triton server, under a p99 SLO at low, peak and "
                     "peak x headroom.",
    "validate": "Check layout, configs, manifests and checksums; exit 3 when there is any problem.",
}
