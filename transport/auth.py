"""NSQ AUTH: asking an auth server what a secret may do, and checking commands against it.

nsqd 1.3's model, which NSQ's auth servers (``pynsqauthd``, ``nsq-auth``) answer:
a client sends ``AUTH <secret>``; the broker asks one of ``--auth-http-address``
(in random order, the next on failure) ``GET /auth?remote_ip=&tls=&secret=&common_name=``
(or ``POST`` with those fields as JSON arrays, ``--auth-http-request-method=post``),
and the server answers::

    {"ttl": 3600, "identity": "...", "identity_url": "...",
     "authorizations": [{"topic": "regex", "channels": ["regex", ...],
                         "permissions": ["subscribe", "publish"]}]}

A PUB, MPUB or DPUB needs an authorization with ``publish`` whose topic regex
matches and one of whose channel regexes matches ``""``; a SUB one with
``subscribe`` whose topic and a channel regex match (Go's ``MatchString``: a
search, not anchored).  After ``ttl`` seconds the server is asked again before
the next such command, so a revoked secret stops working.  An answer with a
permission other than those two, a regex that does not compile or a ``ttl`` of
0 or less is a failure, as in nsqd.  Pure parsing and checking here; the asking
(:func:`query_any`) is a coroutine on the caller's event loop.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from transport.mailbox.envelope import frozen

__all__ = ["ASK_AGAIN", "AuthError", "AuthServers", "AuthState", "Authorization", "answer",
           "ask", "judge", "parse_state", "query_any"]

PERMISSIONS = frozenset({"subscribe", "publish"})
CONNECT_TIMEOUT = 2.0  # nsqd's --http-client-connect-timeout
REQUEST_TIMEOUT = 5.0  # nsqd's --http-client-request-timeout


@frozen
class AuthServers:
    """``--auth-http-address`` (one or more) and ``--auth-http-request-method``."""

    addresses: tuple[str, ...]
    method: str = "get"


class AuthError(Exception):
    """The auth servers could not be asked, or answered something unusable (logged,
    never shown to the client: nsqd answers ``E_AUTH_FAILED AUTH failed``)."""


@frozen
class Authorization:
    topic: re.Pattern[str]
    channels: tuple[re.Pattern[str], ...]
    permissions: frozenset[str]

    def allows(self, topic: str, channel: str) -> bool:
        if ("subscribe" if channel else "publish") not in self.permissions:
            return False
        if not self.topic.search(topic):
            return False
        return any(c.search(channel) for c in self.channels)


@frozen
class AuthState:
    identity: str
    identity_url: str
    authorizations: tuple[Authorization, ...]
    expires: float  # on the clock `parse_state` was given

    def allows(self, topic: str, channel: str) -> bool:
        return any(a.allows(topic, channel) for a in self.authorizations)


ASK_AGAIN = "ask again"
""":func:`judge`'s verdict when the answer's TTL has passed."""


def judge(state: AuthState | None, command: str, topic: str, channel: str, now: float
          ) -> tuple[str, str] | str | None:
    """What a connection with `state` may do about `command` (PUB, MPUB, DPUB: `channel`
    ""; SUB): None if allowed, :data:`ASK_AGAIN` if the TTL has passed, else nsqd's
    fatal ``(code, text)`` -- the one rule set of both protocols."""
    if state is None or not state.authorizations:
        return "E_AUTH_FIRST", f"AUTH required before {command}"
    if state.expires <= now:
        return ASK_AGAIN
    if not state.allows(topic, channel):
        return "E_UNAUTHORIZED", f'AUTH failed for {command} on "{topic}" "{channel}"'
    return None


def answer(state: AuthState) -> dict[str, Any] | tuple[str, str]:
    """AUTH's answer once the servers replied: nsqd's map, or its fatal refusal when
    the secret may do nothing."""
    if not state.authorizations:
        return "E_UNAUTHORIZED", "AUTH no authorizations found"
    return {"identity": state.identity, "identity_url": state.identity_url,
            "permission_count": len(state.authorizations)}


def parse_state(data: Any, now: float) -> AuthState:
    """An auth server's answer as an :class:`AuthState`; AuthError saying what is wrong."""
    if not isinstance(data, dict):
        raise AuthError("the answer is not a JSON object")
    auths = []
    for raw in data.get("authorizations") or ():
        if not isinstance(raw, dict):
            raise AuthError(f"authorization {raw!r} is not an object")
        permissions = frozenset(raw.get("permissions") or ())
        unknown = permissions - PERMISSIONS
        if unknown:
            raise AuthError(f"unknown permission {sorted(unknown)[0]}")
        try:
            topic = re.compile(str(raw.get("topic", "")))
            channels = tuple(re.compile(str(c)) for c in raw.get("channels") or ())
        except re.error as e:
            raise AuthError(f"unable to compile {e.pattern!r} {e}") from e
        auths.append(Authorization(topic, channels, permissions))
    ttl = data.get("ttl")
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl <= 0:
        raise AuthError(f"invalid TTL {ttl!r} (must be >0)")
    return AuthState(str(data.get("identity") or ""), str(data.get("identity_url") or ""),
                     tuple(auths), now + ttl)


async def query_any(session: Any, addresses: Sequence[str], method: str, *, remote_ip: str,
                    tls: bool, secret: str, common_name: str,
                    clock: Callable[[], float]) -> AuthState:
    """Ask the auth servers in random order until one answers (an aiohttp `session`)."""
    import aiohttp  # noqa: PLC0415 - the broker's HTTP dependency, only where auth is on

    fields = {"remote_ip": remote_ip, "tls": "true" if tls else "false", "secret": secret,
              "common_name": common_name}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT, connect=CONNECT_TIMEOUT)
    errors = []
    start = random.randrange(len(addresses))
    for i in range(len(addresses)):
        address = addresses[(start + i) % len(addresses)]
        endpoint = address if "://" in address else f"http://{address}/auth"
        headers = {"Accept": "application/vnd.nsq; version=1.0"}
        try:
            if method == "post":
                request = session.post(endpoint, timeout=timeout, headers=headers,
                                       json={k: [v] for k, v in fields.items()})
            else:
                request = session.get(f"{endpoint}?{urlencode(fields)}", timeout=timeout,
                                      headers=headers)
            async with request as response:
                body = await response.read()
                if response.status != 200:
                    raise AuthError(f"got response {response.status} {body[:200]!r}")
                return parse_state(json.loads(body), clock())
        except (AuthError, OSError, ValueError, TimeoutError, aiohttp.ClientError) as e:
            errors.append(f"failed to auth against {address} - {e}")
    raise AuthError("; ".join(errors))


def ask(servers: AuthServers, *, remote_ip: str, tls: bool, secret: str, common_name: str,
        clock: Callable[[], float]) -> AuthState:
    """:func:`query_any` from a thread without an event loop (its own loop and session)."""
    import asyncio  # noqa: PLC0415

    import aiohttp  # noqa: PLC0415

    async def run() -> AuthState:
        async with aiohttp.ClientSession() as session:
            return await query_any(session, servers.addresses, servers.method,
                                   remote_ip=remote_ip, tls=tls, secret=secret,
                                   common_name=common_name, clock=clock)

    return asyncio.run(run())
