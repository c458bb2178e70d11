"""Every file the plugin writes or reads back: one writer, one reader; nothing here imports from the package.

What the writer and the reader do and refuse: docs/architecture.md, "Files, and memory".
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LockTimeout", "Refused", "TEMPORARY", "drop_temporaries", "locked", "planted_link", "read", "unwritable",
           "write"]

TEMPORARY = ".attncost.tmp"  # mkstemp's suffix: .NAME.<8 random characters>.attncost.tmp beside NAME
_OURS = re.compile(rf"\..+\.[a-z0-9_]{{8}}{re.escape(TEMPORARY)}")
_FRESH = 60.0  # seconds: an empty, unlocked temporary younger than this may be a writer's between mkstemp and flock
READ_ONLY = "{path} is read-only{through}; make it writable (chmod u+w {target}) or write elsewhere"
READ_ONLY_FS = "{path} is on a read-only file system ({where} cannot be written by anyone); write elsewhere"
NO_READER = "{path} is a FIFO that no process is reading; start its reader first, or give a regular file"
NOT_A_FILE = "{path} is {kind}; give the path of a regular file"
NOT_REGULAR = "{path} is not a regular file ({kind})"
DIRECTORY = "{path} cannot be replaced: directory {directory} is not writable"
FOREIGN_LINK = ("{link} is a link that another user (uid {uid}) made in a directory anyone may write ({directory}); "
                "it is not followed: remove it, or write elsewhere")
OWNER = ("{path} belongs to uid {uid} and group {gid}; replacing it as uid {me} would change its owner or group "
         "(the new file would be this user's): save it as its owner, or write elsewhere")
NOT_YOURS = ("{path} belongs to uid {uid} and group {gid}, and this user (uid {me}) may not write it; write it as "
             "its owner, or have them give it back (chown), or write elsewhere")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_IN_PLACE = ("a character device", "a FIFO")  # the special files written in place


class Refused(ValueError):
    """A file the writer or the reader will not touch; ``str()`` names it and the fix."""


_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def planted_link(path: Path) -> str | None:
    """Why *path* must not be followed, or None: a link on the way to it (in any component, and in the targets
    of links) that another user made in a directory anyone may write (world-writable, such as ``/tmp``) and
    whose owner is neither this user nor the directory's. That is the kernel's protected_symlinks rule for
    every component, which resolving a path here would bypass (containers often run with it off)."""
    start = Path(os.getcwd()) / path  # joined, not normalized: "sub/../x" walks through sub
    here, pending, hops = Path(start.anchor), list(reversed(start.parts[1:])), 0
    while pending:
        part = pending.pop()
        if part == "..":
            here = here.parent
            continue
        step = here / part
        try:
            info = os.lstat(step)
        except OSError:  # the rest does not exist yet (or cannot be reached: the writer says so)
            return None
        if not stat.S_ISLNK(info.st_mode):
            here = step
            continue
        directory = os.stat(here)
        if directory.st_mode & 0o002 and info.st_uid not in (os.geteuid(), directory.st_uid):
            found = FOREIGN_LINK.format(link=step, uid=info.st_uid, directory=here)
            return found if step == start else f"{path}: {found}"
        hops += 1
        if hops > 40:  # a loop: opening the path says so
            return None
        target = Path(os.readlink(step))
        if target.is_absolute():
            here = Path(target.anchor)
        pending.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
    return None


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1))
    except (OSError, AttributeError):
        return False


def _owner(path: Path, info: os.stat_result) -> str | None:
    """Why a replacement of *path* could not keep its owner and group (root can; others only their own files,
    in a group they belong to), or None."""
    me = os.geteuid()
    if me == 0 or (info.st_uid == me and info.st_gid in (os.getegid(), *os.getgroups(), _new_gid(path))):
        return None
    return OWNER.format(path=path, uid=info.st_uid, gid=info.st_gid, me=me)


def _new_gid(path: Path) -> int:
    """The group a new file beside *path* gets: the directory's when it is set-group-ID, else this user's."""
    try:
        directory = os.stat((path.resolve() if path.is_symlink() else path).parent)
    except OSError:
        return os.getegid()
    return directory.st_gid if directory.st_mode & stat.S_ISGID else os.getegid()


def unwritable(path: Path, *, append: bool = False) -> str | None:
    """Why :func:`write` would refuse *path* (a planted link, read-only or on a read-only file system, a
    directory, a socket or block device, an owner or group it cannot keep, a directory it cannot replace a
    file in), or None. A symlink is judged by its target."""
    try:
        if (planted := planted_link(path)) is not None:
            return planted
        info: os.stat_result | None = os.stat(path)  # through links
    except FileNotFoundError:
        info = None
    except OSError as exc:  # a link loop, a parent that cannot be searched
        return f"{path} cannot be reached: {exc.strerror}"
    target = path.resolve() if path.is_symlink() else path
    if info is not None:
        kind = _kind(info.st_mode)
        if kind != "a regular file" and kind not in _IN_PLACE:
            return NOT_A_FILE.format(path=path, kind=kind)
        if _read_only_fs(target):
            return READ_ONLY_FS.format(path=path, where=target)
        # no write bit for anyone: the owner's intent, which root's access would override
        if info.st_mode & 0o222 and not os.access(path, os.W_OK) and info.st_uid != os.geteuid():
            return NOT_YOURS.format(path=path, uid=info.st_uid, gid=info.st_gid, me=os.geteuid())
        if not info.st_mode & 0o222 or not os.access(path, os.W_OK):  # through links, as open() goes
            through = f" (through the link to {target})" if target != path else ""
            return READ_ONLY.format(path=path, through=through, target=target)
        if kind in _IN_PLACE:
            return None
        if not append and (problem := _owner(path, info)) is not None:
            return problem
    replaced = not (append and info is not None)  # appending to a file needs no right to its directory
    if replaced and target.parent.is_dir() and not os.access(target.parent, os.W_OK | os.X_OK):
        if _read_only_fs(target.parent):
            return READ_ONLY_FS.format(path=path, where=target.parent)
        return DIRECTORY.format(path=path, directory=target.parent)
    return None


def write(path: Path, data: bytes | str, *, append: bool = False) -> None:
    """Write *data* (text as UTF-8) to *path*: a regular file is replaced whole (unless it holds *data*
    already: then nothing is written), or *append* adds to it in one write call; a character device or a FIFO
    with a reader is written in place.

    Raises:
        Refused: what :func:`unwritable` names, or a FIFO that no process is reading.
        OSError: what the file system says (a missing directory, a full disk).
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if (problem := unwritable(path, append=append)) is not None:
        raise Refused(problem)
    try:
        info: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        _in_place(path, raw, 0)  # no O_CREAT, no O_TRUNC: a device stays the device
    elif append:
        _in_place(path, raw, os.O_APPEND | os.O_CREAT)
    else:
        target = path.resolve() if path.is_symlink() else path
        drop_temporaries(target.parent)
        if info is None or info.st_size != len(raw) or not _holds(target, raw):
            _replace(target, info, raw)


