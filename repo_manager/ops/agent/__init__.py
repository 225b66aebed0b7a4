"""`trm agent`: a sidecar that makes the Triton server beside it serve what an environment says.

``core.Agent`` is the loop (sync through the node cache, zero-drop local rollout, refusal of bad
versions); ``lease`` coordinates the drain-swap path across the pods of an environment; ``http`` serves
/healthz, /readyz, /status and /metrics (``metrics``). See docs/agent.md.
"""

from __future__ import annotations

import signal

from repo_manager.core.settings import Settings
from repo_manager.ops.agent.core import Agent, AgentOptions
from repo_manager.ops.agent.http import AgentHTTP

__all__ = ["Agent", "AgentOptions", "run_agent"]


def run_agent(options: AgentOptions, settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status (0: a clean stop)."""
    agent = Agent(options, settings)
    http = AgentHTTP(agent, options.listen, head_timeout_s=options.head_timeout_s)

    def stop(signum: int, _frame: object) -> None:
        agent.log(f"stopping ({signal.Signals(signum).name})")
        agent.stop_event.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    http.start()
    agent.log("started", listen=http.address, store=agent.store.location, env=options.env,
              repository=str(options.repository), cache=str(options.cache), url=options.url)
    try:
        agent.run()
    finally:
        http.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    agent.log("stopped")
    return 0
