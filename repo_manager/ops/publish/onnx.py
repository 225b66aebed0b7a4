"""ONNX models: read the graph's signature and turn it into a Triton config.

Batch rule: the model is batchable when every input and output has rank >= 1 and a dynamic (symbolic or
unknown) first dimension; the config then has ``max_batch_size > 0`` and dims without that axis.
Otherwise ``max_batch_size: 0`` and the full dims. What Triton cannot express is refused, naming the
tensor: non-tensor types (sequences, maps), element types without a Triton type, and scalars.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import onnx
from google.protobuf.message import DecodeError

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError
from repo_manager.core.paths import SourceReadError, open_inside
from repo_manager.ops.publish.core import Staged, copy_inside, copy_into, source_record

_ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.DOUBLE: "FP64",
    onnx.TensorProto.BFLOAT16: "BF16", onnx.TensorProto.INT8: "INT8", onnx.TensorProto.INT16: "INT16",
    onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.UINT8: "UINT8",
    onnx.TensorProto.UINT16: "UINT16", onnx.TensorProto.UINT32: "UINT32",
    onnx.TensorProto.UINT64: "UINT64", onnx.TensorProto.BOOL: "BOOL", onnx.TensorProto.STRING: "STRING",
}


@dataclass(frozen=True)
class OnnxSignature:
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    """(name, Triton type, full dims with -1 for dynamic)."""
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    opset: int
    producer: str
    external_data: tuple[str, ...]
    """Relative paths of external-data files the graph needs beside it."""

    @property
    def batchable(self) -> bool:
        return all(len(dims) >= 1 and dims[0] == -1 for _, _, dims in self.inputs + self.outputs)

    def specs(self, batchable: bool) -> tuple[list[cfg.TensorSpec], list[cfg.TensorSpec]]:
        def convert(items):
            return [cfg.TensorSpec(n, t, d[1:] if batchable else d) for n, t, d in items]
        return convert(self.inputs), convert(self.outputs)


def load_onnx(path: Path) -> onnx.ModelProto:
    """Load and check an ONNX file; any failure is an InputError naming the file."""
    if not path.exists():
        raise InputError(f"source {path} does not exist")
    if not path.is_file():
        raise InputError(f"source {path} is not a file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{path} is not a readable ONNX model (corrupt or truncated): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if not model.graph.output:
        raise InputError(f"{path} is not an ONNX model: its graph has no outputs (corrupt or truncated?)")
    external_data_files(path, _locations(model))  # before the checker and onnxruntime read them
    try:
        # by path, so that external data is looked up beside the model (not in the working directory)
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise InputError(f"{path} fails the ONNX checker: {str(exc).splitlines()[0]}") from exc
    return model


def _tensor(value_info: onnx.ValueInfoProto, role: str) -> tuple[str, str, tuple[int, ...]]:
    kind = value_info.type.WhichOneof("value")
    if kind != "tensor_type":
        raise InputError(f"{role} {value_info.name!r} is a {kind}, not a tensor: Triton cannot express it")
    elem = value_info.type.tensor_type.elem_type
    if elem not in _ONNX_TO_TRITON:
        raise InputError(f"{role} {value_info.name!r} has ONNX element type "
                         f"{onnx.TensorProto.DataType.Name(elem)}, which has no Triton data type")
    if not value_info.type.tensor_type.HasField("shape"):
        raise InputError(f"{role} {value_info.name!r} has no shape in the graph; give it one")
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                 for d in value_info.type.tensor_type.shape.dim)
    if not dims:
        raise InputError(f"{role} {value_info.name!r} is a scalar (rank 0); Triton tensors need rank >= 1")
    return value_info.name, _ONNX_TO_TRITON[elem], dims


def signature(model: onnx.ModelProto) -> OnnxSignature:
    initializers = {init.name for init in model.graph.initializer}
    inputs = tuple(_tensor(v, "input") for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_tensor(v, "output") for v in model.graph.output)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    return OnnxSignature(inputs, outputs, opset, f"{model.producer_name} {model.producer_version}".strip(),
                         _locations(model))


def _locations(model: onnx.ModelProto) -> tuple[str, ...]:
    return tuple(sorted({entry.value for init in model.graph.initializer for entry in init.external_data
                         if entry.key == "location"}))


def onnx_config(name: str, sig: OnnxSignature, options: cfg.ConfigOptions) -> cfg.ModelConfig:
    batchable = sig.batchable and options.max_batch_size != 0
    inputs, outputs = sig.specs(batchable)
    for spec in inputs + outputs:
        if spec.dtype == "BF16":
            raise InputError(f"tensor {spec.name!r} is BF16, which the embedded onnxruntime backend cannot "
                             "pass through numpy; export it as FP16 or FP32")
    return cfg.build_config(name, "onnxruntime", inputs, outputs, batchable, options,
                            default_model_filename="model.onnx")


def build_onnx(source: Path, options: cfg.ConfigOptions):
    """A ``build`` function for ``run_publish``: stage model.onnx (+ external data) with its config."""

    if source.is_dir():
        found = next(source.glob("*.onnx"))
        open_inside(source, found.name).close()  # a file trm found in the folder, not one the user named
        source = found
    source = source.absolute()  # external data and the reference resolve beside the model, whatever the cwd
    model = load_onnx(source)
    sig = signature(model)
    data_files = external_data_files(source, sig.external_data)
    reference = onnx_reference(source)  # before staging: a model onnxruntime cannot load stages nothing

    def build(repo, name: str) -> list[Staged]:
        config = onnx_config(name, sig, options)
        staging = repo.stage(name)
        staged = Staged(name, staging, config,
                        source_record(source, "onnx", opset=sig.opset, producer=sig.producer,
                                      converter="copy"),
                        reference=reference)
        copy_into(staging, source, "model.onnx")
        for rel in data_files:
            copy_inside(staging, source.parent, rel)
        return [staged]

    return build


def external_data_files(source: Path, locations: tuple[str, ...]) -> tuple[str, ...]:
    """Each external-data file the graph names, as a path relative to the model's folder, each opened
    there as ``paths.open_inside`` opens it. A location that leaves the folder, a symbolic link anywhere
    on the way, a missing or unreadable file is bad input naming it (exit 3)."""
    folder = source.parent
    files: list[str] = []
    for location in locations:
        rel = PurePosixPath(location)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise InputError(f"{source} names external data {location!r}, outside its folder",
                             hint="keep external-data files in the model's folder (onnx.save_model(..., "
                                  "location='weights.bin'))")
        try:
            open_inside(folder, rel.as_posix()).close()
        except SourceReadError as exc:
            if exc.reason == "missing":
                raise InputError(f"{source} needs external data {location!r}, which is missing from {folder}",
                                 path=str(exc.path)) from exc
            raise SourceReadError(f"{source} needs external data {location!r}: {exc.message}", path=exc.path,
                                  reason=exc.reason, hint=exc.hint) from exc
        files.append(rel.as_posix())
    return tuple(files)


_UNKNOWN_OP = re.compile(r"(?P<domain>[\w.]*):(?P<op>\w+)\(-?\d+\) is not a registered function/op")


def onnx_reference(path: Path):
    """onnxruntime run directly on the source: the reference Triton's answers are compared with.

    A model onnxruntime cannot load (an operator or domain it does not know, a bad graph) is bad input,
    named in one line: neither trm's backend nor Triton's official one could serve it.
    """
    import onnxruntime as ort  # noqa: PLC0415 - heavy import, only when verifying

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        message = str(exc)
        unknown = _UNKNOWN_OP.search(message)
        if unknown:
            domain = unknown["domain"] or "ai.onnx"
            raise InputError(f"{path} uses operator {unknown['op']} of domain {domain}, which onnxruntime "
                             f"{ort.__version__} does not know",
                             hint="export with standard ONNX operators, or register the custom op library "
                                  "on the server") from exc
        detail = message.split(":", 3)[-1].strip().splitlines()[0] if message else type(exc).__name__
        raise InputError(f"onnxruntime cannot load {path}: {detail}") from exc
    names = [o.name for o in session.get_outputs()]

    def run(inputs):
        return dict(zip(names, session.run(names, dict(inputs))))

    return run
