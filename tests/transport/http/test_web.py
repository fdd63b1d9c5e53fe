"""The daemons' HTTP/1.1 server (transport.http.web): framing, keep-alive, routing,
errors and shutdown, spoken to over raw sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from transport.http import web

pytestmark = pytest.mark.timeout(30)


class Served:
    """An app served on its own loop and thread, on a free loopback port."""

    def __init__(self, app: web.Application, shutdown_timeout: float = 2.0,
                 keepalive_timeout: float = 30.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.Runner(app, shutdown_timeout=shutdown_timeout,
                                 keepalive_timeout=keepalive_timeout)
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.runner.start(sock), self.loop).result(5)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from `sock` (bytes after it stay in `buf`)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        body += chunk
    buf[:] = body[length:]
    return status, headers, bytes(body[:length])


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (it reads EOF)."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return False


started = threading.Event()
release = threading.Event()


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(body=request.method.encode() + b" " + request.path.encode() + b" "
                        + request.query.get("q", "-").encode() + b" " + body)


async def refuse(request: web.Request) -> web.Response:
    return web.Response(status=413, text=f"no {request.content_length}")


async def crash(_request: web.Request) -> web.Response:
    raise RuntimeError("boom")


async def slow(_request: web.Request) -> web.Response:
    started.set()
    await asyncio.to_thread(release.wait, 10)
    return web.Response(text="done")


async def named(request: web.Request) -> web.Response:
    return web.Response(text=request.match_info["what"])


@pytest.fixture
def served() -> Iterator[Served]:
    app = web.Application()
    app.router.add_get("/echo", echo)
    app.router.add_post("/echo", echo)
    app.router.add_post("/refuse", refuse)
    app.router.add_get("/crash", crash, allow_head=False)
    app.router.add_get("/slow", slow)
    app.router.add_get("/api/{what}", named)
    started.clear()
    release.clear()
    s = Served(app)
    yield s
    release.set()
    s.close()


def test_keep_alive_serves_pipelined_requests_in_order(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /echo?q=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /echo?q=a+b%21 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                     b"GET /ech%6F HTTP/1.1\r\nHost: x\r\n\r\n")
        buf = bytearray()
        assert read_response(sock, buf)[2] == b"GET /echo 1 "
        assert read_response(sock, buf)[2] == b"POST /echo a b! abc"
        status, headers, body = read_response(sock, buf)
        assert (status, body) == (200, b"GET /echo - ")
        assert "connection" not in headers
        assert headers["content-type"] == "application/octet-stream"


def test_a_chunked_body_is_read_whole(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: t\r\n\r\n"
                     b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        buf = bytearray()
        assert read_response(sock, buf)[2] == b"POST /echo - abcde"
        assert read_response(sock, buf)[2] == b"GET /echo - "


def test_expect_100_continue_is_answered_when_the_handler_reads(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        buf = bytearray()
        status, _, _ = read_response(sock, buf)
        assert status == 100
        sock.sendall(b"body")
        assert read_response(sock, buf)[2] == b"POST /echo - body"


def test_a_refused_body_is_not_asked_for_and_the_connection_closes(served: Served) -> None:
    with served.connect() as sock:
        # Given a body announced with Expect: 100-continue that the handler refuses
        sock.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        buf = bytearray()
        # Then the answer comes without a 100, and the connection closes after it
        status, headers, body = read_response(sock, buf)
        assert (status, body) == (413, b"no 99999999")
        assert headers["connection"] == "close"
        assert closed(sock)


def test_a_small_unread_body_is_dropped_and_the_connection_kept(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                     b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        buf = bytearray()
        assert read_response(sock, buf)[0] == 413
        assert read_response(sock, buf)[2] == b"GET /echo - "


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /echo HTTP/2.0\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nno colon\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
    # (what a proxy in front may read otherwise: no smuggling through lax framing)
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
     400),
    (b"POST /echo HTTP/1.1\r\nX: a\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
     b"hello", 400),
    (b"GET /echo HTTP/1.1\r\nX\x00Y: a\r\n\r\n", 400),
    ("POST /echo HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\n".encode(), 400),
])
def test_bad_framing_is_answered_and_the_connection_closed(
        served: Served, request_bytes: bytes, status: int) -> None:
    with served.connect() as sock:
        sock.sendall(request_bytes)
        buf = bytearray()
        got, headers, _ = read_response(sock, buf)
        assert (got, headers["connection"]) == (status, "close")
        assert closed(sock)
    # and the server goes on serving others
    with served.connect() as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\n\r\n")
        assert read_response(sock, bytearray())[0] == 200


def test_routing_answers_head_404_405_and_named_segments(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"HEAD /echo HTTP/1.1\r\n\r\n"  # HEAD: GET's headers, no body
                     b"GET /api/topics HTTP/1.1\r\n\r\n"
                     b"GET /nowhere HTTP/1.1\r\n\r\n"
                     b"DELETE /echo HTTP/1.1\r\n\r\n"
                     b"HEAD /crash HTTP/1.1\r\n\r\n")
        buf = bytearray()
        # (the HEAD answer's Content-Length is GET's; the test reader takes no body for it)
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"Content-Length: 13" in head  # ("HEAD /echo - ")
        buf[:] = rest
        assert read_response(sock, buf)[::2] == (200, b"topics")
        assert read_response(sock, buf)[::2] == (404, b"404: Not Found")
        status, headers, _ = read_response(sock, buf)
        assert (status, headers["allow"]) == (405, "GET, HEAD, POST")
        while b"\r\n\r\n" not in buf:  # (HEAD: no body to read)
            buf += sock.recv(65536)
        assert buf.startswith(b"HTTP/1.1 405 ")  # a GET route without HEAD


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout() -> None:
    app = web.Application()
    app.router.add_get("/echo", echo)
    served = Served(app, keepalive_timeout=0.2)
    try:
        with served.connect() as sock:
            sock.sendall(b"GET /echo HTTP/1.1\r\n\r\n")
            assert read_response(sock, bytearray())[0] == 200
            assert closed(sock)  # (after 0.2 s without a request; the recv waits for it)
        with served.connect() as sock:
            sock.sendall(b"GET /echo HTTP/1.1\r\n")  # a head never finished
            assert closed(sock)
    finally:
        served.close()


def test_a_body_read_whole_is_bounded(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (web.MAX_READ + 1))
        status, headers, _ = read_response(sock, bytearray())
        assert (status, headers["connection"]) == (413, "close")
    with served.connect() as sock:  # chunked: refused once past the bound
        sock.sendall(b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(web.MAX_READ // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert read_response(sock, bytearray())[0] == 413


def test_a_crashing_handler_answers_500_and_the_connection_lives(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /crash HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n")
        buf = bytearray()
        assert read_response(sock, buf)[0] == 500
        assert read_response(sock, buf)[0] == 200


def test_http_1_0_closes_after_the_answer_unless_kept_alive(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
        assert read_response(sock, bytearray())[1]["connection"] == "close"
        assert closed(sock)
    with served.connect() as sock:
        sock.sendall(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
                     b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n")
        buf = bytearray()
        assert "connection" not in read_response(sock, buf)[1]
        assert read_response(sock, buf)[1]["connection"] == "close"


def test_close_ends_idle_connections_and_lets_a_running_handler_answer() -> None:
    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/echo", echo)
    started.clear()
    release.clear()
    served = Served(app)
    idle, busy = served.connect(), served.connect()
    with idle, busy:
        idle.sendall(b"GET /echo HTTP/1.1\r\n\r\n")
        read_response(idle, bytearray())
        busy.sendall(b"GET /slow HTTP/1.1\r\n\r\n")
        assert started.wait(5)
        closer = threading.Thread(target=served.close)
        closer.start()
        assert closed(idle)  # the idle one closes at once
        release.set()  # the running handler finishes: its answer says close
        status, headers, body = read_response(busy, bytearray())
        assert (status, body, headers["connection"]) == (200, b"done", "close")
        closer.join(10)
        assert not closer.is_alive()


def test_close_cancels_a_handler_still_running_at_the_deadline() -> None:
    async def forever(_request: web.Request) -> web.Response:
        started.set()
        await asyncio.sleep(60)
        return web.Response(text="never")

    app = web.Application()
    app.router.add_get("/forever", forever)
    started.clear()
    served = Served(app, shutdown_timeout=0.1)
    with served.connect() as sock:
        sock.sendall(b"GET /forever HTTP/1.1\r\n\r\n")
        assert started.wait(5)
        served.close()
        assert closed(sock)


def test_middlewares_wrap_routes_and_see_404s_outermost_first() -> None:
    seen: list[str] = []

    def mw(name: str) -> web.Middleware:
        async def middleware(request: web.Request, handler: web.Handler) -> web.Response:
            seen.append(f"{name}>")
            try:
                return await handler(request)
            except web.HTTPNotFound:
                return web.Response(status=404, text=f"{name} says no")
            finally:
                seen.append(f"<{name}")
        return middleware

    app = web.Application(middlewares=[mw("a")])
    app.middlewares.append(mw("b"))
    app.router.add_get("/echo", echo)
    served = Served(app)
    try:
        with served.connect() as sock:
            sock.sendall(b"GET /echo HTTP/1.1\r\n\r\nGET /x HTTP/1.1\r\n\r\n")
            buf = bytearray()
            assert read_response(sock, buf)[0] == 200
            assert read_response(sock, buf)[::2] == (404, b"b says no")
        assert seen == ["a>", "b>", "<b", "<a", "a>", "b>", "<b", "<a"]
    finally:
        served.close()
