"""nsqd's HTTP API over a fake broker facade: every endpoint, error mapping, limit and format.

Each test starts an :class:`HttpServer` on 127.0.0.1 port 0 with a
:class:`FakeFacade` that records calls and raises on demand, and talks to it
with ``http.client`` (no test dependency beyond pytest).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from transport.http import web
from transport.http.api import HttpServer, make_app, split_binary_mpub
from transport.http.metrics import (
    CONTENT_TYPE,
    escape_label_value,
    format_stats_text,
    format_value,
    render_metrics,
)
from transport.protocol.validation import Limits, ProtocolError

LIMITS = Limits(max_msg_size=100, max_body_size=1000, max_req_timeout=60_000)
V1 = "nsq; version=1.0"
NOW = 1_700_000_000


def sample_stats() -> dict[str, Any]:
    """Two topics (one paused), channels with clients, processes and actors."""
    return {
        "start_time": NOW - 3661,
        "topics": [
            {"topic_name": "orders", "depth": 3, "backend_depth": 1, "message_count": 40,
             "message_bytes": 4000, "paused": False, "channels": [
                 {"channel_name": "billing", "depth": 2, "backend_depth": 0,
                  "in_flight_count": 5, "deferred_count": 1, "message_count": 40,
                  "requeue_count": 7, "timeout_count": 2, "client_count": 1, "paused": True,
                  "clients": [{"client": "c1", "ready_count": 10, "in_flight_count": 5,
                               "message_count": 33, "finish_count": 28, "requeue_count": 7,
                               "remote_address": "127.0.0.1:5555", "connect_ts": NOW - 90}]},
                 {"channel_name": "audit", "depth": 0, "backend_depth": 0, "in_flight_count": 0,
                  "deferred_count": 0, "message_count": 40, "requeue_count": 0,
                  "timeout_count": 0, "client_count": 0, "paused": False, "clients": []},
             ]},
            {"topic_name": "logs", "depth": 0, "backend_depth": 0, "message_count": 0,
             "message_bytes": 0, "paused": True, "channels": []},
        ],
        "processes": [{"name": "gateway", "role": "gateway", "pid": 11, "restarts": 0,
                       "alive": True},
                      {"name": "worker-0", "role": "worker", "pid": 12, "restarts": 2,
                       "alive": False}],
        "actors": [{"kind": "topic", "node": "worker-0", "count": 2, "alive": 2, "depth": 4,
                    "handled": 99, "restarts": 1}],
    }


class FakeFacade:
    """Records every call (with the thread it ran on); raises what ``errors`` says."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[str] = []
        self.errors: dict[str, BaseException] = {}
        self.reason: str | None = None
        self.stats_data: dict[str, Any] = sample_stats()
        self.info_data: dict[str, Any] = {"version": "0.1.0", "broadcast_address": "host",
                                          "hostname": "host", "http_port": 0,
                                          "tcp_port": 4150, "start_time": NOW}
        self.gate: threading.Event | None = None
        self.rewinding = threading.Semaphore(0)  # released by each rewind as it starts

    def _record(self, *call: Any) -> None:
        self.calls.append(call)
        self.threads.append(threading.current_thread().name)
        if call[0] in self.errors:
            raise self.errors[call[0]]

    def publish(self, topic: str, bodies: list[bytes], defer_ms: int = 0, tag: str = "") -> None:
        self._record("publish", topic, list(bodies), defer_ms, *([tag] if tag else []))
        if self.gate is not None:
            assert self.gate.wait(5)

    def topic_command(self, topic: str, command: str, channel: str = "") -> None:
        self._record("topic_command", topic, command, channel)

    def channel_tags(self, topic: str, channel: str, tags: list[str] | None,
                     create: bool = False) -> dict:
        self._record("channel_tags", topic, channel, tags, create)
        return {"topic": topic, "channel": channel, "tags": sorted(tags or [])}

    def stats(self, topic: str | None, channel: str | None, include_clients: bool,
              include_storage: bool = False) -> dict:
        self._record("stats", topic, channel, include_clients)
        return json.loads(json.dumps(self.stats_data))

    def health(self) -> str | None:
        self._record("health")
        return self.reason

    def channel_rewind(self, topic: str, channel: str, since_ns: int = 0,
                       message_id: str = "", *, create: bool = False,
                       tags: list[str] | None = None) -> dict:
        self._record("channel_rewind", topic, channel, since_ns, message_id)
        self.rewinding.release()
        if self.gate is not None:
            assert self.gate.wait(5)
        return {"messages": 0}

    def info(self) -> dict:
        self._record("info")
        return dict(self.info_data)


