"""Business-logic scripting: preprocessing -> tensorrt_llm -> postprocessing in one Python model.

Takes the ensemble's request (the same inputs, routed by the same maps, ``trm_common``) and returns the
same outputs. Unlike the ensemble, it can stream detokenized text token by token when the engine model
is decoupled (config parameter ``decoupled`` "true"). The member model names come from config.pbtxt
parameters.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from trm_common import (
    ENGINE_FROM_PREPROCESSING,
    ENGINE_FROM_REQUEST,
    PREPROCESSING_FROM_REQUEST,
    RESPONSE_OUTPUTS,
    parameter,
)


def _batched(array):
    """One request as a batch of one: inputs declared as scalars (reshape to []) arrive without the [1] dim."""
    return array.reshape(1, 1) if array.ndim == 1 else array


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
        found = {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}
        return {name: tensor.as_numpy() for name, tensor in found.items() if tensor is not None}

    def _response(self, engine_response):
        tokens = pb_utils.get_output_tensor_by_name(engine_response, "output_ids").as_numpy()
        lengths = pb_utils.get_output_tensor_by_name(engine_response, "sequence_length").as_numpy()
        text = self._call(self.post, [pb_utils.Tensor("TOKENS_BATCH", tokens),
                                      pb_utils.Tensor("SEQUENCE_LENGTH", lengths)], ["OUTPUT"])["OUTPUT"]
        outputs = [pb_utils.Tensor("text_output", text.reshape(1, -1))]
        for name in RESPONSE_OUTPUTS:
            tensor = pb_utils.get_output_tensor_by_name(engine_response, name)
            if tensor is not None:
                outputs.append(pb_utils.Tensor(name, tensor.as_numpy()))
        return pb_utils.InferenceResponse(output_tensors=outputs)

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

    def _given(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else _batched(tensor.as_numpy())

    def _generate(self, request, sender):
        pre_inputs = []
        for target, source in PREPROCESSING_FROM_REQUEST.items():
            value = self._given(request, source)
            if value is not None:
                if target == "REQUEST_OUTPUT_LEN":
                    value = value.astype(np.int32)
                pre_inputs.append(pb_utils.Tensor(target, value))
        pre = self._call(self.pre, pre_inputs, [output for output, _ in ENGINE_FROM_PREPROCESSING.values()])
        inputs = [pb_utils.Tensor(target, pre[output])
                  for target, (output, _) in ENGINE_FROM_PREPROCESSING.items() if output in pre]
        for target, source in ENGINE_FROM_REQUEST.items():
            value = self._given(request, source)
            if value is not None and target != "streaming":
                inputs.append(pb_utils.Tensor(target, value))
        stream = self._given(request, "stream")
        streaming = bool(stream is not None and stream.reshape(-1)[0]) and sender is not None
        if stream is not None:  # a model that is not decoupled answers once, whatever the client asked
            inputs.append(pb_utils.Tensor("streaming", np.array([[streaming]], dtype=np.bool_)))
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine, inputs=inputs,
            requested_output_names=["output_ids", "sequence_length", *RESPONSE_OUTPUTS])
        last = None
        for response in engine_request.exec(decoupled=self.decoupled) if self.decoupled else [engine_request.exec()]:
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            if not response.output_tensors():
                continue  # the final, empty response of a decoupled model
            last = self._response(response)
            if streaming:
                sender.send(last)
        if last is None:
            raise pb_utils.TritonModelException("the engine returned no output")
        return pb_utils.InferenceResponse(output_tensors=[]) if streaming else last
