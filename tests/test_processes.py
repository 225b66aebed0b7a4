"""No child process outlives the trm process that started it, whatever signal ends trm.

Real `trm publish` / `trm serve` processes are killed at several moments (server starting, model
loading, serving, a request in flight). Their process trees are read from /proc (children of that
one process, never a global search: other people's servers run on the same machine), and every pid
seen (tritonserver and its Python stubs) must be gone afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx_models as om
import pytest
from seaweed import remove_sockets

from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core import config as cfg
from repo_manager.core.settings import Settings
from repo_manager.ops.publish.core import Staged, run_publish

SLOW_MODEL_PY = '''
import os, pathlib, time
import triton_python_backend_utils as pb_utils

MARKERS = os.environ.get("TRM_TEST_MARKERS")


def mark(name):
    if MARKERS:
        pathlib.Path(MARKERS, name).touch()


class TritonPythonModel:
    def initialize(self, args):
        mark("loading")
        time.sleep({load_s})

    def execute(self, requests):
        mark("executing")
        time.sleep({execute_s})
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
'''


def slow_config(name: str) -> cfg.ModelConfig:
    """The config of ``SLOW_MODEL_PY``: X and Y FP32 [2], max batch 4, one instance, no warm-up."""
    return cfg.build_config(name, "python", [cfg.TensorSpec("X", "FP32", (2,))], [cfg.TensorSpec("Y", "FP32", (2,))],
                            True, cfg.ConfigOptions(max_batch_size=4, instance_count=1, warmup=False))


def slow_model(repo_root: Path, name: str = "slow", *, load_s: float = 0.0, execute_s: float = 0.0) -> None:
    """A Python model that sleeps while loading and while answering, and says when it starts each."""
    def build(repo, _name: str) -> list[Staged]:
        staging = repo.stage(name)
        (staging / "model.py").write_text(SLOW_MODEL_PY.format(load_s=load_s, execute_s=execute_s))
        return [Staged(name, staging, slow_config(name), {"kind": "test"})]

    run_publish(Settings(repository=repo_root), name, build, verify_model=False)


# ------------------------------------------------------------------------------------ process trees

def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a process from a later one reusing its pid), or None
    when it is gone or a zombie (exited, only waiting to be reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def server_workdirs(tree: dict[int, tuple[str, str]]) -> list[Path]:
    """The temporary folders of the servers in ``tree`` (trm removes them when it stops a server itself,
    not when the kernel kills the server for it)."""
    folders = []
    for pid in servers_in(tree):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except FileNotFoundError:
            continue
        folders += [Path(a.split("=", 1)[1]).parent for a in args if a.startswith("--backend-directory=")]
    return folders


def descendants(pid: int) -> dict[int, tuple[str, str]]:
    """Every live descendant of ``pid`` (all threads' children), with its start time and program."""
    found: dict[int, tuple[str, str]] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            started = _start_time(child)
            if started is not None:
                found[child] = (started, command_name(child))
                found.update(descendants(child))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except FileNotFoundError:
        return ""


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def servers_in(tree: dict[int, tuple[str, str]]) -> list[int]:
    return [pid for pid, (_, name) in tree.items() if name.endswith("tritonserver")]


def stubs_in(tree: dict[int, tuple[str, str]]) -> list[int]:
    return [pid for pid, (_, name) in tree.items() if name.endswith("triton_python_backend_stub")]


def assert_all_gone(tree: dict[int, tuple[str, str]], timeout_s: float = 30.0) -> None:
    """Every process of ``tree`` exits (the kernel's parent-death signal needs no help from anyone)."""
    def gone() -> bool:
        return all(_start_time(pid) != started for pid, (started, _) in tree.items())
    try:
        wait_for(gone, "the processes to exit", timeout_s)
    except AssertionError:
        alive = {pid: name for pid, (started, name) in tree.items() if _start_time(pid) == started}
        for pid in alive:  # do not leave them running for the next test
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes outlived trm: {alive}") from None


def trm(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "repo_manager", *map(str, args)], env=full_env, **popen)


def serve(repo: Path, markers: Path, *extra: str) -> subprocess.Popen:
    return trm("--json", "serve", "--repo", repo, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
               *extra, env={"TRM_TEST_MARKERS": str(markers)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               text=True)


def read_ready(proc: subprocess.Popen) -> dict:
    decoder, text = json.JSONDecoder(), ""
    while True:
        line = proc.stdout.readline()
        assert line, f"trm serve ended before it was ready: {proc.stderr.read()}"
        text += line
        try:
            return decoder.decode(text)
        except json.JSONDecodeError:
            continue


# ------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("moment, signum", [("server starting", signal.SIGKILL), ("verifying", signal.SIGKILL),
                                           ("verifying", signal.SIGTERM)])
