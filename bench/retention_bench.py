"""What retention (#21) costs a publish, beside the same publishes without it.

    python -m bench.retention_bench [--messages 200000] [--size 100] [--rounds 3]

One broker (``python -m actors.broker``, two workers, defaults otherwise); for
each round and case, in turn, a fresh topic with two channels and one ZeroMQ
``Producer`` publishing ``--messages`` bodies in MPUBs of 200 (pipelined,
``publish_batch``), timed until the last is acknowledged.  Cases:

* ``off``: retention off (the default: a broker that does not use it);
* ``bytes``: the topic keeps 1 GB of history (``/topic/config``): every batch
  is also appended to the history;
* ``trimmed``: it keeps 1 MB, in chunks of ``--max-bytes-per-file`` (1 MiB
  here), so the history is trimmed as it is written.

It checks that each channel has every message and that the history holds
what the policy keeps, prints each round, then the medians with their ratios
to ``off``.  Then **replay**: per round, a topic keeping 1 GB, one channel,
``--messages`` published, and ``POST /channel/rewind`` from before them timed from the
request to its answer (every message read from the history's files and queued
on the channel again): messages per second.

Whether retention costs a broker that does not use it is measured beside the
build before it (``python -m bench.nsq_clients_bench --brokers ours@<tree>,ours``).
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from bench.tags_bench import _post, arguments, launched_broker, rounds
from transport.client import Producer

CASES = ("off", "bytes", "trimmed")
KEEP = {"off": 0, "bytes": 1_000_000_000, "trimmed": 1_000_000}
CHUNK = 1 << 20  # --max-bytes-per-file


def one(case: str, topic: str, http: int, zmq: str, bodies: list[bytes]) -> float:
    _post(http, f"/topic/create?topic={topic}")
    if KEEP[case]:
        _post(http, f"/topic/config?topic={topic}&retention_bytes={KEEP[case]}")
    for channel in ("c1", "c2"):
        _post(http, f"/channel/create?topic={topic}&channel={channel}")
    with Producer(zmq) as p:
        started = time.perf_counter()
        p.publish_batch(topic, bodies, 200)
        took = time.perf_counter() - started
    stats = _stats(http, topic)
    deadline = time.monotonic() + 10  # (the history is written beside the fan-out)
    while case == "bytes" and stats["retained_bytes"] < sum(map(len, bodies)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = _stats(http, topic)
    depths = {c["channel_name"]: c["depth"] for c in stats["channels"]}
    assert depths == {"c1": len(bodies), "c2": len(bodies)}, (case, depths)
    kept = stats["retained_bytes"]
    if case == "off":
        assert kept == 0, kept
    elif case == "bytes":
        assert kept >= sum(map(len, bodies)), kept
    else:
        assert 0 < kept <= KEEP[case] + CHUNK, kept  # (the chunk being written stays)
    _post(http, f"/topic/delete?topic={topic}")
    return len(bodies) / took


def _stats(http: int, topic: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/stats?format=json&topic={topic}",
                                timeout=10) as r:
        return json.load(r)["topics"][0]


def replay(topic: str, http: int, zmq: str, bodies: list[bytes]) -> float:
    """Messages per second of a rewind of `bodies` from a topic's history."""
    _post(http, f"/topic/create?topic={topic}")
    _post(http, f"/topic/config?topic={topic}&retention_bytes={KEEP['bytes']}")
    _post(http, f"/channel/create?topic={topic}&channel=c")
    # (the history is whole from when retention was turned on: rewind from then)
    since_ms = time.time_ns() // 1_000_000 + 1
    time.sleep(0.002)
    with Producer(zmq) as p:
        p.publish_batch(topic, bodies, 200)
    started = time.perf_counter()
    req = urllib.request.Request(f"http://127.0.0.1:{http}/channel/rewind?topic={topic}"
                                 f"&channel=c&from={since_ms}", method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback http
        answer = json.load(r)
    took = time.perf_counter() - started
    assert answer == {"messages": len(bodies)}, answer
    depth = _stats(http, topic)["channels"][0]["depth"]
    assert depth == 2 * len(bodies), depth
    _post(http, f"/topic/delete?topic={topic}")
    return len(bodies) / took


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, argv)
    with launched_broker(f"--max-bytes-per-file={CHUNK}") as (http, zmq):
        rounds("retention", CASES, args,
               lambda case, topic, bodies: one(case, topic, http, zmq, bodies))
        rounds("replay", ("rewind",), args,
               lambda _case, topic, bodies: replay(topic, http, zmq, bodies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
