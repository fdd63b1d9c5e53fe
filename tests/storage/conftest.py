"""Fixtures for the storage tests: queues on tmp dirs, a manual syncer, a fake memory probe."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from storage import DiskQueue


class ManualSyncer:
    """Stands in for the background syncer: records what was scheduled, runs it on demand."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[Any, float]] = []

    def schedule(self, queue: Any, delay: float) -> None:
        self.scheduled.append((queue, delay))

    def fire(self) -> int:
        due, self.scheduled = self.scheduled, []
        for queue, _ in due:
            queue._timed_sync()
        return len(due)


class FakeMemory:
    """An injectable memory probe: tests set `percent`."""

    def __init__(self, percent: float = 10.0) -> None:
        self.percent = percent

    def __call__(self) -> float:
        return self.percent


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def syncer() -> ManualSyncer:
    return ManualSyncer()


@pytest.fixture
def memory() -> FakeMemory:
    return FakeMemory()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_queue(tmp_path, syncer, memory, clock) -> Iterator[Callable[..., DiskQueue]]:
    """`open_queue(name="q", **options)` opens a queue in tmp_path; all are closed at the end."""
    opened: list[DiskQueue] = []

    def _open(name: str = "q", **options: Any) -> DiskQueue:
        options.setdefault("syncer", syncer)
        options.setdefault("memory_probe", memory)
        options.setdefault("clock", clock)
        q = DiskQueue(name, tmp_path, **options)
        opened.append(q)
        return q

    yield _open
    for q in opened:
        q.close()


def chunk_files(path: os.PathLike[str] | str, name: str = "q") -> list[str]:
    return sorted(f for f in os.listdir(path)
                  if f.startswith(f"{name}.diskqueue.0") and f.endswith(".dat"))


def drain(q: DiskQueue) -> list[bytes]:
    out = []
    while (m := q.get()) is not None:
        out.append(m)
    return out
