"""transport.http.webhook: events POSTed in order, retried with a doubling backoff, never
blocking the caller, dropped (and counted) only after the last attempt."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from transport.http import webhook as wh

pytestmark = pytest.mark.timeout(30)


class Receiver:
    """A local HTTP server answering each POST with the next status of `statuses`
    (then 200), recording the JSON bodies it accepted."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.accepted: list[dict] = []
        self.tries = 0
        self.got = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.got:
                    receiver.tries += 1
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                    if status == 200:
                        assert self.headers["Content-Type"] == "application/json"
                        receiver.accepted.append(json.loads(body))
                    receiver.got.notify_all()
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, predicate, what: str) -> None:
        with self.got:
            assert self.got.wait_for(predicate, timeout=10), what


def _until(predicate) -> None:
    """The sender counts a send once the receiver has answered: wait for that."""
    done = threading.Event()
    for _ in range(1000):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("timed out")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([])
    yield r
    r.server.shutdown()


def test_events_arrive_in_order_and_a_failed_send_is_retried_with_a_doubling_backoff(receiver):
    receiver.statuses[:] = [500, 503]
    slept: list[float] = []
    hook = wh.Webhook(receiver.url, sleep=slept.append, first_backoff=0.5)
    for i in range(3):
        hook.post({"n": i})  # returns at once, whatever the receiver does
    receiver.wait(lambda: len(receiver.accepted) == 3, "three events")
    assert receiver.accepted == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert receiver.tries == 5
    assert slept == [0.5, 1.0]
    _until(lambda: hook.pending() == 0)
    assert hook.sent == 3
    assert hook.dropped == 0


def test_an_event_is_dropped_after_the_last_attempt_and_the_next_one_still_goes(receiver):
    receiver.statuses[:] = [500, 500, 500]
    hook = wh.Webhook(receiver.url, sleep=lambda _s: None, attempts=3)
    hook.post({"n": "lost"})
    hook.post({"n": "next"})
    receiver.wait(lambda: receiver.accepted, "the next event")
    assert receiver.accepted == [{"n": "next"}]
    _until(lambda: hook.pending() == 0)
    assert hook.dropped == 1


def test_a_receiver_that_is_not_there_costs_the_caller_nothing(monkeypatch):
    monkeypatch.setattr(wh, "MAX_QUEUED", 3)
    gate = threading.Event()
    hook = wh.Webhook("http://127.0.0.1:9/none", sleep=lambda _s: gate.wait())
    for i in range(5):
        hook.post({"n": i})  # the first waits in its backoff; the queue stays bounded
    assert hook.pending() == 3
    assert hook.dropped == 2
    gate.set()


def test_only_http_urls_are_taken():
    with pytest.raises(ValueError, match="http"):
        wh.Webhook("file:///etc/passwd")
