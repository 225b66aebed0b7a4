"""Independent fleet check of `trm agent` (issue 12 review): own models (ONNX ``lin``, a Python ``py``
with switchable faults, the ensemble ``pipe``), own clients counting every failure, real SeaweedFS and
tritonservers, agents as subprocesses. Usage: ``PYTHONPATH=. python bench/agent_check.py WORKDIR``
(about 8 minutes on a 2-core machine). Results in docs/agent.md, "Independent fleet check"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import onnx_models  # noqa: E402
import rollout_models as rm  # noqa: E402
import tritonclient.http as th  # noqa: E402
from agent_helpers import AgentProcess  # noqa: E402
from seaweed import BUCKET, SeaweedServer  # noqa: E402

from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.storage import open_store  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core import config as cfg  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish.core import Staged, run_publish  # noqa: E402

PY = """
import numpy as np
import triton_python_backend_utils as pb_utils
TAG = {tag}
MODE = "{mode}"
class TritonPythonModel:
    def initialize(self, args):
        if MODE == "fail_load":
            raise pb_utils.TritonModelException("broken on purpose")
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if MODE == "raise":
                raise RuntimeError("execute raises on purpose")
            y = np.full((x.shape[0], 2), TAG, np.float32)
            if MODE == "wrong_shape":
                y = np.full((x.shape[0], 5), TAG, np.float32)
            if MODE == "wrong_type":
                y = np.full((x.shape[0], 2), TAG, np.int64)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y)]))
        return out
"""


def publish_py(src: Path, tag: int, mode: str = "ok") -> int:
    def build(repo, name):
        staging = repo.stage(name)
        (staging / "model.py").write_text(PY.format(tag=tag, mode=mode))
        opts = cfg.ConfigOptions(max_batch_size=8, instance_count=1, warmup=False)
        config = cfg.build_config(
            name, "python", [cfg.TensorSpec("IN", "FP32", (3,))], [cfg.TensorSpec("OUT", "FP32", (2,))], True, opts
        )
        return [Staged(name, staging, config, {"kind": "check", "tag": tag})]

    return run_publish(Settings(repository=src), "py", build, verify_model=False).version


def publish_lin(src: Path, seed: int, tmp: Path, big: bool = False) -> int:
    path = onnx_models.linear(tmp / f"lin{seed}.onnx", in_features=4, out_features=3, seed=seed)
    if big:  # ~40 MB of weights, so a sync takes long enough to be killed in the middle
        import onnx
        from onnx import numpy_helper

        m = onnx.load(str(path))
        pad = numpy_helper.from_array(
            np.random.default_rng(seed).standard_normal((10_000_000,)).astype(np.float32), "PAD"
        )
        m.graph.initializer.append(pad)
        onnx.save(m, str(path))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "repo_manager",
            "publish",
            "model",
            str(path),
            "--name",
            "lin",
            "--repo",
            str(src),
            "--no-verify",
            "--no-warmup",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["version"] if r.stdout.strip().startswith("{") else None


def push(location, src, *models):
    args = [sys.executable, "-m", "repo_manager", "push", location, "--repo", str(src)]
    for m in models:
        args += ["--model", m]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


class Clients:
    """One thread per server; each request to lin, py, pipe in turn; every failure counted."""

    def __init__(self):
        self.servers = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failed = []
        self.answers = {}
        self.threads = []

    def add(self, pod, url):
        t = threading.Thread(target=self.loop, args=(pod, url), daemon=True)
        self.threads.append(t)
        t.start()

    def loop(self, pod, url):
        client = th.InferenceServerClient(url.replace("http://", ""), network_timeout=30)
        reqs = {
            "lin": ("X", np.ones((1, 4), np.float32), ["Y"]),
            "py": ("IN", np.ones((1, 3), np.float32), ["OUT"]),
            "pipe": ("X", np.ones((1, 4), np.float32), ["Y", "PRE_TAG", "POST_TAG"]),
        }
        i = 0
        while not self.stop.is_set():
            model = ["lin", "py", "pipe"][i % 3]
            i += 1
            name, arr, outs = reqs[model]
            try:
                inp = th.InferInput(name, list(arr.shape), "FP32")
                inp.set_data_from_numpy(arr)
                res = client.infer(model, [inp], outputs=[th.InferRequestedOutput(o) for o in outs])
                if model == "lin":
                    y = res.as_numpy("Y")
                    assert y.shape == (1, 3) and y.dtype == np.float32, (y.shape, y.dtype)
                    key = f"lin:{y[0, 0]:.4f}"
                elif model == "py":
                    y = res.as_numpy("OUT")
                    assert y.shape == (1, 2) and y.dtype == np.float32, (y.shape, y.dtype)
                    key = f"py:{int(y[0, 0])}"
                else:
                    a, b = int(res.as_numpy("PRE_TAG").ravel()[0]), int(res.as_numpy("POST_TAG").ravel()[0])
                    assert a == b, f"mixed ensemble {a}/{b}"
                    key = f"pipe:{a}"
                with self.lock:
                    self.ok += 1
                    self.answers[key] = self.answers.get(key, 0) + 1
            except Exception as exc:  # noqa
                with self.lock:
                    self.failed.append((time.strftime("%H:%M:%S"), pod, model, str(exc)[:200]))
            time.sleep(0.01)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def held(url):
    """Every loaded model:version, pre-check models (loaded with file overrides, absent from the
    repository index) included: Triton's statistics list them all."""
    with TritonClient(url) as c:
        return sorted(f"{e['name']}:{e.get('version')}" for e in c.statistics())


