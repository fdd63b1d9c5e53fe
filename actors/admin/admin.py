"""The web console (nsqadmin's role): ``python -m actors.admin``.

Theory of operation
-------------------
One app (:mod:`transport.http.web`) on its own thread (:class:`transport.http.base.AppServer`)
serves a page (``static/index.html``, ``app.js``, ``app.css``: plain
JavaScript shipped in the package, no build step, nothing fetched from a
CDN) and a small JSON API under ``<base-path>/api/`` that the page polls
every two seconds.  The API reads only the brokers' and lookup daemons'
HTTP APIs (``/stats``, ``/info``, ``/nodes``, ``/lookup``), so it works
against nsqd and nsqlookupd as well as ours:

* brokers are the ``--nsqd-http-address`` ones, or every producer the
  ``--lookupd-http-address`` daemons list (``/nodes``);
* ``GET api/overview``: brokers (version, start time, topics, health),
  lookup daemons, and the topics summed over brokers;
* ``GET api/topic?topic=``: per broker depth (memory and disk), messages,
  paused; its channels summed over brokers;
* ``GET api/channel?topic=&channel=``: per broker figures, the clients (address,
  user agent, RDY, in flight, finished, requeued), end-to-end latency and
  the backlog alarm;
* ``GET api/broker?address=``: its topics, processes (restarts, RSS) and
  actors, and each disk queue's chunk files with their messages, reads,
  writes and cache state (EQueue's per-chunk statistics), from its ``/stats``
  (ours, ``include_storage=true``; nsqd has none of those);
* ``GET api/lookupds``: every daemon's nodes with their topics and tombstones;
* ``POST api/action`` (``{"action", "topic", "channel", "broker", "node"}``):
  create, pause, unpause, empty or delete a topic or channel on every broker
  that holds it (deletes also at every lookup daemon, as nsqadmin does), or
  tombstone a topic at a broker on every lookup daemon.  The page asks for a
  confirmation before each.

A broker that does not answer is shown with its error; it never fails the
page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Executor
from importlib import resources
from typing import Any

import aiohttp

from actors.admin.options import AdminOptions, parse_options
from actors.runtime.daemon import serve
from transport.http import web
from transport.http.base import AppServer

log = logging.getLogger("actors.admin")

STATIC = ("index.html", "app.js", "app.css")


class Cluster:
    """Reads and steers the brokers and lookup daemons over HTTP (async)."""

    def __init__(self, options: AdminOptions) -> None:
        self.options = options
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.options.http_timeout)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, address: str, path: str, method: str = "GET") -> Any:
        """JSON from ``http://address/path``; raises RuntimeError with a sentence."""
        url = f"http://{address}{path}"
        try:
            async with self.session().request(method, url) as r:
                body = await r.read()
                if r.status >= 400:
                    try:
                        why = json.loads(body).get("message", "")
                    except ValueError:
                        why = body.decode(errors="replace")[:200]
                    raise RuntimeError(f"{address}: HTTP {r.status} {why}".strip())
                if not body:
                    return None
                try:
                    return json.loads(body)
                except ValueError:
                    return body.decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise RuntimeError(f"{address}: {e or type(e).__name__}") from None

    async def _gather(self, calls: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*calls, return_exceptions=True))

    # -- who is there ------------------------------------------------------------

    async def lookupd_nodes(self) -> list[dict[str, Any]]:
        out = []
        replies = await self._gather([self.call(a, "/nodes")
                                      for a in self.options.lookupd_http_address])
        for address, reply in zip(self.options.lookupd_http_address, replies, strict=True):
            if isinstance(reply, Exception):
                out.append({"address": address, "error": str(reply), "producers": []})
            else:
                data = reply.get("data", reply) if isinstance(reply, dict) else {}
                out.append({"address": address, "producers": data.get("producers") or []})
        return out

    async def brokers(self) -> list[str]:
        """``host:http_port`` of every broker."""
        if self.options.nsqd_http_address:
            return list(self.options.nsqd_http_address)
        found: list[str] = []
        for lookupd in await self.lookupd_nodes():
            for p in lookupd["producers"]:
                address = f"{p['broadcast_address']}:{p['http_port']}"
                if address not in found:
                    found.append(address)
        return found

    async def stats(self, brokers: Sequence[str], query: str = "") -> list[dict[str, Any]]:
        """Each broker's ``/stats`` JSON, or ``{"error"}``."""
        replies = await self._gather([self.call(b, f"/stats?format=json{query}")
                                      for b in brokers])
        return [{"address": b, "error": str(r)} if isinstance(r, Exception)
                else {"address": b, **r} for b, r in zip(brokers, replies, strict=True)]

    # -- pages --------------------------------------------------------------------

    async def overview(self) -> dict[str, Any]:
        brokers = await self.brokers()
        stats = await self.stats(brokers, "&include_clients=false")
        rows, topics = [], {}
        for s in stats:
            row = {"address": s["address"], "error": s.get("error"),
                   "version": s.get("version", ""), "health": s.get("health", ""),
                   "start_time": s.get("start_time", 0), "topics": len(s.get("topics") or ())}
            rows.append(row)
            for t in s.get("topics") or ():
                entry = topics.setdefault(t["topic_name"], {
                    "topic": t["topic_name"], "depth": 0, "message_count": 0, "brokers": 0,
                    "channels": set(), "paused": False})
                entry["depth"] += t.get("depth") or 0
                entry["message_count"] += t.get("message_count") or 0
                entry["brokers"] += 1
                entry["channels"].update(c["channel_name"] for c in t.get("channels") or ())
                entry["paused"] = entry["paused"] or bool(t.get("paused"))
        lookupds = [{"address": lk["address"], "error": lk.get("error"),
                     "nodes": len(lk["producers"])} for lk in await self.lookupd_nodes()] \
            if self.options.lookupd_http_address else []
        return {"brokers": rows, "lookupds": lookupds, "now": int(time.time()),
                "topics": [{**t, "channels": len(t["channels"])}
                           for _, t in sorted(topics.items())]}

    async def topic(self, topic: str) -> dict[str, Any]:
        stats = await self.stats(await self.brokers(),
                                 f"&topic={_q(topic)}&include_clients=false")
        brokers, channels = [], {}
        for s in stats:
            for t in s.get("topics") or ():
                if t.get("topic_name") != topic:
                    continue
                depth, disk = t.get("depth") or 0, t.get("backend_depth") or 0
                brokers.append({"address": s["address"], "depth": depth,
                                "memory_depth": depth - disk, "backend_depth": disk,
                                "message_count": t.get("message_count") or 0,
                                "paused": bool(t.get("paused")),
                                "e2e": t.get("e2e_processing_latency")})
                for c in t.get("channels") or ():
                    _add_channel(channels.setdefault(c["channel_name"], _channel_row(c)), c)
        errors = [{"address": s["address"], "error": s["error"]} for s in stats
                  if s.get("error")]
        return {"topic": topic, "brokers": brokers, "errors": errors,
                "found": bool(brokers), "totals": _totals(brokers),
                "channels": [channels[c] for c in sorted(channels)]}

    async def channel(self, topic: str, channel: str) -> dict[str, Any]:
        stats = await self.stats(await self.brokers(),
                                 f"&topic={_q(topic)}&channel={_q(channel)}")
        brokers, clients = [], []
        total = _channel_row({"channel_name": channel})
        for s in stats:
            for t in s.get("topics") or ():
                for c in t.get("channels") or ():
                    if t.get("topic_name") != topic or c.get("channel_name") != channel:
                        continue
                    row = _channel_row(c)
                    _add_channel(row, c)
                    _add_channel(total, c)
                    brokers.append({**row, "address": s["address"],
                                    "e2e": c.get("e2e_processing_latency")})
                    clients.extend({
                        "broker": s["address"],
                        "address": cl.get("remote_address", ""),
                        "client_id": cl.get("client_id", ""),
                        "user_agent": cl.get("user_agent", ""),
                        "rdy": cl.get("ready_count", 0),
                        "in_flight": cl.get("in_flight_count", 0),
                        "finished": cl.get("finish_count", 0),
                        "requeued": cl.get("requeue_count", 0),
                        "connected": cl.get("connect_ts", 0),
                    } for cl in c.get("clients") or ())
        return {"topic": topic, "channel": channel, "found": bool(brokers),
                "brokers": brokers, "totals": total, "clients": clients}

    async def broker(self, address: str) -> dict[str, Any]:
        (s,) = await self.stats([address], "&include_clients=false&include_storage=true")
        if s.get("error"):
            return {"address": address, "error": s["error"]}
        queues = []  # ours only: each disk queue's chunks (EQueue's per-chunk statistics)
        for t in s.get("topics") or ():
            owners = [(t["topic_name"], t)] + [(f"{t['topic_name']}/{c['channel_name']}", c)
                                               for c in t.get("channels") or ()]
            for owner, entry in owners:
                storage = entry.get("storage")
                if not isinstance(storage, dict):
                    continue
                cache = storage.get("cache") or {}
                queues.append({
                    "queue": owner, "depth": storage.get("depth", 0),
                    "closed": bool(storage.get("closed")),
                    "cache_hits": cache.get("hits", 0), "cache_misses": cache.get("misses", 0),
                    "chunks": [{"chunk": int(n), **v} for n, v in
                               sorted((storage.get("chunks") or {}).items(),
                                      key=lambda kv: int(kv[0]))]})
        return {"queues": queues,"address": address, "version": s.get("version", ""),
                "health": s.get("health", ""), "start_time": s.get("start_time", 0),
                "topics": [{"topic": t["topic_name"], "depth": t.get("depth") or 0,
                            "message_count": t.get("message_count") or 0,
                            "channels": len(t.get("channels") or ()),
                            "paused": bool(t.get("paused"))} for t in s.get("topics") or ()],
                "processes": s.get("processes") or [], "actors": s.get("actors") or []}

    async def lookupds(self) -> list[dict[str, Any]]:
        out = []
        for lk in await self.lookupd_nodes():
            out.append({"address": lk["address"], "error": lk.get("error"), "nodes": [
                {"node": f"{p.get('broadcast_address')}:{p.get('http_port')}",
                 "version": p.get("version", ""), "tcp_port": p.get("tcp_port"),
                 "topics": p.get("topics") or [],
                 "tombstones": [t for t, dead in zip(p.get("topics") or [],
                                                     p.get("tombstones") or [], strict=False)
                                if dead]} for p in lk["producers"]]})
        return out

    # -- actions --------------------------------------------------------------------

    async def act(self, action: str, topic: str, channel: str = "", broker: str = "",
                  node: str = "") -> dict[str, Any]:
        """Do `action` on every broker that holds the topic (create: on `broker`, or every
        broker); deletes go to the lookup daemons too.  Returns what each answered."""
        if action not in {"create", "pause", "unpause", "empty", "delete", "tombstone"}:
            raise web.HTTPBadRequest(text=f"unknown action {action!r}")
        q = f"topic={_q(topic)}" + (f"&channel={_q(channel)}" if channel else "")
        kind = "channel" if channel else "topic"
        if action == "tombstone":
            targets = [(lk, f"/topic/tombstone?topic={_q(topic)}&node={_q(node)}")
                       for lk in self.options.lookupd_http_address]
        else:
            if broker:
                brokers = [broker]
            elif action == "create" and not channel:
                brokers = await self.brokers()
            else:
                holding = await self.topic(topic)
                brokers = [b["address"] for b in holding["brokers"]]
            targets = [(b, f"/{kind}/{action}?{q}") for b in brokers]
            if action == "delete":
                targets += [(lk, f"/{kind}/delete?{q}")
                            for lk in self.options.lookupd_http_address]
        replies = await self._gather([self.call(a, path, "POST") for a, path in targets])
        return {"action": action, "results": [
            {"address": a, "ok": not isinstance(r, Exception),
             "error": str(r) if isinstance(r, Exception) else None}
            for (a, _), r in zip(targets, replies, strict=True)]}


