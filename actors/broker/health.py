"""The gateway's view of the broker's health, as nsqd's ``/ping`` reports it.

Every publish goes through the gateway (client actors and the HTTP facade),
so the gateway sees storage failures: a publish answered ``E_PUB_FAILED``
(disk full, a failing disk) marks the broker unhealthy, and the next publish
that succeeds marks it healthy again -- nsqd's ``SetHealth`` on backend
write errors.  Plain module state: one gateway process, GIL-atomic updates.
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