class Reply:
    """A response read in full."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = response.headers
        self.body = response.read()

    def json(self) -> Any:
        assert self.headers["Content-Type"] == "application/json; charset=utf-8"
        return json.loads(self.body)

    @property
    def message(self) -> str:
        return self.json()["message"]


@pytest.fixture
def facade() -> FakeFacade:
    return FakeFacade()


@pytest.fixture
def server(facade: FakeFacade) -> Iterator[HttpServer]:
    srv = HttpServer(facade, LIMITS, "127.0.0.1", 0).start()
    yield srv
    assert srv.stop(timeout=5)


def call(server: HttpServer, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        return Reply(conn.getresponse())
    finally:
        conn.close()


def mpub_binary(*bodies: bytes) -> bytes:
    return struct.pack(">i", len(bodies)) + b"".join(
        struct.pack(">i", len(b)) + b for b in bodies)


def publishes(facade: FakeFacade) -> list[tuple[Any, ...]]:
    return [c for c in facade.calls if c[0] == "publish"]


# ---------------------------------------------------------------------------
# /ping and /info


def test_ping_answers_ok_in_plain_text_when_healthy(server: HttpServer) -> None:
    reply = call(server, "GET", "/ping")
    assert (reply.status, reply.body) == (200, b"OK")
    assert reply.headers["Content-Type"].startswith("text/plain")


def test_ping_answers_500_nok_with_the_reason_when_unhealthy(
        server: HttpServer, facade: FakeFacade) -> None:
    facade.reason = "disk full"
    reply = call(server, "GET", "/ping")
    assert (reply.status, reply.body) == (500, b"NOK - disk full")


def test_info_answers_the_facades_fields_and_the_bound_http_port(server: HttpServer) -> None:
    reply = call(server, "GET", "/info")
    assert reply.status == 200
    assert reply.headers["X-NSQ-Content-Type"] == V1
    info = reply.json()
    assert info["version"] == "0.1.0"
    assert info["tcp_port"] == 4150
    assert info["http_port"] == server.port


def test_info_keeps_an_http_port_the_facade_knows(server: HttpServer, facade: FakeFacade) -> None:
    facade.info_data["http_port"] = 4151
    assert call(server, "GET", "/info").json()["http_port"] == 4151


# ---------------------------------------------------------------------------
# /pub


def test_pub_publishes_the_body_to_the_topic(server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "POST", "/pub?topic=orders", b"hello")
    assert (reply.status, reply.body) == (200, b"OK")
    assert reply.headers["X-NSQ-Content-Type"] == V1
    assert publishes(facade) == [("publish", "orders", [b"hello"], 0)]


def test_pub_runs_the_facade_call_off_the_event_loop(
        server: HttpServer, facade: FakeFacade) -> None:
    call(server, "POST", "/pub?topic=orders", b"hello")
    assert facade.threads[0].startswith("http-api-facade")


def test_a_blocked_facade_call_does_not_block_other_requests(
        server: HttpServer, facade: FakeFacade) -> None:
    # Given a publish held inside the facade
    facade.gate = threading.Event()
    result: list[Reply] = []
    publisher = threading.Thread(
        target=lambda: result.append(call(server, "POST", "/pub?topic=t", b"x")))
    publisher.start()
    deadline = time.monotonic() + 5
    while not publishes(facade) and time.monotonic() < deadline:
        time.sleep(0.001)
    # When another client pings, Then it is answered at once
    assert call(server, "GET", "/ping").status == 200
    # And the held publish completes once released
    facade.gate.set()
    publisher.join(5)
    assert result[0].status == 200


@pytest.mark.parametrize("topic", ["a", "A.b-c_9", "t#ephemeral", "x" * 64])
def test_pub_accepts_valid_topic_names(server: HttpServer, facade: FakeFacade, topic: str) -> None:
    reply = call(server, "POST", f"/pub?topic={topic.replace('#', '%23')}", b"m")
    assert reply.status == 200
    assert publishes(facade)[0][1] == topic


@pytest.mark.parametrize("query", ["topic=", "topic=a%20b", "topic=bad!", "topic=" + "x" * 65,
                                   "topic=%C3%A9", "topic=%23ephemeral"])
def test_pub_refuses_an_invalid_topic(server: HttpServer, facade: FakeFacade, query: str) -> None:
    reply = call(server, "POST", f"/pub?{query}", b"m")
    assert (reply.status, reply.message) == (400, "INVALID_TOPIC")
    assert publishes(facade) == []


def test_pub_without_topic_is_missing_arg_topic(server: HttpServer) -> None:
    reply = call(server, "POST", "/pub", b"m")
    assert (reply.status, reply.message) == (400, "MISSING_ARG_TOPIC")


def test_pub_checks_the_body_before_the_topic_as_nsqd(server: HttpServer) -> None:
    reply = call(server, "POST", "/pub", b"")
    assert (reply.status, reply.message) == (400, "MSG_EMPTY")


def test_pub_of_an_empty_body_is_msg_empty(server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "POST", "/pub?topic=t", b"")
    assert (reply.status, reply.message) == (400, "MSG_EMPTY")
    assert publishes(facade) == []


def test_pub_accepts_exactly_max_msg_size_bytes(server: HttpServer, facade: FakeFacade) -> None:
    assert call(server, "POST", "/pub?topic=t", b"x" * 100).status == 200
    assert publishes(facade)[0][2] == [b"x" * 100]


def test_pub_one_byte_over_max_msg_size_is_msg_too_big(
        server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "POST", "/pub?topic=t", b"x" * 101)
    assert (reply.status, reply.message) == (413, "MSG_TOO_BIG")
    assert publishes(facade) == []


def test_pub_of_a_chunked_body_over_the_limit_is_msg_too_big(server: HttpServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("POST", "/pub?topic=t", body=iter([b"x" * 60, b"y" * 60]),
                     encode_chunked=True)
        reply = Reply(conn.getresponse())
    finally:
        conn.close()
    assert (reply.status, reply.message) == (413, "MSG_TOO_BIG")


def test_pub_claiming_a_huge_content_length_is_refused_without_reading_the_body(
        server: HttpServer) -> None:
    # Given a request that announces 1 GB and sends nothing
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        # Then the answer comes at once, without waiting for the body
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")
    assert b'{"message":"MSG_TOO_BIG"}' in head


def test_pub_passes_defer_in_milliseconds(server: HttpServer, facade: FakeFacade) -> None:
    assert call(server, "POST", "/pub?topic=t&defer=1500", b"m").status == 200
    assert call(server, "POST", "/pub?topic=t&defer=60000", b"m").status == 200
    assert [c[3] for c in publishes(facade)] == [1500, 60000]


@pytest.mark.parametrize("defer", ["-1", "abc", "1.5", "", "60001", "9" * 30])
def test_pub_refuses_an_invalid_or_out_of_range_defer(
        server: HttpServer, facade: FakeFacade, defer: str) -> None:
    reply = call(server, "POST", f"/pub?topic=t&defer={defer}", b"m")
    assert (reply.status, reply.message) == (400, "INVALID_DEFER")
    assert publishes(facade) == []


class CodedError(Exception):
    """Not a ProtocolError but shaped like one (as ``actors.broker.errors.BrokerError``)."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text


