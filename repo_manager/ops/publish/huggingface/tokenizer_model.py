"""Triton Python-backend model: text in, token tensors out (the tokenizer member of a Hugging Face service).

Not imported by trm: ``trm publish model`` copies this file as ``model.py`` into each version of the
``<name>_tokenizer`` model, beside the checkpoint's ``tokenizer.json``. It runs inside Triton's python
backend stub, so it imports only what the serving environment has (numpy, tokenizers).

The checkpoint's fast tokenizer is used as is (the same ``tokenizers`` object transformers wraps, with the
checkpoint's lower-casing already in its normalizer), with truncation to ``max_length`` (longest first for
pairs) and padding to the longest text of each request, rounded up to ``pad_to_multiple_of`` so that
requests of similar length share a shape the dynamic batcher can join; all set from the config's
``parameters``. The ``prompt`` parameter, when set, is prepended to every text, as sentence-transformers
does. With a ``QUERY`` input (a reranker) each batch item is the pair (query, text).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

# config output name -> attribute of tokenizers.Encoding
_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        # tokenizer.json may carry whatever truncation/padding it was saved with: set ours explicitly
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(int(params["max_length"]))
        multiple = int(params.get("pad_to_multiple_of", "0")) or None
        self.tokenizer.enable_padding(pad_id=int(params["pad_id"]), pad_token=params["pad_token"],
                                      pad_type_id=int(params.get("pad_type_id", "0")), pad_to_multiple_of=multiple)
        self.prompt = params.get("prompt", "")
        names = [t["name"] for t in config["input"]]
        self.pair = "QUERY" in names
        self.input_name = "TEXT" if "TEXT" in names else names[0]
        self.outputs = [t["name"] for t in config["output"]]
        unknown = [name for name in self.outputs if name not in _FIELDS]
        if unknown:
            raise pb_utils.TritonModelException(f"tokenizer model: unknown outputs {unknown}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = [self.prompt + t for t in _strings(request, self.input_name)]
                if self.pair:
                    encodings = self.tokenizer.encode_batch(list(zip(_strings(request, "QUERY"), texts)))
                else:
                    encodings = self.tokenizer.encode_batch(texts)
                tensors = [pb_utils.Tensor(name, np.array([getattr(e, _FIELDS[name]) for e in encodings],
                                                          dtype=np.int64).reshape(len(texts), -1))
                           for name in self.outputs]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # noqa: BLE001 - reported per request, the model stays up
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"tokenizer model: {exc}")))
        return responses


def _strings(request, name):
    raw = pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)
    return [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else str(t) for t in raw]