def main():
    base = Path(sys.argv[1])
    base.mkdir(parents=True, exist_ok=True)
    src = base / "src"
    tmp = base / "tmp"
    tmp.mkdir(exist_ok=True)
    weed = SeaweedServer(base / "weed").start()
    os.environ.update(weed.env)
    location = f"s3://{BUCKET}/check{int(time.time())}"
    store = open_store(location)
    servers, agents = {}, {}
    clients = Clients()
    results = {}

    def new_pod(node, pod, start_clients=True):
        repo = base / pod / "repo"
        repo.mkdir(parents=True, exist_ok=True)
        servers[pod] = TritonServer(repo).start()
        agents[pod] = AgentProcess(
            location, "prod", servers[pod], repo, base / node / "cache", pod=pod, interval=0.3, log_dir=base
        ).start()
        return agents[pod]

    def converge(models, pods=None, timeout=150):
        t0 = time.monotonic()
        for pod in pods or list(agents):
            agents[pod].wait(
                lambda s: s["ready"] and s["state"] == "ready" and s["served"] == models, timeout, f"ready on {models}"
            )
        return time.monotonic() - t0

    def invariants(tag):
        for pod, server in servers.items():
            h = held(server.url)
            verify = [x for x in h if x.startswith("trm-verify")]
            bad = LocalRepository(base / pod / "repo").validate()
            staging = [
                str(p) for p in (base / pod / "repo").rglob("*") if "stag" in p.name.lower() or p.name.startswith(".")
            ]
            if verify or bad:
                log(f"!! {tag} {pod}: verify leftovers {verify} validate {bad}")
            results.setdefault("invariants", []).append((tag, pod, h, verify, [str(b) for b in bad], staging[:5]))

    try:
        # versions 1
        publish_lin(src, 1, tmp)
        publish_py(src, 1)
        rm.ensemble(src, 1)
        push(location, src, "lin:1", "py:1", "pre:1", "post:1", "pipe:1")
        W1 = {"lin": 1, "py": 1, "pipe": 1}
        store.update_env("prod", W1)
        new_pod("a", "a-pod1")
        new_pod("a", "a-pod2")
        log("fleet up in", round(converge(W1), 1))
        for pod in agents:
            clients.add(pod, servers[pod].url)
        time.sleep(3)
        # S1 good promote + a server added during the rollout
        publish_lin(src, 2, tmp)
        publish_py(src, 2)
        rm.ensemble(src, 2)
        push(location, src, "lin:2", "py:2", "pre:2", "post:2", "pipe:2")
        W2 = {"lin": 2, "py": 2, "pipe": 2}
        store.update_env("prod", W2)
        t0 = time.monotonic()
        agents["a-pod1"].wait(lambda s: s["state"] in ("syncing", "rolling_out"), 30, "rollout start")
        new_pod("b", "b-pod1")
        converge(W2)
        clients.add("b-pod1", servers["b-pod1"].url)
        log("S1 promote good + added server: converged in", round(time.monotonic() - t0, 1))
        invariants("S1")
        log("failed so far", len(clients.failed), clients.failed[:5])
        # S2 multi-model partial failure: lin:3, pipe:3 good; py:3 fails to load
        publish_lin(src, 3, tmp)
        publish_py(src, 3, "fail_load")
        rm.ensemble(src, 3)
        push(location, src, "lin:3", "py:3", "pre:3", "post:3", "pipe:3")
        store.update_env("prod", {"lin": 3, "py": 3, "pipe": 3})
        for pod, a in agents.items():
            s = a.wait(lambda s: s["state"] == "degraded", 150, "refusal")
            log("S2", pod, "served", s["served"], "ready", s["ready"], "reason", s["degraded_reason"])
            results.setdefault("S2", []).append(
                (pod, s["served"], s["ready"], s["degraded_reason"], held(servers[pod].url))
            )
        time.sleep(2)
        for pod in agents:
            log("S2 held", pod, held(servers[pod].url))
        invariants("S2")
        # S3..S5 bad modes, lin/pipe at 2
        for i, mode in ((4, "wrong_shape"), (5, "wrong_type"), (6, "raise")):
            assert publish_py(src, i, mode) == i
            push(location, src, f"py:{i}")
            store.update_env("prod", {"lin": 2, "py": i, "pipe": 2})
            for pod, a in agents.items():
                s = a.wait(
                    lambda s, i=i: s["state"] == "degraded" and s["wanted"].get("py") == i, 150, f"refusal {mode}"
                )
                log(mode, pod, "served", s["served"], "ready", s["ready"], "reason", s["degraded_reason"])
                results.setdefault(mode, []).append((pod, s["served"], s["ready"], s["degraded_reason"]))
            invariants(mode)
            log("failed so far", len(clients.failed), clients.failed[-3:])
        # S6 good again, with kills
        for rnd, (moment, victim) in enumerate((("sync", "a-pod1"), ("rollout", "b-pod1"), ("verify", "a-pod2"))):
            i = 7 + rnd
            publish_lin(src, 10 + i, tmp, big=(moment == "sync"))
            i = publish_py(src, i)
            rm.ensemble(src, i)
            lv = max(int(p.name) for p in (src / "lin").iterdir() if p.name.isdigit())
            ev = max(int(p.name) for p in (src / "pipe").iterdir() if p.name.isdigit())
            push(location, src, f"lin:{lv}", f"py:{i}", f"pre:{ev}", f"post:{ev}", f"pipe:{ev}")
            W = {"lin": lv, "py": i, "pipe": ev}
            store.update_env("prod", W)
            a = agents[victim]
            deadline = time.monotonic() + 60
            what = None
            while time.monotonic() < deadline:
                h = held(servers[victim].url)
                if moment == "verify":
                    if any(x.startswith("trm-verify") for x in h):
                        what = ("verify", h)
                        break
                    continue
                st = a.status()
                if moment == "sync" and st["state"] == "syncing":
                    what = (st["state"], h)
                    break
                if (
                    moment == "rollout"
                    and st["state"] == "rolling_out"
                    and len([x for x in h if not x.startswith("trm-verify")]) > 5
                ):
                    what = (st["state"], h)
                    break
                if moment == "verify" and any(x.startswith("trm-verify") for x in h):
                    what = (st["state"], h)
                    break
                time.sleep(0.02)
            a.kill()
            left = sorted(str(p) for p in (base / victim / "repo").rglob(".trm-tmp-*"))
            log(f"KILL {victim} at {moment}: {what}; staging folders now: {left}")
            agents[victim] = AgentProcess(
                location,
                "prod",
                servers[victim],
                base / victim / "repo",
                base / victim.split("-")[0] / "cache",
                pod=victim,
                interval=0.3,
                log_dir=base,
            ).start()
            t0 = time.monotonic()
            converge(W)
            log(f"kill {moment}: converged in", round(time.monotonic() - t0, 1))
            time.sleep(2)
            log("staging after restart", sorted(str(p) for p in (base / victim / "repo").rglob(".trm-tmp-*")))
            invariants(f"kill-{moment}")
            log("failed so far", len(clients.failed), clients.failed[-3:])
        pv = publish_py(src, 20)
        push(location, src, f"py:{pv}")
        W = dict(W, py=pv)
        store.update_env("prod", W)
        agents["a-pod2"].wait(lambda s: s["state"] == "rolling_out", 60, "rolling_out")
        t0 = time.monotonic()
        rc = agents["a-pod2"].stop(60)
        log(
            "SIGTERM mid-rollout a-pod2 rc",
            rc,
            "in",
            round(time.monotonic() - t0, 2),
            "s; held",
            held(servers["a-pod2"].url),
        )
        agents["a-pod2"] = AgentProcess(
            location,
            "prod",
            servers["a-pod2"],
            base / "a-pod2" / "repo",
            base / "a" / "cache",
            pod="a-pod2",
            interval=0.3,
            log_dir=base,
        ).start()
        converge(W)
        log("converged after SIGTERM mid-rollout")
        invariants("sigterm")
        # S9 Triton restart under an agent
        srv = servers["b-pod1"]
        ports = (int(srv.url.rsplit(":", 1)[1]), int(srv.endpoints.grpc.rsplit(":", 1)[1]))
        log("restarting triton of b-pod1", ports)
        # clients of b will fail while the server is down: count them separately
        before = len(clients.failed)
        srv.stop()
        servers["b-pod1"] = TritonServer(base / "b-pod1" / "repo", http_port=ports[0], grpc_port=ports[1]).start()
        t0 = time.monotonic()
        agents["b-pod1"].wait(lambda s: s["ready"] and s["state"] == "ready" and s["served"] == W, 120, "reload")
        log(
            "restart: agent reloaded in",
            round(time.monotonic() - t0, 1),
            "failures during restart",
            len(clients.failed) - before,
        )
        results["restart_failures"] = clients.failed[before:]
        clients.failed = clients.failed[:before]
        time.sleep(3)
        clients.stop.set()
        for t in clients.threads:
            t.join(40)
        log("clients ok", clients.ok, "failed", len(clients.failed))
        for f in clients.failed[:30]:
            log("FAIL", f)
        results["failed"] = clients.failed
        log("answers", clients.answers)
        # SIGTERM
        for pod, a in agents.items():
            kids = subprocess.run(
                ["ps", "--ppid", str(a.process.pid), "-o", "pid,cmd", "--no-headers"], capture_output=True, text=True
            ).stdout
            t0 = time.monotonic()
            rc = a.stop(30)
            log(
                "SIGTERM",
                pod,
                "rc",
                rc,
                "in",
                round(time.monotonic() - t0, 2),
                "s; children before:",
                kids.strip() or "none",
            )
        for pod in servers:
            log("final", pod, held(servers[pod].url), sorted(p.name for p in (base / pod / "repo" / "py").iterdir()))
        (base / "results.json").write_text(json.dumps(results, indent=1, default=str))
    except Exception:  # noqa: BLE001 - a bench run: print what each agent logged, whatever failed
        traceback.print_exc()
        for pod, a in agents.items():
            print(f"--- {pod}\n{a.log_tail(40)}")
    finally:
        clients.stop.set()
        for a in agents.values():
            a.stop(10)
        for s in servers.values():
            if s.process is not None:
                s.stop()
        weed.stop()


main()