def test_publish_ended_by_a_signal_leaves_no_server_and_no_staging(tmp_path, moment, signum):
    """`trm publish` starts its own tritonserver to verify; ending trm takes it (and its stubs) along.
    SIGTERM goes through trm's cleanup: the server is stopped and the staging folder removed."""
    source = om.linear(tmp_path / "m.onnx")
    repo = tmp_path / "repo"
    proc = trm("publish", "model", source, "--name", "lin", "--repo", repo,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if moment == "server starting":
            wait_for(lambda: servers_in(descendants(proc.pid)), "tritonserver to start")
        else:  # a stub is a child of the server: the candidate is loading or answering
            wait_for(lambda: stubs_in(descendants(proc.pid)), "the model's stub to start")
        tree = descendants(proc.pid)
        workdirs = server_workdirs(tree)
        proc.send_signal(signum)
        code = proc.wait(60)
    finally:
        proc.kill()
        proc.wait()
    assert servers_in(tree) and workdirs
    assert_all_gone(tree)
    assert not list(repo.glob("lin/1"))
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM
        assert not list(repo.rglob(".trm-tmp-*"))
        assert not any(folder.exists() for folder in workdirs)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGHUP])
def test_serve_ended_while_loading_leaves_no_server(tmp_path, signum):
    repo, markers = tmp_path / "repo", tmp_path / "markers"
    markers.mkdir()
    slow_model(repo, load_s=30)
    proc = serve(repo, markers)
    try:
        wait_for(lambda: (markers / "loading").exists(), "the model to start loading")
        tree = descendants(proc.pid)
        workdirs = server_workdirs(tree)
        proc.send_signal(signum)
        code = proc.wait(60)
    finally:
        proc.kill()
        proc.communicate()
    assert servers_in(tree) and workdirs
    assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum)
    assert_all_gone(tree)
    if signum != signal.SIGKILL:  # stopped by trm itself, not only by the kernel
        assert not any(folder.exists() for folder in workdirs)
    else:  # the kernel stopped it: its folder stays until the next server start sees its owner gone
        assert all(folder.exists() for folder in workdirs)
        (tmp_path / "empty").mkdir()
        with TritonServer(tmp_path / "empty"):
            assert not any(folder.exists() for folder in workdirs)


def test_only_the_working_folders_of_dead_owners_are_removed(tmp_path):
    """A folder whose owner file names a live process (this one), one naming a pid whose process is gone,
    one naming a live pid with another start time (a reused pid), one without an owner file: only the
    dead owners' folders are removed."""
    from repo_manager.adapters.triton.server import free_dead_workdirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    owners = {"live": f"{os.getpid()} {me}", "dead": f"{gone.pid} 1", "reused": f"{os.getpid()} 1", "none": None}
    for name, owner in owners.items():
        (tmp_path / f"trm-triton-{name}" / "backends").mkdir(parents=True)
        if owner is not None:
            (tmp_path / f"trm-triton-{name}" / "owner").write_text(owner + "\n")
    removed = free_dead_workdirs(tmp_path)
    assert sorted(Path(r).name for r in removed) == ["trm-triton-dead", "trm-triton-reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trm-triton-live", "trm-triton-none"]


def test_serve_stops_after_in_flight_requests_finish(tmp_path):
    """SIGTERM with a request in flight and an idle keep-alive client connected: the request is answered,
    then trm serve exits 0 without waiting out Triton's exit timeout for the idle connection, and takes
    every child with it."""
    repo, markers = tmp_path / "repo", tmp_path / "markers"
    markers.mkdir()
    slow_model(repo, execute_s=3)
    proc = serve(repo, markers)
    answers: list = []
    try:
        info = read_ready(proc)
        tree = descendants(proc.pid)
        url = info["endpoints"]["http"]
        idle = TritonClient(url)
        assert idle.is_ready()  # keeps its connection open through the stop

        def request() -> None:
            with TritonClient(url) as client:
                answers.append(client.infer("slow", {"X": np.ones((1, 2), np.float32)})["Y"])

        sender = threading.Thread(target=request)
        sender.start()
        wait_for(lambda: (markers / "executing").exists(), "the request to reach the model")
        proc.send_signal(signal.SIGTERM)
        # Triton's own stop would hold the idle connection for its whole exit timeout (30 s before);
        # a generous bound, not a measurement (bench figures are in docs/rollout.md)
        code = proc.wait(25)
        sender.join(30)
        idle.close()
    finally:
        proc.kill()
        proc.communicate()
    assert code == 0
    assert len(answers) == 1 and answers[0].tolist() == [[1.0, 1.0]]
    assert_all_gone(tree)


def test_serve_stop_lets_an_ensemble_request_in_flight_finish(tmp_path):
    """A request still in an ensemble's first step when the stop begins gets its answer: Triton keeps
    the second step's model until the ensemble's in-flight requests are done, although trm unloads all."""
    import rollout_models as rm

    repo, executing = tmp_path / "repo", tmp_path / "pre-executing"
    rm.ensemble(repo, 1, pre_delay=3.0, pre_marker=str(executing))
    proc = serve(repo, tmp_path)
    answers: list = []
    try:
        url = read_ready(proc)["endpoints"]["http"]

        def request() -> None:
            with TritonClient(url) as client:
                answers.append(client.infer("pipe", {"X": np.ones((1, rm.FEATURES), np.float32)}))

        sender = threading.Thread(target=request)
        sender.start()
        wait_for(executing.exists, "the request to reach the ensemble's first step")  # in `pre` (3 s) now
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        sender.join(30)
    finally:
        proc.kill()
        proc.communicate()
    assert code == 0
    assert len(answers) == 1 and answers[0]["Y"].tolist() == [[2.0] * rm.FEATURES]


