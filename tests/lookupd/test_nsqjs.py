"""nsqjs (npm, 0.13), as its users run it, reads from our brokers through our lookupd."""

from __future__ import annotations

import json
import subprocess

import pytest

from actors.lookupd import Lookupd
from tests.chaos.harness import BrokerProcess
from tests.lookupd.conftest import NSQJS, nsqjs_node, wait_until
from transport.client import Producer, lookup

pytestmark = pytest.mark.timeout(120)



def test_nsqjs_reader_finds_our_brokers_through_our_lookupd(lookupd: Lookupd,
                                                            tmp_path) -> None:
    node = nsqjs_node()
    brokers = [BrokerProcess(tmp_path / f"b{i}", tmp_path / f"b{i}.log", (
        "--workers", "1", "--broadcast-address", "127.0.0.1",
        "--lookupd-tcp-address", lookupd.tcp_address)) for i in range(2)]
    try:
        for b in brokers:
            b.start()
            with Producer(b.zmq_endpoint) as p:
                p.multi_publish("jst", [b"%d-%d" % (b.tcp, n) for n in range(3)])
        wait_until(lambda: len(lookup(lookupd.http_address, "jst")) == 2,
                   what="both brokers in the lookup")
        done = subprocess.run([node, str(NSQJS / "read.js"), lookupd.http_address, "jst", "c",
                               "6"], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == sorted(f"{b.tcp}-{n}" for b in brokers
                                                 for n in range(3))
    finally:
        for b in brokers:
            b.stop()