def _q(text: str) -> str:
    return urllib.parse.quote(text, safe="")


_SUMMED = ("depth", "backend_depth", "in_flight_count", "deferred_count", "requeue_count",
           "timeout_count", "message_count", "client_count")


def _channel_row(c: dict[str, Any]) -> dict[str, Any]:
    return {"channel": c.get("channel_name", ""), **dict.fromkeys(_SUMMED, 0),
            "paused": False, "backlog_alarm": False, "brokers": 0}


def _add_channel(row: dict[str, Any], c: dict[str, Any]) -> None:
    for key in _SUMMED:
        row[key] += c.get(key) or (len(c.get("clients") or ()) if key == "client_count" else 0)
    row["paused"] = row["paused"] or bool(c.get("paused"))
    row["backlog_alarm"] = row["backlog_alarm"] or bool(c.get("backlog_alarm"))
    row["brokers"] += 1


def _totals(brokers: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("depth", "memory_depth", "backend_depth", "message_count")
    return {k: sum(b[k] for b in brokers) for k in keys}


# ------------------------------------------------------------------ the HTTP app


def make_app(options: AdminOptions, _executor: Executor | None = None,
             _port: int = 0) -> web.Application:
    cluster = Cluster(options)
    app = web.Application()
    prefix = options.prefix
    static = {name: (resources.files("actors.admin") / "static" / name).read_bytes()
              for name in STATIC}
    types = {"html": "text/html", "js": "text/javascript", "css": "text/css"}

    def serve(name: str) -> Any:
        async def handler(_request: web.Request) -> web.Response:
            body = static[name]
            if name == "index.html":  # the page finds its API under the base path
                body = body.replace(b"{{BASE}}", (prefix + "/").encode())
            return web.Response(body=body, content_type=types[name.rpartition(".")[2]],
                                charset="utf-8")
        return handler

    async def api(request: web.Request) -> web.Response:
        q = request.query
        what = request.match_info["what"]
        try:
            if what == "overview":
                data: Any = await cluster.overview()
            elif what == "topic":
                data = await cluster.topic(_arg(q, "topic"))
            elif what == "channel":
                data = await cluster.channel(_arg(q, "topic"), _arg(q, "channel"))
            elif what == "broker":
                data = await cluster.broker(_arg(q, "address"))
            elif what == "lookupds":
                data = await cluster.lookupds()
            else:
                raise web.HTTPNotFound(text="no such API")
        except web.HTTPException:
            raise
        except Exception as e:  # a bug must not take the console down: say what it was
            log.exception("api/%s failed", what)
            return web.json_response({"message": str(e)}, status=500)
        return web.json_response(data)

    async def action(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="expected a JSON object") from None
        if not isinstance(body, dict) or not body.get("topic"):
            raise web.HTTPBadRequest(text="expected {\"action\", \"topic\", ...}")
        result = await cluster.act(str(body.get("action", "")), str(body["topic"]),
                                   str(body.get("channel") or ""), str(body.get("broker") or ""),
                                   str(body.get("node") or ""))
        return web.json_response(result)

    async def close(_app: web.Application) -> None:
        await cluster.close()

    app.router.add_get(f"{prefix}/", serve("index.html"))
    if prefix:
        app.router.add_get(prefix, serve("index.html"))
    app.router.add_get(f"{prefix}/static/app.js", serve("app.js"))
    app.router.add_get(f"{prefix}/static/app.css", serve("app.css"))
    app.router.add_get(f"{prefix}/api/{{what}}", api)
    app.router.add_post(f"{prefix}/api/action", action)
    app.router.add_get(f"{prefix}/ping", _ping)
    app.on_cleanup.append(close)
    return app


async def _ping(_request: web.Request) -> web.Response:
    return web.Response(text="OK")


def _arg(query: Any, name: str) -> str:
    value = query.get(name, "")
    if not value:
        raise web.HTTPBadRequest(text=f"missing {name}")
    return str(value)


class Admin:
    """The console as a daemon: ``start()``, ``stop()``, and where it listens."""

    def __init__(self, options: AdminOptions) -> None:
        self.options = options
        host, _, port = options.http_address.rpartition(":")
        self.server = AppServer(lambda executor, p: make_app(options, executor, p),
                                host.strip("[]") or "127.0.0.1", int(port), name="admin")

    @property
    def http_address(self) -> str:
        return f"{self.server.host}:{self.server.port}"

    def start(self) -> Admin:
        self.server.start()
        return self

    def stop(self) -> bool:
        return self.server.stop()

    def __enter__(self) -> Admin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return serve(argv, parse_options, Admin, log,
                 running=lambda admin: f"admin running (pid {os.getpid()}): "
                                       f"http://{admin.http_address}{admin.options.base_path}")
