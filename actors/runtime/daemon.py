"""What a daemon's ``main`` shares (the broker's, the lookup daemon's, the console's):
its flags, logging at the flag's level and a life in the foreground until SIGTERM or
SIGINT (:func:`serve` does all of it).

:func:`run_in_foreground` starts the daemon, then waits for a signal and
stops it in order.  A signal that comes while the daemon is still starting
stops it at once (``start()`` cleans up what it began) and exits 1; an error
the daemon raises while starting (a busy port, a locked data directory) is
one log line and exit 1.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from actors.runtime.flags import OptionsError
from actors.runtime.options import LOG_FORMAT

__all__ = ["Daemon", "log_level", "run_in_foreground", "serve", "setup_logging"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "error": logging.ERROR, "fatal": logging.CRITICAL}


def log_level(name: str) -> int:
    """The ``logging`` level of a ``--log-level`` value (nsqd's names)."""
    return _LEVELS.get(name, logging.INFO)


def setup_logging(name: str) -> None:
    """The supervisor's log records, at the ``--log-level`` `name`."""
    logging.basicConfig(level=log_level(name), format=LOG_FORMAT.format(node="supervisor"))


class Daemon(Protocol):
    def start(self) -> Any: ...

    def stop(self) -> bool: ...


def serve(argv: Sequence[str] | None, parse: Callable[[Sequence[str] | None], Any],
          make: Callable[[Any], Daemon], log: logging.Logger, *,
          running: Callable[[Any], str], **foreground: Any) -> int:
    """A daemon's ``main``: its options (`parse`; a bad flag is one line and exit 2),
    logging at their ``log_level``, then the daemon `make` makes of them in the
    foreground (:func:`run_in_foreground`; `running` says it runs, from the daemon)."""
    try:
        options = parse(argv)
    except OptionsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(options.log_level)
    daemon = make(options)
    return run_in_foreground(daemon, log, running=lambda: running(daemon), **foreground)


class _Interrupted(BaseException):
    """SIGTERM or SIGINT while the daemon starts."""


def run_in_foreground(daemon: Daemon, log: logging.Logger, *,
                      running: Callable[[], str], stopping: str = "stopping",
                      start_errors: tuple[type[BaseException], ...] = (RuntimeError,)) -> int:
    """Start `daemon`, log `running()`, wait for SIGTERM/SIGINT, stop it; the exit
    status (0: stopped cleanly)."""
    stop = threading.Event()
    starting = True

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()
        if starting:  # whatever start() waits for: stop now (start() cleans up)
            raise _Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        daemon.start()
        starting = False
    except _Interrupted as e:
        log.warning("%s while starting: stopped", e)
        return 1
    except start_errors as e:
        log.critical("%s", e)
        return 1
    log.info("%s; SIGTERM or Ctrl-C stops it", running())
    while not stop.wait(0.5):
        pass
    log.info("%s", stopping)
    clean = daemon.stop()
    log.info("stopped %s", "cleanly" if clean else "after killing stragglers")
    return 0 if clean else 1
