"""Can this node run these engines? Decisions on ``NodeFacts`` and version manifests.

``check_engine_compatible(manifest, node)`` is the one gate: sync and rollout call it before installing or
loading a version, and it raises ``CompatibilityError`` (exit 11) naming the exact mismatch. It checks, for
the engine member of a TensorRT-LLM publish (``source.kind == "tensorrt-llm"``, role ``tensorrt_llm``) and
for an LLM-API model (role ``llmapi``):

- a GPU is visible, and as many as the engine's world size (tp × pp);
- the GPU's compute capability equals the engine's (TensorRT engines do not deserialize on another
  architecture);
- TensorRT and TensorRT-LLM on the node are the versions the engine was built with (major.minor.patch),
  when the node has them installed (on a node that only runs Triton's container they are not visible,
  and the check says "unknown" instead of failing);
- the driver supports the CUDA version the engine was built with;
- the memory plan the version was published with still fits the node's GPU memory.

Any other manifest passes (there is nothing to check). ``diagnose`` runs the same checks over a whole
repository plus the node-wide ones (a GPU at all; each framework's CUDA against the driver).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core.errors import CompatibilityError, InputError
from repo_manager.core.manifest import Manifest
from repo_manager.ops.llm.node import NodeFacts
from repo_manager.ops.llm.plan import GIB, PlanRequest, plan_memory
from repo_manager.ops.llm.shape import ModelShape

ENGINE_ROLES = ("tensorrt_llm", "llmapi")


@dataclass(frozen=True)
class Finding:
    subject: str
    """"node" or "model/version"."""
    check: str
    status: str
    """ok, fail or unknown."""
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"[{self.status}] {self.subject}: {self.check}: {self.message}"


def _version_tuple(text: str | None, parts: int) -> tuple[int, ...] | None:
    if not text:
        return None
    numbers = []
    for piece in str(text).split(".")[:parts]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers) if numbers else None


def _cuda_check(subject: str, what: str, needed: str | None, node: NodeFacts) -> Finding:
    have, want = _version_tuple(node.driver_cuda_version, 2), _version_tuple(needed, 2)
    if want is None:
        return Finding(subject, "driver_cuda", "unknown", f"the CUDA version {what} needs is not recorded")
    if have is None:
        return Finding(subject, "driver_cuda", "unknown", "the driver's CUDA version is unknown (no GPU probe)")
    if have < want:
        return Finding(subject, "driver_cuda", "fail",
                       f"{what} needs CUDA {needed}, driver {node.driver_version or '?'} supports only CUDA "
                       f"{node.driver_cuda_version}: update the driver or use a build for CUDA "
                       f"{node.driver_cuda_version}")
    return Finding(subject, "driver_cuda", "ok", f"driver supports CUDA {node.driver_cuda_version} ≥ {needed}")


def _same_version(subject: str, check: str, label: str, built: str | None, here: str | None) -> Finding:
    if not built:
        return Finding(subject, check, "unknown", f"the {label} version of the build is not recorded")
    if not here:
        return Finding(subject, check, "unknown", f"{label} is not installed where trm runs; the serving "
                                                  f"image must have {label} {built}")
    if _version_tuple(built, 3) != _version_tuple(here, 3):
        return Finding(subject, check, "fail", f"engine built with {label} {built}, node has {here}: rebuild "
                                               f"the engine with {label} {here} or serve with {built}")
    return Finding(subject, check, "ok", f"{label} {here}")


def holds_engine(manifest: Manifest) -> bool:
    """True for the versions ``check_engine_compatible`` judges (an engine, or an LLM-API model): only
    these need the node's facts, so a caller probes the node only when one is involved."""
    source = manifest.source if isinstance(manifest.source, dict) else {}
    return source.get("kind") == "tensorrt-llm" and source.get("role") in ENGINE_ROLES


def engine_findings(manifest: Manifest, node: NodeFacts) -> list[Finding]:
    """Every check of one version against the node; empty for versions that hold no engine."""
    if not holds_engine(manifest):
        return []
    source = manifest.source
    subject = f"{manifest.model}/{manifest.version}"
    findings: list[Finding] = []
    world = int(source.get("world_size", 1))
    if not node.gpus:
        return [Finding(subject, "gpu", "fail", f"no GPU visible ({_why_no_gpu(node)}); the engine needs {world}")]
    if len(node.gpus) < world:
        findings.append(Finding(subject, "gpu_count", "fail",
                                f"the engine is built for {world} GPUs (tp × pp), the node has {len(node.gpus)}"))
    else:
        findings.append(Finding(subject, "gpu_count", "ok", f"{len(node.gpus)} GPU(s) for world size {world}"))
    fingerprint = source.get("fingerprint") or {}
    if source.get("role") == "tensorrt_llm":
        wanted = fingerprint.get("compute_capability")
        others = sorted({g.compute_capability for g in node.gpus[:world]} - {wanted})
        if others:
            names = ", ".join(sorted({g.name for g in node.gpus if g.compute_capability in others}))
            findings.append(Finding(subject, "compute_capability", "fail",
                                    f"engine built for compute capability {wanted} "
                                    f"({fingerprint.get('gpu_name') or 'unknown GPU'}), node GPU {names} is "
                                    f"{', '.join(others)}: rebuild the engine on this GPU type"))
        else:
            findings.append(Finding(subject, "compute_capability", "ok", f"compute capability {wanted}"))
        findings.append(_same_version(subject, "tensorrt", "TensorRT", fingerprint.get("tensorrt_version"),
                                      node.tensorrt_version))
        findings.append(_same_version(subject, "tensorrt_llm", "TensorRT-LLM",
                                      fingerprint.get("tensorrt_llm_version"), node.tensorrt_llm_version))
        findings.append(_cuda_check(subject, "the engine", fingerprint.get("cuda_version"), node))
    findings.append(_memory_finding(subject, source, node))
    return findings


