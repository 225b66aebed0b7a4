"""The agent's /metrics in the Prometheus text exposition format (0.0.4), written by hand so the
sidecar needs no extra package; every family carries ``env`` and ``pod`` labels."""

from __future__ import annotations

from typing import Any


def _labels(values: dict[str, str]) -> str:
    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in values.items()) + "}"


def render(status: dict[str, Any]) -> str:
    """Text for one scrape, from the agent's status snapshot (``Agent.status()``)."""
    base = {"env": status["env"], "pod": status["pod"]}
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{_labels(base | labels)} {float(value):g}")

    family("trm_agent_ready", "gauge", "1 when /readyz answers 200.", [({}, status["ready"])])
    family("trm_agent_degraded", "gauge", "1 while the agent refuses the version its environment names.",
           [({}, status["state"] == "degraded")])
    family("trm_agent_served_version", "gauge", "Version of each model the server answers with.",
           [({"model": m}, v) for m, v in sorted(status["served"].items()) if v is not None])
    family("trm_agent_wanted_version", "gauge", "Version of each model the environment names.",
           [({"model": m}, v) for m, v in sorted(status["wanted"].items())])
    family("trm_agent_rollouts_total", "counter", "Local rollouts by outcome (done, rolled_back, refused, failed).",
           [({"outcome": o}, n) for o, n in sorted(status["rollouts"].items())])
    sync = status["sync"]
    family("trm_agent_sync_bytes_total", "counter", "Blob bytes synced into the node repository, by source "
           "(downloaded from the store, reused from the node cache).",
           [({"source": "downloaded"}, sync["bytes_downloaded"]), ({"source": "cache"}, sync["bytes_reused"])])
    pointer = status["pointer"]
    family("trm_agent_pointer_reads_total", "counter", "Reads of the environment pointer by result.",
           [({"result": r}, pointer[k]) for r, k in (("changed", "changed"), ("unchanged", "unchanged"),
                                                    ("error", "errors"))])
    if pointer["age_s"] is not None:
        family("trm_agent_pointer_age_seconds", "gauge", "Seconds since the pointer was last read successfully.",
               [({}, pointer["age_s"])])
    return "\n".join(lines) + "\n"