@pytest.mark.parametrize(("error", "status", "message"), [
    (ProtocolError("E_BAD_TOPIC", "PUB topic name is not valid"), 400, "INVALID_TOPIC"),
    (ProtocolError("E_BAD_MESSAGE", "PUB message too big 200 > 100"), 413, "MSG_TOO_BIG"),
    (ProtocolError("E_BAD_MESSAGE", "PUB invalid message body size 0"), 400, "MSG_EMPTY"),
    (ProtocolError("E_BAD_BODY", "MPUB body too big 2000 > 1000"), 413, "BODY_TOO_BIG"),
    (ProtocolError("E_BAD_BODY", "MPUB invalid body size 0"), 400, "BAD_BODY"),
    (ProtocolError("E_INVALID", "DPUB timeout 1 out of range"), 400, "INVALID_DEFER"),
    (ProtocolError("E_PUB_FAILED", "PUB failed exiting"), 503, "EXITING"),
    (ProtocolError("E_MPUB_FAILED", "MPUB failed exiting"), 503, "EXITING"),
    (ProtocolError("E_SOMETHING_NEW", "?"), 500, "INTERNAL_ERROR"),
    (CodedError("E_PUB_FAILED", "exiting"), 503, "EXITING"),
    (TimeoutError("ask timed out"), 500, "INTERNAL_ERROR"),
])
def test_pub_maps_facade_errors_to_nsqd_answers(
        server: HttpServer, facade: FakeFacade, error: Exception, status: int,
        message: str) -> None:
    facade.errors["publish"] = error
    reply = call(server, "POST", "/pub?topic=t", b"m")
    assert (reply.status, reply.message) == (status, message)


@pytest.mark.parametrize(("request_", "what", "answer"), [
    (("/pub?topic=t", "E_PUB_FAILED"), "disk full", (507, "DISK_FULL")),
    (("/mpub?topic=t", "E_MPUB_FAILED"), "disk full", (507, "DISK_FULL")),
    (("/pub?topic=t&defer=10", "E_DPUB_FAILED"), "disk full", (507, "DISK_FULL")),
    (("/pub?topic=t", "E_PUB_FAILED"), "disk failed, the queue takes no writes",
     (503, "DISK_FAILED")),
])
def test_a_publish_the_disk_refused_says_so_with_the_refusals_sentence(
        server: HttpServer, facade: FakeFacade, request_: tuple[str, str], what: str,
        answer: tuple[int, str]) -> None:
    path, code = request_
    text = f"PUB failed: {what} - [Errno 5] the cause, naming /d/t.00002.dat"
    facade.errors["publish"] = ProtocolError(code, text)
    reply = call(server, "POST", path, b"m")
    assert (reply.status, reply.message) == answer
    assert json.loads(reply.body)["detail"] == text


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "HEAD"])
def test_pub_with_another_method_than_post_is_method_not_allowed(
        server: HttpServer, method: str) -> None:
    reply = call(server, method, "/pub?topic=t")
    assert reply.status == 405
    assert reply.headers["Allow"] == "POST"
    if method != "HEAD":
        assert reply.message == "METHOD_NOT_ALLOWED"


# ---------------------------------------------------------------------------
# /mpub


def test_mpub_splits_a_body_on_newlines_and_skips_empty_lines(
        server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "POST", "/mpub?topic=t", b"a\nbb\n\n\nc\r\n")
    assert (reply.status, reply.body) == (200, b"OK")
    assert publishes(facade) == [("publish", "t", [b"a", b"bb", b"c\r"], 0)]


def test_mpub_of_only_empty_lines_succeeds_and_publishes_nothing(
        server: HttpServer, facade: FakeFacade) -> None:
    assert call(server, "POST", "/mpub?topic=t", b"\n\n").status == 200
    assert call(server, "POST", "/mpub?topic=t", b"").status == 200
    assert publishes(facade) == []


def test_mpub_line_over_max_msg_size_is_msg_too_big(server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "POST", "/mpub?topic=t", b"ok\n" + b"x" * 101)
    assert (reply.status, reply.message) == (413, "MSG_TOO_BIG")
    assert publishes(facade) == []


def test_mpub_body_over_max_body_size_is_body_too_big(
        server: HttpServer, facade: FakeFacade) -> None:
    body = b"\n".join([b"x" * 99] * 11)  # 1099 bytes, every line fits
    reply = call(server, "POST", "/mpub?topic=t", body)
    assert (reply.status, reply.message) == (413, "BODY_TOO_BIG")
    chunked = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        chunked.request("POST", "/mpub?topic=t", body=iter([body[:600], body[600:]]),
                        encode_chunked=True)
        reply = Reply(chunked.getresponse())
    finally:
        chunked.close()
    assert (reply.status, reply.message) == (413, "BODY_TOO_BIG")
    assert publishes(facade) == []


def test_mpub_accepts_a_body_of_exactly_max_body_size(
        server: HttpServer, facade: FakeFacade) -> None:
    body = b"\n".join([b"x" * 99] * 10)  # 999 bytes
    body += b"\n"
    assert len(body) == 1000
    assert call(server, "POST", "/mpub?topic=t", body).status == 200
    assert len(publishes(facade)[0][2]) == 10


