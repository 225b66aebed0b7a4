"""What a killed vLLM engine leaves behind, and freeing it.

vLLM's engine runs in processes of its own (``VLLM::EngineCore``, ``VLLM::Worker``) and talks to them through
shared-memory segments in /dev/shm (hundreds of MB per engine on CPU). A clean unload shuts them down and
unlinks the segments; a SIGKILL does neither. trm covers both halves:

- processes: the server runs under ``repo_manager.adapters.process``' group reaper, which kills the whole process
  group when trm dies and also when tritonserver itself dies; the engine's processes are in that group;
- segments: trm's vllm backend records, every second while its engine starts and once it has started, the
  stub's and the engine's process ids and the /dev/shm segments they map (every segment any of those records
  named: vLLM's engine maps a 160 MiB one on CPU before its workers load the weights), in one file per stub
  in ``registry_dir()``. A server's stop frees its engines' records once its whole process group is gone
  (``ManagedProcess.stop`` waits for that). Every server start
  (``free_stale_engines``) kills what is left of a record whose stub is dead and, once those processes are
  gone, unlinks its segments; a segment some live process still maps keeps the record for the next start.
  While a server runs, its owner does the same every ``ENGINE_SWEEP_S`` (``repo_manager.adapters.triton.server``)
  when a record's stub is dead: a stub that crashed, or was ended before its cleanup, leaves them too.

The same holds for Triton's own Python-based backends (python, and trm's onnxruntime and vllm): each model
instance's stub talks to tritonserver through a ``triton_<backend>_backend_shm_region_<uuid>`` segment that
only a clean shutdown unlinks. ``free_dead_backend_segments`` unlinks those no live process maps or
holds open.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REGISTRY_ENV = "TRM_VLLM_ENGINE_REGISTRY"


def registry_dir() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or Path(tempfile.gettempdir()) / "trm-vllm-engines")


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: gone): with the pid, it names the process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, start: int | None = None) -> bool:
    """Running, and (``start``) the same process that was recorded: a pid is reused once its process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return False
    if fields[0] == "Z":
        return False
    return start is None or (len(fields) > 19 and fields[19] == str(start))


_WAIT4 = {"x86_64": 61, "aarch64": 260}.get(os.uname().machine)
"""The wait4 system call's number, as /proc/<pid>/task/<tid>/syscall shows it (None: not known here)."""
STUB = b"triton_python_backend_stub"


def stubs_waited_for(root: int) -> dict[int, int]:
    """Python stubs in the process tree of ``root`` (a tritonserver, or what launched it) that a thread of
    their server waits to exit while they run: ``{stub pid: its start ticks}``.

    Triton 2.51's python backend does this for a stub that missed its health check while initializing (the
    model's ``initialize()`` still running on a saturated host): it gives up on the stub, does not kill it,
    and waits for an exit that never comes (``StubLauncher::Launch``), so the load never ends and nothing can
    be loaded or unloaded on that server. A stub it is right to wait for (told to finalize) exits within
    seconds."""
    if _WAIT4 is None:
        return {}
    found: dict[int, int] = {}
    for pid in [root, *_descendants(root)]:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                fields = Path(f"/proc/{pid}/task/{task}/syscall").read_text().split()
                if not fields or fields[0] != str(_WAIT4):
                    continue
                child = int(fields[1], 16)
                if child > 0 and STUB in Path(f"/proc/{child}/cmdline").read_bytes() and alive(child):
                    start = start_ticks(child)
                    if start is not None:
                        found[child] = start
            except (OSError, ValueError, IndexError):
                continue  # the thread or the child ended meanwhile, or the call is not readable
    return found


