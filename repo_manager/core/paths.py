"""The one path-safety rule for everything trm writes or deletes.

A *target* is a folder the user named: the node repository of `trm sync`, the destination of `trm export`,
the repository `trm validate --fix` repairs, the node cache. The target itself may be a symbolic link (the
user chose it), but nothing *beneath* it is followed: every existing component between the target and the
path written or deleted must be a real folder, never a symbolic link (which could lead anywhere, e.g. a
model folder ``repo/base -> /elsewhere``) and never a file. A path that breaks the rule is refused with
``UnsafePathError`` (exit 3) before anything is written.

File names that come from a store (a manifest's file list) are checked by ``check_store_path`` when the
manifest is read: relative POSIX paths of portable names (no control characters, no backslash, no ``..``
or ``.`` part, no absolute path, bounded length). Breaking that rule is hostile store content:
``IntegrityError`` (exit 7).

The checks are made just before each write (not once per command) and new files are always created under a
unique temporary name, then renamed: a rename replaces a link found at the final name instead of writing
through it. They guard against a layout that is already hostile or careless when trm runs; someone who can
rewrite the target while trm runs could write into it directly anyway.

Reads from a *source* (a repository `trm adopt` reads, a folder `trm publish` reads) follow the mirror
rule: ``open_inside``, ``read_inside`` and ``walk_inside`` are the only ways in. Each path component is
opened relative to the folder before it without following links, so nothing outside the source is read
through a link anywhere on the way; a folder that cannot be listed or a file that cannot be opened is an
error naming it (``SourceReadError``, exit 3), never a silent omission.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from repo_manager.core.errors import InputError, IntegrityError

MAX_NAME_BYTES = 255
"""Longest file or folder name (one path component), in UTF-8 bytes: what Linux, macOS and S3 keys share."""
MAX_PATH_BYTES = 1024
"""Longest relative path inside a version folder (S3 allows 1024 bytes per key)."""
_UNPORTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")

_UMASK = os.umask(0)
os.umask(_UMASK)


class UnsafePathError(InputError):
    """A path trm was asked to write or delete leads out of its target (a symbolic link, a file in the way)."""

    kind = "unsafe_path"


def file_mode() -> int:
    """Permissions of a new regular file: what ``open()`` would give under this process's umask (temporary
    files start at 0600; a Triton running as another user must be able to read what trm writes)."""
    return 0o666 & ~_UMASK


def check_store_path(path: object, origin: str = "a manifest") -> str:
    """A file path from store content: relative, POSIX, portable names only. IntegrityError otherwise."""
    if not isinstance(path, str) or not path:
        raise IntegrityError(f"file path {path!r} is not allowed in {origin}")
    if _UNPORTABLE.search(path):
        raise IntegrityError(f"file path {path!r} in {origin} holds a control character or a backslash",
                             hint="store file names are limited to printable characters")
    if path.startswith("/") or posixpath.normpath(path) != path or path.split("/")[0] == "..":
        raise IntegrityError(f"file path {path!r} in {origin} leaves the version folder")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise IntegrityError(f"file path {path!r} is not allowed in {origin}")
    try:
        encoded = [part.encode() for part in parts]
    except UnicodeEncodeError as exc:  # a lone surrogate from a JSON \ud800 escape
        raise IntegrityError(f"file path {path!r} in {origin} is not valid UTF-8") from exc
    if any(len(part) > MAX_NAME_BYTES for part in encoded) or len(path.encode()) > MAX_PATH_BYTES:
        raise IntegrityError(f"file path {path[:80]!r}… in {origin} is too long")
    return path


def check_within(root: Path, path: Path) -> Path:
    """``path`` if every existing component strictly below ``root`` is a real folder (the last one may be
    a file or missing); UnsafePathError otherwise. ``path`` must be ``root`` joined with relative parts."""
    try:
        relative = Path(os.path.relpath(path, root)) if path.is_absolute() != root.is_absolute() \
            else path.relative_to(root)
    except ValueError:
        relative = Path("..")
    if relative.is_absolute() or ".." in relative.parts:
        raise UnsafePathError(f"{path} is outside {root}")
    current = root
    parts = relative.parts
    for index, part in enumerate(parts):
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return path  # the rest will be created by trm, as real folders
        except NotADirectoryError as exc:
            raise UnsafePathError(f"cannot write {path}: a part of it is a file", path=str(current)) from exc
        if stat.S_ISLNK(info.st_mode):
            raise UnsafePathError(f"refusing to write through {current}: it is a symbolic link "
                                  f"(to {os.readlink(current)}) inside {root}",
                                  hint="replace the link with a real folder, or choose another target",
                                  path=str(current))
        if index < len(parts) - 1 and not stat.S_ISDIR(info.st_mode):
            raise UnsafePathError(f"cannot write {path}: {current} is not a folder", path=str(current))
    return path


def make_dirs(root: Path, folder: Path) -> Path:
    """Create ``folder`` (and its parents below ``root``) after checking the rule; checked again after,
    so a link that appeared meanwhile is still refused before anything is written into it."""
    check_within(root, folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise UnsafePathError(f"cannot create folder {folder}: a file is in the way", path=str(folder)) from exc
    except OSError as exc:
        raise InputError(f"cannot create {folder}: {exc.strerror}", hint="choose a writable folder") from exc
    return check_within(root, folder)


def write_new_file(root: Path, target: Path, chunks, *, mode: int | None = None) -> None:
    """Write ``chunks`` (an iterable of bytes) to ``target`` below ``root``: folders checked and created,
    a unique temporary file with the umask's permissions, fsynced, renamed into place (replacing a link
    found at ``target`` rather than writing through it)."""
    make_dirs(root, target.parent)
    replace_file(target, chunks, mode=mode)


def replace_file(target: Path, chunks, *, mode: int | None = None) -> None:
    """The one atomic write: a unique temporary file beside ``target`` with the umask's permissions (mkstemp
    makes 0600; a Triton running as another user must read it), fsynced, renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:200]}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:  # a temporary file, not a repository's staging folder: gone on any exit, then re-raised
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_tree(root: Path, folder: Path) -> bool:
    """Delete ``folder`` (below ``root``) only if it is a real folder reached through real folders; a link
    is never followed (only unlinked, when it is ``folder`` itself). True if something was removed."""
    check_within(root, folder.parent)
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        folder.unlink()
        return True
    shutil.rmtree(folder, ignore_errors=True)  # rmtree itself never follows links inside the tree
    return True