@pytest.mark.parametrize("flag", ["true", "1", "yes", ""])
def test_mpub_binary_publishes_length_prefixed_messages(
        server: HttpServer, facade: FakeFacade, flag: str) -> None:
    body = mpub_binary(b"one", b"two\nlines", b"\x00\xff")
    reply = call(server, "POST", f"/mpub?topic=t&binary={flag}", body)
    assert reply.status == 200
    assert publishes(facade) == [("publish", "t", [b"one", b"two\nlines", b"\x00\xff"], 0)]


@pytest.mark.parametrize("flag", ["false", "0"])
def test_mpub_binary_false_means_newline_mode(
        server: HttpServer, facade: FakeFacade, flag: str) -> None:
    assert call(server, "POST", f"/mpub?topic=t&binary={flag}", b"a\nb").status == 200
    assert publishes(facade)[0][2] == [b"a", b"b"]


@pytest.mark.parametrize(("body", "message"), [
    (b"", "BAD_BODY"),                                              # no count
    (b"\x00\x00\x01", "BAD_BODY"),                                  # short count
    (struct.pack(">i", 0), "BAD_BODY"),                             # zero messages
    (struct.pack(">i", -1), "BAD_BODY"),                            # negative count
    (struct.pack(">i", 1000), "BAD_BODY"),                          # more than could fit
    (struct.pack(">i", 2) + struct.pack(">i", 1) + b"a", "BAD_MESSAGE"),  # missing size
    (struct.pack(">i", 1) + b"\x00\x00", "BAD_MESSAGE"),            # short size
    (struct.pack(">ii", 1, 0), "BAD_MESSAGE"),                      # empty message
    (struct.pack(">ii", 1, -5) + b"a", "BAD_MESSAGE"),              # negative size
    (struct.pack(">ii", 1, 101) + b"x" * 101, "BAD_MESSAGE"),       # over max_msg_size
    (struct.pack(">ii", 1, 10) + b"short", "BAD_MESSAGE"),          # truncated body
    (mpub_binary(b"a") + b"junk", "BAD_BODY"),                      # bytes after the last
])
def test_mpub_binary_refuses_malformed_bodies_with_413(
        server: HttpServer, facade: FakeFacade, body: bytes, message: str) -> None:
    reply = call(server, "POST", "/mpub?topic=t&binary=true", body)
    assert (reply.status, reply.message) == (413, message)
    assert publishes(facade) == []


def test_mpub_binary_over_max_body_size_is_body_too_big(server: HttpServer) -> None:
    body = mpub_binary(*[b"x" * 96] * 10)  # 4 + 10 * 100 bytes
    reply = call(server, "POST", "/mpub?topic=t&binary=true", body)
    assert (reply.status, reply.message) == (413, "BODY_TOO_BIG")


def test_split_binary_mpub_gives_nsqds_codes_without_http() -> None:
    assert split_binary_mpub(mpub_binary(b"a", b"bc"), LIMITS) == [b"a", b"bc"]
    with pytest.raises(ProtocolError) as info:
        split_binary_mpub(struct.pack(">ii", 1, 200), LIMITS)
    assert info.value.code == "E_BAD_MESSAGE"


@pytest.mark.parametrize(("query", "message"), [
    ("", "MISSING_ARG_TOPIC"), ("?topic=", "INVALID_TOPIC"), ("?topic=a/b", "INVALID_TOPIC")])
def test_mpub_checks_the_topic(server: HttpServer, query: str, message: str) -> None:
    reply = call(server, "POST", f"/mpub{query}", b"a")
    assert (reply.status, reply.message) == (400, message)


def test_mpub_of_a_failing_topic_is_503_exiting(server: HttpServer, facade: FakeFacade) -> None:
    facade.errors["publish"] = ProtocolError("E_MPUB_FAILED", "MPUB failed")
    reply = call(server, "POST", "/mpub?topic=t&binary=true", mpub_binary(b"a"))
    assert (reply.status, reply.message) == (503, "EXITING")


def test_mpub_with_get_is_method_not_allowed(server: HttpServer) -> None:
    reply = call(server, "GET", "/mpub?topic=t")
    assert (reply.status, reply.message) == (405, "METHOD_NOT_ALLOWED")


# ---------------------------------------------------------------------------
# /topic/* and /channel/*

COMMANDS = ["create", "delete", "empty", "pause", "unpause"]


@pytest.mark.parametrize("command", COMMANDS)
def test_topic_commands_reach_the_facade_and_answer_an_empty_200(
        server: HttpServer, facade: FakeFacade, command: str) -> None:
    reply = call(server, "POST", f"/topic/{command}?topic=orders")
    assert (reply.status, reply.body) == (200, b"")
    assert reply.headers["X-NSQ-Content-Type"] == V1
    assert facade.calls == [("topic_command", "orders", command, "")]


@pytest.mark.parametrize("command", COMMANDS)
def test_channel_commands_reach_the_facade_with_the_channel(
        server: HttpServer, facade: FakeFacade, command: str) -> None:
    reply = call(server, "POST", f"/channel/{command}?topic=orders&channel=billing%23ephemeral")
    assert (reply.status, reply.body) == (200, b"")
    assert facade.calls == [("topic_command", "orders", f"{command}_channel",
                             "billing#ephemeral")]


# nsqd 1.3's answers, measured beside it: /channel/* say INVALID_ARG_*, /topic/delete,
# pause and unpause look a bad name up (404), /topic/create and empty say INVALID_TOPIC.
_BAD_TOPIC = {"/topic/create": (400, "INVALID_TOPIC"), "/topic/empty": (400, "INVALID_TOPIC"),
              "/topic/delete": (404, "TOPIC_NOT_FOUND"), "/topic/pause": (404, "TOPIC_NOT_FOUND"),
              "/topic/unpause": (404, "TOPIC_NOT_FOUND"),
              **{f"/channel/{c}": (400, "INVALID_ARG_TOPIC") for c in COMMANDS}}


