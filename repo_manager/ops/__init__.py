"""Operations: one module or package per command family; each takes a request, plans, and returns a frozen
result (publish, push, sync, export, rollout, promote, adopt, agent, tune, observe, inventory, serving, the
LLM paths). Verification (``verify``) is shared by publish, adopt, rollout and promote. Operations import
``core`` and ``adapters``, never ``cli`` (tests/test_layers.py checks it).
"""
