"""The broker's health, as nsqd's ``/ping`` reports it.

A publish answered ``E_PUB_FAILED`` (disk full, a failing disk) marks the
broker unhealthy, and the next publish that succeeds marks it healthy again --
nsqd's ``SetHealth`` on backend write errors.  Publishes are answered in the
gateway (the HTTP facade, ZeroMQ sessions, NSQ TCP connections it keeps) and
in the workers (the NSQ TCP connections handed to them), so each process
keeps the time and outcome of the last publish it answered, and the gateway's
``/ping`` takes the latest of them all (the workers' through their scanners'
`Alive` answers; one clock, ``CLOCK_MONOTONIC``, for the processes of a
host).  Plain module state, GIL-atomic updates.

A queue whose fsync failed takes no more writes until the broker restarts
(`storage.DiskFailedError`): its disk-queue actor records it here, in its
worker's copy of this module, and the worker's scanner reports the failed
queues of its process to the gateway's ``/ping`` (``NOK - <queue>: <error>``)
for as long as the process lives, whatever later publishes elsewhere do.
"""

from __future__ import annotations

import time

_last: tuple[float, str | None] = (0.0, None)


def record_publish(error: tuple[str, str, bool] | None) -> None:
    """Note a publish's outcome (None = it succeeded)."""
    global _last  # noqa: PLW0603 - this process's one health flag
    if error is None:
        _last = (time.monotonic(), None)
    elif error[0] == "E_PUB_FAILED":
        _last = (time.monotonic(), error[1])


def last_publish() -> tuple[float, str | None]:
    """When this process last answered a publish (``time.monotonic()``; 0: never), and
    why it was refused if storage failed it (None: stored, or refused for a reason
    that says nothing of the broker's health)."""
    return _last


def latest_reason(outcomes: list[tuple[float, str | None]]) -> str | None:
    """Of the processes' :func:`last_publish` outcomes, the latest's reason: None when
    healthy, else why not (for ``/ping``: ``NOK - <reason>``)."""
    return max(outcomes, key=lambda outcome: outcome[0])[1]


_failed_queues: dict[str, str] = {}


def record_failed_queue(queue: str, why: str) -> None:
    """Queue `queue` of this process failed (an fsync error): it stays failed."""
    _failed_queues.setdefault(queue, why)


def failed_queue(queue: str) -> str | None:
    """Why `queue` failed in this process's life, or None."""
    return _failed_queues.get(queue)


def failed_queues() -> dict[str, str]:
    """This process's failed queues: name -> why."""
    return dict(_failed_queues)
