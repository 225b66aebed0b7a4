"""Watching Triton servers: alert rules and a dashboard as files (``rules``), a live view (``top``).

Both read Triton's own Prometheus metrics (``nv_inference_*``); trm's launcher turns on Triton's latency
summaries (``--metrics-config=summary_latencies=true``) so that p50/p99 per model exist.
"""
