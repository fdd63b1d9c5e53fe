"""nsqlookupd 1.3's HTTP API as an application (:mod:`transport.http.web`) over an injected facade.

Theory of operation
-------------------
As :mod:`transport.http.api` does for nsqd, the app owns nothing but HTTP:
it reads the query string (only the query string, the first value of a
repeated key, as nsqlookupd does), checks arguments in nsqlookupd's order with
its codes (``MISSING_ARG_TOPIC``, ``INVALID_ARG_TOPIC``, ...), and renders what a
:class:`LookupFacade` answers -- the lookup daemon's registry, behind actor
asks that block, so every call runs on the server's executor.  ``/ping`` is
plain text; everything else answers "V1" (:mod:`transport.http.base`), with
``X-NSQ-Content-Type: nsq; version=1.0``, which go-nsq needs to read a
``/lookup``.

One difference on purpose: nsqlookupd passes ``*`` to its registry as a
wildcard, so ``POST /topic/delete?topic=*`` deletes every topic; here a name is
a name.  See docs/CLUSTER.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from transport.http import web
from transport.http.base import EXECUTOR, AppServer, HttpError, call, errors, v1
from transport.protocol.validation import valid_name

__all__ = ["LookupFacade", "LookupHttpServer", "make_lookup_app"]


class LookupFacade(Protocol):
    """What the lookup daemon's HTTP API asks (each call may block)."""

    def lookup(self, topic: str) -> dict[str, Any] | bytes | None:
        """``{"channels": [...], "producers": [...]}`` (or that as JSON bytes), or None:
        no such topic."""
        ...

    def topics(self) -> list[str]: ...

    def channels(self, topic: str) -> list[str]: ...

    def nodes(self) -> list[dict[str, Any]]:
        """Active brokers, each with ``topics`` and the parallel ``tombstones``."""
        ...

    def debug(self) -> dict[str, list[dict[str, Any]]]:
        """Every registration (``category:key:subkey``) with its producers."""
        ...

    def topic_create(self, topic: str) -> None: ...

    def topic_delete(self, topic: str) -> None: ...

    def channel_create(self, topic: str, channel: str) -> None: ...

    def channel_delete(self, topic: str, channel: str) -> bool:
        """False: no such channel."""
        ...

    def tombstone(self, topic: str, node: str) -> None: ...

    def info(self) -> dict[str, Any]:
        """``{"version": ...}``."""
        ...


FACADE = web.AppKey("lookup_facade", LookupFacade)


def _arg(request: web.Request, name: str) -> str:
    """A query argument (present, possibly empty), or 400 ``MISSING_ARG_<NAME>``."""
    value = request.query.get(name)
    if value is None:
        raise HttpError(400, f"MISSING_ARG_{name.upper()}")
    return value


def _name_arg(request: web.Request, name: str) -> str:
    """A topic or channel name, or 400 ``MISSING_ARG_*`` / ``INVALID_ARG_*``."""
    value = _arg(request, name)
    if not valid_name(value.encode("utf-8", "replace")):
        raise HttpError(400, f"INVALID_ARG_{name.upper()}")
    return value


def _facade(request: web.Request) -> LookupFacade:
    return request.app[FACADE]


async def _ping(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def _info(request: web.Request) -> web.Response:
    return v1(await call(request, _facade(request).info))


async def _debug(request: web.Request) -> web.Response:
    return v1(await call(request, _facade(request).debug))


async def _lookup(request: web.Request) -> web.Response:
    topic = _arg(request, "topic")
    found = await call(request, _facade(request).lookup, topic)
    if found is None:
        raise HttpError(404, "TOPIC_NOT_FOUND")
    return v1(found)


async def _topics(request: web.Request) -> web.Response:
    return v1({"topics": await call(request, _facade(request).topics)})


async def _channels(request: web.Request) -> web.Response:
    topic = _arg(request, "topic")
    return v1({"channels": await call(request, _facade(request).channels, topic)})


async def _nodes(request: web.Request) -> web.Response:
    return v1({"producers": await call(request, _facade(request).nodes)})


async def _topic_create(request: web.Request) -> web.Response:
    await call(request, _facade(request).topic_create, _name_arg(request, "topic"))
    return v1()


async def _topic_delete(request: web.Request) -> web.Response:
    await call(request, _facade(request).topic_delete, _arg(request, "topic"))
    return v1()


async def _topic_tombstone(request: web.Request) -> web.Response:
    topic = _arg(request, "topic")
    node = _arg(request, "node")
    await call(request, _facade(request).tombstone, topic, node)
    return v1()


async def _channel_create(request: web.Request) -> web.Response:
    topic, channel = _name_arg(request, "topic"), _name_arg(request, "channel")
    await call(request, _facade(request).channel_create, topic, channel)
    return v1()


async def _channel_delete(request: web.Request) -> web.Response:
    topic, channel = _name_arg(request, "topic"), _name_arg(request, "channel")
    if not await call(request, _facade(request).channel_delete, topic, channel):
        raise HttpError(404, "CHANNEL_NOT_FOUND")
    return v1()


def make_lookup_app(facade: LookupFacade, *, executor: Executor | None = None,
                    ) -> web.Application:
    """nsqlookupd's HTTP API over `facade` (``executor`` runs its blocking calls)."""
    app = web.Application(middlewares=[errors])
    app[FACADE] = facade
    if executor is not None:
        app[EXECUTOR] = executor
    get: Callable[..., Any] = functools.partial(app.router.add_get, allow_head=False)
    get("/ping", _ping)
    get("/info", _info)
    get("/debug", _debug)
    get("/lookup", _lookup)
    get("/topics", _topics)
    get("/channels", _channels)
    get("/nodes", _nodes)
    app.router.add_post("/topic/create", _topic_create)
    app.router.add_post("/topic/delete", _topic_delete)
    app.router.add_post("/topic/tombstone", _topic_tombstone)
    app.router.add_post("/channel/create", _channel_create)
    app.router.add_post("/channel/delete", _channel_delete)
    return app


class LookupHttpServer(AppServer):
    """Serves :func:`make_lookup_app` on its own thread (:class:`AppServer`)."""

    def __init__(self, facade: LookupFacade, host: str = "127.0.0.1", port: int = 4161,
                 ) -> None:
        self.facade = facade
        super().__init__(self._app, host, port, name="lookupd-http")

    def _app(self, executor: Executor, port: int) -> web.Application:
        return make_lookup_app(self.facade, executor=executor)
