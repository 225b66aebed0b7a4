"""Detokenize the engine's output: TOKENS_BATCH [batch, beam, tokens] + SEQUENCE_LENGTH -> OUTPUT text."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from trm_common import load_tokenizer, parameter, version_path


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.tokenizer = load_tokenizer(version_path(args, parameter(config, "tokenizer_dir")))[0]
        self.skip_special = parameter(config, "skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            if tokens.ndim == 2:  # one beam
                tokens, lengths = tokens[:, None, :], lengths.reshape(-1, 1)
            texts = [[self.tokenizer.decode(tokens[b, k, :int(lengths[b, k])].tolist(),
                                            skip_special_tokens=self.skip_special).encode()
                      for k in range(tokens.shape[1])] for b in range(tokens.shape[0])]
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))]))
        return responses
