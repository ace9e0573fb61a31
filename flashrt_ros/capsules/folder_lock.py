"""One capsule_dir, one user at a time: an exclusive lock on `<capsule_dir>/.flashrt.lock`.

Two nodes given the same capsule_dir (two arms, one copied params file) each reload the other's
capsules at start, and a drop or a flight dump's trim in one deletes files the other holds.
The lock is flock(2): held while the file stays open, given back by the kernel when the process
ends however it ends (kill -9 too), so a crashed node never leaves a stale lock. The file names
its holder, so the second user is told who has the folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from pathlib import Path

from flashrt_ros.capsules.store import make_folder
from flashrt_ros.errors import BadRequest

LOCK_NAME = ".flashrt.lock"


class FolderLock:
    """The held lock of a folder; release() (or the process's end) gives it back."""

    def __init__(self, folder: Path, fd: int | None, why_unlocked: str = ""):
        self.folder = folder
        self._fd = fd
        # why the folder is used without a lock ("" when locked): a read-only folder
        self.why_unlocked = why_unlocked

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor drops the flock


def lock_folder(folder: str | Path, owner: str) -> FolderLock:
    """Take `folder`'s lock for `owner` (say, a node's name), creating the folder when it does
    not exist. BadRequest naming the holder when another process (or another lock in this one)
    has it. A folder where the lock file cannot be written (read-only: nothing in it can be
    changed either) is used unlocked, and the returned lock says why."""
    d = make_folder(Path(folder).expanduser())
    path = d / LOCK_NAME
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise BadRequest(f"cannot open the lock file {path}: {e.strerror}") from None
        try:  # another user's lock file (a run with sudo): flock needs no write access
            fd = os.open(path, os.O_RDONLY | flags)
        except OSError:  # none there, and none can be made: nothing here can be changed either
            return FolderLock(d, None, f"cannot write {path}: {e.strerror}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(_read(fd))
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise BadRequest(f"cannot lock {path}: {e.strerror}") from None
        raise BadRequest(
            f"capsule_dir {d} is in use by {holder or 'another process'}: give each node a "
            "capsule_dir of its own (two users of one folder reload each other's capsules and "
            "delete each other's files)"
        ) from None
    with contextlib.suppress(OSError):  # only informative: the lock holds without it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner} (pid {os.getpid()})\n".encode(), 0)
    return FolderLock(d, fd)


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    return ""


def _holder(text: str) -> str:
    """The lock file's text when it can name the holder: its pid still runs. A holder that
    took the lock read-only (another user's file) could not write its own name, so the text
    may be an earlier holder's; the pid check catches that one once it has ended."""
    m = re.search(r"\(pid (\d+)\)$", text)
    if m is None:
        return ""
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return ""
    except (PermissionError, OverflowError, ValueError):
        pass  # another user's process: it runs
    return text
