"""Child processes that cannot outlive trm, and trm's own ending on a signal.

Every long-running process trm starts (tritonserver, a TensorRT-LLM engine build; SeaweedFS in the tests)
goes through ``ManagedProcess``, and every short one (an operator's drain/restore/eval command, nvidia-smi)
through ``run_command``, which uses it:

* it runs in a new session (a Ctrl-C in the terminal reaches trm only, which then stops it in order),
  with its output in a log file whose tail goes into errors, and at trm's niceness (``nice trm ...``);
* the kernel sends it a **parent-death signal** (``PR_SET_PDEATHSIG``, SIGKILL by default) when trm
  dies without cleaning up (SIGKILL, a crash). Linux sends that signal when the *thread* that forked the
  child exits, so children are always forked by a thread that lives as long as trm: the main thread, or
  one long-lived launcher thread when the caller is another thread;
* ``stop()`` sends the stop signal to the command (through the group reaper below), waits, then SIGKILLs
  the group, and returns once none of the group's processes runs (what comes after a stop, such as freeing
  the shared memory they mapped, does not find one still being torn down).

``terminate_on_signals()`` (installed by ``cli.main``) turns SIGTERM and SIGHUP into ``Terminated``, a
``SystemExit``, so every ``finally`` and context manager on the way out runs: servers are stopped and
staging folders removed, as for Ctrl-C. A second signal during that cleanup is ignored (the cleanup is
bounded by timeouts); a SIGKILL is covered by the parent-death signal.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, NamedTuple


class Terminated(SystemExit):
    """trm was asked to stop by a signal (exit code 128 + signal number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class _Launcher:
    """One thread that lives as long as trm and forks children for callers on other threads."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, function: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="trm-process-launcher", daemon=True)
                self._thread.start()
        done: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put((function, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            function, done = self._jobs.get()
            try:
                done.put((True, function()))
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                done.put((False, exc))


_launcher = _Launcher()


# The group reaper: the process trm forks, in a new session whose group it leads. The parent-death signal
# (SIGUSR2) is armed on it; on that signal it kills its whole process group, so the command *and every
# process the command started* die with trm (a tritonserver's Python stubs are its children: a death signal
# on tritonserver alone left a stub behind when trm was killed while a model was loading). Otherwise it
# waits for the command and exits as it did, passing SIGTERM/SIGINT/SIGHUP on to it (``stop()`` and a user's
# `kill PID` stop the command gracefully; what it leaves in the group is killed after it exits, by the
# reaper itself, so that a command that dies alone, even by SIGKILL, takes its helpers with it: a SIGKILLed
# tritonserver left vLLM's engine processes running).
_GROUP_REAPER = """
import errno, os, signal, sys, time
death, parent, niceness, command = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def reap(*_):
    os.killpg(0, death)
    os._exit(128 + death)
signal.signal(signal.SIGUSR2, reap)
try:  # the parent-death signal, armed here rather than between fork and exec (see spawn)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR2), 0, 0, 0)  # PR_SET_PDEATHSIG
except (ImportError, OSError, AttributeError):
    pass  # not Linux, no ctypes: the cleanup paths only
for _ in range(5 if niceness > 0 else 0):  # this session as a whole runs at trm's niceness (see spawn)
    try:
        with open("/proc/self/autogroup", "w") as handle:
            handle.write(str(niceness))
        break
    except OSError as exc:  # unprivileged, Linux takes one such write per 100 ms machine-wide (EAGAIN)
        if exc.errno != errno.EAGAIN:
            break  # a kernel without autogroups: the inherited niceness is all there is
        time.sleep(0.1)
STOPS, pending, child = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP), [], []
def forward(signum, _frame):
    if child:
        os.kill(child[0], signum)
    else:
        pending.append(signum)
for s in STOPS:
    signal.signal(s, forward)
if os.getppid() != parent:
    reap()
