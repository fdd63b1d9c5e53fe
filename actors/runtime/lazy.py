"""Package attributes imported on first use (PEP 562), for the daemons' packages.

``python -m actors.broker`` runs ``actors/broker/__init__.py`` before its
``__main__``, which must start the fork server before the broker's own imports
(actors/runtime/forkserver.py): so the packages name their public classes here
instead of importing them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attributes"]


def attributes(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for `package` that imports ``where[name]`` on first use."""

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return getattr_