@pytest.mark.parametrize("path", sorted(_BAD_TOPIC))
@pytest.mark.parametrize("query", ["", "?topic=", "?topic=a*b", "?topic=" + "t" * 65])
def test_topic_and_channel_commands_check_the_topic_as_nsqd(
        server: HttpServer, facade: FakeFacade, path: str, query: str) -> None:
    reply = call(server, "POST", path + query + ("&channel=c" if query else ""))
    expected = (400, "MISSING_ARG_TOPIC") if not query else _BAD_TOPIC[path]
    assert (reply.status, reply.message) == expected
    assert facade.calls == []


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("query", "message"), [
    ("", "MISSING_ARG_CHANNEL"), ("&channel=", "INVALID_ARG_CHANNEL"),
    ("&channel=" + "c" * 65, "INVALID_ARG_CHANNEL")])
def test_channel_commands_check_the_channel(
        server: HttpServer, facade: FakeFacade, command: str, query: str, message: str) -> None:
    reply = call(server, "POST", f"/channel/{command}?topic=t{query}")
    assert (reply.status, reply.message) == (400, message)
    assert facade.calls == []


@pytest.mark.parametrize(("code", "status", "message"), [
    ("E_TOPIC_NOT_FOUND", 404, "TOPIC_NOT_FOUND"),
    ("E_CHANNEL_NOT_FOUND", 404, "CHANNEL_NOT_FOUND"),
    ("E_BAD_TOPIC", 400, "INVALID_TOPIC"),
    ("E_BAD_CHANNEL", 400, "INVALID_CHANNEL"),
    ("E_INVALID", 500, "INTERNAL_ERROR"),
])
def test_commands_map_facade_errors_to_nsqd_answers(
        server: HttpServer, facade: FakeFacade, code: str, status: int, message: str) -> None:
    facade.errors["topic_command"] = ProtocolError(code, "no")
    for path in ("/topic/delete?topic=t", "/channel/empty?topic=t&channel=c"):
        reply = call(server, "POST", path)
        assert (reply.status, reply.message) == (status, message)


def test_commands_with_get_are_method_not_allowed(server: HttpServer, facade: FakeFacade) -> None:
    for path in ("/topic/create?topic=t", "/channel/create?topic=t&channel=c"):
        reply = call(server, "GET", path)
        assert (reply.status, reply.message) == (405, "METHOD_NOT_ALLOWED")
    assert facade.calls == []


# ---------------------------------------------------------------------------
# /stats


def test_stats_json_has_nsqds_shape_and_our_extras(server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "GET", "/stats?format=json")
    assert reply.status == 200
    assert reply.headers["X-NSQ-Content-Type"] == V1
    stats = reply.json()
    assert stats["version"] == "0.1.0"
    assert stats["health"] == "OK"
    assert stats["start_time"] == NOW - 3661
    assert stats["producers"] == []
    assert [t["topic_name"] for t in stats["topics"]] == ["orders", "logs"]
    billing = stats["topics"][0]["channels"][0]
    assert billing["in_flight_count"] == 5
    assert billing["clients"][0]["client"] == "c1"
    assert stats["processes"][1]["restarts"] == 2
    assert stats["actors"][0]["handled"] == 99
    assert ("stats", None, None, True) in facade.calls


def test_stats_json_health_says_nok_with_the_reason(server: HttpServer, facade: FakeFacade) -> None:
    facade.reason = "disk full"
    facade.stats_data["health"] = "disk full"  # a facade's own health key does not win
    assert call(server, "GET", "/stats?format=json").json()["health"] == "NOK - disk full"


def test_stats_filters_by_topic_and_channel(server: HttpServer, facade: FakeFacade) -> None:
    stats = call(server, "GET", "/stats?format=json&topic=orders&channel=audit").json()
    assert [t["topic_name"] for t in stats["topics"]] == ["orders"]
    assert [c["channel_name"] for c in stats["topics"][0]["channels"]] == ["audit"]
    assert ("stats", "orders", "audit", True) in facade.calls
    stats = call(server, "GET", "/stats?format=json&topic=nope").json()
    assert stats["topics"] is None  # as nsqd


@pytest.mark.parametrize(("value", "expected"), [
    ("false", False), ("0", False), ("true", True), ("1", True), ("maybe", True), ("", True)])
def test_stats_include_clients_follows_nsqds_bool_parameters(
        server: HttpServer, facade: FakeFacade, value: str, expected: bool) -> None:
    stats = call(server, "GET", f"/stats?format=json&include_clients={value}").json()
    assert ("stats", None, None, expected) in facade.calls
    billing = stats["topics"][0]["channels"][0]
    assert billing["client_count"] == 1
    assert (billing["clients"] is None) != expected  # nsqd: null without clients
    assert billing["e2e_processing_latency"] == {"count": 0, "percentiles": None}


def test_stats_text_is_the_default_format(server: HttpServer) -> None:
    reply = call(server, "GET", "/stats")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    text = reply.body.decode()
    assert text.startswith("nsqd v0.1.0 ")
    assert "\nHealth: OK\n" in text
    assert "\nTopics:\n" in text


