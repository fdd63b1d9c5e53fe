"""nsqjs (npm, 0.13), unchanged, over TLS, snappy, deflate and AUTH against our broker."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.broker.test_auth import READER, WRITER, AuthServer
from tests.lookupd.conftest import NSQJS, nsqjs_node

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("options", [
    {"tls": True}, {"snappy": True}, {"deflate": True, "deflateLevel": 3},
    {"tls": True, "snappy": True}, {"authSecret": "js"},
], ids="+".join)
def test_nsqjs_publishes_and_reads_over(start, pki, options):
    node = nsqjs_node()
    authd = AuthServer()
    try:
        authd.grant("js", WRITER, {**READER, "topic": "^orders_js$", "channels": [".*"]})
        extra = (f"--auth-http-address={authd.address}",) if "authSecret" in options else ()
        t = start("ours", "true" if options.get("tls") else "false", extra=extra)
        done = subprocess.run([node, str(NSQJS / "roundtrip.js"), t.tcp, "orders_js",
                               json.dumps(options)], capture_output=True, text=True,
                              timeout=60, check=False,
                              env={**os.environ, "NODE_EXTRA_CA_CERTS": pki.ca_file})
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert json.loads(done.stdout) == ["one", "two"]
    finally:
        authd.close()
    if "authSecret" in options:
        assert {a["secret"] for a in authd.asked} == {"js"}
