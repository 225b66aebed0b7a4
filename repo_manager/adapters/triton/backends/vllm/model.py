"""trm's Python-based ``vllm`` backend for the embedded tritonserver.

The tritonserver bundled with nvidia-pytriton has no vllm backend. Triton treats a backend folder holding a
``model.py`` as a Python-based backend, so with this file in ``<backends>/vllm/`` a config.pbtxt that says
``backend: "vllm"`` loads unchanged here, and with the official vllm_backend on a production server.

The interface is the official backend's:
- ``<model>/<version>/model.json`` holds vLLM engine arguments (``AsyncEngineArgs(**model.json)``);
- the model is decoupled, with no Triton batching (vLLM batches inside): one response per engine output
  when ``stream`` is true, the final flag on the last one; one response with the whole text otherwise;
- inputs ``text_input``, ``stream``, ``sampling_parameters`` (a JSON object of vLLM ``SamplingParams``
  fields; the request's parameters when absent), ``exclude_input_in_output`` (default: the prompt is
  prepended to a non-streamed output and never to a streamed one), ``return_finish_reason``,
  ``return_cumulative_logprob``, ``return_logprobs``, ``return_num_input_tokens``,
  ``return_num_output_tokens``; outputs with the same names without ``return_``;
- a cancelled request is aborted in the engine; the engine is shut down when the model is unloaded;
- the official ``vllm:*`` metrics through Triton's custom metrics (counters of prompt and generation tokens,
  histograms of TTFT, time per output token, end-to-end latency, prompt/generation tokens and ``n`` per
  request).

What trm adds:
- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``
  (the official backend has none; vllm_backend PR #92);
- a third label, ``engine`` (the stub's pid), beside the official ``model`` and ``version``: each engine has its
  own series, so that a reload cannot crash the server (``metric_labels``);
- a relative ``model`` path in model.json is resolved against the version folder (the official backend
  passes it to vLLM as given, which resolves it against the server's working directory), and an absolute one
  that does not exist, or the placeholder of trm's stored form (a model.json loaded as the store holds it,
  e.g. through the load API's file overrides), is replaced by the version folder when that holds a
  checkpoint;
- ``sampling_parameters`` are checked: not JSON, not an object, an unknown field or a value vLLM refuses
  (a negative ``max_tokens``) is an error response naming it, where the official backend logs the error and
  generates with defaults;
- an optional bound on waiting requests: with the config parameter ``max_waiting_requests`` N, a request
  that arrives while N requests have been handed to the engine and have not yet produced their first token
  (vLLM's waiting queue plus the ones in prefill) is answered at once with an UNAVAILABLE error and counted
  in ``vllm:num_requests_rejected_total``, instead of joining a queue that grows without bound past
  capacity (without the parameter, or with 0, nothing is rejected, as in the official backend);
- the engine's processes are recorded (``repo_manager.adapters.engines``' registry) so that the shared memory of
  an engine killed with its server is freed at the next server start.

Runs inside Triton's python backend stub, whose interpreter starts in the C locale: the locale is switched
to C.UTF-8 before vLLM is imported (its imports read UTF-8 files with the default encoding).
"""

import asyncio
import faulthandler
import json
import locale
import os
import signal
import sys
import threading
import time
import uuid

os.environ.setdefault("LC_CTYPE", "C.UTF-8")
try:
    locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
except locale.Error:
    pass
if not getattr(sys, "argv", None):
    sys.argv = ["triton_python_backend_stub"]

import numpy as np
import triton_python_backend_utils as pb_utils

ENGINE_ARGS_FILE = "model.json"
REGISTRY_ENV = "TRM_VLLM_ENGINE_REGISTRY"
STORED_FORM_PLACEHOLDER = "<version folder>"
"""model.json's ``model`` in the form trm stores it (repo_manager/core/localized.py PLACEHOLDER; this file runs
inside Triton's stub and imports nothing of trm: tests/test_layers.py checks that both agree)."""
_BOOL_INPUTS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")