def test_stats_text_lays_out_topics_channels_and_clients_as_nsqd() -> None:
    text = format_stats_text(sample_stats(), "OK", "0.1.0", NOW)
    lines = text.splitlines()
    assert lines[2] == "uptime 1h1m1s"
    assert lines[1].startswith("start_time ")
    assert "   [orders         ] depth: 3     be-depth: 1     msgs: 40       e2e%: " in lines
    assert ("   *P [billing                  ] depth: 2     be-depth: 0     inflt: 5    "
            "def: 1    re-q: 7     timeout: 2     msgs: 40       e2e%: ") in lines
    assert any(line.startswith("      [audit ") for line in lines)
    assert any(line.startswith("*P [logs ") for line in lines)
    client = next(line for line in lines if "c1:5555" in line)
    assert client.startswith("        [V2 c1:5555")
    assert "rdy: 10  " in client
    assert client.endswith("connected: 1m30s")
    assert "Producers: None" in lines
    assert any(line.startswith("   [worker-0 ") and "restarts: 2" in line for line in lines)
    assert any(line.startswith("   [topic ") and "count: 2 " in line and "mailbox: 4" in line
               for line in lines)


def test_stats_text_without_topics_says_none_and_survives_odd_fields() -> None:
    odd = {"start_time": "?", "topics": [{"topic_name": None, "depth": None,
                                          "channels": [{"channel_name": "c", "error": "t/o"}]}]}
    assert "Topics: None" in format_stats_text({"topics": []}, "OK", "1", NOW)
    text = format_stats_text(odd, "NOK - x", "1", NOW)
    assert "[None           ] depth: 0 " in text
    assert "uptime 0s" in text


# ---------------------------------------------------------------------------
# /metrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')


def parse_exposition(text: str) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    """Parse the text format strictly: HELP then TYPE before any sample of a family."""
    assert text.endswith("\n")
    families: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}
    helped: set[str] = set()
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped, f"{name} described twice"
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helped
            assert name not in families
            assert kind in {"gauge", "counter"}
            assert kind != "counter" or name.endswith("_total")
            families[name] = (kind, [])
            current = name
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, _, labels_text, value = match.groups()
            assert name == current, f"sample {name} without its TYPE line right before"
            labels: dict[str, str] = {}
            if labels_text:
                pos = 0
                while pos < len(labels_text):
                    label = LABEL.match(labels_text, pos)
                    assert label, f"bad labels {labels_text!r}"
                    raw = label.group(2)
                    labels[label.group(1)] = re.sub(
                        r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), raw)
                    pos = label.end()
            families[name][1].append((labels, float(value)))
    return families


def value_of(families: dict, name: str, **labels: str) -> float:
    matches = [v for got, v in families[name][1] if got == labels]
    assert len(matches) == 1, (name, labels, families[name][1])
    return matches[0]


def test_metrics_serves_prometheus_text_with_help_and_type_lines(
        server: HttpServer, facade: FakeFacade) -> None:
    reply = call(server, "GET", "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"] == CONTENT_TYPE
    families = parse_exposition(reply.body.decode())
    assert ("stats", None, None, False) in facade.calls
    assert value_of(families, "nsq_healthy") == 1
    assert value_of(families, "nsq_topics") == 2
    assert value_of(families, "nsq_build_info", version="0.1.0") == 1
    assert value_of(families, "nsq_start_time_seconds") == NOW - 3661


def test_metrics_exports_topic_and_channel_gauges_and_counters(server: HttpServer) -> None:
    families = parse_exposition(call(server, "GET", "/metrics").body.decode())
    assert value_of(families, "nsq_topic_depth", topic="orders") == 3
    assert value_of(families, "nsq_topic_backend_depth", topic="orders") == 1
    assert value_of(families, "nsq_topic_messages_total", topic="orders") == 40
    assert value_of(families, "nsq_topic_message_bytes_total", topic="orders") == 4000
    assert value_of(families, "nsq_topic_paused", topic="logs") == 1
    billing = {"topic": "orders", "channel": "billing"}
    assert value_of(families, "nsq_channel_depth", **billing) == 2
    assert value_of(families, "nsq_channel_in_flight", **billing) == 5
    assert value_of(families, "nsq_channel_deferred", **billing) == 1
    assert value_of(families, "nsq_channel_requeued_total", **billing) == 7
    assert value_of(families, "nsq_channel_timed_out_total", **billing) == 2
    assert value_of(families, "nsq_channel_messages_total", **billing) == 40
    assert value_of(families, "nsq_channel_clients", **billing) == 1
    assert value_of(families, "nsq_channel_paused", **billing) == 1
    assert families["nsq_channel_requeued_total"][0] == "counter"
    assert families["nsq_channel_depth"][0] == "gauge"


def test_metrics_exports_process_and_actor_stats(server: HttpServer) -> None:
    families = parse_exposition(call(server, "GET", "/metrics").body.decode())
    worker = {"process": "worker-0", "role": "worker"}
    assert value_of(families, "nsq_process_up", **worker) == 0
    assert value_of(families, "nsq_process_restarts_total", **worker) == 2
    topics = {"kind": "topic", "node": "worker-0"}
    assert value_of(families, "nsq_actors", **topics) == 2
    assert value_of(families, "nsq_actors_up", **topics) == 2
    assert value_of(families, "nsq_actor_mailbox_depth", **topics) == 4
    assert value_of(families, "nsq_actor_messages_handled_total", **topics) == 99
    assert value_of(families, "nsq_actor_restarts_total", **topics) == 1


@pytest.mark.parametrize(("reason", "full", "failed"), [
    ("worker-1 does not answer: timed out", 0, 0),
    ("PUB failed: disk full - [Errno 28] no space left to create /d/t.00002.dat", 1, 0),
    ("t:c: disk failed - fdatasync of the write chunk failed: [Errno 5] EIO", 0, 1),
])
def test_metrics_say_unhealthy_and_whether_the_disk_is_full_or_failed(
        server: HttpServer, facade: FakeFacade, reason: str, full: int, failed: int) -> None:
    facade.reason = reason
    families = parse_exposition(call(server, "GET", "/metrics").body.decode())
    assert value_of(families, "nsq_healthy") == 0
    assert value_of(families, "nsq_disk_full") == full
    assert value_of(families, "nsq_disk_failed") == failed


