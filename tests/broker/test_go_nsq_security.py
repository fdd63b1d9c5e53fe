"""go-nsq, as NSQ's own tools run it (``to_nsq`` publishes, ``nsq_tail`` reads; v1.3.0
from ../shared/nsq/bin), over TLS, snappy, deflate and AUTH against our broker."""

from __future__ import annotations

import subprocess

import pytest

from tests.broker.test_auth import READER, WRITER, AuthServer
from tests.lookupd.conftest import nsq_binary

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("opts", [
    ("tls_v1,true",), ("snappy,true",), ("deflate,true", "deflate_level,4"),
    ("tls_v1,true", "deflate,true"), ("auth_secret,go",),
], ids=lambda o: "+".join(x.split(",")[0] for x in o))
def test_go_nsq_publishes_and_tails_over(start, pki, opts):
    to_nsq, nsq_tail = nsq_binary("to_nsq"), nsq_binary("nsq_tail")
    authd = AuthServer()
    try:
        authd.grant("go", WRITER, {**READER, "topic": "^orders_go$", "channels": [".*"]})
        tls = "tls_v1,true" in opts
        extra = (f"--auth-http-address={authd.address}",) if "auth_secret,go" in opts else ()
        t = start("ours", "true" if tls else "false", extra=extra)
        opts = (*opts, f"tls_root_ca_file,{pki.ca_file}") if tls else opts
        published = subprocess.run(
            [to_nsq, f"--nsqd-tcp-address={t.tcp}", "--topic=orders_go",
             *(f"--producer-opt={o}" for o in opts)],
            input="first\nsecond\n", capture_output=True, text=True, timeout=30, check=False)
        assert published.returncode == 0, published.stderr[-2000:]
        tail = subprocess.run(
            [nsq_tail, f"--nsqd-tcp-address={t.tcp}", "--topic=orders_go", "--channel=c",
             "-n", "2", *(f"--consumer-opt={o}" for o in opts)],
            capture_output=True, text=True, timeout=30, check=False)
        assert tail.returncode == 0, tail.stderr[-2000:]
        assert sorted(tail.stdout.split()) == ["first", "second"]
    finally:
        authd.close()
