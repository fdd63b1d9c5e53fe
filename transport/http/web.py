"""The daemons' HTTP/1.1 server: an app of routes and middlewares served on asyncio.

Theory of operation
-------------------
nsqd's, nsqlookupd's and the console's APIs need little of HTTP: a request
line, headers, a body (``Content-Length`` or chunked), a router of exact paths
(and ``{name}`` segments for the console), middlewares, and keep-alive.  A
general framework (aiohttp) costs a third of a second to import, on the path
between a broker's launch and its first answer (#23); this module is that
subset, imports in about a millisecond, and is as fast per request.

The names follow aiohttp's (:class:`Application`, :class:`Request`,
:class:`Response`, :func:`middleware`, :class:`HTTPException` and its
subclasses) so the apps read as they would on it.  A handler is ``async def
handler(request) -> Response``; a middleware is ``async def mw(request,
handler) -> Response``, the first in :attr:`Application.middlewares` the
outermost.  An unknown path raises :class:`HTTPNotFound` and a known path with
another method :class:`HTTPMethodNotAllowed` *inside* the middlewares, so an app
can word those answers itself; an :class:`HTTPException` that leaves them is
sent as ``"<status>: <reason>"`` text (or its own ``text``), and any other
exception as a 500.

:class:`Runner` serves an app on the running loop from a bound socket (TLS
with an ``ssl_context``).  Each connection reads one request at a time
(pipelined requests wait their turn).  The body is read only when the handler
asks (``await request.read()``, ``await request.content.read(n)``), so a
handler can refuse a declared ``Content-Length`` without reading it; ``Expect:
100-continue`` is answered at that first read, as Go's server does.  A
response whose request body was not read to its end closes the connection.
Bad framing (request line, headers, chunk sizes, both ``Content-Length`` and
``Transfer-Encoding``) is answered 400 and closes it; a head over 64 KiB 431.
:meth:`Runner.close` stops listening, closes idle connections, lets running
handlers finish for ``shutdown_timeout`` (their connections then close), and
cancels what remains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qsl, unquote

__all__ = ["AppKey", "Application", "HTTPBadRequest", "HTTPException", "HTTPMethodNotAllowed",
           "HTTPNotFound", "Request", "Response", "Runner", "StreamResponse", "json_response",
           "middleware"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

Handler = Callable[["Request"], Awaitable["Response"]]
Middleware = Callable[["Request", Handler], Awaitable["Response"]]

MAX_HEAD = 64 * 1024
"""The longest request line and headers, together (431 beyond)."""

KEEPALIVE_TIMEOUT = 75.0
"""How long a connection may wait between requests, or take to send a request's head,
before it is closed (aiohttp's and nginx's keep-alive timeout)."""

MAX_READ = 1024 * 1024
"""The largest body ``request.read()`` / ``json()`` take whole (413 beyond); handlers
that take more read it in pieces (``request.content.read(n)``), as ``/mpub`` does."""

_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,16}")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

_REASONS = {100: "Continue", 200: "OK", 201: "Created", 204: "No Content",
            301: "Moved Permanently", 302: "Found", 304: "Not Modified", 400: "Bad Request",
            401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 411: "Length Required",
            413: "Payload Too Large", 415: "Unsupported Media Type",
            429: "Too Many Requests", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout", 507: "Insufficient Storage"}


def _reason(status: int) -> str:
    reason = _REASONS.get(status)
    if reason is None:
        from http import HTTPStatus  # noqa: PLC0415 - rare statuses only

        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
    return reason


# ------------------------------------------------------------------ the app


class AppKey(Generic[_T]):
    """A typed key of an :class:`Application`'s state."""

    __slots__ = ("name",)

    def __init__(self, name: str, t: type[_T] | None = None) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<AppKey({self.name})>"