def _descendants(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile: the others' children still count
    return children + [grandchild for child in children for grandchild in _descendants(child)]


BACKEND_SEGMENT = re.compile(r"^triton_[A-Za-z0-9_]+_backend_shm_region_[0-9a-f-]+$")


def free_dead_backend_segments(shm: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the Python-based backends' shared-memory regions of servers that died without cleaning up
    (a SIGKILLed tritonserver leaves one per model instance): segments of this user that no live process
    maps or holds open; nothing at all if a Triton process of this user could not be read (a segment it
    uses would look unused).

    The segments are listed before the processes are read, so one created meanwhile is not a candidate; one
    listed is already open in the process creating it (Triton's python backend keeps the descriptor for the
    region's lifetime, beside the mapping), so its age does not matter."""
    candidates = []
    for path in shm.iterdir() if shm.is_dir() else ():
        try:
            if BACKEND_SEGMENT.match(path.name) and path.lstat().st_uid == os.getuid():
                candidates.append(str(path))
        except OSError:
            continue  # unlinked meanwhile
    if not candidates:
        return []
    used, complete = _shm_in_use_by_user(open_files=False)
    unused = [path for path in candidates if path not in used]
    if complete and unused:  # the descriptors too, only where a mapping did not already tell
        used, complete = _shm_in_use_by_user(open_files=True)
        unused = [path for path in unused if path not in used]
    if not complete:
        return []
    freed = []
    for path in unused:
        try:
            Path(path).unlink()
            freed.append(path)
        except OSError:
            continue
    return freed


def _shm_in_use_by_user(*, open_files: bool) -> tuple[set[str], bool]:
    """/dev/shm paths mapped (or, with ``open_files``, held open) by live processes, and whether every Triton
    process of this user could be read."""
    used: set[str] = set()
    complete = True
    uid = os.getuid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat().st_uid
            if open_files:
                for fd in os.listdir(entry / "fd"):
                    try:
                        target = os.readlink(entry / "fd" / fd)
                    except OSError:
                        continue  # closed meanwhile
                    if target.startswith("/dev/shm/"):
                        used.add(target.removesuffix(" (deleted)"))
            else:
                with open(entry / "maps") as handle:
                    for line in handle:
                        if "/dev/shm/" in line:
                            used.add(line[line.index("/dev/shm/"):].strip().removesuffix(" (deleted)"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM):
                continue  # exiting while read (ESRCH and the like): it uses nothing any more
            # a process that cannot be read (pid 1 of a sandbox, say): only a Triton process (tritonserver or a
            # stub: the name says it) could use a backend region
            try:
                name = (entry / "comm").read_text()
            except OSError:
                continue  # gone meanwhile
            if (uid == 0 or owner == uid) and name.startswith("triton"):
                complete = False
    return used, complete


@dataclass(frozen=True)
class EngineRecord:
    """What an engine's record (``<registry>/<id>.json``, written by the backend) says: the stub's pid first,
    then the engine's processes, their start times, and the /dev/shm segments they created."""

    path: Path
    pids: tuple[int, ...]
    starts: dict[int, int]
    segments: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> EngineRecord | None:
        """The record in ``path``; None when it cannot be read (it names nothing anyone can rely on)."""
        try:
            record = json.loads(path.read_text())
            return cls(path, tuple(int(p) for p in record.get("pids", [])),
                       {int(k): int(v) for k, v in (record.get("starts") or {}).items() if v is not None},
                       tuple(str(s) for s in record.get("segments", []) if str(s).startswith("/dev/shm/")))
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def stub_alive(self) -> bool:
        """Whether the Python stub that started the engine still runs (then the engine serves)."""
        return bool(self.pids) and alive(self.pids[0], self.starts.get(self.pids[0]))


def _records(folder: Path) -> list[tuple[Path, EngineRecord | None]]:
    return [(path, EngineRecord.read(path)) for path in (folder.glob("*.json") if folder.is_dir() else ())]


def has_dead_engine(folder: Path | None = None) -> bool:
    """Whether a recorded engine's stub is dead (``free_stale_engines`` has work): a cheap look at the
    records, without reading every process's mappings."""
    return any(record is None or not record.stub_alive() for _path, record in _records(folder or registry_dir()))


def free_stale_engines(folder: Path | None = None) -> dict[str, list]:
    """Kill the leftover processes and unlink the segments of every recorded engine whose stub is dead; also
    unlink the regions of dead servers' Python stubs (``free_dead_backend_segments``)."""
    # the Python stubs' regions and loky's semaphores need no record: freed even where no engine ever ran
    freed: dict[str, list] = {"processes": [], "segments": _free_dead_loky_semaphores() + free_dead_backend_segments()}
    records: list[EngineRecord] = []
    for path, record in _records(folder or registry_dir()):
        if record is None:
            path.unlink(missing_ok=True)
        elif not record.stub_alive():  # else its stub still serves
            records.append(record)
    if not records:
        return freed
    killed = []
    for record in records:
        for pid in record.pids[1:]:
            start = record.starts.get(pid)
            if start is not None and alive(pid, start):  # never a process that merely got a recorded pid
                try:
                    os.kill(pid, signal.SIGKILL)
                    freed["processes"].append(pid)
                    killed.append((pid, start))
                except OSError:
                    pass
    # a killed process maps its segments until the kernel has torn it down (longer for GBs of weights)
    deadline = time.monotonic() + KILL_WAIT_S
    while any(alive(pid, start) for pid, start in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    in_use, _ = _shm_in_use_by_user(open_files=False)
    for record in records:
        kept = False
        for segment in record.segments:
            if BACKEND_SEGMENT.match(Path(segment).name):
                continue  # the stub's own region: free_dead_backend_segments, which also reads open descriptors
            if segment in in_use:
                kept = True  # still mapped: the record stays, and the next start tries again
            elif Path(segment).exists():
                try:
                    os.unlink(segment)
                    freed["segments"].append(segment)
                except OSError:
                    pass
        if not kept:
            record.path.unlink(missing_ok=True)
    return freed


KILL_WAIT_S = 10.0
"""How long a start waits for the killed processes of a dead engine to be gone before freeing its segments."""


def _free_dead_loky_semaphores() -> list[str]:
    """joblib/loky's named semaphores (``sem.loky-<pid>-<random>``, imported with vLLM and transformers) of
    processes that died before unlinking them: the pid in the name says whose they are."""
    freed = []
    for path in Path("/dev/shm").glob("sem.loky-*"):
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            try:
                path.unlink()
                freed.append(str(path))
            except OSError:
                pass
    return freed
