"""Imported in each vLLM worker process that trm's ``vllm`` backend starts (engine argument
``worker_extension_cls``), before the model loads.

On an x86 CPU with AMX, Linux lets a process run AMX tile instructions only after it asked for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); without that the first one is a SIGILL. vLLM's CPU attention kernel for
bf16 (``cpu_attn_amx.hpp``) executes them without asking: the request is made by oneDNN/brgemm as a side
effect, and a model whose projections are all small (SGL's kernel, at most 1 MiB per weight) whose first
batch has at most 4 tokens never reaches brgemm before the attention, so the worker dies at its first
generation (`Worker proc VllmWorker-0 died unexpectedly`). The permission is per process and dropped at exec,
so each spawned worker asks for it here. A no-op elsewhere (no AMX, no torch.cpu._init_amx).
"""

try:
    import torch

    torch.cpu._init_amx()  # noqa: SLF001 - torch's own request (arch_prctl), not exposed publicly
except Exception:  # noqa: BLE001 - an old torch, a GPU-only build: nothing to ask for
    pass


class AmxWorkerExtension:
    """No methods: importing this module is the point."""
