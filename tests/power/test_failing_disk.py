"""A failing disk (#22): a queue whose fsync fails with EIO is never acknowledged again.

The broker runs on the power-cut rig (`tests.power.volatile_fs`), which fails
every fsync of the files whose path holds a given text while its control file
exists.  After a failed fsync the kernel may have dropped the pages it could
not write, and a retry can succeed without them (fsyncgate), so the broker
must not retry: that queue refuses publishes until a restart, `/ping` names it,
and the other queues keep serving.
"""

from __future__ import annotations

import http.client
import json

import pytest

from tests.power.rig import BrokerProcess, Tcp, VolatileMount
from tests.power.volatile_fs import EIO_CONTROL
from transport.nsq.client_codec import ErrorFrame, Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(180)


def _pub(b: BrokerProcess, topic: str) -> object:
    c = Tcp(b.tcp)
    try:
        c.send(pc.Pub(topic, b"m"))
        return next(c.events())
    finally:
        c.sock.close()


def _get(b: BrokerProcess, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", b.http, timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read()


def _depth(b: BrokerProcess, topic: str) -> int:
    stats = json.loads(_get(b, f"/stats?format=json&topic={topic}")[1])
    return stats["topics"][0]["channels"][0]["depth"]


def test_a_queue_whose_fsync_fails_refuses_publishes_until_a_restart(
        fs: VolatileMount, broker: BrokerProcess) -> None:
    control = fs.backing / EIO_CONTROL
    try:
        broker.start()
        broker.create(("bad", "good"), ("c",))
        assert _pub(broker, "bad") == _pub(broker, "good") == Response(b"OK")
        # Given a disk that fails every fsync of the channel bad/c's files
        control.write_text("bad:c.")
        # When a publish to bad is fsynced
        failed = _pub(broker, "bad")
        # Then it is refused, and so is the next one once the disk answers again
        assert isinstance(failed, ErrorFrame)
        assert failed.error.code == "E_PUB_FAILED"
        assert "bad:c" in str(failed.error)
        control.unlink()
        assert isinstance(_pub(broker, "bad"), ErrorFrame)
        # And the other queues keep serving, and /ping names the failed queue
        assert _pub(broker, "good") == Response(b"OK")
        status, text = _get(broker, "/ping")
        assert status == 500
        assert text.startswith(b"NOK - bad:c: disk failed - fdatasync of the write chunk failed")
        # And a restart once the disk is fixed recovers the queue by scanning
        broker.kill9()
        broker.start()
        assert _pub(broker, "bad") == Response(b"OK")
        assert _depth(broker, "bad") >= 2  # the acknowledged one and this one
        assert _get(broker, "/ping") == (200, b"OK")
    finally:
        control.unlink(missing_ok=True)