pid = os.fork()
if pid == 0:
    for s in (signal.SIGUSR2, *STOPS):
        signal.signal(s, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        os.write(2, ("cannot start %s: %s\\n" % (command[0], exc)).encode())
        os._exit(127)
child.append(pid)
for signum in pending:
    os.kill(pid, signum)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
group, me = os.getpgrp(), os.getpid()
for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    try:
        with open("/proc/" + entry + "/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        if entry.isdigit() and int(entry) != me and int(fields[2]) == group:
            os.kill(int(entry), signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        pass
if code < 0:
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL, SIGSTOP: cannot be caught anyway
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def spawn(command: Sequence[str], *, log_path: Path | None = None, output: tuple[IO, IO] | None = None,
          env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
          death_signal: int = signal.SIGKILL) -> subprocess.Popen:
    """Start ``command`` in a new session under the group reaper, output appended to ``log_path`` (or to the
    two open files of ``output``, stdout and stderr): it and everything it starts are killed with trm
    (``death_signal`` to the group)."""
    command = list(command)
    if shutil.which(command[0]) is None:  # the reaper would only report it in the log: say it here
        raise FileNotFoundError(2, "No such file or directory", command[0])
    # no preexec_fn: Python then forks without running fork handlers in the child (with one, gRPC's handlers,
    # in a trm that had opened a channel, wrote "epoll_wait error: Bad file descriptor" into the command's
    # stderr); the reaper arms its parent-death signal itself and checks that trm is still its parent after.
    # Linux schedules each session as a group (autogroups) and shares the CPU between groups first, so the
    # niceness a child inherits counts only against its own session's processes: the reaper, which leads the
    # new session, gives the session as a whole the calling thread's niceness, so that ``nice trm ...`` lowers
    # the tritonserver and engines it starts too (raising a niceness needs no privilege)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's
    reaper = [sys.executable, "-I", "-S", "-c", _GROUP_REAPER, str(int(death_signal)), str(os.getpid()),
              str(niceness), *command]

    def start(stdout: IO | int, stderr: IO | int) -> subprocess.Popen:
        return subprocess.Popen(reaper, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)

    def popen() -> subprocess.Popen:
        if output is not None:
            return start(*output)
        assert log_path is not None, "spawn needs a log_path or an output"
        with open(log_path, "ab") as log:
            return start(log, subprocess.STDOUT)

    return popen() if threading.current_thread() is threading.main_thread() else _launcher.run(popen)


class ManagedProcess:
    """A child process with a log file, stopped as a whole process group. See the module docstring."""

    def __init__(self, command: Sequence[str], *, log_path: Path | None = None,
                 output: tuple[IO, IO] | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, stop_signal: int = signal.SIGTERM,
                 death_signal: int = signal.SIGKILL) -> None:
        self.command = list(command)
        self.log_path = Path(log_path) if log_path is not None else None
        self.output = output
        self.env = env
        self.cwd = cwd
        self.stop_signal = stop_signal
        self.death_signal = death_signal
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> ManagedProcess:
        self.process = spawn(self.command, log_path=self.log_path, output=self.output, env=self.env,
                             cwd=self.cwd, death_signal=self.death_signal)
        return self

    def wait(self) -> int:
        """Until the process exits; its exit code. Stop it in a ``finally`` (an interrupt leaves it running)."""
        assert self.process is not None
        return self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0, stop_signal: int | None = None) -> int | None:
        """The stop signal to the process group, wait up to ``timeout_s``, then SIGKILL the group and wait (up to
        ``GROUP_EXIT_S``) until none of its processes runs. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:  # to the reaper, which passes it to the command (the command stops its own children)
                self.process.send_signal(self.stop_signal if stop_signal is None else stop_signal)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        # children it left behind in its group (a server's helpers) go with it, and are gone when this returns:
        # what runs after a stop (freeing the shared memory a killed engine mapped) must not see them alive
        self._signal_group(signal.SIGKILL)
        deadline = time.monotonic() + GROUP_EXIT_S
        while group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.process.returncode

    def _signal_group(self, signum: int) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


GROUP_EXIT_S = 10.0
"""How long ``ManagedProcess.stop`` waits for the SIGKILLed members of the group to be gone: the kernel tears a
process down after the signal, longer for one that maps gigabytes (an engine's weights)."""


def group_alive(group: int) -> bool:
    """Whether a process of process group ``group`` still runs (a zombie, or one being reaped, has ended)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] not in ("Z", "X") and fields[2] == str(group):
            return True
    return False


class CommandResult(NamedTuple):
    """What a shell command run by ``run_command`` ended with."""

    returncode: int
    stdout: str
    stderr: str


def run_command(command: str | Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
                cwd: str | Path | None = None) -> CommandResult:
    """A short command run to its end: an operator's shell command line (a string: a rollout's drain/restore
    command, a promotion's eval gate) or a program and its arguments (a list: nvidia-smi). Run like
    ``subprocess.run(command, shell=isinstance(command, str), capture_output=True, text=True)`` but as a
    managed child: it and everything it starts die with trm, a SIGKILL of trm included; at ``timeout_s``,
    or when trm is interrupted, its whole process group is stopped. What it left running in its group when it exits is
    killed too (a drain command cannot leave a helper behind). Raises ``subprocess.TimeoutExpired`` (after
    stopping it) and ``FileNotFoundError`` when the program (or /bin/sh) is missing."""
    import tempfile  # noqa: PLC0415 - cli imports this module: keep its start light

    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = ManagedProcess(argv, output=(out, err), env=env, cwd=cwd)
        try:
            process.start()
            assert process.process is not None
            try:
                process.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(argv, timeout_s) from None
        finally:
            process.stop(timeout_s=5.0)
        return CommandResult(process.returncode if process.returncode is not None else -1, _text(out), _text(err))


def _text(handle: IO) -> str:
    """What ``text=True`` makes of captured output: decoded, universal newlines."""
    handle.seek(0)
    return handle.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_stopping = threading.Event()


def stopping() -> None:
    """trm is stopping on request (``trm serve`` got its signal): further SIGTERM/SIGHUP are ignored
    so that the stop, bounded by its own timeouts, is not cut short."""
    _stopping.set()


@contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Terminated`` in the main thread (once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stopping.clear()

    def handler(signum: int, _frame: object) -> None:
        if _stopping.is_set():
            return  # already cleaning up; a SIGKILL remains for the impatient
        _stopping.set()
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in ENDING_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
