"""Tokenize a request for the TensorRT-LLM engine, with upstream's inputs and outputs.

QUERY (and DECODER_QUERY for encoder-decoder models) -> INPUT_ID and lengths; STOP_WORDS_DICT and
BAD_WORDS_DICT -> the engine's word lists [batch, 2, n] (row 0: the words' token ids one after the
other, row 1: where each word ends; padded with 0 and -1); EMBEDDING_BIAS_WORDS/WEIGHTS -> a bias over
the vocabulary; END_ID/PAD_ID override the tokenizer's; PROMPT_TABLE_EXTRA_ID marks the prompt-table
tokens (ids >= vocab_size) for KV-cache reuse. Refuses a prompt longer than the engine's max_input_len,
and caps REQUEST_OUTPUT_LEN so prompt + output stay within its max_seq_len (both written into
config.pbtxt from the engine's config.json).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from trm_common import load_tokenizer, parameter, version_path


def _strings(values):
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = version_path(args, parameter(config, "tokenizer_dir"))
        self.tokenizer, self.end_id, self.pad_id = load_tokenizer(folder)
        self.add_special_tokens = parameter(config, "add_special_tokens", "true").lower() == "true"
        self.max_input_len = int(parameter(config, "max_input_len"))
        self.max_seq_len = int(parameter(config, "max_seq_len"))
        self.vocab_size = int(parameter(config, "vocab_size", str(self.tokenizer.get_vocab_size())))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._one(request)))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _encode(self, texts, pad_id):
        ids = [self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids for text in texts]
        lengths = [len(i) for i in ids]
        batch = np.full((len(ids), max(1, max(lengths))), pad_id, dtype=np.int32)
        for row, tokens in enumerate(ids):
            batch[row, :len(tokens)] = tokens
        return batch, np.array(lengths, dtype=np.int32).reshape(-1, 1)

    def _word_lists(self, words, batch_size):
        """[batch, 2, n]: token ids of the words, then the end offset of each word (TensorRT-LLM's format)."""
        if words is None:
            return np.empty((batch_size, 2, 0), dtype=np.int32)
        flat, offsets = [], []
        for row in words:
            ids, ends = [], []
            for word in _strings(row):
                tokens = self.tokenizer.encode(word, add_special_tokens=False).ids if word else []
                if tokens:
                    ids += tokens
                    ends.append(len(ids))
            flat.append(ids)
            offsets.append(ends)
        width = max(1, max(len(ids) for ids in flat))
        out = np.zeros((len(flat), 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for row, (ids, ends) in enumerate(zip(flat, offsets)):
            out[row, 0, :len(ids)] = ids
            out[row, 1, :len(ends)] = ends
        return out

    def _embedding_bias(self, words, weights, batch_size):
        if words is None or weights is None:
            return np.empty((batch_size, 0), dtype=np.float32)
        bias = np.zeros((len(words), self.vocab_size), dtype=np.float32)
        for row, (row_words, row_weights) in enumerate(zip(words, weights)):
            if len(row_words) != len(row_weights):
                raise ValueError(f"embedding_bias_words has {len(row_words)} words but embedding_bias_weights "
                                 f"{len(row_weights)} weights")
            for word, weight in zip(_strings(row_words), row_weights):
                for token in self.tokenizer.encode(word, add_special_tokens=False).ids:
                    bias[row, token] += weight
        return bias

    def _one(self, request):
        queries = _strings(self._input(request, "QUERY").reshape(-1))
        batch_size = len(queries)
        wanted = self._input(request, "REQUEST_OUTPUT_LEN").reshape(-1)
        end_id, pad_id = self._input(request, "END_ID"), self._input(request, "PAD_ID")
        end_id = np.full((batch_size, 1), self.end_id, np.int32) if end_id is None else end_id.astype(np.int32)
        pad_id = np.full((batch_size, 1), self.pad_id, np.int32) if pad_id is None else pad_id.astype(np.int32)
        input_ids, lengths = self._encode(queries, self.pad_id)
        longest = int(lengths.max())
        if longest > self.max_input_len:
            raise ValueError(f"prompt of {longest} tokens exceeds the engine's max_input_len {self.max_input_len}")
        room = self.max_seq_len - lengths.reshape(-1)
        if room.min() < 1:
            raise ValueError("no room left for output tokens")
        output_len = np.minimum(wanted.astype(np.int32), room.astype(np.int32)).reshape(-1, 1)
        decoder_query = self._input(request, "DECODER_QUERY")
        if decoder_query is None:
            decoder_ids = pad_id.reshape(-1, 1) * np.ones((batch_size, 1), np.int32)
            decoder_lengths = np.ones((batch_size, 1), np.int32)
        else:
            decoder_ids, decoder_lengths = self._encode(_strings(decoder_query.reshape(-1)), self.pad_id)
        outputs = [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("DECODER_INPUT_ID", decoder_ids),
            pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", decoder_lengths),
            pb_utils.Tensor("BAD_WORDS_IDS", self._word_lists(self._input(request, "BAD_WORDS_DICT"), batch_size)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._word_lists(self._input(request, "STOP_WORDS_DICT"), batch_size)),
            pb_utils.Tensor("EMBEDDING_BIAS", self._embedding_bias(
                self._input(request, "EMBEDDING_BIAS_WORDS"), self._input(request, "EMBEDDING_BIAS_WEIGHTS"),
                batch_size)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len),
            pb_utils.Tensor("OUT_END_ID", end_id.reshape(-1, 1)),
            pb_utils.Tensor("OUT_PAD_ID", pad_id.reshape(-1, 1)),
        ]
        extra_id = self._input(request, "PROMPT_TABLE_EXTRA_ID")
        if extra_id is not None:  # absent, the engine gets no prompt_table_extra_ids (as upstream)
            marked = np.where(input_ids >= self.vocab_size, extra_id.reshape(-1, 1).astype(np.uint64), 0)
            outputs.append(pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", marked.astype(np.uint64)))
        return outputs
