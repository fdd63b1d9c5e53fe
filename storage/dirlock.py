"""`DirLock`: one owner per data directory, by an OS lock (as nsqd's dirlock).

The lock is ``flock(LOCK_EX)`` on ``<dir>/.lock``, taken before anything else
in the directory is touched.  The OS holds it for as long as an open file
description of the lock file is open, so a ``kill -9`` releases it: a stale
lock file never blocks a restart.  The file holds the owner's PID, for the
message a second owner gets.

Processes started by the owner may share the lock (`inheritable_fd`): then
it is held until the last of them exits, so a broker restarted while the
children of a killed one are still flushing waits for them instead of
writing beside them (`acquire(wait=...)` while the PID in the file is dead).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from storage.errors import StorageError
from storage.meta import makedirs_durable

__all__ = ["DirLock", "DirLockedError"]

LOCK_FILE = ".lock"


class DirLockedError(StorageError):
    """The directory belongs to another live process (`pid`, when known)."""

    def __init__(self, path: str, pid: int | None) -> None:
        holder = f" (pid {pid})" if pid else ""
        super().__init__(f"data path {path} is in use by another broker{holder}")
        self.path = path
        self.pid = pid


class DirLock:
    """``DirLock(path).acquire()`` ... ``release()``; a context manager too."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.fd = -1

    def acquire(self, wait: float = 0.0) -> DirLock:
        """Take the lock, or raise `DirLockedError` at once -- unless the PID recorded
        in the file is dead (its children still hold the lock while they stop): then
        wait up to `wait` seconds for them.  Raises StorageError if the directory
        cannot be created or written."""
        try:
            makedirs_durable(self.path)
            fd = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(f"data path {self.path} cannot be used: {e.strerror}") from e
        deadline = time.monotonic() + wait
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pid = _read_pid(fd)
                    if (pid is not None and _alive(pid)) or time.monotonic() >= deadline:
                        raise DirLockedError(self.path, pid) from None
                    time.sleep(0.05)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the OS lock goes with the last open description
            self.fd = -1

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(os.pread(fd, 32, 0).split()[0])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
