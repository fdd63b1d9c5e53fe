"""Snappy and deflate negotiated by IDENTIFY (nsqd 1.3's ``--snappy``, ``--deflate``,
``--max-deflate-level``), alone and inside TLS, beside the real nsqd, with pynsq, and
against garbage in the compressed stream."""

from __future__ import annotations

import json
import os
import time
import zlib

import pytest
import snappy

from tests.broker.tls_kit import Client, https, pynsq_roundtrip
from transport.nsq.client_codec import ErrorFrame, Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(120)


def _deflate_client(c: Client) -> None:
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    deflater = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    c.inn = inflater.decompress
    c.out = lambda data: deflater.compress(data) + deflater.flush(zlib.Z_SYNC_FLUSH)


def _snappy_client(c: Client) -> None:
    c.inn = snappy.StreamDecompressor().decompress
    c.out = snappy.StreamCompressor().add_chunk


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
@pytest.mark.parametrize("how", ["deflate", "snappy"])
def test_compression_is_negotiated_and_both_directions_are_compressed(start, kind, how):
    t = start(kind, "false")
    c = Client(t.tcp)
    try:
        ask = {"deflate": True, "deflate_level": 3} if how == "deflate" else {"snappy": True}
        reply = c.identify(**ask)
        assert reply[how] is True
        if how == "deflate":
            assert reply["deflate_level"] == 3
            _deflate_client(c)
        else:
            _snappy_client(c)
        assert c.frames(1) == [Response(b"OK")]  # in the compressed stream
        c.send(pc.Sub("zipped", "c"))
        assert c.frames(1) == [Response(b"OK")]
        c.send(pc.Rdy(5))
        c.send(pc.Pub("zipped", b"x" * 5000))
        frames = c.frames(2)
        assert Response(b"OK") in frames
        (msg,) = [f for f in frames if isinstance(f, pc.Message)]
        assert msg.body == b"x" * 5000
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_both_compressions_at_once_is_identify_failed_and_the_level_is_capped(start, kind):
    t = start(kind, "false", extra=("--max-deflate-level=4",))
    c = Client(t.tcp)
    try:
        c.send(pc.Identify({"feature_negotiation": True, "snappy": True, "deflate": True}))
        (err,) = c.frames(1)
        assert isinstance(err, ErrorFrame)
        assert str(err.error) == "E_IDENTIFY_FAILED cannot enable both deflate and snappy " \
                                 "compression"
        assert c.closed_by_peer()
    finally:
        c.close()
    c = Client(t.tcp)
    try:
        reply = c.identify(deflate=True, deflate_level=9)
        assert (reply["deflate"], reply["deflate_level"], reply["max_deflate_level"]) == \
            (True, 4, 4)
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_a_broker_that_does_not_offer_compression_answers_false(start, kind):
    t = start(kind, "false", extra=("--snappy=false", "--deflate=false"))
    c = Client(t.tcp)
    try:
        reply = c.identify(snappy=True, deflate=True, deflate_level=2)
        assert (reply["snappy"], reply["deflate"], reply["deflate_level"]) == (False, False, 6)
        c.send(pc.Pub("plain", b"x"))
        assert c.frames(1) == [Response(b"OK")]
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_tls_then_snappy(start, pki, kind):
    t = start(kind, "true")
    c = Client(t.tcp)
    try:
        reply = c.identify(tls_v1=True, snappy=True)
        assert (reply["tls_v1"], reply["snappy"]) == (True, True)
        assert c.upgrade(pki.client_context())  # OK inside TLS
        _snappy_client(c)
        assert c.frames(1) == [Response(b"OK")]  # OK inside snappy inside TLS
        c.send(pc.Pub("tls_snappy", b"y"))
        assert c.frames(1) == [Response(b"OK")]
        if kind == "ours":
            _, _, body = https(t.https_port, pki.client_context(), "GET",
                               "/stats?format=json&topic=tls_snappy&include_clients=true")
            (producer,) = json.loads(body)["producers"]
            assert (producer["tls"], producer["snappy"], producer["deflate"]) == \
                (True, True, False)
    finally:
        c.close()


@pytest.mark.parametrize("how", ["deflate", "snappy"])
def test_garbage_in_the_compressed_stream_closes_only_that_connection(start, how):
    t = start("ours", "false")
    healthy = Client(t.tcp)
    healthy.identify(**{how: True})
    (_deflate_client if how == "deflate" else _snappy_client)(healthy)
    assert healthy.frames(1) == [Response(b"OK")]
    try:
        bad = Client(t.tcp)
        bad.identify(**{how: True})
        bad.sock.sendall(b"\xff" * 64 + os.urandom(512))
        assert bad.closed_by_peer()
        bad.close()
        healthy.send(pc.Pub("still", b"fine"))
        assert healthy.frames(1) == [Response(b"OK")]
    finally:
        healthy.close()


def test_a_deflate_bomb_is_refused_by_the_line_limit_not_inflated_whole(start):
    t = start("ours", "false")
    c = Client(t.tcp)
    try:
        c.identify(deflate=True)
        _deflate_client(c)
        assert c.frames(1) == [Response(b"OK")]
        c.sock.sendall(c.out(b"P" * (64 * 1024 * 1024)))  # ~64 KiB on the wire
        (err,) = c.frames(1)
        assert isinstance(err, ErrorFrame)
        assert err.error.code == "E_INVALID"
        assert c.closed_by_peer()
    finally:
        c.close()


@pytest.mark.parametrize("how", ["snappy", "deflate"])
def test_the_real_pynsq_publishes_and_reads_compressed(start, how):
    pytest.importorskip("nsq")
    t = start("ours", "false")
    pynsq_roundtrip(t.tcp, f"pynsq_{how}", f"{how}=True", [b"a" * 3000, b"b"])


@pytest.mark.parametrize("how", ["deflate", "snappy"])
def test_a_compressed_command_split_across_reads_is_put_together(start, how):
    # (a read holding only part of a chunk inflates to nothing: that must not read as
    # the client closing -- it did, and MPUBs over TLS, read 16 KiB a record, hung)
    t = start("ours", "false")
    c = Client(t.tcp)
    try:
        c.identify(**{how: True})
        (_deflate_client if how == "deflate" else _snappy_client)(c)
        assert c.frames(1) == [Response(b"OK")]
        wire = c.out(c.codec.send(pc.Mpub("split", tuple(os.urandom(64) for _ in range(300)))))
        for i in range(0, len(wire), 4096):
            c.sock.sendall(wire[i:i + 4096])
            time.sleep(0.02)  # each piece its own read
        assert c.frames(1) == [Response(b"OK")]
    finally:
        c.close()
