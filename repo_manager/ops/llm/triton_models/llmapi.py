"""TensorRT-LLM's LLM-API backend: one Python model that builds or loads the engine itself.

Reads ``model.yaml`` beside it (TensorRT-LLM ``LLM`` arguments, plus ``triton_config``); ``model`` is the
checkpoint folder inside this version (relative paths resolve against the version folder). Inputs:
text_input, max_tokens, optional sampling parameters and ``stream`` (decoupled mode only).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

_SAMPLING = {"temperature": float, "top_k": int, "top_p": float, "random_seed": int}


class TritonPythonModel:
    def initialize(self, args):
        from tensorrt_llm import LLM, SamplingParams

        self.sampling_params = SamplingParams
        folder = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(folder, "model.yaml")) as handle:
            settings = yaml.safe_load(handle)
        triton = settings.pop("triton_config", {})
        self.decoupled = bool(triton.get("decoupled", False))
        if not os.path.isabs(settings["model"]):
            settings["model"] = os.path.join(folder, settings["model"])
        self.llm = LLM(**settings)
        self.config = json.loads(args["model_config"])

    def _params(self, request):
        max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        kwargs = {"max_tokens": int(max_tokens.as_numpy().reshape(-1)[0]) if max_tokens is not None else 64}
        for name, kind in _SAMPLING.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                kwargs["seed" if name == "random_seed" else name] = kind(tensor.as_numpy().reshape(-1)[0])
        return self.sampling_params(**kwargs)

    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            prompt = prompt.decode() if isinstance(prompt, bytes) else str(prompt)
            stream = pb_utils.get_input_tensor_by_name(request, "stream")
            streaming = bool(stream is not None and stream.as_numpy().reshape(-1)[0]) and self.decoupled
            if self.decoupled:
                sender = request.get_response_sender()
                sent = 0
                for output in self.llm.generate_async(prompt, self._params(request), streaming=streaming):
                    text = output.outputs[0].text
                    if streaming:
                        sender.send(self._response(text[sent:]))
                        sent = len(text)
                if not streaming:
                    sender.send(self._response(output.outputs[0].text))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                output = self.llm.generate(prompt, self._params(request))
                responses.append(self._response(output.outputs[0].text))
        return None if self.decoupled else responses

    def _response(self, text):
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))])

    def finalize(self):
        shutdown = getattr(getattr(self, "llm", None), "shutdown", None)
        if shutdown:
            shutdown()
