"""Atomic, durable metadata files: temp file, fsync, `os.replace`, fsync the directory."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """`os.makedirs`, then fsync the parent of every directory it created: a new
    directory's entry survives a power cut only once its parent is synced."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    for created in reversed(missing):  # the topmost first
        fsync_dir(os.path.dirname(created))


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, sort_keys=True).encode() + b"\n")


def read_json(path: str) -> dict[str, Any] | None:
    """The object in `path`; None if missing or unreadable (logged, the file kept aside)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise ValueError("not an object")
    except ValueError as e:
        log.warning("metadata file %s is unreadable (%s); ignoring it", path, e)
        with contextlib.suppress(OSError):
            os.replace(path, f"{path}.bad")
        return None
    return obj
