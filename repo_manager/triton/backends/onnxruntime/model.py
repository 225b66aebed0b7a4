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
        if self.max_batch_size > 0:
            groups = {}
            for index in range(len(arrays)):
                key = tuple((name, a.shape[1:], a.dtype.str) for name, a in sorted(feeds.items()))
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

    def _response(self, results):
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for (name, _), value in zip(self.outputs, results)])

    def finalize(self):
        self.session = None