class RequestError(Exception):
    """A bad request: answered with an error response, the engine never sees it."""


def _python_executable():
    """The interpreter the engine's processes run in: the stub's sys.executable is not a Python."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
            candidate = os.path.join(folder, name)
            if os.access(candidate, os.X_OK):
                return candidate
    return sys.executable


class TritonPythonModel:
    def initialize(self, args):
        import multiprocessing

        # `kill -USR1 <stub pid>` writes every thread's Python stack to the server's log: what a load or an
        # unload that does not end is waiting on
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        multiprocessing.set_executable(_python_executable())
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import SamplingParams

        self.args = args
        self.config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.config):
            raise pb_utils.TritonModelException("vllm backend: the model must use the decoupled transaction policy")
        self.version_dir = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.join(self.version_dir, ENGINE_ARGS_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                engine_config = json.load(handle)
        except (OSError, ValueError) as exc:
            raise pb_utils.TritonModelException(f"vllm backend: cannot read {path}: {exc}") from exc
        if not isinstance(engine_config, dict) or "model" not in engine_config:
            raise pb_utils.TritonModelException(f"vllm backend: {path} must be a JSON object naming \"model\"")
        model = str(engine_config["model"])
        if not os.path.isabs(model) and os.path.exists(os.path.join(self.version_dir, model)):
            engine_config["model"] = os.path.join(self.version_dir, model)
        elif (model == STORED_FORM_PLACEHOLDER or os.path.isabs(model) and not os.path.exists(model)) and \
                os.path.isfile(os.path.join(self.version_dir, "config.json")):
            # a version installed under another root than the one it was published to (a sync to another
            # node): its checkpoint is this version folder
            pb_utils.Logger.log_warn(f"vllm backend: {model} (model.json) does not exist; serving the checkpoint "
                                     f"in {self.version_dir}")
            engine_config["model"] = self.version_dir
        self.SamplingParams = SamplingParams
        self.sampling_fields = set(getattr(SamplingParams, "__struct_fields__", ()) or
                                   SamplingParams.__annotations__)
        output = pb_utils.get_output_config_by_name(self.config, "text_output")
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        self.metrics = _Metrics(metric_labels(args["model_name"], args["model_version"]))
        self.max_model_len = None
        self.engine = None
        self.loop = asyncio.new_event_loop()
        self.ongoing = 0
        self.max_waiting = _max_waiting(self.config)
        self.waiting = 0
        """Requests handed to the engine that have not produced a first output yet."""
        self.waiting_lock = threading.Lock()
        self.stopping = threading.Event()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self.loop_thread.start()
        # each worker process asks for AMX before vLLM's bf16 CPU attention uses it (trm_vllm_worker.py);
        # the workers are spawned with this sys.path
        if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
            sys.path.append(os.path.dirname(os.path.abspath(__file__)))
        engine_config.setdefault("worker_extension_cls", "trm_vllm_worker.AmxWorkerExtension")
        engine_args = AsyncEngineArgs(**engine_config)
        started = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(self._start_engine(engine_args), self.loop)
        # recorded while it starts too: the engine maps its first segment (160 MiB on CPU) before its workers
        # load the weights, and a server killed meanwhile must not leave it behind
        started_or_failed = threading.Event()
        recorder = threading.Thread(target=_register_until, args=(started_or_failed,), name="vllm-engine-record",
                                    daemon=True)
        recorder.start()
        try:
            future.result()
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        finally:
            started_or_failed.set()
            recorder.join()
        pb_utils.Logger.log_info(f"vllm backend: engine for {args['model_name']} started in "
                                 f"{time.monotonic() - started:.1f} s")
        _register_engine(started=True)

    async def _start_engine(self, engine_args):
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.max_model_len = vllm_config.model_config.max_model_len
        factory = self.metrics.stat_logger_factory()
        self.engine = AsyncLLM.from_vllm_config(vllm_config=vllm_config,
                                                usage_context=UsageContext.OPENAI_API_SERVER,
                                                stat_loggers=[factory] if factory else None,
                                                disable_log_stats=False)

    # ------------------------------------------------------------------------------------- requests
    def execute(self, requests):
        for request in requests:
            if self.stopping.is_set():
                _send_error(request.get_response_sender(), "the model is being unloaded", self.output_dtype,
                            pb_utils.TritonError.UNAVAILABLE)
                continue
            if not self._admit():
                self.metrics.rejected()
                _send_error(request.get_response_sender(),
                            f"{self.args['model_name']} is overloaded: {self.max_waiting} requests are already "
                            "waiting (max_waiting_requests); retry later", self.output_dtype,
                            pb_utils.TritonError.UNAVAILABLE)
                continue
            self.ongoing += 1
            asyncio.run_coroutine_threadsafe(self._generate(request), self.loop)
        return None

    def _admit(self):
        """Count the request as waiting unless ``max_waiting`` already are (then False: reject it)."""
        with self.waiting_lock:
            if self.max_waiting and self.waiting >= self.max_waiting:
                return False
            self.waiting += 1
            return True

    def _started(self, state):
        """The request's first output (or its end): it no longer waits."""
        if not state.get("started"):
            state["started"] = True
            with self.waiting_lock:
                self.waiting -= 1

    def _sampling_params(self, text):
        try:
            values = json.loads(text) if text else {}
        except ValueError as exc:
            raise RequestError(f"sampling_parameters is not JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise RequestError("sampling_parameters must be a JSON object of vLLM sampling parameters")
        unknown = sorted(set(values) - self.sampling_fields)
        if unknown:
            raise RequestError(f"unknown sampling parameter {unknown[0]!r}")
        for key in ("max_tokens", "min_tokens", "n", "top_k", "seed", "logprobs", "prompt_logprobs"):
            value = values.get(key)
            if isinstance(value, str) and value.lstrip("-").isdigit():  # the official backend's string values
                values[key] = int(value)
        for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = values.get(key)
            if isinstance(value, str):
                try:
                    values[key] = float(value)
                except ValueError as exc:
                    raise RequestError(f"sampling parameter {key} must be a number, not {value!r}") from exc
        max_tokens = values.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise RequestError(f"max_tokens must be a positive integer, not {max_tokens!r}")
        try:
            return self.SamplingParams(**values)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"invalid sampling parameters: {exc}") from exc

    def _inputs(self, request):
        def value(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy().reshape(-1)[0]

        prompt = value("text_input")
        if prompt is None:
            raise RequestError("text_input is missing")
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError("text_input is not UTF-8 text") from exc
        stream = bool(value("stream")) if value("stream") is not None else False
        exclude = value("exclude_input_in_output")
        prepend = (not bool(exclude)) if exclude is not None else not stream
        if prepend and stream:
            raise RequestError("when streaming, exclude_input_in_output = false is not allowed")
        parameters = value("sampling_parameters")
        if parameters is None:
            parameters = request.parameters()
        elif isinstance(parameters, bytes):
            parameters = parameters.decode("utf-8", errors="replace")
        flags = {name: bool(value(name)) if value(name) is not None else False for name in _BOOL_INPUTS}
        return prompt, stream, prepend, self._sampling_params(parameters), flags

    async def _generate(self, request):
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        final_sent = False
        admitted = {}
        try:
            prompt, stream, prepend, params, flags = self._inputs(request)
            state = {}
            last = None
            async for output in self.engine.generate(prompt, params, request_id):
                self._started(admitted)
                last = output
                if sender.is_cancelled():
                    await self.engine.abort(request_id)
                    pb_utils.Logger.log_info(f"vllm backend: request {request_id} was cancelled: aborted in the "
                                             "engine")
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "the request was cancelled", pb_utils.TritonError.CANCELLED)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    final_sent = True
                    return
                if stream:
                    flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
                    sender.send(self._response(output, state, False, flags), flags=flag)
                    final_sent = output.finished
            if not stream and last is not None:
                sender.send(self._response(last, {}, prepend, flags),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                final_sent = True
        except RequestError as exc:
            _send_error(sender, str(exc), self.output_dtype, pb_utils.TritonError.INVALID_ARG)
            final_sent = True
        except Exception as exc:  # noqa: BLE001 - every failure is the request's answer, never the stub's end
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, ValueError) else pb_utils.TritonError.INTERNAL
            if not final_sent:
                _send_error(sender, message, self.output_dtype, code)
                final_sent = True
        finally:
            self._started(admitted)
            if not final_sent:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.ongoing -= 1

    def _response(self, output, state, prepend, flags):
        outputs = output.outputs
        previous = state.get("text", [0] * len(outputs))
        prefix = output.prompt if prepend and "text" not in state and output.prompt else ""
        texts = [(prefix + o.text[p:]).encode("utf-8") for o, p in zip(outputs, previous)]
        state["text"] = [len(o.text) for o in outputs]
        tensors = [pb_utils.Tensor("text_output", np.asarray(texts, dtype=self.output_dtype))]
        if flags["return_finish_reason"]:
            tensors.append(pb_utils.Tensor("finish_reason", np.asarray([str(o.finish_reason) for o in outputs],
                                                                       dtype=np.object_)))
        if flags["return_cumulative_logprob"]:
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.asarray(
                [o.cumulative_logprob if o.cumulative_logprob is not None else float("nan") for o in outputs],
                dtype=np.float32)))
        if flags["return_logprobs"]:
            done = state.get("logprobs", [0] * len(outputs))
            items = []
            for i, o in enumerate(outputs):
                if o.logprobs is None:
                    items.append(b"null")
                    continue
                items.append(json.dumps([
                    {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                     for token, lp in entry.items()} for entry in o.logprobs[done[i]:]]).encode("utf-8"))
            state["logprobs"] = [len(o.logprobs or []) for o in outputs]
            tensors.append(pb_utils.Tensor("logprobs", np.asarray(items, dtype=np.object_)))
        if flags["return_num_input_tokens"]:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.asarray(
                [len(output.prompt_token_ids or [])], dtype=np.uint32)))
        if flags["return_num_output_tokens"]:
            done = state.get("tokens", [0] * len(outputs))
            tensors.append(pb_utils.Tensor("num_output_tokens", np.asarray(
                [len(o.token_ids) - d for o, d in zip(outputs, done)], dtype=np.uint32)))
            state["tokens"] = [len(o.token_ids) for o in outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # ------------------------------------------------------------------------------------- unload
    def finalize(self):
        self.stopping.set()
        deadline = time.monotonic() + 30
        while self.ongoing > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - unloading goes on
                pb_utils.Logger.log_warn(f"vllm backend: engine shutdown failed: {exc}")
            self.engine = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=5)
        self.metrics.finalize()
        # the record stays: the stub can still die on its way out (a kill at unload, a crash in the interpreter's
        # exit) and leave segments that only the launcher, once this process is gone, frees


