"""What a killed vLLM engine leaves behind, and freeing it.

vLLM's engine runs in processes of its own (``VLLM::EngineCore``, ``VLLM::Worker``) and talks to them through
shared-memory segments in /dev/shm (hundreds of MB per engine on CPU). A clean unload shuts them down and
unlinks the segments; a SIGKILL does neither. trm covers both halves:

- processes: the server runs under ``repo_manager.process``' group reaper, which kills the whole process
  group when trm dies and also when tritonserver itself dies; the engine's processes are in that group;
- segments: trm's vllm backend records, once its engine has started, the stub's and the engine's process ids
  and the /dev/shm segments they map, in one file per stub in ``registry_dir()``. Every server start
  (``free_stale_engines``) kills what is left of a record whose stub is dead and unlinks its segments.

The same holds for Triton's own Python-based backends (python, and trm's onnxruntime and vllm): each model
instance's stub talks to tritonserver through a ``triton_<backend>_backend_shm_region_<uuid>`` segment that
only a clean shutdown unlinks. ``free_dead_backend_segments`` unlinks those no live process maps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

REGISTRY_ENV = "TRM_VLLM_ENGINE_REGISTRY"


def registry_dir() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or Path(tempfile.gettempdir()) / "trm-vllm-engines")


def _alive(pid: int, start: int | None = None) -> bool:
    """Running, and (``start``) the same process that was recorded: a pid is reused once its process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return False
    if fields[0] == "Z":
        return False
    return start is None or (len(fields) > 19 and fields[19] == str(start))


BACKEND_SEGMENT = re.compile(r"^triton_[A-Za-z0-9_]+_backend_shm_region_[0-9a-f-]+$")
SEGMENT_MIN_AGE_S = 5.0  # never one just created: the server maps it at once, but not in the same instant


def free_dead_backend_segments(shm: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the Python-based backends' shared-memory regions of servers that died without cleaning up
    (a SIGKILLed tritonserver leaves one per model instance). Only segments of this user, older than
    ``SEGMENT_MIN_AGE_S``, that no process maps; and nothing at all if the mappings of a Triton process
    of this user could not be read (a segment it maps would look unused)."""
    mapped, complete = _mapped_segments_of_user()
    if not complete:
        return []
    freed = []
    now = time.time()
    for path in shm.iterdir() if shm.is_dir() else ():
        if not BACKEND_SEGMENT.match(path.name) or str(path) in mapped:
            continue
        try:
            info = path.lstat()
            if info.st_uid != os.getuid() or now - info.st_mtime < SEGMENT_MIN_AGE_S:
                continue
            path.unlink()
            freed.append(str(path))
        except OSError:
            continue
    return freed


def _mapped_segments_of_user() -> tuple[set[str], bool]:
    """/dev/shm paths mapped by live processes, and whether every Triton process of this user could be read."""
    mapped: set[str] = set()
    complete = True
    uid = os.getuid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat().st_uid
            with open(entry / "maps") as handle:
                for line in handle:
                    if "/dev/shm/" in line:
                        mapped.add(line[line.index("/dev/shm/"):].strip().removesuffix(" (deleted)"))
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError:
            # a process whose mappings cannot be read (pid 1 of a sandbox, say): only a Triton process
            # (tritonserver or a stub: the name says it) could map a backend region
            try:
                name = (entry / "comm").read_text()
            except OSError:
                name = "triton?"
            if (uid == 0 or owner == uid) and name.startswith("triton"):
                complete = False
    return mapped, complete


def free_stale_engines(folder: Path | None = None) -> dict[str, list]:
    """Kill the leftover processes and unlink the segments of every recorded engine whose stub is dead."""
    folder = folder or registry_dir()
    freed: dict[str, list] = {"processes": [], "segments": []}
    if not folder.is_dir():
        return freed
    records = []
    for path in folder.glob("*.json"):
        try:
            record = json.loads(path.read_text())
            pids = [int(p) for p in record.get("pids", [])]
            starts = {int(k): int(v) for k, v in (record.get("starts") or {}).items() if v is not None}
            segments = [str(s) for s in record.get("segments", []) if str(s).startswith("/dev/shm/")]
        except (OSError, ValueError, TypeError, AttributeError):
            path.unlink(missing_ok=True)
            continue
        if pids and _alive(pids[0], starts.get(pids[0])):
            continue  # its stub still serves
        records.append((path, pids, starts, segments))
    freed["segments"] += _free_dead_loky_semaphores() + free_dead_backend_segments()
    if not records:
        return freed
    for _path, pids, starts, _segments in records:
        for pid in pids[1:]:
            if pid in starts and _alive(pid, starts[pid]):  # never a process that merely got a recorded pid
                try:
                    os.kill(pid, signal.SIGKILL)
                    freed["processes"].append(pid)
                except OSError:
                    pass
    in_use, _ = _mapped_segments_of_user()
    for path, _pids, _starts, segments in records:
        for segment in segments:
            if segment not in in_use and Path(segment).exists():
                try:
                    os.unlink(segment)
                    freed["segments"].append(segment)
                except OSError:
                    pass
        path.unlink(missing_ok=True)
    return freed


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
