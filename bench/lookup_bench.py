"""Finding a message by its id through the broker (#21): ``GET /message``, at millions
of messages.

    python -m bench.lookup_bench [--messages 10000000] [--size 100] [--lookups 1000]

One broker (``python -m actors.broker``, defaults, every topic keeping its history:
``--retention-bytes``), a topic with one channel and no consumer, and
``--messages`` bodies of ``--size`` bytes published in MPUBs of 200 by a ZeroMQ
``Producer``.  Then ``GET /message`` over one kept-alive HTTP connection, for ids
sampled evenly from the history's files, in two states:

* **queued**: every message waits in the channel, all but ``--mem-queue-size`` of
  them in its disk queue, which the lookup searches by its summaries (and the
  topic's history, by its index).  First, a lookup of an id that is nowhere makes
  the disk queue's summaries (one read of the backlog); it is timed on its own.
* **consumed**: the channel emptied (``/channel/empty``): the message is found in
  the history only.

Each case prints p50 / p99 / max in milliseconds, beside ``GET /ping`` on the same
connection (the HTTP round trip the lookup cannot go below).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable

from actors.broker.nsq_message import record_id
from bench.history_bench import _line as history_line
from bench.tags_bench import _post, launched_broker
from storage.chunk import iter_messages
from transport.client import Producer

TOPIC, CHANNEL = "lk", "c"


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read()


def _timed(conn: http.client.HTTPConnection, paths: list[str],
           check: Callable[[int, bytes], None]) -> list[float]:
    out = []
    for path in paths:
        started = time.perf_counter()
        status, body = _get(conn, path)
        out.append((time.perf_counter() - started) * 1000)
        check(status, body)
    return out


def _line(name: str, ms: list[float]) -> str:
    return history_line(name, ms, "requests")


def _sample_ids(history: str, count: int) -> list[bytes]:
    """`count` ids spread evenly over the history's files."""
    ids = [record_id(r) for name in sorted(os.listdir(history)) if name.endswith(".dat")
           for _, r in iter_messages(os.path.join(history, name))]
    step = max(1, len(ids) // count)
    return ids[::step][:count]


def _channel_depth(conn: http.client.HTTPConnection, *, on_disk: bool = False) -> int:
    """The channel's depth (`on_disk`: what its disk queue holds, written)."""
    _, body = _get(conn, f"/stats?format=json&topic={TOPIC}&channel={CHANNEL}"
                         f"&include_storage={'true' if on_disk else 'false'}")
    topics = json.loads(body)["topics"]
    if not topics or not topics[0]["channels"]:
        return -1
    channel = topics[0]["channels"][0]
    return channel["storage"]["depth"] if on_disk else channel["depth"]


def _wait(what: str, check: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("flags", nargs="*", help="more flags for the broker (after --)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="lookupbench")
    try:
        with launched_broker(f"--retention-bytes={1 << 40}", *args.flags, data=work) as (port, zmq):
            _post(port, f"/topic/create?topic={TOPIC}")
            _post(port, f"/channel/create?topic={TOPIC}&channel={CHANNEL}")
            body = os.urandom(args.size // 2 + 1).hex().encode()[:args.size]
            started = time.perf_counter()
            with Producer(zmq) as producer:
                for done in range(0, args.messages, 100_000):
                    producer.publish_batch(TOPIC, [body] * min(100_000, args.messages - done),
                                           200)
            took = time.perf_counter() - started
            print(f"lookup_bench: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
                  f"{args.messages:,} messages of {args.size} B published in {took:.1f} s "
                  f"({args.messages / took:,.0f} msgs/s)", flush=True)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            _wait("the channel's depth", lambda: _channel_depth(conn) == args.messages)
            last = -1  # (the depth counts what the channel sent its disk queue: wait until
            while (depth := _channel_depth(conn, on_disk=True)) != last:  # it is written)
                last = depth
                time.sleep(1)
            os.sync()  # (the files' 2.5 GB written back now, not under the lookups)
            ids = _sample_ids(os.path.join(work, "d", f"{TOPIC}.history"), args.lookups)
            random.Random(1).shuffle(ids)
            paths = [f"/message?topic={TOPIC}&id={i.decode()}" for i in ids]

            def expect(state: str) -> Callable[[int, bytes], None]:
                def check(status: int, raw: bytes) -> None:
                    if status != 200 or json.loads(raw)["state"] != state:
                        raise SystemExit(f"expected {state}: {status} {raw!r}")
                return check

            ping = _timed(conn, ["/ping"] * args.lookups, lambda s, _b: None)
            print(_line("GET /ping", ping))
            def missing(status: int, raw: bytes) -> None:
                if status != 404:
                    raise SystemExit(f"expected 404: {status} {raw!r}")

            # (a miss looks through every chunk: it summarises the whole backlog)
            print(_line("first lookup (a miss)",
                        _timed(conn, [f"/message?topic={TOPIC}&id={'0' * 16}"], missing)))
            print(_line("queued", _timed(conn, paths, expect("queued"))))
            _post(port, f"/channel/empty?topic={TOPIC}&channel={CHANNEL}")
            _wait("the channel emptied", lambda: _channel_depth(conn) == 0)
            print(_line("consumed", _timed(conn, paths, expect("consumed"))))
            print(_line("GET /ping", _timed(conn, ["/ping"] * args.lookups,
                                            lambda s, _b: None)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