def _holds(path: Path, raw: bytes) -> bool:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | _NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            return handle.read(len(raw) + 1) == raw
    return False


def _in_place(path: Path, raw: bytes, flags: int) -> None:
    try:
        # O_NONBLOCK: a FIFO without a reader fails at once (ENXIO) instead of waiting for one forever
        fd = os.open(path, os.O_WRONLY | _NONBLOCK | flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise Refused(NO_READER.format(path=path)) from None
        raise
    try:
        if _NONBLOCK:
            os.set_blocking(fd, True)  # a slow reader is waited for, as by any writer to a pipe
        _write_all(fd, raw)
    finally:
        os.close(fd)


def _write_all(fd: int, raw: bytes) -> None:
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view):]


def _replace(target: Path, info: os.stat_result | None, raw: bytes) -> None:
    mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666 & ~_umask()
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMPORARY, dir=target.parent)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held to the rename: a temporary no one holds was left by a kill
        _write_all(fd, raw)
        os.fsync(fd)
        if info is not None:
            _keep_owner(fd, target, info)
        os.fchmod(fd, mode)  # after the data (the temporary was private while it was written) and the chown
        os.replace(temporary, target)  # readers see the old file or the new one, never half of one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    finally:
        os.close(fd)


def _keep_owner(fd: int, target: Path, info: os.stat_result) -> None:
    now = os.fstat(fd)
    if (now.st_uid, now.st_gid) == (info.st_uid, info.st_gid):
        return
    try:
        os.fchown(fd, info.st_uid, info.st_gid)  # before fchmod: a chown clears set-id bits
    except PermissionError:
        raise Refused(OWNER.format(path=target, uid=info.st_uid, gid=info.st_gid, me=os.geteuid())) from None