class Application(dict[Any, Any]):
    """Routes, middlewares, cleanup callbacks, and state (``app[key]``)."""

    def __init__(self, *, middlewares: Iterable[Middleware] = ()) -> None:
        super().__init__()
        self.middlewares: list[Middleware] = list(middlewares)
        self.on_cleanup: list[Callable[[Application], Awaitable[None]]] = []
        self.router = Router()
        self._chains: dict[Handler, Handler] | None = None

    def __hash__(self) -> int:  # (a dict is not hashable; an app is one thing)
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def freeze(self) -> None:
        """Wrap each route's handler in the middlewares, once (at the first request)."""
        self._chains = {}
        for handler in self.router.handlers():
            self._chains[handler] = self._wrap(handler)

    def _wrap(self, handler: Handler) -> Handler:
        for mw in reversed(self.middlewares):
            handler = _bind(mw, handler)
        return handler

    async def handle(self, request: Request) -> Response:
        """The answer to `request`: its route's handler inside the middlewares."""
        if self._chains is None:
            self.freeze()
        handler, request.match_info = self.router.resolve(request.method, request.path)
        chain = self._chains.get(handler) if self._chains is not None else None
        return await (chain or self._wrap(handler))(request)

    async def cleanup(self) -> None:
        for callback in self.on_cleanup:
            try:
                await callback(self)
            except Exception:
                logger.exception("HTTP app cleanup %r failed", callback)