def _max_waiting(config):
    """The ``max_waiting_requests`` config parameter: a count of at least 0 (0 or absent: no bound)."""
    text = str(config.get("parameters", {}).get("max_waiting_requests", {}).get("string_value", "")).strip()
    if not text:
        return 0
    if not text.isdigit():
        raise pb_utils.TritonModelException(f"vllm backend: the parameter max_waiting_requests must be a whole "
                                            f"number of requests (0: no bound), not {text!r}")
    return int(text)


def _send_error(sender, message, dtype, code):
    tensor = pb_utils.Tensor("text_output", np.asarray([message.encode("utf-8")], dtype=dtype))
    sender.send(pb_utils.InferenceResponse(output_tensors=[tensor], error=pb_utils.TritonError(message, code)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


# ---------------------------------------------------------------------------------------- metrics

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


def metric_labels(model, version):
    """The labels of this engine's series: the official backend's ``model`` and ``version``, and ``engine``, the
    stub's pid. Two engines of one model version are alive at once during a reload (the new one loads before the
    old one goes) and with two instances; Triton (2.51, and server issue #8663 upstream) gives them one shared
    Prometheus series when their labels are equal, and frees it when the first of them goes: the next update by
    the other one crashed tritonserver (SIGSEGV at the first request after a reload of a model that reports
    custom metrics, tests/test_processes.py). Each engine's own series cannot be freed under another."""
    return {"model": model, "version": version, "engine": str(os.getpid())}


class _Metrics:
    """vllm:* metric families in Triton's metrics endpoint, fed by a vLLM stat logger."""

    def __init__(self, labels):
        self.labels = labels
        self.enabled = False
        self.families = []  # a family that is garbage-collected takes its metrics off the endpoint
        try:
            family = pb_utils.MetricFamily

            def make(name, text, kind):
                self.families.append(family(name=name, description=text, kind=kind))
                return self.families[-1]

            counter = lambda name, text: make(name, text, family.COUNTER)  # noqa: E731
            gauge = lambda name, text: make(name, text, family.GAUGE)  # noqa: E731
            self.prompt_tokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."
                                         ).Metric(labels=labels)
            self.generation_tokens = counter("vllm:generation_tokens_total", "Number of generation tokens "
                                             "processed.").Metric(labels=labels)
            self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches."
                                 ).Metric(labels=labels)
            self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."
                                 ).Metric(labels=labels)
            self.rejected_count = counter("vllm:num_requests_rejected_total", "Requests rejected at once because "
                                          "max_waiting_requests were waiting (trm's backend).").Metric(labels=labels)
            self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent."
                                  ).Metric(labels=labels)
            self.histograms = {}
            if hasattr(family, "HISTOGRAM"):
                for key, name, text, buckets in (
                        ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _LATENCY_BUCKETS),
                        ("tpot", "vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                         "seconds.", _LATENCY_BUCKETS),
                        ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                         "seconds.", _LATENCY_BUCKETS),
                        ("prompt", "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                         _TOKEN_BUCKETS),
                        ("generation", "vllm:request_generation_tokens", "Number of generation tokens processed.",
                         _TOKEN_BUCKETS),
                        ("n", "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])):
                    self.histograms[key] = make(name, text, family.HISTOGRAM).Metric(labels=labels, buckets=buckets)
            self.enabled = True
        except Exception as exc:  # noqa: BLE001 - a server started with metrics off
            pb_utils.Logger.log_info(f"vllm backend: metrics not reported ({exc})")

    def rejected(self):
        if self.enabled:
            self.rejected_count.increment(1.0)

    def observe(self, key, values):
        metric = self.histograms.get(key)
        if metric is not None:
            for value in values:
                metric.observe(float(value))

    def stat_logger_factory(self):
        if not self.enabled:
            return None
        from vllm.v1.metrics.loggers import StatLoggerBase

        metrics = self

        class TritonStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index=0):
                self.vllm_config = vllm_config
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0, **_):
                metrics.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self):
                pass

            def log(self):
                pass

        return TritonStatLogger

    def record(self, scheduler, iteration):
        if not self.enabled:
            return  # finalized: the engine's last report after its shutdown
        try:
            if scheduler is not None:
                self.running.set(float(getattr(scheduler, "num_running_reqs", 0)))
                self.waiting.set(float(getattr(scheduler, "num_waiting_reqs", 0)))
                usage = getattr(scheduler, "kv_cache_usage", None)
                if usage is None:
                    usage = getattr(scheduler, "gpu_cache_usage", 0.0)
                self.kv_usage.set(float(usage))
            if iteration is None:
                return
            prompt = getattr(iteration, "num_prompt_tokens", None)
            if prompt is None:
                prompt = getattr(getattr(iteration, "prompt_token_stats", None), "total", 0)
            if prompt:
                self.prompt_tokens.increment(float(prompt))
            if iteration.num_generation_tokens:
                self.generation_tokens.increment(float(iteration.num_generation_tokens))
            self.observe("ttft", getattr(iteration, "time_to_first_tokens_iter", ()))
            self.observe("tpot", getattr(iteration, "inter_token_latencies_iter", None)
                         or getattr(iteration, "time_per_output_tokens_iter", ()))
            finished = getattr(iteration, "finished_requests", ())
            self.observe("e2e", [r.e2e_latency for r in finished])
            self.observe("prompt", [r.num_prompt_tokens for r in finished])
            self.observe("generation", [r.num_generation_tokens for r in finished])
            self.observe("n", getattr(iteration, "n_params_iter", ()))
        except Exception as exc:  # noqa: BLE001 - metrics never stop generation
            pb_utils.Logger.log_warn(f"vllm backend: metrics update failed: {exc}")

    def finalize(self):
        """Drop the metrics, then their families, while the stub still talks to the server. Left to the
        interpreter's exit, their destructors run once that connection is gone and crash the stub (measured on
        a Python model with four custom metric families: a segfault at each of 5 unloads without this, none of
        5 with it; such a crash once left Triton itself aborting on its next load)."""
        self.enabled = False
        self.histograms = {}
        for name in ("prompt_tokens", "generation_tokens", "running", "waiting", "rejected_count", "kv_usage"):
            self.__dict__.pop(name, None)
        self.families = []