def test_server_started_from_a_short_lived_thread_survives_the_thread(tmp_path):
    """Linux sends the parent-death signal when the forking *thread* ends: trm forks from a thread
    that lives as long as the process, so a server started by a worker thread keeps running."""
    (tmp_path / "repo").mkdir()
    started: list[TritonServer] = []
    worker = threading.Thread(target=lambda: started.append(TritonServer(tmp_path / "repo").start()))
    worker.start()
    worker.join()
    server = started[0]
    try:
        time.sleep(0.5)
        assert server.process is not None and server.process.poll() is None
        with TritonClient(server.url) as client:
            assert client.is_ready()
    finally:
        server.stop()


def test_sigkilled_publish_takes_its_engine_builder_with_it(tmp_path):
    """An engine build (minutes on a GPU) runs as a managed process too: it dies with trm."""
    import llm_fixtures as fx

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    builder = tmp_path / "slow_builder.py"
    builder.write_text("import time\ntime.sleep(300)\n")
    proc = trm("publish", "model", checkpoint, "--name", "llm", "--format", "tensorrt-llm", "--repo",
               tmp_path / "repo", "--gpu-memory", "24", "--max-seq-len", "128", "--builder",
               f"{sys.executable} {builder}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any("slow_builder" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
                             for pid in descendants(proc.pid) if Path(f"/proc/{pid}/cmdline").exists()),
                 "the builder to start")
        tree = descendants(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert tree
    assert_all_gone(tree)


def test_sigkilled_owner_takes_seaweed_with_it(tmp_path):
    """The test S3 server goes through the same managed-process helper."""
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); from seaweed import SeaweedServer; "
              "s = SeaweedServer(__import__('pathlib').Path(sys.argv[2])).start(); print(s.pid, *s.ports.values(), "
              "flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "weed")],
                             stdout=subprocess.PIPE, text=True)
    ports: list[int] = []
    try:
        pid, *ports = map(int, owner.stdout.readline().split())
        tree = descendants(owner.pid)
    finally:
        owner.kill()
        owner.wait()
    try:
        # the managed pid is the group reaper; weed runs under it
        assert pid in tree and any(name.endswith("weed") for _, name in tree.values())
        assert_all_gone(tree)
    finally:
        remove_sockets(ports)  # what a killed weed leaves in /tmp (no owner is left to remove them)


# ------------------------------------------------------------------- operator commands (run_command)

def _alive(pid: int) -> bool:
    return _start_time(pid) is not None


@pytest.mark.parametrize("command", ["echo out; echo err >&2; exit 3", "printf 'a\\nb'", "kill -TERM $$",
                                     "kill -KILL $$", "printf 'a\\r\\nb\\rc'", "exit 0", "cat", "echo $TRM_X",
                                     "nonexistent-program-xyz"])
def test_run_command_answers_like_subprocess_run(command):
    """What the drain, restore and eval commands see and return is what subprocess.run(shell=True) gives."""
    from repo_manager.adapters.process import run_command

    env = dict(os.environ, TRM_X="x-value")
    expected = subprocess.run(command, shell=True, capture_output=True, text=True, env=env,
                              stdin=subprocess.DEVNULL, timeout=30)
    got = run_command(command, env=env, timeout_s=30)
    assert (got.returncode, got.stdout, got.stderr) == (expected.returncode, expected.stdout, expected.stderr)


def test_a_command_is_started_without_running_trms_fork_handlers_in_the_child(tmp_path):
    """A library's fork handlers do not run between fork and exec: gRPC's, in a trm that had opened a channel,
    wrote "epoll_wait error: Bad file descriptor" into a drain command's stderr (a Python fork handler stands in
    for them: it runs in every child Python forks itself, which a ``preexec_fn`` makes it do)."""
    marker = tmp_path / "forked"
    script = ("import os, sys\n"
              f"os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'a').write('x'))\n"
              "from repo_manager.adapters.process import run_command\n"
              "got = run_command('echo out; echo err >&2', timeout_s=30)\n"
              "assert (got.returncode, got.stdout, got.stderr) == (0, 'out\\n', 'err\\n'), got\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "a fork handler ran in the command's process"


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="a kernel without autogroups")
def test_a_child_in_a_session_of_its_own_runs_at_trms_niceness_as_a_whole(tmp_path):
    """``nice trm ...`` lowers what trm starts too: Linux schedules each session as a group (autogroups), where the
    niceness a child inherits counts only against its own processes, so the group gets trm's niceness."""
    script = ("from repo_manager.adapters.process import run_command\n"
              "print(run_command('cat /proc/self/autogroup; cut -d\\  -f19 /proc/self/stat', timeout_s=30).stdout)")
    done = subprocess.run(["nice", "-n", "7", sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent)
    niceness = min(os.getpriority(os.PRIO_PROCESS, 0) + 7, 19)  # nice adds to this test's own
    group, own = done.stdout.split("\n")[:2]
    assert group.endswith(f" nice {niceness}") and own == str(niceness), done.stdout + done.stderr


def test_run_command_stops_the_whole_group_at_its_timeout_and_after_it_exits(tmp_path):
    from repo_manager.adapters.process import run_command

    pids = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(f"sleep 300 & echo $! > {pids}; sleep 300", timeout_s=1.0)
    assert time.monotonic() - started < 15
    wait_for(lambda: not _alive(int(pids.read_text())), "the backgrounded sleep to be stopped", 10)

    done = run_command("sleep 300 & echo $!", timeout_s=30)  # the command exits, its helper stays behind
    assert done.returncode == 0
    wait_for(lambda: not _alive(int(done.stdout)), "the left-behind sleep to be stopped", 10)


def test_a_stopped_process_group_is_gone_when_stop_returns_even_a_member_that_takes_long_to_die(tmp_path):
    """What runs right after a stop (the server's owner freeing the shared memory its engines mapped) must not
    find a member of the group still alive: one that maps a gigabyte takes a while to be torn down after the
    SIGKILL. Looked at once, at the moment ``stop`` returns."""
    from repo_manager.adapters.process import ManagedProcess

    ready = tmp_path / "ready"
    holder = (f"import os, time; block = b'x' * (2 << 30); open({str(ready)!r}, 'w').write(str(os.getpid())); "
              "time.sleep(300)")
    # the holder is a member of the group, not the command (whose end the group's reaper waits for)
    process = ManagedProcess(["/bin/sh", "-c", f'"{sys.executable}" -c "{holder}" & wait'], log_path=tmp_path / "log")
    process.start()
    try:
        wait_for(lambda: ready.exists() and ready.read_text(), "the holder to touch its gigabyte", 60)
        pid = int(ready.read_text())
    finally:
        process.stop(timeout_s=0.1)
    assert not _alive(pid)


def test_sigkilled_owner_takes_its_operator_command_with_it(tmp_path):
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from repo_manager.adapters.process import run_command; "
              "print('go', flush=True); run_command('sleep 300 & sleep 300', timeout_s=600)")
    owner = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent.parent)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "go"
        wait_for(lambda: sum(name.endswith("sleep") for _, name in descendants(owner.pid).values()) == 2,
                 "both sleeps to start", 30)
        tree = descendants(owner.pid)
    finally:
        owner.kill()
        owner.wait()
    assert_all_gone(tree)


