"""Tokenize prompts for the TensorRT-LLM engine: QUERY (text) -> INPUT_ID, lengths, end and pad ids.

Refuses a prompt longer than the engine's max_input_len, and caps REQUEST_OUTPUT_LEN so prompt + output
stay within its max_seq_len (both written into config.pbtxt from the engine's config.json).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from trm_common import load_tokenizer, parameter, version_path


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = version_path(args, parameter(config, "tokenizer_dir"))
        self.tokenizer, self.end_id, self.pad_id = load_tokenizer(folder)
        self.add_special_tokens = parameter(config, "add_special_tokens", "true").lower() == "true"
        self.max_input_len = int(parameter(config, "max_input_len"))
        self.max_seq_len = int(parameter(config, "max_seq_len"))

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
        wanted = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy().reshape(-1)
        ids = []
        for query in queries:
            text = query.decode() if isinstance(query, bytes) else str(query)
            ids.append(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids)
        lengths = [len(i) for i in ids]
        if max(lengths) > self.max_input_len:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"prompt of {max(lengths)} tokens exceeds the engine's max_input_len {self.max_input_len}"))
        room = [self.max_seq_len - n for n in lengths]
        if min(room) < 1:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("no room left for output tokens"))
        output_len = np.minimum(wanted.astype(np.int32), np.array(room, dtype=np.int32))
        batch = np.full((len(ids), max(lengths)), self.pad_id, dtype=np.int32)
        for row, tokens in enumerate(ids):
            batch[row, :len(tokens)] = tokens
        column = np.ones((len(ids), 1), dtype=np.int32)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", batch),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array(lengths, dtype=np.int32).reshape(-1, 1)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len.reshape(-1, 1)),
            pb_utils.Tensor("OUT_END_ID", column * self.end_id),
            pb_utils.Tensor("OUT_PAD_ID", column * self.pad_id),
        ])
