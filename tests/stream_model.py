"""A decoupled Python model with the official vLLM backend's request interface and a known token pace.

It takes the inputs of triton-inference-server/vllm_backend (``text_input``, ``stream``,
``sampling_parameters`` as JSON, ``exclude_input_in_output``, ``return_num_input_tokens``,
``return_num_output_tokens``, ``return_finish_reason``) and answers as that backend does when streaming:
one response per generated token, ``num_output_tokens`` the tokens **of that response** (vllm_backend
docs/additional_outputs.md), the last response flagged final with ``finish_reason`` "length". It
"generates" ``max_tokens`` tokens, the first after ``first_ms`` and each next one ``next_ms`` later
(sleeps, so the pace is the model's and not the CPU's), each request on its own thread so concurrent
streams overlap as in an engine. Without ``stream`` it sends one response with every token.

Failure modes for the load generator's tests, chosen by the prompt: a prompt containing ``FAIL_AT_<k>``
sends ``k`` tokens and then an error response (the final one): a stream broken mid-way; ``EXIT_AT_<k>``
sends ``k`` tokens and then the model's process exits (the stream is cut; the model is unusable after).
"""

from __future__ import annotations

from pathlib import Path

MODEL_PY = '''
import json
import os
import re
import threading
import time

import numpy as np
import triton_python_backend_utils as pb

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        value = lambda key, default: float(params.get(key, {}).get("string_value", default))
        self.first = value("first_ms", 20.0) / 1000.0
        self.next = value("next_ms", 10.0) / 1000.0
        self.version = int(args["model_version"])

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.generate, args=(request,), daemon=True).start()
        return None

    def generate(self, request):
        def flag(name, default=False):
            tensor = pb.get_input_tensor_by_name(request, name)
            return bool(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else default

        sender = request.get_response_sender()
        prompt = pb.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
        tensor = pb.get_input_tensor_by_name(request, "sampling_parameters")
        sampling = json.loads(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else {}
        max_tokens = int(sampling.get("max_tokens", 16))
        stream, counts, inputs = flag("stream"), flag("return_num_output_tokens"), flag("return_num_input_tokens")
        reason = flag("return_finish_reason")
        fail = re.search(r"FAIL_AT_(\\d+)", prompt)
        fail_at = int(fail.group(1)) if fail else None
        crash = re.search(r"EXIT_AT_(\\d+)", prompt)
        crash_at = int(crash.group(1)) if crash else None

        def response(tokens, last):
            out = [pb.Tensor("text_output", np.array(["".join(tokens).encode()], dtype=np.object_))]
            if counts:
                out.append(pb.Tensor("num_output_tokens", np.array([len(tokens)], dtype=np.uint32)))
            if inputs:
                out.append(pb.Tensor("num_input_tokens", np.array([len(prompt.split())], dtype=np.uint32)))
            if reason:
                out.append(pb.Tensor("finish_reason", np.array([b"length" if last else b""], dtype=np.object_)))
            return pb.InferenceResponse(output_tensors=out)

        pending = []
        for i in range(max_tokens):
            time.sleep(self.first if i == 0 else self.next)
            if fail_at is not None and i == fail_at:
                sender.send(pb.InferenceResponse(error=pb.TritonError(f"engine failed after {i} tokens")),
                            flags=FINAL)
                return
            if crash_at is not None and i == crash_at:
                os._exit(1)
            token = f" t{i}"
            last = i == max_tokens - 1
            if stream:
                sender.send(response([token], last), flags=FINAL if last else 0)
            else:
                pending.append(token)
        if not stream:
            sender.send(response(pending, True), flags=FINAL)
'''

CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true }},
  {{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "return_finish_reason" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "return_num_input_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "return_num_output_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }},
  {{ name: "finish_reason" data_type: TYPE_STRING dims: [ -1 ] }},
  {{ name: "num_input_tokens" data_type: TYPE_UINT32 dims: [ 1 ] }},
  {{ name: "num_output_tokens" data_type: TYPE_UINT32 dims: [ -1 ] }}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "first_ms" value {{ string_value: "{first_ms}" }} }}
parameters {{ key: "next_ms" value {{ string_value: "{next_ms}" }} }}
'''


def stream_repository(root: Path, name: str = "llm", *, first_ms: float = 20.0, next_ms: float = 10.0) -> Path:
    """A model repository holding the streaming stand-in as ``name`` version 1."""
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(MODEL_PY)
    (folder / "config.pbtxt").write_text(CONFIG.format(name=name, first_ms=first_ms, next_ms=next_ms))
    return root