def test_sigkilled_rollout_takes_its_drain_command_with_it(tmp_path):
    """`trm rollout --drain-cmd` killed with SIGKILL while the operator's command runs: nothing of it stays."""
    import rollout_models as rm

    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.ops.serving import load_version

    repo = tmp_path / "repo"
    rm.tagged(repo, "m", 1)
    server = TritonServer(repo).start()
    try:
        with TritonClient(server.url) as client:
            load_version(client, LocalRepository(repo), "m", 1)
        rm.tagged(repo, "m", 2)
        marker = tmp_path / "draining"
        proc = trm("-q", "rollout", "m", "--version", "2", "--url", server.url, "--repo", repo,
                   "--memory-budget", "10", "--drain-cmd", f"touch {marker}; sleep 300 & sleep 300",
                   "--restore-cmd", "true", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: marker.exists() and sum(name.endswith("sleep") for _, name in
                                                     descendants(proc.pid).values()) == 2, "the drain command")
            tree = descendants(proc.pid)
        finally:
            proc.kill()
            proc.wait()
        assert_all_gone(tree)
        with TritonClient(server.url) as client:  # killed before the swap: still serving v1
            assert client.is_ready()
    finally:
        server.stop()


def _backend_segments(tree: dict[int, tuple[str, str]]) -> set[str]:
    """The Python-based backends' /dev/shm regions the processes of ``tree`` map."""
    from repo_manager.adapters.engines import BACKEND_SEGMENT

    found = set()
    for pid in tree:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        found |= {line[line.index("/dev/shm/"):].removesuffix(" (deleted)") for line in lines
                  if "/dev/shm/" in line and BACKEND_SEGMENT.match(line.rsplit("/", 1)[-1].removesuffix(" (deleted)"))}
    return found


def test_the_shared_memory_a_sigkilled_server_left_is_freed_by_the_next_server(tmp_path, monkeypatch):
    """SIGKILL of `trm serve` takes tritonserver and its stubs, but not their /dev/shm regions (only a clean
    shutdown unlinks them): the next server trm starts (at its start, or its stop) unlinks those no process
    maps, and leaves alone the regions of a server that still runs; also on a machine where no vLLM engine
    ever ran (no engine registry folder)."""
    from repo_manager.adapters import engines

    monkeypatch.setenv(engines.REGISTRY_ENV, str(tmp_path / "no-engine-ever-ran"))

    repo, markers = tmp_path / "repo", tmp_path / "markers"
    markers.mkdir()
    slow_model(repo)
    proc = serve(repo, markers)
    try:
        read_ready(proc)
        tree = descendants(proc.pid)
        left = _backend_segments(tree)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        proc.kill()
        proc.communicate()
    assert left, "the served model's stub maps no backend region"
    assert_all_gone(tree)
    assert all(Path(p).exists() for p in left)  # what the kernel's kill leaves
    other = tmp_path / "other"
    slow_model(other)
    with TritonServer(other) as server, TritonClient(server.url) as client:
        client.load("slow")
        running = _backend_segments({server.pid: ("", "")} | descendants(server.pid))
        assert running and not (running & left)
        assert not [p for p in left if Path(p).exists()]
        engines.free_dead_backend_segments()  # a running server's regions are mapped: kept
        assert all(Path(p).exists() for p in running)


