"""Business-logic scripting: preprocessing -> tensorrt_llm -> postprocessing in one Python model.

Unlike the ensemble, it can stream detokenized text token by token when the engine model is decoupled
(config parameter ``decoupled`` "true"). The member model names come from config.pbtxt parameters.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from trm_common import parameter

_SAMPLING = {"temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
             "beam_width": "beam_width", "random_seed": "random_seed"}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.pre = parameter(config, "preprocessing_model_name")
        self.engine = parameter(config, "tensorrt_llm_model_name")
        self.post = parameter(config, "postprocessing_model_name")
        self.decoupled = parameter(config, "decoupled", "false").lower() == "true"

    def _call(self, model, inputs, outputs):
        request = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs)
        response = request.exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}

    def _text(self, tokens, lengths):
        out = self._call(self.post, [pb_utils.Tensor("TOKENS_BATCH", tokens),
                                     pb_utils.Tensor("SEQUENCE_LENGTH", lengths)], ["OUTPUT"])
        return pb_utils.Tensor("text_output", out["OUTPUT"].reshape(1, -1))

    def execute(self, requests):
        responses = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            try:
                response = self._generate(request, sender)
            except pb_utils.TritonModelException as exc:
                response = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
            if sender is not None:
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(response)
        return None if self.decoupled else responses

    def _generate(self, request, sender):
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(1, 1)
        max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(1, 1)
        pre = self._call(self.pre, [pb_utils.Tensor("QUERY", text),
                                    pb_utils.Tensor("REQUEST_OUTPUT_LEN", max_tokens.astype(np.int32))],
                         ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"])
        inputs = [pb_utils.Tensor("input_ids", pre["INPUT_ID"]),
                  pb_utils.Tensor("input_lengths", pre["REQUEST_INPUT_LEN"]),
                  pb_utils.Tensor("request_output_len", pre["REQUEST_OUTPUT_LEN"]),
                  pb_utils.Tensor("end_id", pre["OUT_END_ID"]), pb_utils.Tensor("pad_id", pre["OUT_PAD_ID"])]
        for name, target in _SAMPLING.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs.append(pb_utils.Tensor(target, tensor.as_numpy().reshape(1, -1)))
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        streaming = bool(stream is not None and stream.as_numpy().reshape(-1)[0]) and sender is not None
        inputs.append(pb_utils.Tensor("streaming", np.array([[streaming]], dtype=np.bool_)))
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine, inputs=inputs, requested_output_names=["output_ids", "sequence_length"])
        last = None
        for response in engine_request.exec(decoupled=self.decoupled) if self.decoupled else [engine_request.exec()]:
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            if not response.output_tensors():
                continue  # the final, empty response of a decoupled model
            tokens = pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy()
            lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
            last = pb_utils.InferenceResponse(output_tensors=[self._text(tokens, lengths)])
            if streaming:
                sender.send(last)
        if last is None:
            raise pb_utils.TritonModelException("the engine returned no output")
        return pb_utils.InferenceResponse(output_tensors=[]) if streaming else last
