"""trm's Python-based ``onnxruntime`` backend for the embedded tritonserver.

The tritonserver bundled with nvidia-pytriton has no onnxruntime backend. Triton treats a backend folder
holding a ``model.py`` as a Python-based backend, so with this file in ``<backends>/onnxruntime/`` a
config.pbtxt that says ``backend: "onnxruntime"`` loads unchanged here, and with the official backend on a
production server.

Behaviour, as the official backend's:
- the model file is ``<model>/<version>/<default_model_filename or model.onnx>``;
- inputs and outputs are taken by the names and types in the config;
- with ``max_batch_size > 0`` the requests of one batch that the dynamic batcher formed are concatenated
  along the batch axis and run as one session call (requests whose non-batch dims differ, e.g. other
  sequence lengths, are run as separate groups), then the outputs are split back per request.

One addition, opt-in per model: the config parameter ``unpad`` (JSON: ``{"mask": "attention_mask", "pad":
{"input_ids": 0, "attention_mask": 0, ...}}``), which trm's Hugging Face publisher sets on encoders whose
outputs have no sequence axis (embeddings, scores, logits). Then every row of every request in the batch is
cut to its own length (the mask's count of leading ones), the rows are sorted by length and split into groups
that waste little on padding (each group is padded, with the values given, to its own longest row only), one
session call per group, and the rows are put back in request order. A masked encoder answers the same for a row
whatever padding follows it; what it saves is the compute spent on padding, which for short texts of mixed
length is most of it. Rows whose mask is not ones-then-zeros (left padding) take the plain path. The official
backend ignores the parameter and computes the padded batch: the same answers, more work.

Runs inside Triton's python backend stub: it may only import what the serving environment has (numpy,
onnxruntime, triton_python_backend_utils). Session threads: config parameter ``intra_op_thread_count``.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        filename = self.config.get("default_model_filename") or "model.onnx"
        path = os.path.join(args["model_repository"], args["model_version"], filename)
        if not os.path.isfile(path):
            raise pb_utils.TritonModelException(f"onnxruntime backend: model file {path} not found")
        options = ort.SessionOptions()
        params = self.config.get("parameters", {})
        threads = params.get("intra_op_thread_count", {}).get("string_value")
        if threads:
            options.intra_op_num_threads = int(threads)
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        self.max_batch_size = int(self.config.get("max_batch_size", 0))
        self.input_names = [t["name"] for t in self.config["input"]]
        self.outputs = [(t["name"], pb_utils.triton_string_to_numpy(t["data_type"]))
                        for t in self.config["output"]]
        unpad = params.get("unpad", {}).get("string_value")
        self.unpad = json.loads(unpad) if unpad else None
        session_outputs = {o.name for o in self.session.get_outputs()}
        missing = [name for name, _ in self.outputs if name not in session_outputs]
        if missing:
            raise pb_utils.TritonModelException(f"onnxruntime backend: outputs {missing} are not in {path}")

    def _run(self, feeds):
        names = [name for name, _ in self.outputs]
        results = self.session.run(names, feeds)
        return [np.asarray(r).astype(dtype, copy=False) for r, (_, dtype) in zip(results, self.outputs)]

    def execute(self, requests):
        arrays = []
        for request in requests:
            feeds = {}
            for name in self.input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    feeds[name] = tensor.as_numpy()
            arrays.append(feeds)
        responses = [None] * len(requests)
        if self.unpad is not None and self.max_batch_size > 0:
            try:
                return self._execute_unpadded(arrays)
            except _NotRightPadded:
                pass
        if self.max_batch_size > 0:
            groups = {}
            for index in range(len(arrays)):
                key = tuple((name, a.shape[1:], a.dtype.str) for name, a in sorted(arrays[index].items()))
                groups.setdefault(key, []).append(index)
            for indices in groups.values():
                self._execute_group(indices, arrays, responses)
        else:
            for index in range(len(arrays)):
                self._execute_group([index], arrays, responses)
        return responses

    def _execute_group(self, indices, arrays, responses):
        try:
            if len(indices) == 1:
                feeds = arrays[indices[0]]
                sizes = None
            else:
                feeds = {name: np.concatenate([arrays[i][name] for i in indices], axis=0)
                         for name in arrays[indices[0]]}
                sizes = [len(next(iter(arrays[i].values()))) for i in indices]
            results = self._run(feeds)
        except Exception as exc:  # noqa: BLE001 - reported per request, the model stays up
            error = pb_utils.TritonError(f"onnxruntime backend: {exc}")
            for i in indices:
                responses[i] = pb_utils.InferenceResponse(output_tensors=[], error=error)
            return
        if sizes is None:
            responses[indices[0]] = self._response(results)
            return
        offsets = np.cumsum([0] + sizes)
        for position, i in enumerate(indices):
            start, end = offsets[position], offsets[position + 1]
            responses[i] = self._response([r[start:end] for r in results])

    def _execute_unpadded(self, arrays):
        """Length-bucketed execution (see the module docstring): one response per request, in order."""
        mask_name = self.unpad["mask"]
        rows = []  # (length, request index, row index)
        for index, feeds in enumerate(arrays):
            mask = feeds.get(mask_name)
            if mask is None or mask.ndim != 2 or any(a.ndim != 2 or a.shape != mask.shape for a in feeds.values()):
                raise _NotRightPadded()
            real = mask.astype(bool)
            lengths = np.maximum(real.sum(axis=1), 1)
            if not np.array_equal(real, np.arange(mask.shape[1])[None, :] < lengths[:, None]):
                raise _NotRightPadded()
            rows.extend((int(n), index, r) for r, n in enumerate(lengths))
        rows.sort()
        results = {}
        try:
            for start, end in _buckets([n for n, _, _ in rows]):
                group = rows[start:end]
                width = group[-1][0]
                feeds = {}
                for name in arrays[group[0][1]]:
                    batch = np.full((len(group), width), self.unpad["pad"].get(name, 0),
                                    dtype=arrays[group[0][1]][name].dtype)
                    for k, (n, index, r) in enumerate(group):
                        batch[k, :n] = arrays[index][name][r, :n]
                    feeds[name] = batch
                outputs = self._run(feeds)
                for k, (_, index, r) in enumerate(group):
                    results[(index, r)] = [o[k] for o in outputs]
        except Exception as exc:  # noqa: BLE001 - reported per request, the model stays up
            error = pb_utils.TritonError(f"onnxruntime backend: {exc}")
            return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in arrays]
        responses = []
        for index, feeds in enumerate(arrays):
            count = len(next(iter(feeds.values())))
            per_row = [results[(index, r)] for r in range(count)]
            # _run already cast every output to its config type
            responses.append(self._response([np.stack([row[j] for row in per_row]) for j in range(len(self.outputs))]))
        return responses

    def _response(self, results):
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for (name, _), value in zip(self.outputs, results)])

    def finalize(self):
        self.session = None


class _NotRightPadded(Exception):
    """The batch is not rows of real tokens followed by padding: run it as it came."""


# The cost of one session call, in padded token slots: measured on a 2-core CPU with all-MiniLM-L6-v2 a call
# costs about as much as 6-8 token slots (served, 4 clients x 8 texts: 8 gave 460-470 texts/s, 16 gave 426-450).
CALL_COST = 8


def _buckets(lengths):
    """Split sorted ``lengths`` into consecutive groups minimising sum(rows * longest) + CALL_COST per group
    (a dynamic programme over at most max_batch_size rows): [(start, end), ...]."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            cost = best[start] + (end - start) * lengths[end - 1] + CALL_COST
            if cost < best[end]:
                best[end], cut[end] = cost, start
    spans = []
    end = n
    while end > 0:
        spans.append((cut[end], end))
        end = cut[end]
    return spans[::-1]