def test_a_backend_region_is_freed_only_when_no_process_maps_it_or_holds_it_open(tmp_path):
    """The rule itself, on regions of the backends' name made here: one mapped by a live process is kept, one
    only held open (a server between creating its region and mapping it) is kept, and one nobody uses is
    unlinked at once, however recently it was written; once its holders are gone, the next call frees them.

    A call frees nothing while some Triton process of this user cannot be read (one exiting on the other
    test worker, at that instant): the rule's own safety. A call that freed nothing is therefore repeated,
    within a deadline; what it must free, and keep, is asserted unchanged."""
    from repo_manager.adapters import engines

    def free() -> list[str]:
        deadline = time.monotonic() + 30
        while True:
            freed = engines.free_dead_backend_segments()
            if freed or time.monotonic() > deadline:
                return freed
            time.sleep(0.05)

    names = [f"triton_python_backend_shm_region_{uuid.uuid4()}" for _ in range(3)]
    mapped, held, orphan = (Path("/dev/shm") / name for name in names)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nf = open(sys.argv[1], 'w')\n"
                               "print('open', flush=True)\ntime.sleep(300)\n", str(held)],
                              stdout=subprocess.PIPE, text=True)
    mapper = None
    try:
        assert holder.stdout.readline().strip() == "open"
        mapper = _mapping_process(mapped)
        orphan.write_bytes(b"x" * 4096)  # written an instant ago
        freed = free()
        assert str(orphan) in freed and not orphan.exists()
        assert mapped.exists() and held.exists() and str(mapped) not in freed and str(held) not in freed
    finally:
        for process in (holder, mapper):
            if process is not None:
                process.kill()
                process.wait()
    freed = free()
    assert {str(mapped), str(held)} <= set(freed) and not mapped.exists() and not held.exists()


