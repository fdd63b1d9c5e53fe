"""Fixtures of the power-cut rig: a mounted volatile file system and a broker on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.power.rig import BrokerProcess, MountError, VolatileMount, fuse_problem


@pytest.fixture
def fs(tmp_path) -> Iterator[VolatileMount]:
    """The rig mounted on a tmp dir; skipped, saying why, where FUSE cannot mount."""
    if (problem := fuse_problem()) is not None:
        pytest.skip(problem)
    mount = VolatileMount(tmp_path)
    try:
        mount.up()
    except MountError as e:
        pytest.skip(str(e))
    yield mount
    with contextlib.suppress(Exception):
        mount.cut()


@pytest.fixture
def broker(fs: VolatileMount) -> Iterator[BrokerProcess]:
    """Our durable broker on the rig (not started); killed at the end.  A long data
    path keeps its ipc sockets in /tmp, off the volatile mount."""
    b = BrokerProcess(fs.mount / ("d" * 80))
    yield b
    with contextlib.suppress(Exception):
        b.kill9()