def test_metrics_say_the_disk_is_fine_when_healthy(server: HttpServer) -> None:
    families = parse_exposition(call(server, "GET", "/metrics").body.decode())
    assert value_of(families, "nsq_disk_full") == 0
    assert value_of(families, "nsq_disk_failed") == 0


def test_metrics_escape_label_values() -> None:
    name = 'we"ird\\kind\nname'
    text = render_metrics({"actors": [{"kind": name, "node": "n", "handled": 1}]})
    assert 'kind="we\\"ird\\\\kind\\nname"' in text
    families = parse_exposition(text)
    assert value_of(families, "nsq_actor_messages_handled_total", kind=name, node="n") == 1
    assert escape_label_value('a"b') == 'a\\"b'


def test_metrics_skip_missing_and_non_numeric_fields() -> None:
    stats = {"topics": [{"topic_name": "t", "depth": "lots", "channels": [
        {"channel_name": "c", "error": "timed out"},
        {"channel_name": "d", "clients": [{}, {}]}, "garbage"]}],
        "processes": [{"name": "p", "rss_bytes": 1024}], "actors": None}
    families = parse_exposition(render_metrics(stats))
    assert families["nsq_topic_depth"][1] == []
    assert families["nsq_channel_depth"][1] == []
    assert value_of(families, "nsq_channel_clients", topic="t", channel="d") == 2
    assert value_of(families, "nsq_process_resident_memory_bytes", process="p", role="") == 1024


def test_metrics_of_an_empty_broker_declare_every_family() -> None:
    families = parse_exposition(render_metrics({}))
    assert "nsq_channel_timed_out_total" in families
    assert families["nsq_topic_depth"][1] == []


@pytest.mark.parametrize(("value", "text"), [
    (3, "3"), (2.5, "2.5"), (4.0, "4"), (float("inf"), "+Inf"),
    (float("-inf"), "-Inf"), (float("nan"), "NaN"), (1e300, "1e+300")])
def test_metric_values_are_formatted_for_prometheus(value: float, text: str) -> None:
    assert format_value(value) == text


# ---------------------------------------------------------------------------
# Everything else


@pytest.mark.parametrize("path", ["/", "/nope", "/debug/pprof/", "/topic/frobnicate",
                                  "/ping/extra", "/put?topic=t"])
def test_unknown_paths_are_not_found_as_json(server: HttpServer, path: str) -> None:
    reply = call(server, "GET", path)
    assert (reply.status, reply.message) == (404, "NOT_FOUND")
    assert reply.headers["X-NSQ-Content-Type"] == V1


@pytest.mark.parametrize("path", ["/ping", "/info", "/stats", "/metrics"])
def test_read_only_endpoints_refuse_post(server: HttpServer, path: str) -> None:
    reply = call(server, "POST", path, b"")
    assert (reply.status, reply.message) == (405, "METHOD_NOT_ALLOWED")
    assert reply.headers["Allow"] == "GET"


def test_a_facade_crash_is_a_500_internal_error(server: HttpServer, facade: FakeFacade) -> None:
    facade.errors["stats"] = RuntimeError("boom")
    facade.errors["health"] = RuntimeError("boom")
    for path in ("/stats", "/metrics", "/ping"):
        reply = call(server, "GET", path)
        assert (reply.status, reply.message) == (500, "INTERNAL_ERROR")
    assert call(server, "POST", "/pub?topic=t", b"m").status == 200


def test_keep_alive_connections_serve_many_requests(server: HttpServer, facade: FakeFacade) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        for i in range(5):
            conn.request("POST", "/pub?topic=t", body=b"x" * (i + 1))
            assert Reply(conn.getresponse()).status == 200
        conn.request("POST", "/pub?topic=t", body=b"x" * 101)  # refused mid-connection
        assert Reply(conn.getresponse()).status == 413
    finally:
        conn.close()
    assert len(publishes(facade)) == 5


# ---------------------------------------------------------------------------
# Server life


def test_start_binds_port_zero_and_stop_leaves_no_threads(facade: FakeFacade) -> None:
    before = set(threading.enumerate())
    srv = HttpServer(facade, LIMITS, "127.0.0.1", 0).start()
    assert srv.port != 0
    assert call(srv, "POST", "/pub?topic=t", b"m").status == 200
    # Given an idle keep-alive connection left open
    idle = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    idle.request("GET", "/ping")
    assert Reply(idle.getresponse()).status == 200
    started = time.monotonic()
    assert srv.stop(timeout=5)
    assert time.monotonic() - started < 3
    idle.close()
    assert set(threading.enumerate()) == before
    assert srv.stop()  # stopping twice is harmless
    with pytest.raises(ConnectionRefusedError), \
            socket.create_connection(("127.0.0.1", srv.port), timeout=1):
        pass


def test_stop_reports_a_facade_call_that_will_not_return(facade: FakeFacade) -> None:
    # Given a server whose facade is stuck in a publish
    srv = HttpServer(facade, LIMITS, "127.0.0.1", 0, shutdown_timeout=0.05).start()
    facade.gate = threading.Event()
    outcome: list[object] = []

    def publish() -> None:
        try:
            outcome.append(call(srv, "POST", "/pub?topic=t", b"m"))
        except OSError as e:  # the server dropped the connection while stopping
            outcome.append(e)

    client = threading.Thread(target=publish)
    client.start()
    deadline = time.monotonic() + 5
    while not publishes(facade) and time.monotonic() < deadline:
        time.sleep(0.001)
    # When it is stopped, Then stop() says the thread is still running
    assert not srv.stop(timeout=0.3)
    # And once the call returns, the thread ends and a second stop() succeeds
    facade.gate.set()
    assert srv.stop(timeout=5)
    client.join(5)
    assert isinstance(outcome[0], http.client.RemoteDisconnected)


