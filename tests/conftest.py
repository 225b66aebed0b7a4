"""Fixtures shared by the whole suite: a real tritonserver, settings in temporary folders.

Every test works in its own temporary folders; nothing touches the user's home, caches or the project's
model_repository/.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.settings import Settings

SERIAL = {
    # they measure time or throughput (SLOs, latency gates, open-loop rates, deadlines), or hold LLM engines
    # whose timing they assert: run one at a time, never beside another test (scripts/test.sh)
    "test_agent_http.py", "test_completion_store.py", "test_llm_loadgen.py", "test_loadgen.py", "test_overload.py",
    "test_promote.py", "test_promote_llm.py", "test_restricted_api.py", "test_tuning.py",
    # the walkthrough verifies MiniLM's Python-based models on a server of its own: beside a vLLM engine's start
    # (test_vllm_rollout.py, two at a time) a stub missed Triton's health check while initializing (docs/local-s3.md)
    "test_local_s3.py",
}


LONGEST_FIRST = ("test_vllm_rollout.py", "test_vllm.py", "test_agent.py", "test_huggingface.py", "test_rollout.py",
                 "test_processes.py")
"""The modules that take longest two at a time (minutes each), started first: scripts/test.sh hands modules to
its two workers in collection order (``--no-loadscope-reorder``), and the longest one started last kept one
worker busy for minutes after the other had finished."""

ENGINES = {"test_vllm_rollout.py", "test_vllm.py"}
"""The modules that start real vLLM engines (minutes of them): one worker runs them, one after the other, while
the other worker runs the rest; two engines starting beside each other (test_vllm.py run beside
test_vllm_rollout.py) made a test of one of them fail once."""


ENGINE_NICENESS = 10
"""How much lower the engine modules run, two at a time: what they start (tritonserver, its Python stubs, vLLM's
engine processes, which keep both cores busy while they start and generate) yields the CPU to the other worker's.

Why: Triton's Python backend gives a starting stub one second to answer its initialization or show it is alive
(``StubLauncher::ReceiveMessageFromStub``); past that it fails the load and frees the initialization message, and
the stub, reading it late, crashes on a handle that points nowhere (the kernel's ``trap stack segment`` in
``triton_python_backend_stub``), after which tritonserver aborts in ``TRITONBACKEND_ModelInstanceFinalize``
(``boost::interprocess::lock_exception``). Every such crash came while the other worker ran vLLM engines.

