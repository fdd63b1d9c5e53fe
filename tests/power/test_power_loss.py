"""Nothing acknowledged is lost on a power cut (#22): the broker on a volatile file system.

The data directory lives on `tests.power.volatile_fs`, which drops at each
unmount whatever POSIX lets a power cut drop: bytes not fsynced, directory
entries whose directory was not fsynced.  Each cut kills the broker (-9),
unmounts (the cut), mounts again and restarts it, while producers publish in
durable mode (``--mem-queue-size=0 --sync-every=1``) and consumers FIN on
one channel while another waits; small chunk files make every life rotate.
At the end every message a producer saw acknowledged must have been
delivered on every channel (before a cut or in the final drain), and nothing
never published may come out.  Each life also creates a channel of its own
(which must then hold everything acknowledged from that life on) and creates
and deletes another (which must stay deleted): the topic's metadata goes
through the cuts too.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.power.rig import BrokerProcess, VolatileMount, consume, produce

pytestmark = pytest.mark.timeout(300)

CUTS = 4
PER_LIFE = 1000  # messages acknowledged per topic between cuts
TOPICS = ("t", "u")
# "c" is consumed while the broker runs (every other life); "d" only after the last
# cut.  In a life without consumers no queue's floor moves, so no metadata write
# fsyncs the shared directory: only the sync itself can make a new chunk's entry durable.
CHANNELS = ("c", "d")


def test_nothing_acknowledged_is_lost_across_power_cuts(fs: VolatileMount,
                                                       broker: BrokerProcess) -> None:
    acked: dict[str, set[bytes]] = {t: set() for t in TOPICS}
    got: dict[tuple[str, str], set[bytes]] = {(t, c): set() for t in TOPICS for c in CHANNELS}
    published_prefixes: list[str] = []
    for life in range(CUTS + 1):
        broker.start()
        broker.create(TOPICS, CHANNELS)
        if life == CUTS:
            break
        # A channel of this life's (kept) and one created and deleted in it
        broker.post(f"/channel/create?topic=t&channel=n{life}")
        broker.post(f"/channel/create?topic=t&channel=x{life}")
        # Given producers and consumers at work
        stop = threading.Event()
        prefix = f"life{life}"
        published_prefixes.append(prefix)
        threads = [threading.Thread(target=produce,
                                    args=(broker.tcp, t, prefix, acked[t], stop))
                   for t in TOPICS]
        if life % 2 == 0:  # (in the other lives no queue's floor moves: see CHANNELS)
            threads += [threading.Thread(target=consume,
                                         args=(broker.tcp, t, "c", got[t, "c"].add, stop))
                        for t in TOPICS]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60  # each life: until every topic has its share
        deleted = False
        while (min(len(acked[t]) for t in TOPICS) < PER_LIFE * (life + 1)
               and time.monotonic() < deadline and all(t.is_alive() for t in threads)):
            if not deleted and len(acked["t"]) >= PER_LIFE * life + PER_LIFE // 2:
                broker.post(f"/channel/delete?topic=t&channel=x{life}")
                deleted = True
            time.sleep(0.01)
        assert deleted, "the life ended before its channel was deleted"
        # When the power goes: the broker dies, the unsynced state is dropped
        broker.kill9()
        stop.set()
        for t in threads:
            t.join(30)
        fs.cut()
        fs.up()
    # Then the last life delivers every acknowledged message not consumed before
    stop = threading.Event()
    conn = http.client.HTTPConnection("127.0.0.1", broker.http, timeout=10)
    conn.request("GET", "/stats?format=json&topic=t")
    (t_stats,) = json.loads(conn.getresponse().read())["topics"]
    names = {c["channel_name"] for c in t_stats["channels"]}
    assert names == {*CHANNELS, *(f"n{k}" for k in range(CUTS))}, "a channel came or went"
    for k in range(CUTS):  # each life's channel: everything acknowledged from then on
        got["t", f"n{k}"] = set()
        acked[f"t/n{k}"] = {m for m in acked["t"] if int(m[4:m.index(b"-")]) >= k}
    for (topic, channel), delivered in got.items():
        consume(broker.tcp, topic, channel, delivered.add, stop, idle=3.0)
    total = sum(len(acked[t]) for t in TOPICS)
    print(f"{CUTS} cuts: {total} acknowledged, {sum(map(len, got.values()))} delivered")
    assert total >= PER_LIFE * CUTS * len(TOPICS), "the load did not run"
    prefixes = tuple(p.encode() for p in published_prefixes)
    for (topic, channel), delivered in got.items():
        expected = acked.get(f"{topic}/{channel}", acked[topic])
        lost = expected - delivered
        assert not lost, (f"{topic}/{channel}: {len(lost)} of {len(expected)} "
                          f"acknowledged messages lost: {sorted(lost)[:5]}")
        assert all(b.startswith(prefixes) for b in delivered), "never published"
