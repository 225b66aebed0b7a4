"""`trm infer NAME --text ...` for a vLLM model: the generated text streamed to the terminal as it arrives.

Requests go through Triton's HTTP ``generate_stream`` endpoint (one server-sent event per engine output);
``--json`` prints, per prompt, the text, prompt and generated token counts, the time to first token and the
generation rate (generated tokens after the first, per second after the first).
"""

from __future__ import annotations

import sys
from typing import Any

from repo_manager.core.errors import InputError, NotFoundError, ServerError
from repo_manager.core.settings import Settings

DEFAULT_MAX_TOKENS = 64


def is_llm(settings: Settings, name: str) -> bool:
    """True when ``name`` is served by the vllm backend (its config says so)."""
    try:
        if settings.triton_url:
            from repo_manager.adapters.triton.client import TritonClient  # noqa: PLC0415 - tritonclient only for a running server

            with TritonClient(settings.triton_url, timeout_s=10.0) as client:
                return client.model_config(name).backend == "vllm"
        from repo_manager.adapters.repository import LocalRepository  # noqa: PLC0415 - only without a running server

        return LocalRepository(settings.repository).config(name).backend == "vllm"
    except (NotFoundError, ServerError, InputError):
        return False  # the ordinary path reports what is wrong


def sampling_parameters(max_tokens: int | None, temperature: float | None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": max_tokens or DEFAULT_MAX_TOKENS}
    if temperature is not None:
        params["temperature"] = temperature
    return params


def llm_infer(ctx, settings: Settings, name: str, texts: list[str], *, max_tokens: int | None,
              temperature: float | None, version: int | None) -> None:
    """Generate for each text; stream it to stdout (unless --json), then emit the summary."""
    from repo_manager.ops.llm.generate import generate  # noqa: PLC0415 - the LLM client only for an LLM

    params = sampling_parameters(max_tokens, temperature)
    results = []

    def run(url: str) -> None:
        for text in texts:
            def show(chunk: str) -> None:
                if not ctx.json:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()

            result = generate(url, name, text, params, stream=True, version=version, on_text=show)
            if not ctx.json:
                sys.stdout.write("\n")
            results.append({"prompt": text, **result.to_dict()})

    if settings.triton_url:
        run(settings.triton_url)
    else:
        from repo_manager.ops.serving import embedded_server  # noqa: PLC0415 - the embedded server only without --url

        ctx.progress("starting an embedded tritonserver (a vLLM engine takes a while to start)")
        with embedded_server(settings, [name], http_port=0, grpc_port=0, metrics_port=0) as info:
            run(info.endpoints.http)
    data = {"model": name, "sampling_parameters": params, "generations": results}
    if ctx.json:
        ctx.emit(data)
    else:
        for item in results:
            rate = f", {item['tokens_per_s']:.1f} tokens/s" if item.get("tokens_per_s") else ""
            ctx.progress(f"{item['num_input_tokens']} prompt tokens, {item['num_output_tokens']} generated "
                         f"({item['finish_reason']}); first token after {item['ttft_s']:.3f} s{rate}")
