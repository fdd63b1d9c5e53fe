"""POSTing JSON events to an operator's URL without ever making the broker wait.

Theory of operation
-------------------
:meth:`Webhook.post` puts the event on a queue and returns; one daemon thread
per URL and process (:func:`webhook_for`) sends them in order, each as one
``POST`` with a JSON body.  A send that fails (no connection, a timeout, any
status but 2xx) is tried again after a backoff that doubles from
:data:`FIRST_BACKOFF` to :data:`MAX_BACKOFF`, up to :data:`ATTEMPTS` times;
then the event is logged and dropped, and the next one is tried.  Events
wait in memory, at most :data:`MAX_QUEUED` (the oldest is dropped, logged,
beyond that): a receiver that is down for a day costs the broker a bounded
queue, never a blocked actor.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ATTEMPTS = 10
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
MAX_QUEUED = 10_000
TIMEOUT = 5.0


class Webhook:
    """See the module docstring; `sleep` is injectable for tests."""

    def __init__(self, url: str, *, sleep: Callable[[float], Any] = time.sleep,
                 first_backoff: float = FIRST_BACKOFF, attempts: int = ATTEMPTS) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a webhook is an http:// or https:// URL, not {url!r}")
        self.url = url
        self.sleep = sleep
        self.first_backoff = first_backoff
        self.attempts = attempts
        self.sent = 0
        self.dropped = 0
        self._queue: deque[dict[str, Any]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def post(self, event: dict[str, Any]) -> None:
        """Queue `event` (JSON-serialisable) to be sent; never blocks."""
        with self._cond:
            if len(self._queue) >= MAX_QUEUED:
                old = self._queue.popleft()
                self.dropped += 1
                log.error("webhook %s: %d events waiting; dropped the oldest: %s",
                          self.url, MAX_QUEUED, old)
            self._queue.append(event)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="webhook", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                event = self._queue[0]
            self._deliver(event)
            with self._cond:
                self._queue.popleft()

    def _deliver(self, event: dict[str, Any]) -> None:
        import urllib.error  # noqa: PLC0415 - with a webhook only, not in every start
        import urllib.request  # noqa: PLC0415

        body = json.dumps(event, separators=(",", ":")).encode()
        backoff = self.first_backoff
        for attempt in range(1, self.attempts + 1):
            try:
                request = urllib.request.Request(  # noqa: S310 - http(s) only (__init__)
                    self.url, data=body, method="POST",
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:  # noqa: S310
                    reply.read()
                self.sent += 1
                return
            except (urllib.error.URLError, OSError, ValueError) as e:
                # (HTTPError, a status other than 2xx, is a URLError)
                if attempt == self.attempts:
                    self.dropped += 1
                    log.error("webhook %s: gave up after %d attempts (%s); dropped %s",
                              self.url, attempt, e, event)
                    return
                log.warning("webhook %s: attempt %d failed (%s); again in %gs",
                            self.url, attempt, e, backoff)
                self.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)


_HOOKS: dict[str, Webhook] = {}
_LOCK = threading.Lock()


def webhook_for(url: str) -> Webhook:
    """This process's sender for `url` (made on first use)."""
    with _LOCK:
        hook = _HOOKS.get(url)
        if hook is None:
            hook = _HOOKS[url] = Webhook(url)
        return hook
