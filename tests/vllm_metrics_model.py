"""A stand-in for a vLLM engine behind Triton: a decoupled Python model that reports vLLM's metric families.

The real vLLM engine is not in the shared venv. This stand-in speaks the official vLLM backend's request
interface (tests/stream_model.py's config: ``text_input``, ``stream``, ``sampling_parameters`` ...) and,
like an engine, runs at most ``slots`` requests at a time: the others wait in its own queue. It reports,
through Triton's custom metrics (``pb_utils.MetricFamily``, labels ``model``, ``version`` and ``engine`` from trm's
vLLM backend's own ``metric_labels``), the families and names vLLM exports: counters ``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total``; gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (running / slots: 1 is full); histograms ``vllm:time_to_first_token_seconds``
(from arrival, so queueing counts), ``vllm:time_per_output_token_seconds`` and
``vllm:e2e_request_latency_seconds``. Token pace as in tests/stream_model.py: ``first_ms`` to the first
token once running, then ``next_ms`` per token (sleeps).
"""

from __future__ import annotations

import ast
from pathlib import Path

from stream_model import CONFIG

BACKEND = Path(__file__).resolve().parents[1] / "repo_manager/adapters/triton/backends/vllm/model.py"


def _backend_function(name: str) -> str:
    """The source of one top-level function of trm's vLLM backend: the stand-in labels its series as the backend
    does, with the backend's own code."""
    source = BACKEND.read_text()
    found = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name]
    assert found, f"trm's vLLM backend has no function {name}"
    return ast.get_source_segment(source, found[0])


MODEL_PY = '''
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0]


%METRIC_LABELS%


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        value = lambda key, default: float(params.get(key, {}).get("string_value", default))
        self.first = value("first_ms", 20.0) / 1000.0
        self.next = value("next_ms", 10.0) / 1000.0
        self.slots = int(value("slots", 1))
        self.hold = params.get("hold_file", {}).get("string_value") or None
        self.lock = threading.Lock()
        self.handed = threading.Condition(self.lock)
        self.running = self.waiting = 0
        self.granted = 0
        """Slots handed over to waiting requests and not yet taken (``_release``)."""
        labels = metric_labels(args["model_name"], args["model_version"])
        family = pb.MetricFamily
        self.families = []

        def metric(name, kind, **extra):
            self.families.append(family(name=name, description=name, kind=kind))
            return self.families[-1].Metric(labels=labels, **extra)

        self.prompt = metric("vllm:prompt_tokens_total", family.COUNTER)
        self.generation = metric("vllm:generation_tokens_total", family.COUNTER)
        self.running_gauge = metric("vllm:num_requests_running", family.GAUGE)
        self.waiting_gauge = metric("vllm:num_requests_waiting", family.GAUGE)
        self.kv = metric("vllm:kv_cache_usage_perc", family.GAUGE)
        self.ttft = metric("vllm:time_to_first_token_seconds", family.HISTOGRAM, buckets=BUCKETS)
        self.itl = metric("vllm:time_per_output_token_seconds", family.HISTOGRAM, buckets=BUCKETS)
        self.e2e = metric("vllm:e2e_request_latency_seconds", family.HISTOGRAM, buckets=BUCKETS)

    def finalize(self):
        # metrics first, then their families, while the stub still talks to the server (left to the
        # interpreter's exit they crash the stub, as trm's vllm backend documents)
        for name in ("prompt", "generation", "running_gauge", "waiting_gauge", "kv", "ttft", "itl", "e2e"):
            self.__dict__.pop(name, None)
        self.families = []

    def _gauges(self):  # (under self.lock)
        self.running_gauge.set(float(self.running))
        self.waiting_gauge.set(float(self.waiting))
        self.kv.set(self.running / self.slots)

    def _acquire(self):
        with self.handed:
            if self.running < self.slots and not self.waiting:
                self.running += 1
                self._gauges()
                return
            self.waiting += 1
            self._gauges()
            while not self.granted:
                self.handed.wait()
            self.granted -= 1

    def _release(self):
        """A finished request hands its slot straight to a waiting one, as an engine's scheduler does: the
        gauges never show a free slot while requests wait (a scrape in between would read running 0)."""
        with self.handed:
            if self.waiting:
                self.waiting -= 1
                self.granted += 1
                self.handed.notify()
            else:
                self.running -= 1
            self._gauges()

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.generate, args=(request, time.monotonic()), daemon=True).start()
        return None

    def generate(self, request, arrived):
        sender = request.get_response_sender()
        prompt = pb.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
        tensor = pb.get_input_tensor_by_name(request, "sampling_parameters")
        sampling = json.loads(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else {}
        max_tokens = int(sampling.get("max_tokens", 16))
        self._acquire()
        try:
            with self.lock:  # one metric call at a time, as vLLM's single stat logger makes them
                self.prompt.increment(float(len(prompt.split())))
            last_at = None
            for i in range(max_tokens):
                time.sleep(self.first if i == 0 else self.next)
                now = time.monotonic()
                with self.lock:
                    if last_at is None:
                        self.ttft.observe(now - arrived)
                    else:
                        self.itl.observe(now - last_at)
                    self.generation.increment(1.0)
                last_at = now
                last = i == max_tokens - 1
                if last and self.hold and max_tokens > 16:  # the test says when its streams end (a file)
                    deadline = time.monotonic() + 600
                    while not os.path.exists(self.hold) and time.monotonic() < deadline:
                        time.sleep(0.05)
                out = [pb.Tensor("text_output", np.array([f" t{i}".encode()], dtype=np.object_)),
                       pb.Tensor("num_output_tokens", np.array([1], dtype=np.uint32))]
                sender.send(pb.InferenceResponse(output_tensors=out), flags=FINAL if last else 0)
            with self.lock:
                self.e2e.observe(time.monotonic() - arrived)
        finally:
            self._release()
'''


def write_engine_stand_in(folder: Path, name: str = "chat", *, first_ms: float = 20.0, next_ms: float = 20.0,
                          slots: int = 1, hold: Path | None = None) -> Path:
    """A source folder (model.py + config.pbtxt) of the stand-in that `trm publish model` accepts. ``hold``: a
    file every stream of more than 16 tokens waits for before its last token (at most 10 minutes), so a test
    decides when they end (a smoke check's request, 16 tokens by default, is not held)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_PY.replace("%METRIC_LABELS%", _backend_function("metric_labels")))
    config = CONFIG.format(name=name, first_ms=first_ms, next_ms=next_ms)
    config += f'parameters {{ key: "slots" value {{ string_value: "{slots}" }} }}\n'
    if hold is not None:
        config += f'parameters {{ key: "hold_file" value {{ string_value: "{hold}" }} }}\n'
    (folder / "config.pbtxt").write_text(config)
    return folder
