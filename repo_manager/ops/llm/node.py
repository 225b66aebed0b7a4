"""The facts of a serving node that decide whether an engine can run there.

``probe_node()`` fills a ``NodeFacts`` from the machine: NVML through ctypes (``libnvidia-ml.so.1``, which
the NVIDIA driver installs; no Python package needed), else ``nvidia-smi``; TensorRT, TensorRT-LLM and
PyTorch versions from the installed package metadata (nothing is imported, so probing is fast and works
without a GPU). The decisions (``repo_manager.ops.llm.doctor``) take ``NodeFacts`` as plain data: tests give
them the facts of nodes they cannot be on (another GPU, an old driver), which is testing a decision
function on data, not mocking a failure.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Any

from repo_manager.adapters.process import run_command

MIB = 1024**2


@dataclass(frozen=True)
class GpuFacts:
    name: str
    memory_bytes: int
    compute_capability: str
    """e.g. "9.0"."""
    index: int = 0


@dataclass(frozen=True)
class NodeFacts:
    gpus: tuple[GpuFacts, ...] = ()
    driver_version: str | None = None
    driver_cuda_version: str | None = None
    """The newest CUDA version the driver supports (nvidia-smi's "CUDA Version")."""
    cuda_runtime_version: str | None = None
    tensorrt_version: str | None = None
    tensorrt_llm_version: str | None = None
    framework_cuda: dict[str, str] = field(default_factory=dict)
    """CUDA version each installed framework was built for, e.g. {"torch": "12.4"}."""
    probe: str = "none"
    """How the GPU facts were found: nvml, nvidia-smi, or none (with the reason)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> NodeFacts:
        """Facts written by `trm doctor --json` (or by hand), every field checked: ValueError says which."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        gpus = data.get("gpus", [])
        if not isinstance(gpus, list):
            raise ValueError("gpus is not a list")
        checked = []
        for number, gpu in enumerate(gpus):
            if not isinstance(gpu, dict) or set(gpu) - set(GpuFacts.__dataclass_fields__):
                raise ValueError(f"gpus[{number}] is not an object with {', '.join(GpuFacts.__dataclass_fields__)}")
            memory, capability = gpu.get("memory_bytes"), gpu.get("compute_capability")
            if not isinstance(gpu.get("name"), str) or not isinstance(capability, str) or \
                    not re.fullmatch(r"[0-9]{1,2}\.[0-9]{1,2}", capability) or isinstance(memory, bool) or \
                    not isinstance(memory, int) or not 0 < memory < 2 ** 60 or \
                    not isinstance(gpu.get("index", 0), int) or isinstance(gpu.get("index", 0), bool):
                raise ValueError(f"gpus[{number}] needs a name, memory_bytes (a positive integer) and "
                                 "compute_capability like \"9.0\"")
            checked.append(GpuFacts(**gpu))
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "gpus"}
        for key, value in fields.items():
            if key == "framework_cuda":
                if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                    raise ValueError("framework_cuda is not an object of version strings")
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"{key} is not a version string")
        return cls(**{**fields, "gpus": tuple(checked)})


# ----------------------------------------------------------------------------------------------- NVML

class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _probe_nvml() -> tuple[list[GpuFacts], str | None, str | None]:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != 0:
        raise OSError("nvmlInit failed")
    try:
        buffer = ctypes.create_string_buffer(96)
        driver = buffer.value.decode() if lib.nvmlSystemGetDriverVersion(buffer, 96) == 0 else None
        cuda = ctypes.c_int()
        cuda_version = None
        # _v2 since driver 418; older libraries only have the unversioned symbol
        get_cuda = getattr(lib, "nvmlSystemGetCudaDriverVersion_v2", None) or lib.nvmlSystemGetCudaDriverVersion
        if get_cuda(ctypes.byref(cuda)) == 0:
            cuda_version = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}"
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise OSError("nvmlDeviceGetCount failed")
        gpus = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            name = ctypes.create_string_buffer(96)
            lib.nvmlDeviceGetName(handle, name, 96)
            memory = _Memory()
            lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
            major, minor = ctypes.c_int(), ctypes.c_int()
            lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))
            gpus.append(GpuFacts(name.value.decode(), int(memory.total), f"{major.value}.{minor.value}", index))
        return gpus, driver, cuda_version
    finally:
        lib.nvmlShutdown()


def _probe_nvidia_smi() -> tuple[list[GpuFacts], str | None, str | None]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise OSError("nvidia-smi not found")
    query = run_command([exe, "--query-gpu=index,name,memory.total,compute_cap,driver_version",
                         "--format=csv,noheader,nounits"], timeout_s=30)
    if query.returncode != 0:
        raise OSError(f"nvidia-smi failed: {(query.stderr or query.stdout).strip()[:200]}")
    gpus, driver = [], None
    for line in query.stdout.strip().splitlines():
        index, name, memory, capability, driver = (part.strip() for part in line.split(","))
        gpus.append(GpuFacts(name, int(float(memory)) * MIB, capability, int(index)))
    header = run_command([exe], timeout_s=30).stdout
    match = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    return gpus, driver, match.group(1) if match else None


# ------------------------------------------------------------------------------------------ packages

def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _torch_cuda() -> str | None:
    """torch.version.cuda, read from the installed file: importing torch takes seconds."""
    spec = util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    version_file = Path(spec.origin).parent / "version.py"
    if not version_file.is_file():
        return None
    match = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([0-9.]+)['\"]", version_file.read_text(), re.M)
    return match.group(1) if match else None


def probe_node() -> NodeFacts:
    """The facts of this machine. Never raises: a missing GPU is a fact (``gpus == ()``), with the reason."""
    gpus: list[GpuFacts] = []
    driver = cuda = None
    reasons = []
    probe = "none"
    for name, function in (("nvml", _probe_nvml), ("nvidia-smi", _probe_nvidia_smi)):
        try:
            gpus, driver, cuda = function()
            probe = name
            break
        except (OSError, AttributeError, ValueError, subprocess.SubprocessError) as exc:
            reasons.append(f"{name}: {exc}")
    if probe == "none":
        probe = "none (" + "; ".join(reasons) + ")"
    frameworks = {}
    torch_cuda = _torch_cuda()
    if torch_cuda:
        frameworks["torch"] = torch_cuda
    return NodeFacts(gpus=tuple(gpus), driver_version=driver, driver_cuda_version=cuda,
                     cuda_runtime_version=_version("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime"),
                     tensorrt_version=_version("tensorrt", "tensorrt-cu12", "tensorrt_cu12"),
                     tensorrt_llm_version=_version("tensorrt_llm", "tensorrt-llm"),
                     framework_cuda=frameworks, probe=probe)
