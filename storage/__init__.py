"""Pure, synchronous, embeddable storage: chunk files, DiskQueue, delayed store.

Imports nothing else of this project, so a Python program can embed it the
way Go programs embed go-diskqueue.
"""

from storage.delayed import DelayedStore
from storage.diskqueue import DiskQueue
from storage.errors import (
    DiskFailedError,
    DiskFullError,
    MessageSizeError,
    QueueClosedError,
    StorageError,
)
from storage.null import NullQueue

__all__ = [
    "DelayedStore",
    "DiskFailedError",
    "DiskFullError",
    "DiskQueue",
    "MessageSizeError",
    "NullQueue",
    "QueueClosedError",
    "StorageError",
]
