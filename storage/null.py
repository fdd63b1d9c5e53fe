"""`NullQueue`: the disk queue of `#ephemeral` topics and channels (nsq's dummy backend).

It has `DiskQueue`'s interface and keeps nothing: what is put is counted and
dropped, reads find nothing.  The broker keeps ephemeral messages in memory
only; overflow that would have gone to disk goes here and is counted as
dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from storage.errors import MessageSizeError, QueueClosedError


class NullQueue:
    """Accepts and discards messages; always empty."""

    ack_mode = False

    def __init__(self, name: str, *, min_msg_size: int = 0, max_msg_size: int = 1024 * 1024,
                 **_ignored: Any) -> None:
        self.name = name
        self._min = min_msg_size
        self._max = max_msg_size
        self._closed = threading.Event()
        self.dropped = 0
        self.dropped_bytes = 0

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise QueueClosedError(f"queue {self.name} is closed")

    def put(self, data: bytes) -> None:
        self.put_many((data,))

    def put_many(self, messages: Iterable[bytes]) -> None:
        self._check_open()
        messages = list(messages)
        for m in messages:
            if not self._min <= len(m) <= self._max:
                raise MessageSizeError(len(m), self._min, self._max)
        self.dropped += len(messages)
        self.dropped_bytes += sum(map(len, messages))

    def get(self, timeout: float | None = 0.0) -> bytes | None:
        self.read(timeout)
        return None

    def get_many(self, limit: int, timeout: float | None = 0.0) -> list[bytes]:
        self.read(timeout)
        return []

    def read(self, timeout: float | None = 0.0) -> tuple[int, bytes] | None:
        self._check_open()
        if timeout != 0:
            self._closed.wait(timeout)
        return None

    def read_many(self, limit: int, timeout: float | None = 0.0) -> list[tuple[int, bytes]]:
        self.read(timeout)
        return []

    def ack(self, position: int) -> bool:
        return False

    def ack_many(self, positions: Iterable[int]) -> int:
        return 0

    def depth(self) -> int:
        return 0

    def pending(self) -> int:
        return 0

    def sync(self) -> None:
        self._check_open()

    def empty(self) -> None:
        self._check_open()

    def close(self, *, sync: bool = True) -> None:
        self._closed.set()

    def delete(self) -> None:
        self.close()

    def __enter__(self) -> NullQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "depth": 0, "pending": 0, "ack_mode": False,
                "dropped": self.dropped, "dropped_bytes": self.dropped_bytes}
