"""Side by side with the real nsqlookupd 1.3.0: the same brokers' commands and the same
HTTP requests, sent to both, get the same answers (lists compared as sets, since
nsqlookupd's order is random; each broker's remote address as its letter)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from actors.lookupd import Lookupd
from tests.lookupd.conftest import Http, Peer, free_port, nsq_binary, wait_until
from transport.nsq.lookup_codec import Identify, Register, Unregister

pytestmark = pytest.mark.timeout(60)


def _normal(value: Any, names: dict[str, str]) -> Any:
    """`value` with remote addresses replaced by names and lists sorted."""
    if isinstance(value, dict):
        return {k: _normal(names.get(v, v) if k == "remote_address" else v, names)
                for k, v in value.items()}
    if isinstance(value, list):
        items = [_normal(v, names) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    return value


def _nodes(body: dict[str, Any], names: dict[str, str]) -> Any:
    """/nodes with each node's topics and tombstones paired (their order is random)."""
    out = []
    for node in body["producers"]:
        pairs = sorted(zip(node.pop("topics"), node.pop("tombstones"), strict=True))
        out.append({**_normal(node, names), "topics": pairs})
    return sorted(out, key=lambda v: json.dumps(v, sort_keys=True))


def scenario(tcp: str, http: str) -> list[Any]:
    """Everything a daemon answered, normalised, in order."""
    web = Http(http)
    out: list[Any] = []

    def get(path: str, method: str = "GET",
            shape: Callable[[Any, dict[str, str]], Any] = _normal) -> None:
        status, headers, body = web.call(method, path)
        parsed = json.loads(body) if body and body != b"OK" else body.decode()
        out.append((method, path, status, headers.get("X-Nsq-Content-Type",
                                                      headers.get("X-NSQ-Content-Type")),
                    shape(parsed, names) if status == 200 and parsed else parsed))

    a, b = Peer(tcp), Peer(tcp)
    names = {a.address: "A", b.address: "B"}
    hello = a.ask(Identify("hostA", 1001, 2001, "1.3.0", "hostnameA"))
    out.append(sorted(hello.json()))  # (values differ: ports, hostname, version)
    b.ask(Identify("hostB", 1002, 2002, "1.3.0", "hostnameB"))
    for peer, command in [(a, Register("t1", "c1")), (a, Register("t1", "c2")),
                          (a, Register("t2")), (a, Register("e#ephemeral", "ce#ephemeral")),
                          (b, Register("t1")), (b, Register("t1", "c1"))]:
        out.append((names[peer.address], command, peer.ask(command).data))
    for path in ["/lookup?topic=t1", "/lookup?topic=t2", "/lookup?topic=nope", "/lookup",
                 "/topics", "/channels?topic=t1", "/channels?topic=nope", "/channels"]:
        get(path)
    get("/nodes", shape=_nodes)
    get("/topic/tombstone?topic=t1&node=hostA:2001", "POST")
    get("/topic/tombstone?topic=t1&node=hostA:1001", "POST")  # (the TCP port: no match)
    get("/lookup?topic=t1")
    get("/nodes", shape=_nodes)
    for peer, command in [(a, Unregister("t1", "c2")), (a, Register("t1", "c9")),
                          (a, Unregister("e#ephemeral", "ce#ephemeral"))]:
        out.append((names[peer.address], command, peer.ask(command).data))
    for path in ["/channels?topic=t1", "/channels?topic=e%23ephemeral", "/lookup?topic=t1"]:
        get(path)
    b.close()
    time.sleep(0.2)  # (both daemons drop a closed peer as soon as they read the EOF)
    get("/lookup?topic=t1")
    for path in ["/topic/create?topic=made", "/topic/create?topic=bad!", "/topic/create",
                 "/channel/create?topic=made&channel=ch", "/channel/create?topic=made",
                 "/channel/delete?topic=made&channel=nope", "/channel/delete?topic=made&channel=ch",
                 "/topic/tombstone?topic=made", "/topic/delete?topic=t2"]:
        get(path, "POST")
    for path in ["/topics", "/lookup?topic=made", "/ping", "/nowhere"]:
        get(path)
    get("/topic/create?topic=x")  # (a GET on a POST route)
    for raw in [b"  V2", b"  V1FOO bar\n", b"  V1REGISTER t\n", b"  V1PING\n",
                b"  V1IDENTIFY\n\x00\x00\x00\x02{]",
                b"  V1IDENTIFY\n\x00\x00\x00\x0e{\"tcp_port\":1}"]:
        peer = Peer(tcp)
        peer.send_raw(raw)
        out.append((raw, peer.answer(), peer.answer() if raw != b"  V1PING\n" else None))
        peer.close()
    a.close()
    return out


def test_our_lookupd_answers_as_nsqlookupd_1_3_does(lookupd: Lookupd, tmp_path,
                                                    processes) -> None:
    binary = nsq_binary("nsqlookupd")
    tcp, web = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    processes([binary, f"--tcp-address={tcp}", f"--http-address={web}"],
              tmp_path / "nsqlookupd.log")
    wait_until(lambda: Http(web).up(), what="nsqlookupd")
    theirs = scenario(tcp, web)
    ours = scenario(lookupd.tcp_address, lookupd.http_address)
    for step, (mine, real) in enumerate(zip(ours, theirs, strict=True)):
        assert mine == real, f"step {step}: ours {mine!r}, nsqlookupd {real!r}"