def _umask() -> int:
    mask = os.umask(0o077)  # read by setting it: for that instant a file another thread creates is private
    os.umask(mask)
    return mask


def drop_temporaries(directory: Path) -> list[str]:
    """Remove the temporaries that killed writes left in *directory* (SIGKILL skips every cleanup); return their
    names. Only this module's names (``.NAME.<8 random characters>.attncost.tmp``), only regular files of this
    user, only ones no writer holds (a live writer holds a ``flock`` on its temporary until the rename), and never
    an empty one younger than a minute (a writer between ``mkstemp`` and its ``flock``). A link is never followed."""
    try:
        names = [name for name in os.listdir(directory) if _OURS.fullmatch(name)]
    except OSError:
        return []
    return [name for name in names if _drop_if_stale(directory / name)]


def _drop_if_stale(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:  # gone, a link, not ours to read
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return False
        if info.st_size == 0 and time.time() - info.st_mtime < _FRESH:
            return False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a live writer holds it
                return False
        elif time.time() - info.st_mtime < 3600:  # no flock: only an hour's age tells
            return False
        if os.lstat(path).st_ino != info.st_ino:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read(path: Path, limit: int) -> bytes:
    """Up to *limit* + 1 bytes of the regular file at *path* (a link is followed).

    Raises:
        Refused: not a regular file (a FIFO, a device, a socket, a directory), found before it is opened.
        OSError: it cannot be read.
    """
    kind = _kind(os.stat(path).st_mode)
    if kind != "a regular file":
        raise Refused(NOT_REGULAR.format(path=path, kind=kind))
    fd = os.open(path, os.O_RDONLY | _NONBLOCK)  # swapped for a FIFO since the stat: still no hang
    with os.fdopen(fd, "rb") as handle:
        kind = _kind(os.fstat(fd).st_mode)
        if kind != "a regular file":
            raise Refused(NOT_REGULAR.format(path=path, kind=kind))
        return handle.read(limit + 1)


class LockTimeout(OSError):
    """The lock was still held by another process when the time ran out."""


@contextlib.contextmanager
def locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive lock on *path* (created empty, opened without following a link), and remove it after.

    A lock file that is removed can be locked by two processes at once, one on the removed file and one on a
    new one, unless each checks after it got the lock that its file is still the one at *path*: this one does,
    and tries again when it is not, so the lock leaves nothing behind (the holder removes it while it still
    holds it). Waits up to *timeout* seconds.

    Raises:
        LockTimeout: another process held it all that time.
        OSError: the lock cannot be created or opened (a link there: ``ELOOP``).
    """
    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[union-attr]  # POSIX
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockTimeout(errno.EAGAIN, "held by another process", str(path)) from None
                    time.sleep(0.05)
            try:
                current = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue  # its holder removed it while this one waited: take the new one
            if (current.st_dev, current.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                continue
            try:
                yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # still held: a waiter on this file finds it gone and starts over
            return
        finally:
            os.close(fd)
