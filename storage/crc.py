"""CRC-32C (Castagnoli), the storage's checksum, from the ``crc32c`` wheel's extension.

``import crc32c`` runs the package's ``__init__``, which reads its own version
through ``importlib.metadata`` (importing ``email`` and compiling its regular
expressions): ~13 ms of every broker process's start here, for one C function.
So the extension module is loaded by itself; a wheel laid out otherwise is
imported as a package.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from collections.abc import Callable


def _load() -> Callable[..., int]:
    try:
        package = importlib.util.find_spec("crc32c")  # (finds; imports nothing)
        if package is None or not package.submodule_search_locations:
            raise ImportError("no crc32c package")
        finder = importlib.machinery.FileFinder(
            package.submodule_search_locations[0],
            (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES))
        spec = finder.find_spec("crc32c._crc32c")
        if spec is None or spec.loader is None:
            raise ImportError("no crc32c._crc32c extension")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.crc32c  # type: ignore[no-any-return]
    except ImportError:
        from crc32c import crc32c  # noqa: PLC0415

        return crc32c


crc32c = _load()
"""``crc32c(data, value=0, gil_release_mode=-1) -> int``, as the wheel's."""
