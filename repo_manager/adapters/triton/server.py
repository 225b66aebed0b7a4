"""The one Triton launcher: find a ``tritonserver`` binary and run it as a context manager.

Binary lookup order: the ``tritonserver`` setting (option ``--tritonserver`` or ``$TRM_TRITONSERVER``),
then ``tritonserver`` on $PATH (the NGC container's), then the one bundled in the ``nvidia-pytriton``
wheel. For the bundled binary trm assembles a backend folder per server: the python backend with the
stub for the running Python, and trm's Python-based ``onnxruntime`` backend, so configs written for the
official onnxruntime backend load unchanged. A server from $PATH keeps its own backends.

The server always runs in explicit model-control mode (never polling, which can read half-written
folders), as a ``repo_manager.adapters.process.ManagedProcess``: in a new process session, killed by the kernel
if trm dies (its Python stubs notice their parent is gone and exit within a second), with its log in a
file whose tail goes into any start-up error. Stopping drains first (every model unloaded, so in-flight
requests finish and nothing else holds the server), then SIGTERM (Triton's short exit timeout only
covers idle connections by then), then SIGKILL.

With a restricted-API key (``api_key``, else the command's: ``restricted.current()``) the server answers
its control groups (``restricted.RESTRICTED_APIS``: load, unload, index, shared memory, statistics, trace,
logging) only to requests carrying the key; trm's own calls to it (readiness, drain) carry it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from repo_manager.adapters.engines import (
    REGISTRY_ENV,
    alive,
    free_stale_engines,
    has_dead_engine,
    registry_dir,
    start_ticks,
    stubs_waited_for,
)
from repo_manager.adapters.process import ManagedProcess
from repo_manager.adapters.triton import restricted
from repo_manager.adapters.triton.restricted import ApiKey
from repo_manager.core.errors import ServerError, ServerStartError, TrmError

BACKENDS_SRC = Path(__file__).parent / "backends"


@dataclass(frozen=True)
class TritonBinary:
    path: Path
    bundled: bool
    """True for the nvidia-pytriton binary, which needs trm's assembled backend folder."""

    @property
    def lib_dir(self) -> Path | None:
        if not self.bundled:
            return None
        return self.path.parent.parent.parent.parent / "nvidia_pytriton.libs"


def find_tritonserver(explicit: str | None = None) -> TritonBinary:
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ServerStartError(f"tritonserver binary {explicit} does not exist or is not executable",
                                   hint="fix --tritonserver / $TRM_TRITONSERVER")
        return TritonBinary(path, bundled="pytriton" in path.parts)
    on_path = shutil.which("tritonserver")
    if on_path and "pytriton" not in Path(on_path).parts:
        return TritonBinary(Path(on_path), bundled=False)
    try:
        import pytriton  # noqa: PLC0415 - optional until needed
    except ImportError as exc:
        raise ServerStartError(
            "no tritonserver binary found",
            hint="pip install nvidia-pytriton (bundles tritonserver), use the NGC tritonserver container, "
                 "or pass --tritonserver PATH") from exc
    bundled = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
    if not bundled.is_file():
        raise ServerStartError(f"nvidia-pytriton is installed but {bundled} is missing",
                               hint="reinstall nvidia-pytriton")
    return TritonBinary(bundled, bundled=True)