def _bind(mw: Middleware, handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        return await mw(request, handler)
    return wrapped


def middleware(fn: _T) -> _T:
    """Marks a middleware (as aiohttp's decorator does; nothing to do here)."""
    return fn


class Router:
    """Exact paths, and paths with ``{name}`` segments (matching one segment)."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._patterns: dict[str, tuple[re.Pattern[str], dict[str, Handler]]] = {}

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        if "{" in path:
            if path not in self._patterns:
                regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path))
                self._patterns[path] = (re.compile(f"^{regex}$"), {})
            methods = self._patterns[path][1]
        else:
            methods = self._exact.setdefault(path, {})
        if method in methods:
            msg = f"{method} {path} is routed already"
            raise ValueError(msg)
        methods[method] = handler

    def add_get(self, path: str, handler: Handler, *, allow_head: bool = True) -> None:
        self.add_route("GET", path, handler)
        if allow_head:
            self.add_route("HEAD", path, handler)

    def add_post(self, path: str, handler: Handler) -> None:
        self.add_route("POST", path, handler)

    def handlers(self) -> list[Handler]:
        tables = [*self._exact.values(), *(m for _, m in self._patterns.values())]
        return list({h: None for methods in tables for h in methods.values()})

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        methods = self._exact.get(path)
        info: dict[str, str] = {}
        if methods is None:
            for pattern, candidates in self._patterns.values():
                match = pattern.match(path)
                if match is not None:
                    methods, info = candidates, match.groupdict()
                    break
            else:
                return _not_found, info
        handler = methods.get(method)
        if handler is None:
            allowed = set(methods)

            async def not_allowed(_request: Request) -> Response:
                raise HTTPMethodNotAllowed(method, allowed)
            return not_allowed, info
        return handler, info


async def _not_found(_request: Request) -> Response:
    raise HTTPNotFound


# ------------------------------------------------------------------ requests and responses


class Query(dict[str, str]):
    """A query string: ``q[name]`` and ``q.get(name)`` are the first value (as
    nsqd's ``url.Values.Get``), :meth:`getall` every one."""

    def __init__(self, raw: str) -> None:
        pairs = parse_qsl(raw, keep_blank_values=True) if raw else []
        super().__init__()
        for key, value in pairs:
            self.setdefault(key, value)
        self._pairs = pairs

    def getall(self, key: str, default: list[str] | None = None) -> list[str]:
        values = [v for k, v in self._pairs if k == key]
        if not values and default is None:
            raise KeyError(key)
        return values or list(default or ())


class Headers(dict[str, str]):
    """A request's headers, by name in any case (a repeated one's values joined by ``, ``)."""

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


class Body:
    """A request's body, read as the handler asks: ``read(n)`` gives up to `n` bytes
    (all of the rest with ``n < 0``), ``b""`` at its end."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 length: int | None, *, chunked: bool, expect_continue: bool) -> None:
        self._reader = reader
        self._writer = writer
        self._left = 0 if chunked else (length or 0)  # of the body, or of the current chunk
        self._chunked = chunked
        self._continue = expect_continue and (chunked or bool(length))
        self.at_eof = not chunked and not length

    async def read(self, n: int = -1) -> bytes:
        if self.at_eof:
            return b""
        if self._continue:
            self._continue = False
            self._writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self._chunked:
            return await self._read_some(n)
        out = bytearray()
        while not self.at_eof and (n < 0 or len(out) < n):
            if self._left == 0:
                await self._next_chunk()
                continue
            out += await self._read_some(n - len(out) if n >= 0 else -1)
            if self._left == 0:
                await self._crlf()
        return bytes(out)

    async def _read_some(self, n: int) -> bytes:
        want = self._left if n < 0 else min(n, self._left)
        try:
            data = await self._reader.readexactly(want) if n < 0 else \
                await self._reader.read(want)
        except asyncio.IncompleteReadError as e:
            raise ConnectionResetError("the client closed mid-body") from e
        if not data and want:
            raise ConnectionResetError("the client closed mid-body")
        self._left -= len(data)
        if self._left == 0 and not self._chunked:
            self.at_eof = True
        return data

    async def _next_chunk(self) -> None:
        line = await self._line()
        size_text = line.split(b";", 1)[0].strip(b" \t")
        if not _CHUNK_SIZE.fullmatch(size_text):  # (hex digits only: no 0x, no sign)
            raise _BadRequest("bad chunk size")
        size = int(size_text, 16)
        if size == 0:
            while await self._line():  # trailers, up to the empty line
                pass
            self.at_eof = True
        self._left = size

    async def _crlf(self) -> None:
        if await self._line():
            raise _BadRequest("a chunk longer than its size")

    async def _line(self) -> bytes:
        try:
            return (await self._reader.readuntil(b"\r\n"))[:-2]
        except asyncio.IncompleteReadError as e:
            raise ConnectionResetError("the client closed mid-body") from e
        except asyncio.LimitOverrunError:
            raise _BadRequest("a chunk line too long") from None

    def drainable(self, limit: int) -> bool:
        """Whether what is left of the body, unread by the handler, can be read and
        dropped after the answer to keep the connection: a known length up to
        `limit`, that the client is sending (not one still waiting for 100 Continue)."""
        return self.at_eof or (not self._chunked and not self._continue and self._left <= limit)

    async def drain(self) -> None:
        while not self.at_eof:
            await self.read(65536)


class Request:
    """One request: ``method``, ``path`` (decoded), ``path_qs`` (as sent), ``query``,
    ``headers``, ``content_length``, the body (:meth:`read`, :meth:`json`,
    ``content.read(n)``), ``match_info``, ``app`` and ``transport``."""

    __slots__ = ("_query", "app", "content", "content_length", "headers", "match_info", "method",
                 "path", "path_qs", "transport", "version")

    def __init__(self, app: Application, method: str, target: str, *, version: str,
                 headers: Headers, content: Body, content_length: int | None,
                 transport: asyncio.BaseTransport | None) -> None:
        self.app = app
        self.method = method
        self.path_qs = target
        path, _, self._query = target.partition("?")
        self.path = unquote(path) if "%" in path else path
        self.version = version
        self.headers = headers
        self.content = content
        self.content_length = content_length
        self.transport = transport
        self.match_info: dict[str, str] = {}

    @property
    def query(self) -> Query:
        query = self._query
        if not isinstance(query, Query):
            query = self._query = Query(query)
        return query

    async def read(self) -> bytes:
        """The whole body, up to :data:`MAX_READ` (413 beyond, nothing more is read)."""
        length = self.content_length
        if length is not None and length > MAX_READ:
            raise HTTPRequestEntityTooLarge
        body = await self.content.read(MAX_READ + 1)
        while not self.content.at_eof and len(body) <= MAX_READ:  # (chunked)
            body += await self.content.read(MAX_READ + 1 - len(body))
        if len(body) > MAX_READ:
            raise HTTPRequestEntityTooLarge
        return body

    async def text(self) -> str:
        return (await self.read()).decode("utf-8")

    async def json(self) -> Any:
        return json.loads(await self.read())


class Response:
    """An answer: ``status``, ``headers``, and a body given as ``body`` (bytes) or
    ``text`` (sent as UTF-8); ``content_type`` and ``charset`` make its
    ``Content-Type`` (text: ``text/plain; charset=utf-8``; bytes:
    ``application/octet-stream``) unless ``headers`` has one."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, *, status: int = 200, body: bytes | None = None, text: str | None = None,
                 headers: Mapping[str, str] | None = None, content_type: str | None = None,
                 charset: str | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers) if headers else {}
        if text is not None:
            self.body = text.encode("utf-8")
            content_type = content_type or "text/plain"
            charset = charset or "utf-8"
        else:
            self.body = body or b""
            content_type = content_type or ("application/octet-stream" if body else None)
        if content_type and not any(k.lower() == "content-type" for k in self.headers):
            self.headers["Content-Type"] = (f"{content_type}; charset={charset}" if charset
                                            else content_type)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")

    def encode(self, *, keep_alive: bool, head: bool = False) -> bytes:
        """The response as sent: status line, headers, and (unless `head`) the body."""
        lines = [f"HTTP/1.1 {self.status} {_reason(self.status)}"]
        lines.extend(f"{k}: {v}" for k, v in self.headers.items())
        lines.append(f"Content-Length: {len(self.body)}")
        lines.append(f"Date: {_date()}")
        if not keep_alive:
            lines.append("Connection: close")
        head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head_bytes if head else head_bytes + self.body


StreamResponse = Response


def json_response(data: Any, *, status: int = 200) -> Response:
    return Response(status=status, body=json.dumps(data).encode(),
                    content_type="application/json", charset="utf-8")


_date_cache: list[Any] = [0, ""]


def _date() -> str:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[:] = [now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now))]
    return str(_date_cache[1])