The worker's niceness is inherited by everything it starts, and trm gives it to the scheduling group of each
process it starts in a session of its own (``adapters/process.py``: Linux autogroups)."""


@pytest.fixture(scope="module", autouse=True)
def _engines_yield_the_cpu(request):
    """The engine modules, run beside another worker, run at ``ENGINE_NICENESS``; the worker's niceness is set
    back afterwards where this user may (root), else the rest of its modules run lower too."""
    if Path(str(request.path)).name not in ENGINES or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.nice(ENGINE_NICENESS)
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except PermissionError:
            pass


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: none without it (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the modules of ``ENGINES`` as one unit: a worker runs them one after the other.
    (pytest-xdist's ``loadgroup`` would do it with marks, but under pytest 9 its groups are ignored: it renames
    ``item._nodeid``, which pytest 9's node ids no longer read.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModulesAndEngines(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "vLLM engine modules" if Path(module).name in ENGINES else module

    return ModulesAndEngines(config, log)


def pytest_collection_modifyitems(items):
    """Tiers: ``fast`` for a test that starts no server (a developer's every change:
    ``pytest -m fast``); ``serial`` for the modules above; the rest may run two at a time (a module, or the
    engine modules together, to a worker), the longest modules first."""
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)
        if item.path.name in FAST:
            item.add_marker(pytest.mark.fast)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


FAST = {"test_bad_arguments.py", "test_config.py", "test_credentials.py", "test_drain_wait.py",
        "test_hostile_documents.py", "test_layers.py",
        "test_llm_plan.py", "test_mistyped_names.py", "test_path_safety.py", "test_settings.py",
        "test_quality_figures.py", "test_tuning_choice.py", "test_vllm_text.py"}
"""Modules whose tests start no server (``-m fast``: about a minute on this machine)."""


try:  # property tests: the same examples on every run, and no deadline a busy machine could miss
    from hypothesis import settings as _hypothesis

    _hypothesis.register_profile("trm", deadline=None, derandomize=True, database=None)
    _hypothesis.load_profile("trm")
except ImportError:  # hypothesis is a test extra; the modules that use it need it anyway
    pass


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory):
    """HOME, the XDG folders, Hugging Face's cache and the AWS config files point into the session's
    temporary folder for every test (and every process a test starts): nothing reads or writes the
    developer's home. One folder for the session, so caches built once (trm's examples, vLLM's compiled
    kernels, matplotlib's fonts) are reused by the tests after the first."""
    home = tmp_path_factory.mktemp("home")
    values = {"HOME": home, "XDG_CACHE_HOME": home / ".cache", "XDG_CONFIG_HOME": home / ".config",
              "XDG_DATA_HOME": home / ".local" / "share", "XDG_STATE_HOME": home / ".local" / "state",
              "HF_HOME": home / ".cache" / "huggingface", "AWS_CONFIG_FILE": home / ".aws" / "config",
              "AWS_SHARED_CREDENTIALS_FILE": home / ".aws" / "credentials",
              # a Python process that crashes (a Triton stub, a vLLM engine) prints its threads' tracebacks: in the
              # server's log, which a failed test whose server died shows
              "PYTHONFAULTHANDLER": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in values.items():
            patch.setenv(key, str(value))
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            patch.delenv(key, raising=False)
        yield home


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No settings file, no TRM_* variables from the developer's shell."""
    for key in list(os.environ):
        if key.startswith("TRM_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""The tritonservers the tests started and have not stopped."""
_DEATHS: list[str] = []
"""The deaths seen since the last test report: how each server that died by itself ended, and its log's end."""
_STOPPED_LOGS: list[str] = []
"""The last lines of the logs of the servers stopped since the last test report (a stop removes the log)."""
_STOPPED_FATAL: list[str] = []
"""The crash lines (``FATAL_IN_LOG``) in the logs of the servers stopped since the last test report."""
LOG_LINES = 40


SERVER_SIGNAL = re.compile(r"Signal \((?:4|6|7|8|11)\) received")
"""Triton's signal handler, for a crash of the server itself (it prints a backtrace, and may then hang instead of
exiting: the server looks alive and answers nothing)."""
FATAL_IN_LOG = re.compile(SERVER_SIGNAL.pattern + r"|terminate called after throwing|"
                          r"Fatal Python error: (?!_enter_buffered_busy)")
"""What a server's log holds once it or one of its Python stubs or engines (faulthandler: ``Fatal Python error``;
not the lock of a buffered stream at an interpreter's normal exit) crashed. No test causes one on purpose: their
kills are SIGKILL, SIGTERM and SIGSTOP."""

KERNEL_CRASH = re.compile(r"^\[\s*(\d+\.\d+)\]\s.*(?:traps: triton|triton\S*\[\d+\].*segfault|"
                          r"general protection.*triton|Killed process \d+ \(triton)")
"""The kernel's line for a Triton process (the server, a Python stub: ``triton_python_b``) killed by a fault or by
the out-of-memory killer, with its time since boot."""


def _kernel_lines() -> list[str]:
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, errors="replace",
                              timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError, ValueError):
        return []  # unreadable here: the servers' own logs still tell


def _kernel_crashes_since(kernel: list[str], started: float) -> list[str]:
    """The lines of ``kernel`` (``_kernel_lines()``) of Triton processes that crashed since ``started``
    (``time.monotonic()``, the clock of the kernel's timestamps; a second's slack). On either worker: a stub of the
    other worker's server counts too, which at worst runs a failed test once more."""
    return [line for line in kernel if (match := KERNEL_CRASH.match(line)) and float(match.group(1)) >= started - 1.0]


def _log_size(server: TritonServer) -> int:
    try:
        return server.log_path.stat().st_size if server.log_path else 0
    except OSError:
        return 0


def _fatal_lines(server: TritonServer, since: int = 0, *, signal_anywhere: bool = True) -> list[str]:
    """The lines of a server's log after byte ``since`` that say it or one of its Python processes crashed
    (``FATAL_IN_LOG``: a stub Triton restarted before is no reason to doubt the tests after it), and with
    ``signal_anywhere`` the server's own crash (``SERVER_SIGNAL``) before it too: the server is unusable since."""
    try:
        if not server.log_path or not server.log_path.exists():
            return []
        with open(server.log_path, "rb") as handle:
            before = handle.read(since) if signal_anywhere else b""
            handle.seek(since)
            after = handle.read()
    except OSError:
        return []
    crashed = [line.strip() for line in before.decode(errors="replace").splitlines() if SERVER_SIGNAL.search(line)]
    since_then = [line.strip() for line in after.decode(errors="replace").splitlines() if FATAL_IN_LOG.search(line)]
    return list(dict.fromkeys(crashed + since_then))[:5]


def _death_report(server: TritonServer, kernel_lines: Callable[[], list[str]]) -> str | None:
    death = server.death()
    if death is None:
        return None
    kernel = "\n".join(line for line in kernel_lines()[-400:] if "triton" in line)[-3000:]
    return (f"tritonserver at {server.url} {death.split(';')[0]}\n--- its log's last lines ---\n"
            f"{server.log_tail(60)}\n--- the kernel's lines naming triton ---\n{kernel or '(none, or unreadable)'}")


def _note_death(server: TritonServer, kernel_lines: Callable[[], list[str]] = _kernel_lines) -> None:
    """A server's death, noted once (``server._death``) and reported with the phase that saw it."""
    if getattr(server, "_death", None) is None and (report := _death_report(server, kernel_lines)):
        server._death = report
        _DEATHS.append(report)


@pytest.fixture(scope="session", autouse=True)
def _server_deaths_are_reported():
    """A test that fails because its tritonserver died says how it died and what its log said last: a
    test's stop removes the log with the server's folder, and the client only sees a closed connection."""
    started, stop = TritonServer.start, TritonServer.stop

    def start_and_track(self, *args, **kwargs):
        self._death = None
        _LIVE.add(self)
        _SETUP_LOG_SIZES.pop(id(self), None)  # a start makes a new log: all its lines are the running test's
        return started(self, *args, **kwargs)

    def stop_and_note(self, *args, **kwargs):
        _note_death(self)
        _LIVE.discard(self)
        # before the stop removes the log; what it wrote before this test was judged by the tests before
        if lines := _fatal_lines(self, _SETUP_LOG_SIZES.get(id(self), 0), signal_anywhere=False):
            _STOPPED_FATAL.append(f"tritonserver at {self.url}, stopped, had logged a crash:\n" + "\n".join(lines))
        try:
            _STOPPED_LOGS.append(f"tritonserver at {self.url}, stopped:\n{self.log_tail(LOG_LINES)}")
        except Exception:  # noqa: BLE001 - a server that never started has no log: nothing to keep
            pass
        return stop(self, *args, **kwargs)

    TritonServer.start, TritonServer.stop = start_and_track, stop_and_note
    yield
    TritonServer.start, TritonServer.stop = started, stop


FAILURES_FILE = os.environ.get("TEST_FAILURES_FILE")
"""Where scripts/test.sh has each failed test written, as ``crash <node id>`` when a Triton process crashed
(see ``_crashes``), else ``fail <node id>``: a pass whose failures all came with a crash runs them once more,
and says so."""


_SETUP_LOG_SIZES: dict[int, int] = {}
"""The size of each live server's log when the running test was set up (``id(server)``: the lines after it are
this test's; a server started during the test has all its lines from it)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._started = time.monotonic()  # the kernel lines after it are this test's
    _SETUP_LOG_SIZES.clear()  # and the log lines after these
    _SETUP_LOG_SIZES.update({id(server): _log_size(server) for server in list(_LIVE)})


def _crashes(item, kernel_lines: Callable[[], list[str]]) -> list[str]:
    """Why a failed test's servers cannot be trusted, one text per crash: a server that died during this test;
    one that died earlier, not by a SIGKILL (a test's own kill), and is still held by a fixture (a module's
    server that crashed under one test fails the next ones); a running server whose log says it or one of its
    Python processes crashed (Triton's signal handler can hang after printing, so it still looks alive); a
    Triton process the kernel killed during this test (a Python stub's fault leaves its server running)."""
    held = [server._death for server in list(_LIVE) if server._death is not None
            and not (server.death() or "").startswith("died of SIGKILL")]
    fatal = [f"tritonserver at {server.url}, still running, logged a crash:\n" + "\n".join(lines)
             for server in list(_LIVE)
             if server.death() is None and (lines := _fatal_lines(server, _SETUP_LOG_SIZES.get(id(server), 0)))]
    fatal += _STOPPED_FATAL  # a hung one the test then stopped, say
    kernel = _kernel_crashes_since(kernel_lines(), getattr(item, "_started", time.monotonic()))
    if kernel:
        fatal.append("the kernel killed a Triton process during this test:\n" + "\n".join(kernel[-5:]))
    return list(dict.fromkeys(_DEATHS + held + fatal))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    kernel_lines = functools.cache(_kernel_lines)  # dmesg read at most once per report
    for server in list(_LIVE):  # stopped already (noted then), or still held by a fixture
        _note_death(server, kernel_lines)
    if report.failed:
        deaths = _crashes(item, kernel_lines)
        for text in deaths:
            report.sections.append(("Triton crashed", text))
        # the servers this failure may involve: those still running, and those stopped during it
        for server in list(_LIVE):
            try:
                report.sections.append(("tritonserver log", f"tritonserver at {server.url}, running:\n"
                                                            f"{server.log_tail(LOG_LINES)}"))
            except Exception:  # noqa: BLE001 - a log that cannot be read adds no section
                pass
        for text in _STOPPED_LOGS:
            report.sections.append(("tritonserver log", text))
        if FAILURES_FILE:
            with open(FAILURES_FILE, "a", encoding="utf-8") as handle:
                handle.write(f"{'crash' if deaths else 'fail'} {item.nodeid}\n")
    _DEATHS.clear()
    _STOPPED_LOGS.clear()
    _STOPPED_FATAL.clear()


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> TritonServer:
    """One real tritonserver for the session, on an empty scratch repository (explicit mode).

    Verification loads candidates through the load API with file overrides, so tests can share it.
    """
    scratch = tmp_path_factory.mktemp("scratch-repo")
    with TritonServer(scratch) as server:
        yield server


@pytest.fixture
def settings(tmp_path, triton) -> Settings:
    """Settings on a fresh repository, verifying on the session server."""
    return Settings(repository=tmp_path / "repo", triton_url=triton.url)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real SeaweedFS S3 server for the session, on free ports, bound to 127.0.0.1."""
    from seaweed import SeaweedServer

    with SeaweedServer(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """The AWS chain pointed at the session SeaweedFS (keys, region, endpoint), for this test only."""
    for key, value in seaweed.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    return seaweed


@pytest.fixture
def s3_location(s3_env, request):
    """A fresh prefix in the session bucket for one test."""
    import uuid

    from seaweed import BUCKET

    return f"s3://{BUCKET}/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