LOCAL_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})
"""Errors of a write the node refused (full, over quota or a file-size limit, read-only, not allowed)."""


@contextmanager
def node_writes(what: str, folder: Path) -> Iterator[None]:
    """Turn a local write the node refuses (disk full mid-way, quota, read-only …) into InputError (exit
    3) naming ``what`` and ``folder``; anything else passes through unchanged."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in LOCAL_WRITE_ERRNOS:
            raise
        raise InputError(f"{what} could not write in {folder}: {exc.strerror or exc}",
                         hint="free some space (`trm sync --prune` removes unused blobs), or check the "
                              "folder's permissions and limits; a sync resumes where it stopped",
                         path=str(folder)) from exc


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse (exit 3) before writing ``needed`` bytes into ``folder`` when its filesystem has less free:
    a manifest's sizes are checked against the disk before any byte is downloaded or allocated."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: the write itself reports a full disk
    if needed > free:
        raise InputError(f"{what} needs {needed} bytes in {folder}, but its filesystem has {free} free",
                         hint="free some space (`trm sync --prune` removes unused blobs) or use another folder",
                         path=str(folder))


# ------------------------------------------------------------------------------------ reading a source

class SourceReadError(InputError):
    """A file or folder trm reads from a source (a repository being adopted, a folder being published) that
    it cannot read *inside* that source: missing, a symbolic link on the way, not a regular file or folder,
    unreadable (permissions), too large, or named in a way a manifest cannot record. ``reason`` says which:
    ``missing``, ``link``, ``special``, ``unreadable``, ``too_large`` or ``name``."""

    kind = "source_read"

    def __init__(self, message: str, *, path: Path, reason: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, path=str(path))
        self.path = path
        self.reason = reason


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (a FIFO must not block the open)


def open_inside(root: Path, relative: str) -> BinaryIO:
    """Open ``root/relative`` for reading without following a symbolic link anywhere below ``root``: each
    component is opened relative to the folder before it (``openat`` with ``O_NOFOLLOW``), so a link on
    the way (``labels/sub -> /elsewhere``), at the end, or swapped in meanwhile is refused, never read
    through. The file must be a regular file. SourceReadError (exit 3) names the component at fault.
    ``root`` itself may be a link: the user chose it."""
    parts = relative.split("/")
    if relative.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise SourceReadError(f"{root / relative} leaves {root}", path=root / relative, reason="link")
    folder = _open_root(root)
    try:
        current = root
        for part in parts[:-1]:
            current = current / part
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=folder)
            except OSError as exc:
                raise _refusal(folder, part, current, exc, root, folder_wanted=True) from exc
            os.close(folder)
            folder = child
        current = current / parts[-1]
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=folder)
        except OSError as exc:
            raise _refusal(folder, parts[-1], current, exc, root, folder_wanted=False) from exc
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SourceReadError(f"{current} is not a regular file (a folder, FIFO, socket or device)", path=current,
                              reason="special")
    return os.fdopen(fd, "rb")


def read_inside(root: Path, relative: str, limit: int) -> bytes:
    """The bytes of ``root/relative`` read as ``open_inside`` opens it, refused (SourceReadError, reason
    ``too_large``) when there are more than ``limit``: what is read is bounded before it is read."""
    with open_inside(root, relative) as handle:
        path = root / relative
        too_large = SourceReadError(f"{path} is larger than {limit >> 20} MiB", path=path, reason="too_large")
        if os.fstat(handle.fileno()).st_size > limit:
            raise too_large
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise SourceReadError(f"{path} cannot be read ({exc.strerror})", path=path, reason="unreadable") from exc
    if len(data) > limit:
        raise too_large
    return data


def walk_inside(root: Path, *, skip_folders: frozenset[str] = frozenset(),
                links_into: tuple[Path, ...] = ()) -> dict[str, int]:
    """Every regular file below ``root``: relative POSIX path -> size, in path order (depth first, names
    sorted). Total or refused: a folder that cannot be listed or a file that cannot be opened is a
    SourceReadError naming it (``os.walk`` and ``Path.rglob`` pass over both in silence), and so is a
    symbolic link, a FIFO, socket or device, and a name a manifest cannot record (``check_store_path``).
    Folders are walked through their descriptors, never through a link. Folders named in
    ``skip_folders`` (at any depth) are left out unread, and so is an empty regular file of such a name (the
    empty ``__pycache__`` that keeps Python from making that folder: ``repository.block_bytecode_cache``).

    ``links_into`` names the folders a symbolic link *to a file* may lead into (a Hugging Face cache's
    snapshot files are links into the repository's ``blobs/``): such a link is listed, with its target's
    size, when it resolves to a readable regular file inside one of them; any other link is refused."""
    found: dict[str, int] = {}
    top = _open_root(root)
    allowed = tuple(Path(os.path.realpath(folder)) for folder in links_into)
    try:
        _walk(top, root, "", found, skip_folders, allowed)
    finally:
        os.close(top)
    return found


def _walk(folder: int, root: Path, prefix: str, found: dict[str, int], skip: frozenset[str],
          allowed: tuple[Path, ...]) -> None:
    here = root / prefix if prefix else root
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise _unreadable(here, exc) from exc
    for name in names:
        relative, path = f"{prefix}{name}", here / name
        try:
            info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError as exc:
            raise SourceReadError(f"{path} disappeared while it was being read", path=path,
                                  reason="missing") from exc
        except OSError as exc:
            raise _unreadable(path, exc) from exc
        if name in skip and (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode) and info.st_size == 0):
            continue  # the folder, or the empty file of its name that stands in for it (``__pycache__``)
        try:
            check_store_path(relative, "a version")
        except IntegrityError as exc:
            raise SourceReadError(f"{path}: a name a manifest cannot record (printable UTF-8 without a "
                                  f"backslash, at most {MAX_NAME_BYTES} bytes a name)", path=path, reason="name",
                                  hint="rename it") from exc
        if stat.S_ISLNK(info.st_mode):
            if not allowed:
                raise _link(folder, name, path, root)
            found[relative] = _allowed_link(folder, name, path, root, allowed)
            continue
        if stat.S_ISDIR(info.st_mode):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=folder)
            except OSError as exc:
                raise _refusal(folder, name, path, exc, root, folder_wanted=True) from exc
            try:
                if not os.path.samestat(info, os.fstat(child)):
                    raise SourceReadError(f"{path} changed while it was being read", path=path, reason="missing")
                _walk(child, root, f"{relative}/", found, skip, allowed)
            finally:
                os.close(child)
        elif stat.S_ISREG(info.st_mode):
            try:
                os.close(os.open(name, _FILE_FLAGS, dir_fd=folder))  # readable now, not only listed
            except OSError as exc:
                raise _refusal(folder, name, path, exc, root, folder_wanted=False) from exc
            found[relative] = info.st_size
        else:
            raise SourceReadError(f"{path} is not a regular file (a FIFO, socket or device); a version holds "
                                  "regular files", path=path, reason="special")


def _allowed_link(folder: int, name: str, path: Path, root: Path, allowed: tuple[Path, ...]) -> int:
    """The size of the readable regular file the link ``name`` (in the open ``folder``) leads to, when that
    file is inside one of the ``allowed`` folders; SourceReadError naming the link otherwise."""
    target = Path(os.path.realpath(path))
    if not any(target.is_relative_to(place) for place in allowed):
        try:
            to = os.readlink(name, dir_fd=folder)
        except OSError:
            to = str(target)
        inside = " or ".join(map(str, allowed))
        raise SourceReadError(f"{path} is a symbolic link (to {to}) that leads outside {inside}: trm follows a "
                              "link only to a file inside them", path=path, reason="link",
                              hint="replace the link with the file itself")
    try:
        fd = os.open(target, _FILE_FLAGS)
    except FileNotFoundError as exc:
        raise SourceReadError(f"{path} is a symbolic link to {target}, which does not exist", path=path,
                              reason="missing") from exc
    except OSError as exc:
        why = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) else (exc.strerror or str(exc))
        raise SourceReadError(f"{path} cannot be read ({why}; it is a link to {target})", path=path,
                              reason="unreadable", hint="give the user running trm read access to every file "
                                                        "and folder of the source") from exc
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SourceReadError(f"{path} is a symbolic link to {target}, which is not a regular file", path=path,
                              reason="special", hint="replace the link with the folder or file itself")
    return info.st_size


def _open_root(root: Path) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SourceReadError(f"{root} does not exist", path=root, reason="missing") from exc
    except NotADirectoryError as exc:
        raise SourceReadError(f"{root} is not a folder", path=root, reason="special") from exc
    except OSError as exc:
        raise _unreadable(root, exc) from exc


def _unreadable(path: Path, exc: OSError) -> SourceReadError:
    why = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) else (exc.strerror or str(exc))
    return SourceReadError(f"{path} cannot be read ({why})", path=path, reason="unreadable",
                           hint="give the user running trm read access to every file and folder of the source")


def _link(folder: int, name: str, path: Path, root: Path) -> SourceReadError:
    try:
        target = f" (to {os.readlink(name, dir_fd=folder)})"
    except OSError:
        target = ""
    return SourceReadError(f"{path} is a symbolic link{target}: trm reads only real files and folders inside "
                           f"{root}", path=path, reason="link", hint="replace the link with the file or folder itself")


def _refusal(folder: int, name: str, path: Path, exc: OSError, root: Path, *, folder_wanted: bool) -> SourceReadError:
    """Why opening ``name`` (in the open ``folder``) failed, from what is there."""
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return SourceReadError(f"{path} does not exist", path=path, reason="missing")
    except OSError:
        return _unreadable(path, exc)
    if stat.S_ISLNK(info.st_mode):
        return _link(folder, name, path, root)
    if folder_wanted and not stat.S_ISDIR(info.st_mode):
        return SourceReadError(f"{path} is not a folder", path=path, reason="special")
    return _unreadable(path, exc)