def test_rewinds_that_wait_long_never_hold_the_threads_publishes_need(
        server: HttpServer, facade: FakeFacade) -> None:
    # Given more rewinds waiting than the facade has threads (a long rewind waits up
    # to a minute for its messages to be queued)
    facade.gate = threading.Event()
    results: list[Reply] = []
    clients = [threading.Thread(target=lambda: results.append(
        call(server, "POST", "/channel/rewind?topic=t&channel=c&from=0"))) for _ in range(10)]
    for client in clients:
        client.start()
    for _ in range(4):  # (the four the rewinds' pool runs at once)
        assert facade.rewinding.acquire(timeout=5)
    # When a client publishes meanwhile (the gate held by the four rewinds running,
    # not by publishes), Then its publish is answered at once
    gate, facade.gate = facade.gate, None
    assert call(server, "GET", "/ping").status == 200
    assert call(server, "POST", "/pub?topic=t", b"m").status == 200
    # and the rewinds ran four at a time on their own threads
    rewinds = [t for c, t in zip(facade.calls, facade.threads, strict=True)
               if c[0] == "channel_rewind"]
    assert len(rewinds) == 4
    assert all("-slow" in t for t in rewinds)
    gate.set()
    for client in clients:
        client.join(5)
    assert [r.status for r in results] == [200] * 10


def test_a_stopped_server_can_be_started_again(facade: FakeFacade) -> None:
    srv = HttpServer(facade, LIMITS, "127.0.0.1", 0).start()
    assert srv.stop(timeout=5)
    srv.start()
    try:
        assert call(srv, "GET", "/ping").status == 200
    finally:
        assert srv.stop(timeout=5)


def test_start_on_a_busy_port_raises_in_the_caller(facade: FakeFacade) -> None:
    with HttpServer(facade, LIMITS, "127.0.0.1", 0) as first:
        before = set(threading.enumerate())
        with pytest.raises(OSError, match="in use"):
            HttpServer(facade, LIMITS, "127.0.0.1", first.port).start()
        assert set(threading.enumerate()) == before


def test_make_app_serves_on_any_event_loop_with_the_default_executor() -> None:
    facade = FakeFacade()

    async def scenario() -> tuple[int, str, int]:
        runner = web.Runner(make_app(facade, LIMITS))
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await runner.start(sock)
        try:
            def requests() -> tuple[int, str, int]:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("POST", "/pub?topic=t", b"m")
                pub = conn.getresponse()
                pub.read()
                conn.request("GET", "/ping")
                ping = conn.getresponse().read().decode()
                conn.request("GET", "/info")
                info = json.loads(conn.getresponse().read())
                conn.close()
                return pub.status, ping, info["http_port"]
            return await asyncio.to_thread(requests)
        finally:
            await runner.close()

    assert asyncio.run(scenario()) == (200, "OK", 0)
    assert publishes(facade) == [("publish", "t", [b"m"], 0)]


# ---------------------------------------------------------------------------
# Tags (#21): tag= on /pub and /mpub, a channel's filter on /channel/create and config


def test_pub_and_mpub_pass_a_tag_and_refuse_a_bad_one(
        server: HttpServer, facade: FakeFacade) -> None:
    assert call(server, "POST", "/pub?topic=t&tag=red", b"m").status == 200
    assert call(server, "POST", "/mpub?topic=t&tag=a.b:c-1_2", b"x\ny").status == 200
    assert call(server, "POST", "/pub?topic=t&defer=10&tag=red", b"m").status == 200
    assert publishes(facade) == [("publish", "t", [b"m"], 0, "red"),
                                 ("publish", "t", [b"x", b"y"], 0, "a.b:c-1_2"),
                                 ("publish", "t", [b"m"], 10, "red")]
    for bad in ("a%2Cb", "a%20b", "x" * 65, "%C3%A9", ""):
        for path in ("/pub", "/mpub"):
            reply = call(server, "POST", f"{path}?topic=t&tag={bad}", b"m")
            assert (reply.status, reply.message) == (400, "INVALID_TAG"), (path, bad)
    assert len(publishes(facade)) == 3


def test_a_channel_is_created_with_its_filter_and_its_config_reads_and_sets_it(
        server: HttpServer, facade: FakeFacade) -> None:
    assert call(server, "POST", "/channel/create?topic=t&channel=c&tags=red,blue").status == 200
    reply = call(server, "POST", "/channel/config?topic=t&channel=c&tags=green")
    assert (reply.status, reply.json()) == (200, {"topic": "t", "channel": "c", "tags": ["green"]})
    assert call(server, "POST", "/channel/config?topic=t&channel=c&tags=").json()["tags"] == []
    assert call(server, "GET", "/channel/config?topic=t&channel=c").status == 200
    assert [c for c in facade.calls if c[0] == "channel_tags"] == [
        ("channel_tags", "t", "c", ["red", "blue"], True),
        ("channel_tags", "t", "c", ["green"], False),
        ("channel_tags", "t", "c", [], False),
        ("channel_tags", "t", "c", None, False)]
    # (a POST without tags= sets nothing; a bad tag is refused before the broker is asked)
    reply = call(server, "POST", "/channel/config?topic=t&channel=c")
    assert (reply.status, reply.message) == (400, "MISSING_ARG_SETTING")
    for path in ("/channel/config?topic=t&channel=c&tags=ok,a%20b",
                 "/channel/create?topic=t&channel=c&tags=" + "x" * 65):
        reply = call(server, "POST", path)
        assert (reply.status, reply.message) == (400, "INVALID_ARG_TAGS")
    assert len([c for c in facade.calls if c[0] == "channel_tags"]) == 4
