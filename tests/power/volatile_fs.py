"""A FUSE file system that loses, at unmount, everything a power cut may lose.

Usage: ``python -m tests.power.volatile_fs BACKING MOUNTPOINT`` (foreground;
unmount with ``fusermount3 -u MOUNTPOINT``).

Every operation is passed through to the ``BACKING`` directory at once, so
readers see it; but until it is made durable the way POSIX says it must be,
it is also *volatile*, and unmounting -- the "power cut" -- takes back every
volatile change before the process exits:

* a file's bytes and size are volatile until the file is fsynced
  (``fsync`` or ``fdatasync``): the old bytes of each range written and the
  size before the first change are kept, and put back at the cut;
* a directory entry created, renamed or removed (``create``, ``mknod``,
  ``mkdir``, ``rename``, ``unlink``, ``rmdir``) is volatile until its
  directory is fsynced: a created file is removed again (whatever was synced
  into it), a rename is moved back, and a removed file comes back from where
  it was kept (``.vfs-trash`` in the backing directory).

A failing disk: while the backing directory holds a file ``.vfs-eio``, every
fsync of a file whose path contains the text in it fails with EIO (and what
it should have made durable stays volatile).  A full disk: while it holds a
file ``.vfs-full``, whatever needs new space fails with ENOSPC (creating a
file or directory, writing or allocating past a file's end, growing it);
writes inside a file's existing size still succeed, as on a real file system
whose blocks were allocated.

Unmounting flushes the kernel's dirty pages first, so what a killed process
left in its writable ``mmap`` reaches this file system as writes -- volatile
ones -- before the cut.  One lock serialises the operations.  A file's undo
record is keyed by its backing inode, which renames keep.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import stat
import sys
import threading
from typing import Any

import mfusepy as fuse

log = logging.getLogger("volatile_fs")

TRASH = ".vfs-trash"
EIO_CONTROL = ".vfs-eio"
FULL_CONTROL = ".vfs-full"


class VolatileFS(fuse.Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(self, backing: str) -> None:
        self.root = os.path.realpath(backing)
        self.trash = os.path.join(self.root, TRASH)
        os.makedirs(self.trash, exist_ok=True)
        self._mutex = threading.Lock()
        self.ids = itertools.count()
        # inode -> (size before the first unsynced change, [(offset, old bytes), ...])
        self.undo: dict[int, tuple[int, list[tuple[int, bytes]]]] = {}
        # directory (relative) -> [op, ...] since its last fsync, oldest first
        self.dirlog: dict[str, list[tuple[Any, ...]]] = {}

    # -- helpers ---------------------------------------------------------------------

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    @staticmethod
    def _dir(path: str) -> str:
        return os.path.dirname(path.rstrip("/")) or "/"

    def _log(self, path: str, *op: Any) -> None:
        self.dirlog.setdefault(self._dir(path), []).append(op)

    def _remember(self, full: str, offset: int, length: int) -> None:
        """Keep the bytes [offset, offset+length) of `full` before they change."""
        st = os.stat(full)
        size, ranges = self.undo.setdefault(st.st_ino, (st.st_size, []))
        if offset < size:
            with open(full, "rb") as f:
                f.seek(offset)
                ranges.append((offset, f.read(min(length, size - offset))))

    def _to_trash(self, full: str) -> str:
        kept = os.path.join(self.trash, str(next(self.ids)))
        os.rename(full, kept)
        return kept

    # -- the cut ---------------------------------------------------------------------

    def cut(self) -> None:
        """Take back every volatile change (the data first, then the directories)."""
        inodes: dict[int, str] = {}
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                full = os.path.join(dirpath, name)
                inodes[os.lstat(full).st_ino] = full
        for ino, (size, ranges) in self.undo.items():
            full = inodes.get(ino)
            if full is None:
                continue
            with open(full, "r+b") as f:
                for offset, old in reversed(ranges):
                    f.seek(offset)
                    f.write(old)
                f.truncate(size)
        lost = sum(len(ops) for ops in self.dirlog.values())
        for ops in self.dirlog.values():
            for op in reversed(ops):
                self._revert(op)
        log.warning("power cut: %d files' unsynced bytes and %d directory changes undone",
                    len(self.undo), lost)
        self.undo.clear()
        self.dirlog.clear()

    def _revert(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "create":
            full = self._full(op[1])
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)  # a directory never made durable goes, whatever it held
            elif os.path.lexists(full):
                os.unlink(full)
        elif kind == "remove":
            os.rename(op[2], self._full(op[1]))
        elif kind == "rmdir":
            os.mkdir(self._full(op[1]))
        elif kind == "rename":
            _, old, new, displaced = op
            os.rename(self._full(new), self._full(old))
            if displaced is not None:
                os.rename(displaced, self._full(new))

    def destroy(self, path: str) -> None:
        with self._mutex:
            self.cut()

    # -- durability ------------------------------------------------------------------

    def _no_space(self) -> None:
        if os.path.exists(os.path.join(self.root, FULL_CONTROL)):
            raise fuse.FuseOSError(errno.ENOSPC)

    def _failing(self, path: str) -> bool:
        try:
            with open(os.path.join(self.root, EIO_CONTROL)) as f:
                pattern = f.read().strip()
        except FileNotFoundError:
            return False
        return pattern in path

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        if self._failing(path):
            raise fuse.FuseOSError(errno.EIO)
        with self._mutex:
            os.fsync(fh)
            self.undo.pop(os.fstat(fh).st_ino, None)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self.dirlog.pop(path if path != "" else "/", None)
        return 0

    # -- files -----------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._full(path))
        return {k: getattr(st, k) for k in ("st_atime_ns", "st_ctime_ns", "st_gid", "st_mode",
                                           "st_mtime_ns", "st_nlink", "st_size", "st_uid")}

    def readdir(self, path: str, fh: int) -> list[str]:
        names = os.listdir(self._full(path))
        return [".", "..", *(n for n in names if path != "/" or not n.startswith(".vfs-"))]

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            full = self._full(path)
            if flags & os.O_TRUNC:
                self._remember(full, 0, os.stat(full).st_size)
            # Read-write whatever the caller asked (a write keeps the bytes it replaces),
            # and no O_APPEND: the kernel sends every write with its offset.
            return os.open(full, (flags & ~(os.O_ACCMODE | os.O_APPEND)) | os.O_RDWR)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._no_space()
        with self._mutex:
            full = self._full(path)
            existed = os.path.lexists(full)
            if existed:
                self._remember(full, 0, os.stat(full).st_size)
            fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
            if not existed:
                self._log(path, "create", path)
            return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            st = os.fstat(fh)
            if offset + len(data) > st.st_size:
                self._no_space()
            size, ranges = self.undo.setdefault(st.st_ino, (st.st_size, []))
            if offset < size:
                ranges.append((offset, os.pread(fh, min(len(data), size - offset), offset)))
            return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self._mutex:
            full = self._full(path)
            st = os.stat(full)
            if length < st.st_size:
                self._remember(full, length, st.st_size - length)
            else:
                if length > st.st_size:
                    self._no_space()
                self.undo.setdefault(st.st_ino, (st.st_size, []))
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(full, length)
        return 0

    def fallocate(self, path: str, mode: int, offset: int, length: int, fh: int) -> int:
        if mode:
            raise fuse.FuseOSError(errno.EOPNOTSUPP)
        with self._mutex:
            st = os.fstat(fh)
            if offset + length > st.st_size:
                self._no_space()
            self.undo.setdefault(st.st_ino, (st.st_size, []))
            os.posix_fallocate(fh, offset, length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    # -- directory entries -----------------------------------------------------------

    def mknod(self, path: str, mode: int, dev: int) -> int:
        if not stat.S_ISSOCK(mode):
            self._no_space()
        with self._mutex:
            os.mknod(self._full(path), mode, dev)
            if not stat.S_ISSOCK(mode):
                self._log(path, "create", path)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self._no_space()
        with self._mutex:
            os.mkdir(self._full(path), mode)
            self._log(path, "create", path)
        return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            full = self._full(path)
            if stat.S_ISSOCK(os.lstat(full).st_mode):
                os.unlink(full)
            else:
                self._log(path, "remove", path, self._to_trash(full))
        return 0

    def rmdir(self, path: str) -> int:
        with self._mutex:
            full = self._full(path)
            os.rmdir(full)
            self._log(path, "rmdir", path)
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        with self._mutex:
            full_new = self._full(new)
            displaced = self._to_trash(full_new) if os.path.lexists(full_new) else None
            os.rename(self._full(old), full_new)
            # Both directories must be synced; the new one is where a sync is expected.
            self._log(new, "rename", old, new, displaced)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        os.utime(self._full(path), ns=times)
        return 0

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                           "f_favail", "f_ffree", "f_files", "f_flag",
                                           "f_frsize", "f_namemax")}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="volatile_fs: %(message)s")
    backing, mountpoint = argv
    fuse.FUSE(VolatileFS(backing), mountpoint, foreground=True, nothreads=False,
              allow_other=False, default_permissions=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
