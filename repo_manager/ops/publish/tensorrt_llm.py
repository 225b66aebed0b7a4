"""`trm publish model CHECKPOINT --format tensorrt-llm`: plan, build (or take) the engine, stage the layout.

Order, so that nothing is built or written for a model that cannot serve:

1. read the checkpoint's config.json and tokenizer; with ``--engine-dir``, read the engine's config.json,
   check it was built from this model and take its fingerprint;
2. plan the memory for the target GPU (``--gpu-memory``, else this node's smallest GPU) and refuse with
   ``CompatibilityError`` when one sequence of ``max_seq_len`` does not fit;
3. inside ``run_publish``: build the engine with the builder (unless given), stage every member with its
   generated config, commit members, then the ensemble. Verification on Triton needs a GPU and the
   TensorRT-LLM backend; without them the manifest records why it was skipped.

The engine member's manifest ``source`` holds the fingerprint (compute capability, TensorRT-LLM,
TensorRT and CUDA versions), the engine's limits, the model shape and the memory plan: what ``trm doctor``
and ``check_engine_compatible`` need on a serving node.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core.errors import InputError
from repo_manager.core.manifest import check_model_name, scan_files
from repo_manager.core.progress import Progress, quiet
from repo_manager.ops.llm import layout as triton_layout
from repo_manager.ops.llm.engine import (
    BuildOptions,
    EngineConfig,
    Fingerprint,
    builder_command,
    check_engine_matches,
    engine_fingerprint,
    engine_plan_request,
    read_engine,
    run_builder,
)
from repo_manager.ops.llm.node import NodeFacts, probe_node
from repo_manager.ops.llm.plan import GIB, MemoryPlan, PlanRequest, plan_memory, require_fit
from repo_manager.ops.llm.shape import ModelShape, load_shape
from repo_manager.ops.publish.core import Staged, copy_into

MODELS_DIR = Path(__file__).parent.parent / "llm" / "triton_models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
LAYOUTS = ("engine", "llmapi")


@dataclass(frozen=True)
class TrtllmOptions:
    layout: str = "engine"
    gpu_memory_gib: float | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    max_batch_size: int = 8
    max_input_len: int | None = None
    max_seq_len: int | None = None
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    tp: int = 1
    engine_dir: Path | None = None
    builder: str | None = None
    compute_capability: str | None = None
    tensorrt_version: str | None = None
    cuda_version: str | None = None
    bls: bool = False
    serving: triton_layout.ServingOptions = triton_layout.ServingOptions()


def checkpoint_digest(folder: Path) -> str:
    """sha256 over the sorted (path, sha256) of every file of the checkpoint."""
    digest = hashlib.sha256()
    for entry in scan_files(folder):
        digest.update(f"{entry.path}\0{entry.sha256}\n".encode())
    return digest.hexdigest()


def _tokenizer_files(source: Path) -> list[Path]:
    found = [source / f for f in TOKENIZER_FILES if (source / f).is_file()]
    if not (source / "tokenizer.json").is_file():
        raise InputError(f"{source} has no tokenizer (tokenizer.json), which pre/post-processing load",
                         hint="save the fast tokenizer into the checkpoint: "
                              "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    return found


def _gpu_memory(options: TrtllmOptions, node: NodeFacts) -> float:
    if options.gpu_memory_gib:
        return options.gpu_memory_gib
    if node.gpus:
        return min(g.memory_bytes for g in node.gpus) / GIB
    raise InputError("no GPU visible here to plan the engine for",
                     hint="pass --gpu-memory GB: the memory of one serving GPU (e.g. 24, 80, 141)")


def _base_source(source: Path, name: str, role: str, digest: str) -> dict[str, Any]:
    return {"kind": "tensorrt-llm", "role": role, "ensemble": name, "path": str(source.resolve()),
            "checkpoint_sha256": digest}


def _engine_source(base: dict[str, Any], engine: EngineConfig | None, fingerprint: Fingerprint | None,
                   plan: MemoryPlan, shape: ModelShape, world: int) -> dict[str, Any]:
    data = {**base, "plan": plan.to_dict(), "model_shape": shape.to_dict(), "world_size": world}
    if engine is not None and fingerprint is not None:
        data["fingerprint"] = fingerprint.to_dict()
        data["engine"] = engine.summary()
    return data


def _stage_python(repo: LocalRepository, name: str, model_file: str, config, tokenizer: list[Path],
                  source: dict[str, Any]) -> Staged:
    staging = repo.stage(name)
    copy_into(staging, MODELS_DIR / model_file, "model.py")
    copy_into(staging, MODELS_DIR / "common.py", "trm_common.py")
    for file in tokenizer:
        copy_into(staging, file, f"tokenizer/{file.name}")
    return Staged(name, staging, config, source, environment_packages=("transformers", "tensorrt_llm"))


def prepare_tensorrt_llm(source: str | Path, name: str, options: TrtllmOptions, *, node: NodeFacts | None = None,
                         progress: Progress = quiet) -> Callable[[LocalRepository, str], list[Staged]]:
    """Check everything that can be checked before building; return the build for ``run_publish``."""
    source = Path(source)
    check_model_name(name)
    for member in triton_layout.names(name).values():
        check_model_name(member)
    if options.layout not in LAYOUTS:
        raise InputError(f"layout {options.layout!r} is not one of {', '.join(LAYOUTS)}")
    options.serving.check()
    shape = load_shape(source)
    tokenizer = _tokenizer_files(source)
    node = node if node is not None else probe_node()
    gpu_gib = _gpu_memory(options, node)
    engine = fingerprint = None
    if options.layout == "engine" and options.engine_dir is not None:
        engine = read_engine(options.engine_dir)
        check_engine_matches(engine, shape, str(source))
        options.serving.check(engine)
        fingerprint = engine_fingerprint(engine, compute_capability=options.compute_capability,
                                         tensorrt_version=options.tensorrt_version, cuda_version=options.cuda_version)
        request = engine_plan_request(engine, gpu_gib, kv_cache_dtype=options.kv_cache_dtype)
    else:
        max_seq = options.max_seq_len or shape.max_position_embeddings
        request = PlanRequest(gpu_memory_gib=gpu_gib, dtype=options.dtype, kv_cache_dtype=options.kv_cache_dtype,
                              max_batch_size=options.max_batch_size, max_seq_len=max_seq, tp=options.tp,
                              max_num_tokens=options.max_num_tokens)
    plan = require_fit(plan_memory(shape, request))
    progress(f"memory plan: {plan.reason} on {gpu_gib:g} GiB")
    digest = checkpoint_digest(source)
    serving = replace(options.serving, max_tokens_in_paged_kv_cache=plan.max_tokens)

    if options.layout == "llmapi":
        def build_llmapi(repo: LocalRepository, _: str) -> list[Staged]:
            config = triton_layout.llmapi_config(name, serving.decoupled)
            staging = repo.stage(name)
            copy_into(staging, MODELS_DIR / "llmapi.py", "model.py")
            for entry in scan_files(source):
                copy_into(staging, source / entry.path, f"checkpoint/{entry.path}")
            settings = triton_layout.llmapi_yaml(tp=options.tp, max_batch_size=options.max_batch_size,
                                          max_seq_len=plan.max_seq_len, max_num_tokens=options.max_num_tokens,
                                          kv_fraction=serving.kv_cache_free_gpu_mem_fraction,
                                          max_kv_tokens=plan.max_tokens, decoupled=serving.decoupled,
                                          dtype=options.dtype)
            (staging / "model.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
            record = _engine_source(_base_source(source, name, "llmapi", digest), None, None, plan, shape,
                                    options.tp)
            return [Staged(name, staging, config, record, environment_packages=("tensorrt_llm", "transformers"))]
        return build_llmapi

    def build(repo: LocalRepository, _: str) -> list[Staged]:  # run_publish removes what it staged on failure
        member = triton_layout.names(name)
        staged: list[Staged] = []
        built, built_fingerprint, built_plan = engine, fingerprint, plan
        engine_staging = repo.stage(member["tensorrt_llm"])
        if built is None:
            progress("building the TensorRT-LLM engine (needs a GPU)")
            max_seq = plan.max_seq_len
            build_options = BuildOptions(max_batch_size=options.max_batch_size,
                                         max_input_len=options.max_input_len or min(1024, max_seq - 1),
                                         max_seq_len=max_seq, max_beam_width=options.max_beam_width,
                                         max_num_tokens=options.max_num_tokens, dtype=options.dtype, tp=options.tp)
            command = builder_command(options.builder, source, engine_staging, build_options)
            with tempfile.TemporaryDirectory(prefix="trm-build-") as logs:
                built = run_builder(command, engine_staging, Path(logs) / "build.log")
            check_engine_matches(built, shape, str(source))
            built_fingerprint = engine_fingerprint(built, compute_capability=options.compute_capability,
                                                   tensorrt_version=options.tensorrt_version,
                                                   cuda_version=options.cuda_version)
            built_request = engine_plan_request(built, gpu_gib, kv_cache_dtype=options.kv_cache_dtype)
            built_plan = require_fit(plan_memory(shape, built_request))
        else:
            for entry in scan_files(built.path):
                copy_into(engine_staging, built.path / entry.path, entry.path)
        # the backend wants an absolute engine path: the version folder this publish will create
        version_dir = repo.root.resolve() / member["tensorrt_llm"] / str(repo.next_version(member["tensorrt_llm"]))
        pre_config = triton_layout.preprocessing_config(member["preprocessing"], built, serving)
        staged.append(_stage_python(repo, member["preprocessing"], "preprocessing.py", pre_config, tokenizer,
                                    _base_source(source, name, "preprocessing", digest)))
        staged.append(Staged(member["tensorrt_llm"], engine_staging,
                             triton_layout.tensorrt_llm_config(member["tensorrt_llm"], built, serving, version_dir),
                             _engine_source(_base_source(source, name, "tensorrt_llm", digest), built,
                                            built_fingerprint, built_plan, shape, built.world_size),
                             environment_packages=("tensorrt_llm", "tensorrt")))
        post_config = triton_layout.postprocessing_config(member["postprocessing"], built, serving)
        staged.append(_stage_python(repo, member["postprocessing"], "postprocessing.py", post_config, tokenizer,
                                    _base_source(source, name, "postprocessing", digest)))
        if options.bls:
            bls = repo.stage(member["tensorrt_llm_bls"])
            copy_into(bls, MODELS_DIR / "bls.py", "model.py")
            copy_into(bls, MODELS_DIR / "common.py", "trm_common.py")
            staged.append(Staged(member["tensorrt_llm_bls"], bls, triton_layout.bls_config(name, built, serving),
                                 _base_source(source, name, "tensorrt_llm_bls", digest)))
        ensemble = repo.stage(name)
        staged.append(Staged(name, ensemble, triton_layout.ensemble_config(name, built),
                             _base_source(source, name, "ensemble", digest),
                             members={member[r]: 0 for r in ("preprocessing", "tensorrt_llm", "postprocessing")}))
        return staged

    return build


def skipped_verification(node: NodeFacts) -> dict[str, Any]:
    reason = "no GPU" if not node.gpus else "trm does not verify LLM answers yet (see bench/gpu_check.sh)"
    return {"skipped": reason, "node_probe": node.probe,
            "checked": ["memory plan fits", "engine matches the checkpoint", "every config parses with the "
                        "ModelConfig schema"]}

