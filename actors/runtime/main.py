"""Run the actor runtime in the foreground, or connect to one from another process.

``python -m actors.runtime --run-dir DIR --workers 2 --factory echo=pkg.mod:EchoActor``
starts a :class:`~actors.runtime.supervisor.Supervisor`, blocks until SIGTERM or
SIGINT, then performs the orderly shutdown and exits 0 (1 if a node had to be
killed at the deadline).  The broker's entry point (``python -m
actors.broker``) builds on the same pieces.

:func:`connect` gives any other process (a benchmark, a tool) an endpoint that
can ``tell``/``ask`` actors of a running runtime; it reads the topology from
``<run_dir>/runtime.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from actors.runtime.actor import Actor
from actors.runtime.endpoint import Endpoint
from actors.runtime.options import RuntimeOptions
from actors.runtime.placement import Placement
from actors.runtime.supervisor import RUNTIME_FILE, Supervisor

__all__ = ["connect", "main"]


def connect(run_dir: str | os.PathLike[str]) -> Endpoint:
    """An endpoint in this process that can reach the actors of a running runtime.

    Close it with ``endpoint.close()``.
    """
    with open(os.path.join(os.fspath(run_dir), RUNTIME_FILE), encoding="utf-8") as f:
        info = json.load(f)
    options = RuntimeOptions(**info["options"])
    return Endpoint.external(run_dir, Placement(options.workers), options)


def load_factory(spec: str) -> tuple[str, Callable[[str], Actor]]:
    """Parse ``PREFIX=module:attribute`` into ``(prefix, factory)``."""
    prefix, sep, target = spec.partition("=")
    module_name, colon, attribute = target.partition(":")
    if not sep or not colon:
        msg = f"--factory expects PREFIX=module:attribute, got {spec!r}"
        raise argparse.ArgumentTypeError(msg)
    factory: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        factory = getattr(factory, part)
    return prefix, factory


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = RuntimeOptions()
    p = argparse.ArgumentParser(prog="python -m actors.runtime", description=__doc__)
    p.add_argument("--run-dir", required=True, help="directory for ipc sockets")
    p.add_argument("--workers", type=int, default=defaults.workers)
    p.add_argument(
        "--factory",
        action="append",
        default=[],
        type=load_factory,
        metavar="PREFIX=module:attr",
        help="actor factory for names PREFIX:*",
    )
    p.add_argument(
        "--spawn",
        action="append",
        default=[],
        metavar="NAME",
        help="actor to create at start (and after every node restart)",
    )
    p.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout)
    p.add_argument("--mailbox-size", type=int, default=defaults.mailbox_size)
    p.add_argument("--send-timeout", type=float, default=defaults.send_timeout)
    p.add_argument("--max-restarts", type=int, default=defaults.max_restarts)
    p.add_argument("--restart-window", type=float, default=defaults.restart_window)
    p.add_argument("--debug-hooks", action="store_true", help="allow `actors.ctl crash`")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s supervisor %(levelname)s %(message)s")
    options = RuntimeOptions(
        workers=args.workers,
        shutdown_timeout=args.shutdown_timeout,
        mailbox_size=args.mailbox_size,
        send_timeout=args.send_timeout,
        max_restarts=args.max_restarts,
        restart_window=args.restart_window,
        debug_hooks=args.debug_hooks,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stop.set())
    signal.signal(signal.SIGINT, lambda _s, _f: stop.set())
    supervisor = Supervisor(args.run_dir, dict(args.factory), options, log_level=level)
    supervisor.start()
    for name in args.spawn:
        supervisor.spawn(name)
    print(f"actors runtime running in {args.run_dir} (pid {os.getpid()})", flush=True)
    while not stop.wait(0.5):
        pass
    return 0 if supervisor.stop() else 1