# --------------------------------------------------------------------------------- engine registry

def _descendants(pid):
    children = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                children += [int(c) for c in handle.read().split()]
        except OSError:
            continue  # a thread that ended meanwhile: the others' children still count
    found = list(children)
    for child in children:
        found += _descendants(child)
    return found


def _segments(pids):
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as handle:
                for line in handle:
                    path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                    if path.startswith("/dev/shm/"):
                        names.add(path.removesuffix(" (deleted)"))
        except OSError:
            continue
    return sorted(names)


def _start_time(pid):
    """The process's start time in clock ticks since boot: with the pid, it names the process (pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _registry_file():
    folder = os.environ.get(REGISTRY_ENV)
    return os.path.join(folder, f"{os.getpid()}.json") if folder else None


RECORD_EVERY_S = 1.0
"""How often the engine's record is written again while the engine starts."""


def _register_until(done):
    """Record the engine every ``RECORD_EVERY_S`` until ``done`` is set (the start ended, either way)."""
    while not done.wait(RECORD_EVERY_S):
        _register_engine()


def _register_engine(started=False):
    """Write this stub's engine processes and their shared-memory segments where the launcher looks, and whether
    the engine has started. The segments of the record written before are kept: a start maps some only for a
    while, and a segment its process has unlinked is skipped when the record is used."""
    path = _registry_file()
    if not path:
        return
    pids = [os.getpid(), *_descendants(os.getpid())]
    starts = {str(pid): _start_time(pid) for pid in pids}
    segments = set(_segments(pids))
    try:
        with open(path) as handle:
            earlier = json.load(handle)
        # a process recorded before (reparented since, say) stays: the launcher kills only a pid whose start
        # time still matches
        for pid in earlier.get("pids", []):
            if str(pid) not in starts and earlier.get("starts", {}).get(str(pid)) is not None:
                pids.append(int(pid))
                starts[str(pid)] = earlier["starts"][str(pid)]
        segments |= {str(s) for s in earlier.get("segments", [])}
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # none yet, or not a record
    record = {"pids": pids, "starts": starts, "segments": sorted(segments), "started": started}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as handle:
            json.dump(record, handle)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        pb_utils.Logger.log_warn(f"vllm backend: cannot record the engine in {path}: {exc}")

