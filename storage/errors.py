"""Exceptions raised by the storage package.

One root (`StorageError`) so callers can catch everything storage raises;
specific subclasses for the conditions a caller handles differently.
"""

from __future__ import annotations


class StorageError(Exception):
    """Root of every exception raised by `storage`."""


class QueueClosedError(StorageError):
    """The queue or store was closed (or deleted) and cannot be used any more."""


class MessageSizeError(StorageError, ValueError):
    """A message is smaller than `min_msg_size` or larger than `max_msg_size`.

    Raised before anything is written: a batch containing one bad message is
    rejected whole.
    """

    def __init__(self, size: int, min_size: int, max_size: int) -> None:
        self.size = size
        self.min_size = min_size
        self.max_size = max_size
        super().__init__(
            f"message of {size} bytes is outside the allowed size range "
            f"[{min_size}, {max_size}] bytes"
        )


class DiskFullError(StorageError, OSError):
    """A write failed because the device has no space left; nothing was written."""


class DiskFailedError(StorageError):
    """An fsync of the queue's files failed: the queue takes no more writes.

    After a failed fsync the kernel may have dropped the dirty pages it could
    not write, and a later fsync can succeed without them (PostgreSQL's
    "fsyncgate"), so the queue never retries: nothing written since its last
    good sync is acknowledged, and it refuses every write until it is opened
    again (a restart, once the disk is fixed, recovers by scanning).
    """
