"""What NSQ's HTTP daemons share: nsqd's "V1" answers, its error middleware, and a
server that runs an app (transport.http.web) on its own thread.

Theory of operation
-------------------
nsqd and nsqlookupd answer alike (``internal/http_api``): ``/ping`` is plain
text; every other endpoint answers "V1" -- the header
``X-NSQ-Content-Type: nsq; version=1.0``, JSON for data and for errors
(``{"message": "CODE"}``), raw text for a string, an empty body for nothing
(:func:`v1`, :func:`v1_error`).  Handlers raise :class:`HttpError`; the
:func:`errors` middleware turns it, unknown paths (404 ``NOT_FOUND``), wrong
methods (405 ``METHOD_NOT_ALLOWED`` with ``Allow``) and crashes (500
``INTERNAL_ERROR``) into those answers.

The daemons' apps talk to a *facade* whose calls block (an actor ask), so
every call runs on an executor (:func:`call`): the :class:`AppServer`'s own
bounded pool -- unless the facade's method is a coroutine function (it asks
without blocking), which :func:`call` awaits on the loop itself.
:class:`AppServer` serves an app on its own thread and event loop:
:meth:`AppServer.start` binds the socket in the caller's thread (a busy port
raises there; port 0 is resolved to :attr:`AppServer.port`) and returns once
the app serves; :meth:`AppServer.stop` closes the listener and open
connections, waits for running handlers (``shutdown_timeout``) and the
executor, and joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from transport.http import web

__all__ = ["EXECUTOR", "SLOW_EXECUTOR", "V1_HEADERS", "AppServer", "HttpError", "call",
           "errors", "v1", "v1_error"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

EXECUTOR = web.AppKey("executor", Executor)
SLOW_EXECUTOR = web.AppKey("slow_executor", Executor)
"""The pool for facade calls that may wait long (a rewind's, a lookup's first read of a
backlog: up to a minute), so that they never hold every thread publishes need."""
SLOW_WORKERS = 4
"""Where :func:`call` runs blocking facade calls (absent: the loop's default executor)."""

V1_HEADERS = {"X-NSQ-Content-Type": "nsq; version=1.0"}


class HttpError(Exception):
    """An nsqd-style error answer: ``status`` and the ``{"message": message}`` code,
    with ``detail`` (a sentence, ours) where the code alone would not say enough."""

    def __init__(self, status: int, message: str, detail: str = "") -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message
        self.detail = detail


def json_body(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def v1(data: Any = None, status: int = 200) -> web.Response:
    """nsqd's ``RespondV1``: text as is, bytes as JSON encoded already, anything else
    as JSON, with the V1 header."""
    if data is None:
        return web.Response(status=status, body=b"", headers=V1_HEADERS)
    if isinstance(data, str):
        return web.Response(status=status, text=data, headers=V1_HEADERS)
    if isinstance(data, bytes):  # JSON encoded already
        return web.Response(status=status, body=data, headers=V1_HEADERS,
                            content_type="application/json", charset="utf-8")
    return web.Response(status=status, body=json_body(data), headers=V1_HEADERS,
                        content_type="application/json", charset="utf-8")


def v1_error(status: int, message: str, headers: Mapping[str, str] | None = None,
             ) -> web.Response:
    response = v1({"message": message}, status)
    if headers:
        response.headers.update(headers)
    return response


@web.middleware
async def errors(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                 ) -> web.StreamResponse:
    """nsqd's answers for :class:`HttpError`, unknown paths, wrong methods and crashes."""
    try:
        return await handler(request)
    except HttpError as e:
        if e.detail:
            return v1({"message": e.message, "detail": e.detail}, e.status)
        return v1_error(e.status, e.message)
    except web.HTTPNotFound:
        return v1_error(404, "NOT_FOUND")
    except web.HTTPMethodNotAllowed as e:
        return v1_error(405, "METHOD_NOT_ALLOWED", {"Allow": ", ".join(sorted(e.allowed_methods))})
    except web.HTTPException:
        raise
    except Exception:
        logger.exception("HTTP %s %s failed", request.method, request.path_qs)
        return v1_error(500, "INTERNAL_ERROR")


async def call(request: web.Request, fn: Callable[..., Any], *args: Any,
               slow: bool = False) -> Any:
    """A facade call: awaited on the loop if `fn` is a coroutine function (a facade
    that asks without blocking), else run on the app's executor (it blocks); `slow`:
    on the pool for calls that may wait long, if the app has one."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    loop = asyncio.get_running_loop()
    executor = (slow and request.app.get(SLOW_EXECUTOR)) or request.app.get(EXECUTOR)
    return await loop.run_in_executor(executor, functools.partial(fn, *args))


class AppServer:
    """Serves the app ``make_app(executor, port)`` returns on its own thread and event loop.

    ``start()`` returns once the socket listens (``port=0`` picks a free
    port, then :attr:`port` tells which); ``stop()`` returns True if the
    thread ended within ``timeout``.  Facade calls run on a pool of
    ``max_workers`` threads, which bounds how many can block at once.
    """

    def __init__(self, make_app: Callable[[Executor, int], web.Application],
                 host: str = "127.0.0.1", port: int = 0, *, max_workers: int = 8,
                 shutdown_timeout: float = 2.0, name: str = "http-api",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.make_app = make_app
        self.ssl_context = ssl_context
        self.host = host
        self.port = port
        self.max_workers = max_workers
        self.shutdown_timeout = shutdown_timeout
        self.name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> AppServer:
        """Bind, start the thread, and return once requests are served."""
        if self._thread is not None:
            msg = f"{type(self).__name__} already started"
            raise RuntimeError(msg)
        self._ready, self._error = threading.Event(), None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, backlog=128)
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, args=(sock,),
                                        name=f"{self.name}:{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            msg = f"{self.name} did not start on {self.host}:{self.port}"
            raise RuntimeError(msg) from self._error
        logger.info("%s API listening on %s:%d", "HTTPS" if self.ssl_context else "HTTP",
                    self.host, self.port)
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop serving and join the thread; False if it is still running after ``timeout``."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None:
            return True
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("HTTP API thread did not stop within %.1fs", timeout)
            return False
        self._thread = None
        return True

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix=f"{self.name}-facade")
        slow = ThreadPoolExecutor(SLOW_WORKERS, thread_name_prefix=f"{self.name}-slow")
        try:
            loop.run_until_complete(self._serve(loop, sock, executor, slow))
        except BaseException as e:
            self._error = e
            logger.exception("HTTP API server failed")
        finally:
            self._ready.set()
            sock.close()
            executor.shutdown(wait=True, cancel_futures=True)
            slow.shutdown(wait=True, cancel_futures=True)
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _serve(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     executor: Executor, slow: Executor) -> None:
        self._loop = loop
        self._stopping = asyncio.Event()
        app = self.make_app(executor, self.port)
        app[SLOW_EXECUTOR] = slow
        runner = web.Runner(app, shutdown_timeout=self.shutdown_timeout)
        try:
            await runner.start(sock, self.ssl_context)
            self._ready.set()
            await self._stopping.wait()
        finally:
            await runner.close()
