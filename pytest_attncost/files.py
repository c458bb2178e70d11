"""Every file the plugin writes or reads back: one writer, one reader; nothing here imports from the package.

The writer replaces a regular file through a :func:`tempfile.mkstemp` temporary beside it (exclusive, so a
planted link is never followed; 0600 while it holds the data, then the target's mode), fsynced and renamed.
A symlink is followed to its real path and stays a link; a read-only target is refused. A character device
(``/dev/null``) or a FIFO a process reads is written in place, never replaced; a FIFO no one reads, a socket
or a block device is refused. The reader refuses anything but a regular file before opening it: no hangs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from .errors import hidden

__tracebackhide__ = hidden  # pytest shows the user's frames, not these (see errors.hidden)

__all__ = ["Refused", "TEMPORARY", "drop_temporaries", "read", "unwritable", "write"]

TEMPORARY = ".attncost.tmp"  # mkstemp's suffix: .NAME.<8 random characters>.attncost.tmp beside NAME
READ_ONLY = "{path} is read-only{through}; make it writable (chmod u+w {target}) or write elsewhere"
NO_READER = "{path} is a FIFO that no process is reading; start its reader first, or give a regular file"
NOT_A_FILE = "{path} is {kind}; give the path of a regular file"
NOT_REGULAR = "{path} is not a regular file ({kind})"
DIRECTORY = "{path} cannot be replaced: directory {directory} is not writable"
FOREIGN_LINK = ("{path} is a link that another user (uid {uid}) made in a directory anyone may write; it is not "
                "followed: remove it, or write elsewhere")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_IN_PLACE = ("a character device", "a FIFO")  # the special files written in place


class Refused(ValueError):
    """A file the writer or the reader will not touch; ``str()`` names it and the fix."""


_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def unwritable(path: Path, *, append: bool = False) -> str | None:
    """Why :func:`write` would refuse *path* (read-only, a directory, a socket or block device, a directory it
    cannot replace a file in), or None. A symlink is judged by its target."""
    try:
        info = os.stat(path)  # through links
    except FileNotFoundError:
        info = None
    except OSError as exc:  # a link loop, a parent that cannot be searched
        return f"{path} cannot be reached: {exc.strerror}"
    target = path.resolve() if path.is_symlink() else path
    owner = _foreign_link(path) if target != path else None
    if owner is not None:
        return FOREIGN_LINK.format(path=path, uid=owner)
    if info is not None:
        kind = _kind(info.st_mode)
        if kind != "a regular file" and kind not in _IN_PLACE:
            return NOT_A_FILE.format(path=path, kind=kind)
        # no write bit for anyone: the owner's intent, which root's access would override
        if not info.st_mode & 0o222 or not os.access(path, os.W_OK):  # through links, as open() goes
            through = f" (through the link to {target})" if target != path else ""
            return READ_ONLY.format(path=path, through=through, target=target)
        if kind in _IN_PLACE:
            return None
    replaced = not (append and info is not None)  # appending to a file needs no right to its directory
    if replaced and target.parent.is_dir() and not os.access(target.parent, os.W_OK | os.X_OK):
        return DIRECTORY.format(path=path, directory=target.parent)
    return None


def _foreign_link(path: Path) -> int | None:
    """The owner of the link at *path* when it must not be followed, else None: the kernel's protected_symlinks
    rule, which resolving a link here would bypass (in a sticky directory anyone may write, such as /tmp, only
    a link of this user or of the directory's owner is followed)."""
    link, directory = os.lstat(path), os.stat(path.parent)
    shared = directory.st_mode & stat.S_ISVTX and directory.st_mode & 0o002
    return link.st_uid if shared and link.st_uid not in (os.geteuid(), directory.st_uid) else None


def write(path: Path, data: bytes | str, *, append: bool = False) -> None:
    """Write *data* (text as UTF-8) to *path*: a regular file is replaced whole, or *append* adds to it in one
    write call; a character device or a FIFO with a reader is written in place.

    Raises:
        Refused: what :func:`unwritable` names, or a FIFO that no process is reading.
        OSError: what the file system says (a missing directory, a full disk).
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    problem = unwritable(path, append=append)
    if problem is not None:
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
        _replace(path.resolve() if path.is_symlink() else path, info, raw)


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
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _replace(target: Path, info: os.stat_result | None, raw: bytes) -> None:
    mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666 & ~_umask()
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMPORARY, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(fd)
            os.fchmod(fd, mode)  # after the data: the temporary was private while it was written
        os.replace(temporary, target)  # readers see the old file or the new one, never half of one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0o077)  # read by setting it: for that instant a file another thread creates is private
    os.umask(mask)
    return mask


def drop_temporaries(target: Path) -> None:
    """Remove the temporaries that killed writes to *target* left (SIGKILL skips every cleanup).

    Call it only under a lock that every writer of *target* holds while it writes, so that none is in use.
    Only this module's names, only regular files of this user; a link is never followed (lstat, unlink).
    """
    ours = re.compile(rf"\.{re.escape(target.name)}\.[a-z0-9_]{{8}}{re.escape(TEMPORARY)}")
    for name in os.listdir(target.parent):
        if ours.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(target.parent / name)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    os.unlink(target.parent / name)


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