def _mapping_process(segment: Path) -> subprocess.Popen:
    """A process that creates ``segment`` in /dev/shm and maps it until killed (an engine worker's part)."""
    code = ("import mmap, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\nos.ftruncate(fd, 1 << 20)\n"
            "region = mmap.mmap(fd, 1 << 20)\nprint('mapped', flush=True)\ntime.sleep(300)\n")
    process = subprocess.Popen([sys.executable, "-c", code, str(segment)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "mapped"
    return process


def test_a_dead_engines_worker_is_killed_and_its_segments_freed_and_one_still_mapped_waits(tmp_path):
    """The record of an engine whose stub died: its recorded worker is killed and, once it is gone, its
    segment unlinked; a recorded segment some other live process still maps is kept, with the record, and
    freed by a later start once nothing maps it."""
    from repo_manager.adapters import engines

    stub = subprocess.Popen([sys.executable, "-c", "pass"])
    stub.wait()  # a stub pid that is dead
    tag = f"trm-test-{os.getpid()}-{time.monotonic_ns()}"
    own, shared = Path(f"/dev/shm/psm_{tag}-own"), Path(f"/dev/shm/psm_{tag}-shared")
    worker, other = _mapping_process(own), _mapping_process(shared)
    registry = tmp_path / "engines"
    registry.mkdir()
    record = registry / f"{stub.pid}.json"
    start = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    record.write_text(json.dumps({"pids": [stub.pid, worker.pid], "starts": {str(worker.pid): int(start)},
                                  "segments": [str(own), str(shared)]}))
    try:
        freed = engines.free_stale_engines(registry)
        assert worker.wait(5) == -signal.SIGKILL and freed["processes"] == [worker.pid]
        assert not own.exists() and str(own) in freed["segments"]
        assert shared.exists() and record.exists()  # still mapped by a live process: kept for the next start
        other.kill()
        other.wait()
        freed = engines.free_stale_engines(registry)
        assert not shared.exists() and str(shared) in freed["segments"] and not record.exists()
    finally:
        for process in (worker, other):
            process.kill()
            process.wait()
        own.unlink(missing_ok=True)
        shared.unlink(missing_ok=True)


def test_an_operation_under_which_the_embedded_server_died_says_how_it_died(tmp_path):
    """A request to a server that died answers only "not reachable": leaving the server's block with that
    error says how tritonserver ended (here SIGKILL), from its exit status, with the end of its log."""
    from repo_manager.core.errors import ServerError

    with pytest.raises(ServerError) as raised, TritonServer(tmp_path) as server, TritonClient(server.url) as client:
        [tritonserver] = [int(p) for p in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        os.kill(tritonserver, signal.SIGKILL)
        wait_for(lambda: server.process.poll() is not None, "the server to be gone", 30)
        client.repository_index()
    assert "is not reachable" in raised.value.message and "the embedded tritonserver had died of SIGKILL" in \
        raised.value.message, raised.value.message
    assert isinstance(raised.value.__cause__, ServerError) and "died" not in raised.value.__cause__.message


STALLING_MODEL_PY = '''
import os, pathlib, signal, subprocess
import numpy as np
import triton_python_backend_utils as pb_utils

MARKER = pathlib.Path({marker!r})
MODE = {mode!r}


class TritonPythonModel:
    def execute(self, requests):
        if MODE == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "stalls once" and not MARKER.exists():
            MARKER.touch()  # the first stub of this model stops for 3 s, as a paused host stops it
            subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {{os.getpid()}}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''


@pytest.mark.parametrize("mode", ["stalls once", "dies"])
def test_a_python_stub_declared_unhealthy_is_reloaded_once_and_only_a_second_failure_fails(triton, tmp_path, mode):
    """Triton fails a request with "Stub process ... is not healthy" when the stub was stopped for a second
    (real here: SIGSTOP, resumed 3 s later) exactly as when it died (SIGKILL in execute). Verification
    reloads the model and verifies again: the stalled one passes and says why it was reloaded; the one that
    dies fails, naming both tries."""
    from repo_manager.core.errors import VerificationError
    from repo_manager.ops.verify import Candidate, verify

    (tmp_path / "model.py").write_text(STALLING_MODEL_PY.format(marker=str(tmp_path / "stalled"), mode=mode))
    config = cfg.build_config("staller", "python", [cfg.TensorSpec("X", "FP32", (2,))],
                              [cfg.TensorSpec("Y", "FP32", (2,))], True,
                              cfg.ConfigOptions(max_batch_size=4, warmup=False))
    candidate = Candidate("staller", config, {"model.py": tmp_path / "model.py"})
    samples = [{"X": np.ones((1, 2), np.float32)}]
    client = TritonClient(triton.url)
    if mode == "dies":
        with pytest.raises(VerificationError) as failed:
            verify(client, [candidate], "staller", samples, None)
        assert "is not healthy" in failed.value.message and "before trm reloaded" in failed.value.message
    else:
        report = verify(client, [candidate], "staller", samples, None)
        assert report.samples == 1 and report.outputs_checked == 1
        assert "is not healthy" in report.to_dict()["reloaded_after"]
    left = [e["name"] for e in client.repository_index() if e["name"].endswith("staller") and e.get("state") == "READY"]
    assert left == []  # every try's model unloaded


def test_a_rollout_precheck_whose_stub_stalled_on_its_smoke_request_checks_a_fresh_load_once_more(
        triton, tmp_path):
    """The rollout's pre-check (the target loaded under a temporary name, smoke-requested there) on a host that
    stalls the stub during its first request (real: SIGSTOP, resumed 3 s later): Triton fails the request
    with "Stub process ... is not healthy" (seen in CI: an agent refused a version that way and stayed
    degraded). The set is loaded afresh and checked once more, and nothing stays loaded."""
    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.ops.rollout.checks import precheck, smoke_cases

    model_py = STALLING_MODEL_PY.format(marker=str(tmp_path / "stalled"), mode="stalls once")

    def build(repo, _name: str) -> list[Staged]:
        staging = repo.stage("staller")
        (staging / "model.py").write_text(model_py)
        return [Staged("staller", staging, slow_config("staller"), {"kind": "test"})]

    run_publish(Settings(repository=tmp_path / "repo"), "staller", build, verify_model=False)
    repo = LocalRepository(tmp_path / "repo")
    client = TritonClient(triton.url)
    checked = precheck(client, repo, [("staller", 1)], "staller", smoke_cases(repo.config("staller"), None))
    assert checked >= 1 and (tmp_path / "stalled").exists()  # the stub did stall, and the check passed after
    left = [e["name"] for e in client.repository_index() if e["name"].endswith("staller") and e.get("state") == "READY"]
    assert left == []


def starve_the_stub(server: TritonServer, instance: bytes, stopped: list[int]) -> None:
    """Stop the first Python stub of ``instance`` (its command line names it: "slow_0_0") for 8 s, 1.5 s into
    its initialize(), longer than Triton's 5 s health window; record its pid in ``stopped``. Only the stub's
    starvation is simulated: the server, its wait and the stub are real."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # the instance's stub (the one that runs initialize(); an auto-complete stub comes first)
        stubs = [pid for pid, (_, program) in descendants(server.pid).items()
                 if "python_backend_stub" in program and instance in _cmdline(pid)]
        if stubs:
            time.sleep(1.5)  # inside initialize()
            start = _start_time(stubs[0])
            os.kill(stubs[0], signal.SIGSTOP)
            stopped.append(stubs[0])
            time.sleep(8)
            if start is not None and _start_time(stubs[0]) == start:
                os.kill(stubs[0], signal.SIGCONT)
            return
        time.sleep(0.05)


@contextmanager
def starving(repo: Path, instance: bytes) -> Iterator[tuple[TritonServer, TritonClient, list[int]]]:
    """A server on ``repo`` that kills a stuck stub after 2 s, and a thread that starves ``instance``'s first stub
    (``starve_the_stub``); yields (server, client, the stopped stub's pid once it is stopped). The thread is
    joined on the way out."""
    server = TritonServer(repo)
    server.engine_sweep_s, server.stuck_stub_wait_s = 0.5, 2.0
    with server, TritonClient(server.url) as client:
        stopped: list[int] = []
        starver = threading.Thread(target=starve_the_stub, args=(server, instance, stopped), daemon=True)
        starver.start()
        try:
            yield server, client, stopped
        finally:
            starver.join(30)


def test_a_stub_triton_would_wait_for_forever_is_killed_and_its_load_fails_instead_of_never_ending(tmp_path):
    """Triton 2.51 gives up on a Python stub that misses its health check while initializing, but then waits
    for it to exit, and it never does: the load never ends (seen on a saturated host beside vLLM engine
    starts). Real server, real stub, real wait; only the stub's starvation is simulated (SIGSTOP for 8 s
    during its initialize, longer than Triton's 5 s health window). The server's owner kills the stub once
    Triton has waited for it ``stuck_stub_wait_s``: the load fails with Triton's "not healthy" error, the
    server's log says what trm did and why, and the next load of the model succeeds."""
    from repo_manager.core.errors import ModelLoadError

    slow_model(tmp_path / "repo", load_s=6.0)
    with starving(tmp_path / "repo", b"slow_0_0") as (server, client, stopped):
        started = time.monotonic()
        with pytest.raises(ModelLoadError) as failed:
            client.load("slow")
        took = time.monotonic() - started
        assert "is not healthy" in failed.value.message, failed.value.message
        assert stopped and server.killed_stubs == stopped and took < 60, (took, stopped, server.killed_stubs)
        assert "trm: killed Python stub" in server.log_path.read_text()
        client.load("slow")  # the server was not left waiting
        assert client.is_model_ready("slow")


def test_a_candidate_whose_stub_stalled_while_loading_is_loaded_once_more_and_answers(tmp_path):
    """The promotion gates' load (``LoadedCandidates``) on a host that stalls a stub for longer than Triton's
    health window while it initializes: Triton fails the load with "Stub process ... is not healthy" (seen
    once in CI, in an eval gate's warm-up). The load is made once more, the model answers, the first
    failure is kept, and nothing stays loaded after."""
    from repo_manager.ops.verify import Candidate, LoadedCandidates

    (tmp_path / "model.py").write_text(SLOW_MODEL_PY.format(load_s=3.0, execute_s=0.0))
    candidate = Candidate("stalled", slow_config("stalled"), {"model.py": tmp_path / "model.py"})
    (tmp_path / "repo").mkdir()
    with starving(tmp_path / "repo", b"-stalled_0_0") as (_server, client, stopped):
        with LoadedCandidates(client, [candidate]) as loaded:
            answer = client.infer(loaded.names["stalled"], {"X": np.ones((1, 2), np.float32)})
            assert answer["Y"].tolist() == [[1.0, 1.0]]
            assert stopped and len(loaded.reloaded_after) == 1 and "is not healthy" in loaded.reloaded_after[0]
        assert not [e for e in client.repository_index() if e.get("state") == "READY"]


def test_a_python_model_with_custom_metrics_unloads_without_crashing_its_stub(tmp_path):
    """A Python model that reports custom metrics (the stand-in of trm's vllm backend: vLLM's families through
    ``pb_utils.MetricFamily``) drops them in ``finalize()``; left to the interpreter's exit, their destructors
    crashed the stub at every unload (a segfault the kernel logs; such a crash once left Triton aborting on
    its next load). The kernel's log is read for the stubs this server started: none crashed."""
    from vllm_metrics_model import write_engine_stand_in

    from repo_manager.ops.publish import publish_model

    try:
        before = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("the kernel's log cannot be read here")
    if before.returncode != 0:
        pytest.skip("the kernel's log cannot be read here (dmesg needs privileges)")
    settings = Settings(repository=tmp_path / "repo")
    publish_model(settings, write_engine_stand_in(tmp_path / "src", "chat"), "chat", verify_model=False)
    stubs: set[int] = set()
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        for _ in range(3):
            client.load("chat")
            stubs |= {pid for pid, (_, program) in descendants(server.pid).items() if "python_backend_stub" in program}
            client.unload("chat")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (client.is_model_ready("chat")
                                                   or stubs & set(descendants(server.pid))):
                time.sleep(0.2)  # the stub has exited (and crashed, or not)
    assert stubs
    earlier = set(before.stdout.splitlines())  # each line has its own timestamp; a pid may be an old one's
    log = [line for line in subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout.splitlines()
           if line not in earlier]
    crashed = [line for line in log if ("segfault" in line or "traps:" in line)
               and any(f"[{pid}]" in line for pid in stubs)]
    assert crashed == [], crashed


def _engine_series(metrics_url: str, model: str) -> dict[str, float]:
    """``vllm:num_requests_running`` of ``model`` per ``engine`` label, from the server's /metrics."""
    import urllib.request

    from repo_manager.ops.observe.top import LABEL

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            labels = dict(LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0]))
            if labels.get("model") == model:
                found[labels.get("engine", "")] = float(line.rsplit(" ", 1)[1])
    return found


def _generate(url: str, model: str) -> str:
    import urllib.request

    body = json.dumps({"text_input": "a b", "sampling_parameters": json.dumps({"max_tokens": 1})}).encode()
    request = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["text_output"]


def test_a_reload_of_an_engine_that_reports_custom_metrics_keeps_the_server_up(tmp_path):
    """A reload with a new config (what tune-batching does to an LLM) loads the new engine before the old one goes.
    With equal labels Triton gave both one Prometheus series and freed it with the old engine: the new engine's next
    update crashed tritonserver (SIGSEGV, server issue #8663). The stand-in labels its series with trm's vLLM
    backend's own ``metric_labels``: each engine its own series, the old one's gone with it, the server up."""
    from vllm_metrics_model import write_engine_stand_in

    from repo_manager.ops.publish import publish_model

    settings = Settings(repository=tmp_path / "repo")
    publish_model(settings, write_engine_stand_in(tmp_path / "src", "chat"), "chat", verify_model=False)
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        client.load("chat")
        assert _generate(server.url, "chat") == " t0"
        first = set(_engine_series(server.endpoints.metrics, "chat"))
        old = {pid for pid, (_, program) in descendants(server.pid).items() if "python_backend_stub" in program}
        assert len(first) == 1 and first <= {str(pid) for pid in old}, (first, old)
        config = cfg.read_config(settings.repository / "chat" / "config.pbtxt")
        for next_ms in ("5", "6"):  # two reloads (each a new config): the second one's old engine is the first's new
            config.parameters["next_ms"].string_value = next_ms
            client.load("chat", config)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and old & set(descendants(server.pid)):
                time.sleep(0.2)  # the old engine has gone (its finalize freed its series)
            assert not old & set(descendants(server.pid)), "the old engine did not go"
            for _ in range(3):
                assert _generate(server.url, "chat") == " t0"  # the new engine updates its series: no crash
            series = _engine_series(server.endpoints.metrics, "chat")
            assert set(series) and not set(series) & first, (series, first)  # only the new engine's series
            first = set(series)
            old = {pid for pid, (_, program) in descendants(server.pid).items() if "python_backend_stub" in program}
        assert server.process.poll() is None


def test_a_load_longer_than_the_clients_call_timeout_is_waited_for_and_one_past_the_load_timeout_says_so(triton):
    """A load answers when the model is ready, which on a busy node took a small ONNX model's stub over a
    minute: it waits up to the client's load timeout, not its 1 s call timeout here (before, a verification
    load cut off by the 60 s call timeout was reported as "Triton ... is not reachable ... timed out")."""
    from repo_manager.core.errors import ServerError

    config = cfg.build_config("slowload", "python", [cfg.TensorSpec("X", "FP32", (2,))],
                              [cfg.TensorSpec("Y", "FP32", (2,))], True,
                              cfg.ConfigOptions(max_batch_size=4, warmup=False))
    files = {"1/model.py": SLOW_MODEL_PY.format(load_s=3.0, execute_s=0.0).encode()}
    with TritonClient(triton.url, timeout_s=1.0) as client:
        started = time.monotonic()
        client.load("slowload", config, files)
        assert time.monotonic() - started >= 3.0  # a lower bound: the model's own 3 s sleep
    with TritonClient(triton.url) as client:  # (the next calls need no 1 s bound, which a busy server can miss)
        assert client.is_model_ready("slowload")
        client.unload("slowload")
    config.name = "slowload_bounded"
    with TritonClient(triton.url, timeout_s=1.0, load_timeout_s=1.0) as bounded, \
            pytest.raises(ServerError) as failed:
        bounded.load("slowload_bounded", config, files)
    assert failed.value.message.endswith("did not finish the load of slowload_bounded within 1 s")
    assert "not reachable" not in failed.value.message
    with TritonClient(triton.url) as client:
        wait_for(lambda: client.is_model_ready("slowload_bounded"), "the bounded load to finish", 30)
        client.unload("slowload_bounded")


def test_a_running_servers_owner_frees_an_engine_that_died_under_it_without_a_restart(tmp_path, monkeypatch):
    """An engine whose stub is gone while the server keeps running (an unload that did not let it clean up):
    within the sweep interval its recorded worker is killed and its segment unlinked, the server still up."""
    registry = tmp_path / "engines"
    registry.mkdir()
    monkeypatch.setenv("TRM_VLLM_ENGINE_REGISTRY", str(registry))
    (tmp_path / "repo").mkdir()
    with TritonServer(tmp_path / "repo") as server:
        server.engine_sweep_s = 0.3  # read at each wait: the sweeper started with the default picks it up next
        stub = subprocess.Popen([sys.executable, "-c", "pass"])
        stub.wait()
        segment = Path(f"/dev/shm/psm_trm-test-{os.getpid()}-{time.monotonic_ns()}")
        worker = _mapping_process(segment)
        start = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        try:
            (registry / f"{stub.pid}.json").write_text(json.dumps(
                {"pids": [stub.pid, worker.pid], "starts": {str(worker.pid): int(start)}, "segments": [str(segment)]}))
            wait_for(lambda: worker.poll() is not None and not segment.exists(), "the sweep", 30)
            assert worker.returncode == -signal.SIGKILL and not list(registry.glob("*.json"))
            assert server._process is not None and server._process.running()
        finally:
            worker.kill()
            worker.wait()
            segment.unlink(missing_ok=True)


def test_the_embedded_server_refuses_to_start_with_a_numpy_its_python_stub_cannot_read(tmp_path):
    """numpy 2 in the environment the bundled stubs run with makes every text request fail as "Stub process is not
    healthy" (measured here once an unpinned install pulled numpy 2.4.6 in). numpy 2 cannot be installed beside
    the suite's numpy 1, so the check is called with the version it would read: a one-line refusal naming the
    fix, before any process starts; the installed numpy passes it."""
    from repo_manager.adapters.triton.server import check_stub_numpy
    from repo_manager.core.errors import ServerStartError

    with pytest.raises(ServerStartError, match=r"would run with numpy 2\.4\.6, .* older than 2") as refused:
        check_stub_numpy("2.4.6")
    assert "pip install 'numpy<2'" in (refused.value.hint or "")
    check_stub_numpy()  # the suite's own numpy (setup.sh pins it below 2)
    check_stub_numpy("1.26.4")