def assemble_backends(binary: TritonBinary, target: Path) -> Path:
    """A backend folder for the bundled server: python backend + stub, and trm's Python-based backends."""
    root = binary.path.parent.parent
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    # Copies, not symlinks: Triton refuses a backend library whose real path escapes the backend folder.
    for item in (root / "backends" / "python").iterdir():
        if item.is_file():
            shutil.copy2(item, python_dir / item.name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerStartError(f"the bundled tritonserver has no python backend stub for Python {version}")
    shutil.copy2(stub, python_dir / stub.name)
    for backend in BACKENDS_SRC.iterdir():
        if (backend / "model.py").is_file():
            shutil.copytree(backend, target / backend.name, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def port_is_free(port: int, address: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_BELOW = 12000
"""How far below the kernel's ephemeral range ``free_ports`` looks (20768-32767 with Linux's default range)."""


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out as the local end of outgoing connections (and to ``bind`` on port 0)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_ports(count: int, address: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now, for servers that bind them a while later (Triton binds its endpoints
    after its models load). They come from just below the kernel's ephemeral range, never from it: there, any
    outgoing connection made meanwhile (an S3 client, a health probe) can take the port as its own local end,
    and the server then fails to start on a port that was free when it was picked. All sockets are held open
    together so that no port is picked twice; a port with a connection lingering in TIME_WAIT is not picked."""
    low, _ = ephemeral_port_range()
    pool = range(max(1024, low - LISTEN_PORTS_BELOW), low)
    sockets: list[socket.socket] = []
    try:
        for port in random.sample(pool, min(len(pool), 64 * count)) if len(pool) >= count else []:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((address, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
            if len(sockets) == count:
                break
        while len(sockets) < count:  # a range with no room below it (or taken): whatever the kernel gives
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((address, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class Endpoints:
    http: str
    grpc: str
    metrics: str

    def to_dict(self) -> dict[str, str]:
        return {"http": self.http, "grpc": self.grpc, "metrics": self.metrics}


WORKDIR_PREFIX, OWNER_FILE = "trm-triton-", "owner"
"""A server's working folder (its backends and log) in the temporary folder, and the file in it that names
the process that owns the server (pid and start time)."""


def free_dead_workdirs(folder: Path | None = None) -> list[str]:
    """Remove the working folders of servers whose owner died without stopping them (a SIGKILLed trm: its
    server went with it, its folder stayed, 3 MB each). Only folders of this user with an owner file that
    names a process that is gone (the same pid with another start time is another process)."""
    removed = []
    for path in (folder or Path(tempfile.gettempdir())).glob(f"{WORKDIR_PREFIX}*"):
        try:
            if path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            pid, _, start = (path / OWNER_FILE).read_text().strip().partition(" ")
            if not start or alive(int(pid), int(start)):
                continue  # its owner is running (or could not be told apart from a new process)
        except (OSError, ValueError):
            continue  # no owner file (being created, or not trm's): left alone
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


ENGINE_SWEEP_S = 10.0
"""How often a running server's owner looks for a vLLM engine whose stub died under it without its cleanup (a
crash, or a stub ended before its finalize ran) and frees what it left: its processes and its /dev/shm
segments (160 + 240 MB for the tests' small engine), within this interval instead of at the server's next
start or stop."""


STUCK_STUB_WAIT_S = 60.0
"""How long a running server's owner lets Triton wait for a Python stub to exit while the stub still runs
(``engines.stubs_waited_for``) before it kills the stub: the load that waited then fails with Triton's "stub
process is not healthy" (a verification loads once more) instead of never ending. A stub told to finalize
exits within seconds, a vLLM engine's within about 15."""


def check_stub_numpy(version: str | None = None) -> None:
    """ServerStartError when the Python stubs of the bundled tritonserver would run with numpy 2 or later (they
    run with this interpreter's packages): the python backend bundled with Triton 2.51 then misreads every
    string tensor and its stub dies on the first text request, which Triton reports only as "Stub process ...
    is not healthy" (measured: a text service's tokenizer, after an unpinned install pulled numpy 2.4.6 in)."""
    version = version or metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        raise ServerStartError(f"the embedded tritonserver's Python models would run with numpy {version}, and "
                               "the python backend bundled with Triton 2.51 reads string tensors only with numpy "
                               "older than 2 (every text request would fail)",
                               hint="pip install 'numpy<2' into this environment (bash scripts/setup.sh restores "
                                    "the pinned versions)")


class TritonServer:
    """A real tritonserver process. Use as ``with TritonServer(repo) as server: server.url``.

    Ports set to 0 are chosen free. ``models`` are loaded at start-up (explicit mode). ``drain_timeout_s``
    bounds how long a stop waits for in-flight requests; ``exit_timeout_s`` is Triton's own exit timeout.
    """

    def __init__(self, repository: str | Path | list[str | Path], *, binary: str | None = None,
                 http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 address: str = "127.0.0.1", models: list[str] | tuple[str, ...] = (),
                 start_timeout_s: float = 120.0, log_verbose: int = 0,
                 extra_args: list[str] | tuple[str, ...] = (), drain_timeout_s: float = 30.0,
                 exit_timeout_s: int = 3, api_key: ApiKey | None = None) -> None:
        repos = repository if isinstance(repository, list) else [repository]
        self.repositories = [Path(r).resolve() for r in repos]
        self.binary = find_tritonserver(binary)
        self.address = address
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.models = list(models)
        self.start_timeout_s = start_timeout_s
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args)
        self.drain_timeout_s = drain_timeout_s
        self.exit_timeout_s = exit_timeout_s
        self.api_key = api_key or restricted.current()
        self._process: ManagedProcess | None = None
        self._workdir: Path | None = None
        self.log_path: Path | None = None
        self.engine_sweep_s = ENGINE_SWEEP_S
        self.stuck_stub_wait_s = STUCK_STUB_WAIT_S
        self.killed_stubs: list[int] = []
        """Stubs killed because Triton waited for them past ``stuck_stub_wait_s``."""
        self._registry = registry_dir()
        self._sweeper: threading.Thread | None = None
        self._sweeper_stop = threading.Event()

    # ------------------------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        return f"http://{self._client_host}:{self.ports['http']}"

    @property
    def endpoints(self) -> Endpoints:
        host = self._client_host
        return Endpoints(f"http://{host}:{self.ports['http']}", f"{host}:{self.ports['grpc']}",
                         f"http://{host}:{self.ports['metrics']}/metrics")

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def process(self) -> subprocess.Popen | None:
        return self._process.process if self._process else None

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # ---------------------------------------------------------------------------------- control
    def command(self) -> list[str]:
        cmd = [str(self.binary.path)]
        cmd += [f"--model-repository={r}" for r in self.repositories]
        cmd += ["--model-control-mode=explicit", "--strict-readiness=false",
                f"--exit-timeout-secs={self.exit_timeout_s}",
                f"--http-address={self.address}", f"--grpc-address={self.address}",
                f"--metrics-address={self.address}",
                f"--http-port={self.ports['http']}", f"--grpc-port={self.ports['grpc']}",
                f"--metrics-port={self.ports['metrics']}", f"--log-verbose={self.log_verbose}",
                # p50/p99 per model for `trm top` and the alert rules (Triton 2.51 has latency summaries;
                # its histograms cover only decoupled models' first response)
                "--metrics-config=summary_latencies=true"]
        if self._workdir and self.binary.bundled:
            cmd.append(f"--backend-directory={self._workdir / 'backends'}")
        cmd += [f"--load-model={m}" for m in self.models]
        if self.api_key is not None:
            cmd += self.api_key.server_args()
        return cmd + self.extra_args

    @property
    def restricted_apis(self) -> tuple[str, ...]:
        """The API groups that need the key on this server (none without one)."""
        return restricted.RESTRICTED_APIS if self.api_key is not None else ()

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Python models run in stubs that import numpy/onnxruntime: put this interpreter's env first.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # The stub's libpython is not this interpreter's: extension modules of the standard library (_ssl)
        # need symbols of this one (`undefined symbol _PyModule_Add`), found through its LIBDIR.
        libdir = sysconfig.get_config_var("LIBDIR")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [str(self.binary.lib_dir) if self.binary.lib_dir else "", libdir or "",
                        env.get("LD_LIBRARY_PATH", "")] if p)
        # The stub starts its interpreter in the C locale, where Python reads files as ASCII (vLLM's imports
        # fail with UnicodeDecodeError): a UTF-8 character type unless the user chose one.
        if env.get("LC_ALL", "") in ("", "C", "POSIX") and env.get("LC_CTYPE", "") in ("", "C", "POSIX"):
            env.pop("LC_ALL", None)
            env["LC_CTYPE"] = "C.UTF-8"
        env[REGISTRY_ENV] = str(self._registry)
        return env

    def start(self) -> TritonServer:
        for repo in self.repositories:
            if not repo.is_dir():
                raise ServerStartError(f"model repository {repo} does not exist",
                                       hint="create it, or publish a model into it first")
        wanted = [kind for kind, port in self.ports.items() if port == 0]
        for kind, port in zip(wanted, free_ports(len(wanted), self._client_host)):
            self.ports[kind] = port
        if self.binary.bundled:
            check_stub_numpy()
        for kind, port in self.ports.items():
            if kind not in wanted and not port_is_free(port, self.address):
                raise ServerStartError(f"{kind} port {port} is already in use",
                                       hint=f"stop what uses it, or pass --{kind}-port with a free port",
                                       port=port)
        self._registry = registry_dir()  # this server's engines record themselves there, whatever changes later
        free_stale_engines(self._registry)  # what an engine killed with an earlier server left (processes, /dev/shm)
        free_dead_workdirs()
        self._workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        (self._workdir / OWNER_FILE).write_text(f"{os.getpid()} {start_ticks(os.getpid()) or ''}\n")
        try:
            if self.binary.bundled:
                assemble_backends(self.binary, self._workdir / "backends")
            self.log_path = self._workdir / "tritonserver.log"
            self._process = ManagedProcess(self.command(), log_path=self.log_path, env=self._environment())
            self._process.start()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self._sweeper_stop.clear()
        self._sweeper = threading.Thread(target=self._sweep_engines, name="trm-engine-sweeper", daemon=True)
        self._sweeper.start()
        return self

    def _sweep_engines(self) -> None:
        """While the server runs: free what an engine that died under it left (see ``ENGINE_SWEEP_S``), and
        end a wait for a stub that will never exit (``STUCK_STUB_WAIT_S``)."""
        waited: dict[tuple[int, int], float] = {}
        while not self._sweeper_stop.wait(self.engine_sweep_s):
            try:
                if has_dead_engine(self._registry):
                    free_stale_engines(self._registry)
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next one and at stop
                pass
            try:
                waited = self._end_stuck_stub_waits(waited)
            except Exception:  # noqa: BLE001 - as above: the next sweep looks again
                continue

    def _end_stuck_stub_waits(self, waited: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
        """Kill a stub Triton has waited on for ``stuck_stub_wait_s`` while it runs; the waits seen now, and
        since when (a wait is judged only once a later sweep still sees it)."""
        process = self._process
        if process is None or process.pid is None:
            return {}
        now = time.monotonic()
        seen = {key: waited.get(key, now) for key in stubs_waited_for(process.pid).items()}
        for (pid, start), since in seen.items():
            if now - since >= self.stuck_stub_wait_s and alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
                self.killed_stubs.append(pid)
                self._note(f"trm: killed Python stub {pid}: Triton waited {now - since:.0f} s for it to exit "
                           "while it ran (it had missed its health check while initializing); the load that "
                           "waited fails instead of never ending")
        return seen

    def _note(self, line: str) -> None:
        """A line of trm's own in the server's log, where whoever reads that log looks."""
        if self.log_path is not None:
            try:
                with open(self.log_path, "a", encoding="utf-8") as handle:
                    handle.write(line + "\n")
            except OSError:
                pass

    def _wait_ready(self) -> None:
        from repo_manager.adapters.triton.client import TritonClient  # noqa: PLC0415 - tritonclient's libraries only when asked

        # closed on the way out: an open keep-alive connection holds tritonserver's shutdown
        with TritonClient(self.url, timeout_s=2.0, api_key=self.api_key) as client:
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline:
                assert self._process is not None
                if not self._process.running():
                    raise ServerStartError(
                        f"tritonserver exited with code {self._process.returncode} during start-up:\n"
                        f"{self.log_tail()}", log=self.log_path)
                if client.is_ready():
                    return
                time.sleep(0.2)
        raise ServerStartError(f"tritonserver was not ready after {self.start_timeout_s:.0f} s:\n"
                               f"{self.log_tail()}", log=self.log_path)

    def drain(self, timeout_s: float | None = None) -> None:
        """Unload every model and wait until their in-flight requests are done (at most ``timeout_s``).

        Triton's own SIGTERM path first waits for every open HTTP connection to close, idle keep-alive
        ones included, for its whole exit timeout, and then gives loaded models no time at all. Unloading
        first waits exactly for in-flight requests (Triton frees a model when its last request is done);
        new requests are refused meanwhile (an ensemble's in-flight requests finish too: tested). Models
        still loading are left to the exit timeout.
        """
        from repo_manager.adapters.triton.client import TritonClient  # noqa: PLC0415 - tritonclient's libraries only when asked

        if self._process is None or not self._process.running():
            return
        deadline = time.monotonic() + (self.drain_timeout_s if timeout_s is None else timeout_s)
        try:
            with TritonClient(self.url, timeout_s=5.0, api_key=self.api_key) as client:
                ready = {e["name"] for e in client.repository_index() if e.get("state") == "READY"}
                for model in sorted(ready):
                    client.unload(model)
                client.wait_unloaded(lambda e: e.get("name") in ready, deadline - time.monotonic(), poll_s=0.1)
        except TrmError:
            pass  # not answering: the stop signal and SIGKILL remain

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Drain (in-flight requests finish), SIGTERM, wait for Triton's exit, then SIGKILL.

        Returns the exit code. ``timeout_s`` bounds the drain (default ``drain_timeout_s``).
        """
        code = None
        self._sweeper_stop.set()
        if self._process is not None:
            self.drain(timeout_s)
            # Triton ends at its exit timeout, but a model still loading can hold it: SIGKILL after a margin
            code = self._process.stop(timeout_s=self.exit_timeout_s + 5.0)
            self._process = None
            free_stale_engines(self._registry)  # what its vLLM engines left in /dev/shm
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return code

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        death = self.death() if isinstance(exc, TrmError) else None
        self.stop()
        if death is not None and isinstance(exc, TrmError):
            # "not reachable" from the client says nothing of why: the server itself died under the operation
            raise ServerError(f"{exc.message} (the embedded tritonserver had {death})",
                              hint="run it again; if the server dies again, its log lines above say what it "
                              "was doing", report=exc.report, **exc.facts) from exc

    def death(self) -> str | None:
        """How a server trm started ended by itself (``exited with code 1`` / ``died of SIGSEGV``, and the
        last lines of its log), or None while it runs or after trm stopped it."""
        if self._process is None or self._process.running() or self._process.returncode is None:
            return None
        code = self._process.returncode
        try:
            how = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        except ValueError:
            how = f"exited with code {code}"
        tail = " | ".join(line.strip() for line in self.log_tail(4).splitlines() if line.strip())
        return f"{how}; its log ends: {tail}" if tail else how