def _memory_finding(subject: str, source: dict[str, Any], node: NodeFacts) -> Finding:
    plan = source.get("plan") or {}
    shape_data = source.get("model_shape")
    request = plan.get("request") or {}
    if not shape_data or not request:
        return Finding(subject, "memory", "unknown", "the version records no memory plan")
    smallest = min(g.memory_bytes for g in node.gpus)
    replanned = plan_memory(ModelShape.from_dict(shape_data), PlanRequest(
        gpu_memory_gib=smallest / GIB, dtype=request.get("dtype"), kv_cache_dtype=request.get("kv_cache_dtype"),
        max_batch_size=int(request.get("max_batch_size", 1)), max_seq_len=request.get("max_seq_len"),
        tp=int(request.get("tp", 1)), max_num_tokens=int(request.get("max_num_tokens", 8192)),
        utilization=float(request.get("utilization", 0.9))))
    gib = f"{smallest / GIB:.1f} GiB"
    if not replanned.fits:
        return Finding(subject, "memory", "fail", f"does not fit the node's {gib} GPU: {replanned.reason}")
    return Finding(subject, "memory", "ok", f"fits {gib}: {replanned.reason}")


def check_engine_compatible(manifest: Manifest, node: NodeFacts) -> list[Finding]:
    """The findings for ``manifest`` on ``node``; CompatibilityError when any check fails.

    For sync and rollout: call before installing or loading a version (any model: versions without an
    engine pass with no findings).
    """
    findings = engine_findings(manifest, node)
    failed = [f for f in findings if f.status == "fail"]
    if failed:
        raise CompatibilityError(f"{manifest.model} version {manifest.version} cannot run on this node: "
                                 + "; ".join(f"{f.check}: {f.message}" for f in failed),
                                 hint="`trm doctor` lists every check", model=manifest.model,
                                 version=manifest.version)
    return findings


# ---------------------------------------------------------------------------------------- whole node

@dataclass(frozen=True)
class DoctorReport:
    node: NodeFacts
    findings: tuple[Finding, ...]

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "node": self.node.to_dict(), "findings": [f.to_dict() for f in self.findings]}


def _why_no_gpu(node: NodeFacts) -> str:
    return node.probe.removeprefix("none ").strip("()")


def node_findings(node: NodeFacts, *, require_gpu: bool = False) -> list[Finding]:
    """A node without a GPU is a CPU node, which is a legitimate serving node (ONNX, Python, vLLM's CPU
    build): it fails only when ``require_gpu`` says this node must have one; an engine that needs a GPU fails
    on its own (``engine_findings``)."""
    if not node.gpus:
        why = _why_no_gpu(node)
        findings = [Finding("node", "gpu", "fail", f"no GPU visible ({why}) and --require-gpu was given")
                    if require_gpu else
                    Finding("node", "gpu", "ok", f"no GPU visible ({why}): a CPU node, which serves CPU backends "
                                                 "(ONNX, Python, vLLM's CPU build) but no TensorRT-LLM engine")]
    else:
        findings = [Finding("node", "gpu", "ok", ", ".join(
            f"#{g.index} {g.name} ({g.memory_bytes / GIB:.1f} GiB, cc {g.compute_capability})" for g in node.gpus)
            + f"; driver {node.driver_version}, CUDA {node.driver_cuda_version}")]
    for framework, cuda in sorted(node.framework_cuda.items()):
        findings.append(_cuda_check("node", f"{framework} (built for CUDA {cuda})", cuda, node))
    return findings


def diagnose(node: NodeFacts, repository: Path | None = None, *, require_gpu: bool = False) -> DoctorReport:
    """Node-wide checks, then each model's newest version in ``repository`` (when given)."""
    findings = node_findings(node, require_gpu=require_gpu)
    if repository is not None:
        repo = LocalRepository(repository)
        if not repo.root.is_dir():
            raise InputError(f"repository {repo.root} does not exist", hint="pass --repo DIR")
        for model in repo.models():
            versions = repo.versions(model)
            if versions:
                findings.extend(engine_findings(repo.manifest(model, versions[-1]), node))
    return DoctorReport(node, tuple(findings))
