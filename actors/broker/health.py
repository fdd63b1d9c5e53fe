"""The broker's health, as nsqd's ``/ping`` reports it.

Every publish goes through the gateway (client actors and the HTTP facade),
so the gateway sees storage failures: a publish answered ``E_PUB_FAILED``
(disk full, a failing disk) marks the broker unhealthy, and the next publish
that succeeds marks it healthy again -- nsqd's ``SetHealth`` on backend
write errors.  Plain module state: one gateway process, GIL-atomic updates.

A queue whose fsync failed takes no more writes until the broker restarts
(`storage.DiskFailedError`): its disk-queue actor records it here, in its
worker's copy of this module, and the worker's scanner reports the failed
queues of its process to the gateway's ``/ping`` (``NOK - <queue>: <error>``)
for as long as the process lives, whatever later publishes elsewhere do.
"""

from __future__ import annotations

_reason: str | None = None


def record_publish(error: tuple[str, str, bool] | None) -> None:
    """Note a publish's outcome (None = it succeeded)."""
    global _reason  # noqa: PLW0603 - the gateway's one health flag
    if error is None:
        _reason = None
    elif error[0] == "E_PUB_FAILED":
        _reason = error[1]


def reason() -> str | None:
    """None when healthy, else why not (for ``/ping``: ``NOK - <reason>``)."""
    return _reason


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