class HTTPException(Exception):
    """Raised by a handler (or the router) to answer ``status`` with ``text``
    (default ``"<status>: <reason>"``)."""

    status = 500

    def __init__(self, *, text: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(text)
        self.text = text if text is not None else f"{self.status}: {_reason(self.status)}"
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return Response(status=self.status, text=self.text, headers=self.headers)


class HTTPBadRequest(HTTPException):
    status = 400


class HTTPNotFound(HTTPException):
    status = 404


class HTTPRequestEntityTooLarge(HTTPException):
    status = 413


class HTTPMethodNotAllowed(HTTPException):
    status = 405

    def __init__(self, method: str, allowed_methods: Iterable[str], *,
                 text: str | None = None) -> None:
        self.method = method
        self.allowed_methods = set(allowed_methods)
        super().__init__(text=text, headers={"Allow": ", ".join(sorted(self.allowed_methods))})


class _BadRequest(HTTPException):
    """Framing the server cannot read: answered with ``status`` and the connection closed
    (an app's middleware passes it on, as any :class:`HTTPException`)."""

    def __init__(self, text: str, status: int = 400) -> None:
        self.status = status
        super().__init__(text=f"{status}: {text}")


# ------------------------------------------------------------------ serving


class Runner:
    """Serves `app` on the running event loop: :meth:`start` from a bound listening
    socket, :meth:`close` to stop (see the module's docstring)."""

    def __init__(self, app: Application, *, shutdown_timeout: float = 2.0,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT) -> None:
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.keepalive_timeout = keepalive_timeout
        self._server: asyncio.base_events.Server | None = None
        self._idle: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self, sock: socket.socket, ssl_context: ssl.SSLContext | None = None,
                    ) -> None:
        self.app.freeze()
        self._server = await asyncio.start_server(self._connection, sock=sock, ssl=ssl_context,
                                                  limit=MAX_HEAD)

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._idle.values()):
            writer.close()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.shutdown_timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await self.app.cleanup()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer, task)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self._tasks.discard(task)
            self._idle.pop(task, None)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     task: asyncio.Task[None]) -> None:
        transport = writer.transport
        app = self.app
        while not self._closing:
            self._idle[task] = writer
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                              self.keepalive_timeout)
            except TimeoutError:  # idle, or a head sent too slowly: the connection goes
                return
            except asyncio.IncompleteReadError as e:
                if e.partial.strip():
                    writer.write(_error(400, "the request ended within its head"))
                return
            except asyncio.LimitOverrunError:
                writer.write(_error(431, "request head over 64 KiB"))
                return
            finally:
                self._idle.pop(task, None)
            try:
                request, keep_alive = self._parse(head, reader, writer, transport)
            except _BadRequest as e:
                writer.write(e.response().encode(keep_alive=False))
                return
            head_only = request.method == "HEAD"
            try:
                response = await app.handle(request)
            except _BadRequest as e:
                writer.write(e.response().encode(keep_alive=False))
                return
            except HTTPException as e:
                response = e.response()
            except ConnectionError:
                return
            except Exception:
                logger.exception("HTTP %s %s failed", request.method, request.path_qs)
                response = Response(status=500, text="500: Internal Server Error")
            body = request.content
            drain = not body.at_eof
            keep_alive = keep_alive and not self._closing and body.drainable(256 * 1024)
            writer.write(response.encode(keep_alive=keep_alive, head=head_only))
            await writer.drain()
            if not keep_alive:
                return
            if drain:
                await body.drain()

    def _parse(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               transport: asyncio.BaseTransport) -> tuple[Request, bool]:
        lines = head[:-4].decode("latin-1").split("\r\n")
        while lines and not lines[0]:  # (robustness: empty lines before a request)
            lines.pop(0)
        parts = lines[0].split(" ") if lines else []
        if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1") \
                or not _TOKEN.fullmatch(parts[0]) or not parts[1].startswith(("/", "*")) \
                or _BAD_VALUE.search(parts[1]):
            raise _BadRequest("bad request line")
        method, target, version = parts
        headers = Headers()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            # (a name is a token; no CR, LF or NUL anywhere: a bare LF must not split a
            # line differently here than in a proxy in front)
            if not sep or not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise _BadRequest("bad header line")
            key = name.lower()
            value = value.strip(" \t")
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else \
            "keep-alive" in connection
        length: int | None = None
        chunked = False
        if "transfer-encoding" in headers:
            if "content-length" in headers:
                raise _BadRequest("both Content-Length and Transfer-Encoding")
            if headers["transfer-encoding"].lower() != "chunked":
                raise _BadRequest("a Transfer-Encoding other than chunked", 501)
            chunked = True
        elif "content-length" in headers:
            text = headers["content-length"]
            if not (text.isascii() and text.isdigit()) or len(text) > 18:
                raise _BadRequest("bad Content-Length")
            length = int(text)
        expect = headers.get("expect", "").lower() == "100-continue" and version == "HTTP/1.1"
        body = Body(reader, writer, length, chunked=chunked, expect_continue=expect)
        return Request(self.app, method.upper(), target, version=version, headers=headers,
                       content=body, content_length=length, transport=transport), keep_alive


def _error(status: int, text: str) -> bytes:
    return _BadRequest(text, status).response().encode(keep_alive=False)

