"""Options of a daemon from defaults, a TOML config file and flags (nsqd's way).

Theory of operation
-------------------
A daemon's options are one frozen dataclass whose fields carry their kind and
help text (:func:`opt`); this module turns such a class into its command line
(:func:`build_parser`: a flag per field, ``--config`` and ``--version``),
reads a config file with the same keys (``mem_queue_size`` or
``mem-queue-size``), and converts every raw value to the field's kind
(:func:`convert`), later layers winning::

    field defaults  <  --config FILE (TOML)  <  command-line flags

Kinds: ``str``, ``address`` (``host:port``), ``zmq_address``, ``int``,
``float``, ``bool``, ``duration`` (seconds, written as Go durations:
``"100ms"``, ``"2s"``, ``"1m30s"``, and ``d`` for days, ``"7d"``; or a plain number
of seconds),
``log_level``; ``?`` after a kind allows None (empty), ``[]`` makes the flag
repeatable and the value a tuple.  Any bad value raises
:class:`OptionsError` (a ``ValueError``) whose sentence names the option.
Validation of the values together is the dataclass's own
(``__post_init__``).  The broker (:mod:`actors.broker.options`) and the lookup
daemon (:mod:`actors.lookupd.options`) share it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transport.protocol.duration import format_duration, parse_duration

if TYPE_CHECKING:
    import argparse

__all__ = [
    "LOG_LEVELS",
    "OptionsError",
    "build_parser",
    "check_host_port",
    "convert",
    "fail",
    "fields_of",
    "format_duration",
    "load_config",
    "opt",
    "parse_duration",
    "parse_flags",
]

LOG_LEVELS = ("debug", "info", "warn", "error", "fatal")
"""Accepted ``--log-level`` values (nsqd's; ``warning`` is read as ``warn``)."""


class OptionsError(ValueError):
    """An option has a bad value, or the config file is unreadable; ``option`` names it."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def opt(default: Any, kind: str, help_text: str) -> Any:
    """A field of an options dataclass: its default, kind and help text."""
    return field(default=default, metadata={"kind": kind, "help": help_text})


@functools.cache
def fields_of(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of options dataclass `cls`, by name."""
    return {f.name: f for f in dataclasses.fields(cls)}


def fail(name: str, problem: str) -> OptionsError:
    """The error for option `name` whose value has `problem`."""
    return OptionsError(f"invalid option {name}: {problem}", name)


def check_host_port(name: str, value: str) -> None:
    """`value` must be ``<host>:<port>``."""
    host, sep, port = value.rpartition(":")
    ok = (
        bool(sep)
        and port.isdigit()
        and int(port) <= 65535
        and (":" not in host or (host.startswith("[") and host.endswith("]")))
    )
    if not ok:
        raise fail(name, f'expected "<host>:<port>" (e.g. "127.0.0.1:4150"), got {value!r}')


# ---------------------------------------------------------------------------
# Conversion of raw values (config file or command line) to field kinds


def convert(cls: type, name: str, raw: object, label: str | None = None) -> object:
    """`raw` as option `name`'s type (a field of `cls`); errors name it as `label`
    (default: its flag)."""
    kind = fields_of(cls)[name].metadata["kind"]
    if kind.endswith("[]"):  # repeatable: a list of the base kind (a lone value is one)
        items = raw if isinstance(raw, list | tuple) else [raw]
        return tuple(_convert_one(kind[:-2], name, item, label) for item in items)
    return _convert_one(kind, name, raw, label)


def _convert_one(kind: str, name: str, raw: object, label: str | None) -> object:
    try:
        if kind.endswith("?"):
            if raw is None or raw == "":
                return None
            kind = kind[:-1]
        if kind == "duration":
            return parse_duration(raw)
        if kind == "int":
            if isinstance(raw, bool) or not isinstance(raw, int | str):
                raise ValueError
            return int(raw)
        if kind == "float":
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ValueError
            return float(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"true", "1", "yes", "on"}:
                return True
            if text in {"false", "0", "no", "off"}:
                return False
            raise ValueError
        if kind == "log_level":
            level = str(raw).strip().lower()
            return "warn" if level == "warning" else level
        if not isinstance(raw, str):
            raise ValueError
        return raw
    except ValueError as e:
        expected = {"int": "an integer", "float": "a number", "bool": "true or false"}
        what = expected.get(kind, "a duration" if kind == "duration" else "a string")
        msg = f"{label or '--' + name.replace('_', '-')} must be {what}, got {raw!r}"
        raise OptionsError(msg, name) from e


def _normalise_keys(cls: type, mapping: Mapping[str, object],
                    source: str) -> dict[str, object]:
    out: dict[str, object] = {}
    known = fields_of(cls)
    for key, value in mapping.items():
        name = key.replace("-", "_")
        if name not in known:
            import difflib  # noqa: PLC0415 - (a node imports this module, never a typo)

            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            msg = f"unknown option {key!r} in {source}{hint}"
            raise OptionsError(msg, key)
        if name in out:
            msg = f"option {name} is given twice in {source} (as {name!r} and with dashes)"
            raise OptionsError(msg, name)
        out[name] = convert(cls, name, value, name)  # (a config file's key)
    return out


def load_config(cls: type, path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a TOML config file into ``{field name of cls: converted value}``."""
    import tomllib  # noqa: PLC0415 - (only for --config; nodes import this module)

    source = f"config file {os.fspath(path)}"
    try:
        with Path(path).open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        msg = f"{source} does not exist"
        raise OptionsError(msg, "config") from e
    except tomllib.TOMLDecodeError as e:
        msg = f"{source} is not valid TOML: {e}"
        raise OptionsError(msg, "config") from e
    except OSError as e:
        msg = f"{source} cannot be read: {e.strerror or e}"
        raise OptionsError(msg, "config") from e
    return _normalise_keys(cls, data, source)


# ---------------------------------------------------------------------------
# Command line


def _default_text(f: dataclasses.Field[Any]) -> str:
    default: Any = f.default
    if default in (None, ()) or "(default" in f.metadata["help"]:  # (the help says it better)
        return ""
    if f.metadata["kind"] == "duration":
        return f" (default {format_duration(default)})"
    text = f" (default {default!r})" if isinstance(default, str) else f" (default {default})"
    return text.replace("%", "%%")  # (argparse formats help with %)


_METAVARS = {
    "str": "TEXT",
    "address": "HOST:PORT",
    "zmq_address": "ENDPOINT",
    "log_level": "LEVEL",
    "int": "N",
    "float": "X",
    "duration": "DURATION",
}


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of an options dataclass `cls`: a flag per field (``--config``
    and ``--version`` too); absent flags are absent from the namespace (no defaults)."""
    # (argparse and gettext: 2.4 ms that the nodes, which import this module for the
    # options' fields, never need)
    import argparse  # noqa: PLC0415

    from actors import __version__  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with the same keys as the flags"
    )
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + _default_text(f)
        kind = f.metadata["kind"]
        if kind == "bool":  # --x, --x=false as nsqd takes it, and --no-x
            parser.add_argument(flag, dest=f.name, nargs="?", const=True, metavar="true|false",
                                help=help_text)
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                                help=argparse.SUPPRESS)
        elif kind.endswith("[]"):
            parser.add_argument(flag, dest=f.name, metavar=_METAVARS[kind[:-2]],
                                action="append", help=help_text + " (repeatable)")
        else:
            metavar = _METAVARS[kind.rstrip("?")]
            parser.add_argument(flag, dest=f.name, metavar=metavar, help=help_text)
    return parser


def parse_flags(cls: type, parser: argparse.ArgumentParser,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Field values of `cls` from defaults < ``--config FILE`` < flags, converted
    (not yet validated: construct `cls` with them).

    ``argparse`` exits on unknown flags and ``--help``/``--version``; a bad
    value raises :class:`OptionsError`.
    """
    namespace = vars(parser.parse_args(argv))
    config_path = namespace.pop("config", None)
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(load_config(cls, config_path))
    values.update({name: convert(cls, name, raw) for name, raw in namespace.items()})
    return values
