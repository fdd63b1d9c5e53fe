"""What TLS, snappy, deflate and CURVE cost: publish and consume rates beside plain text.

    python -m bench.security_bench [--messages 200000] [--size 100] [--batch 200] [--rounds 3]

One broker with every feature on (``--tls-cert``/``--tls-key`` from a throwaway
CA made by ``trustme``, snappy and deflate offered, ``--zmq-curve-secret-key``)
serves every case, each on a fresh topic:

* NSQ TCP (``plain``, ``tls``, ``snappy``, ``deflate``, ``tls+snappy``): one
  connection publishes ``--messages`` in MPUBs of ``--batch`` (8 in flight, as
  ``bench_writer``), then one connection drains them (RDY 2500, FINs per read):
  ``bench.broker_bench``'s lean clients over a socket upgraded after IDENTIFY.
* ZeroMQ (``zmq``, ``zmq+curve``): ``transport.client.Producer`` (MPUBs of
  ``--batch``, 8 in flight) and ``Consumer``; ``zmq`` on a second broker (idle
  otherwise) without CURVE, as a CURVE listener takes CURVE clients only.

Cases alternate within each round, and a case's ratio is the median over rounds
of its rate divided by ``plain``'s (``zmq``'s for CURVE) in the same round, so
the machine's drift cancels.  #19's target: TLS costs at most 30 % of plain
text's throughput at 100 B in MPUBs of 200 (ratio >= 0.70).  The client
pays for TLS and compression too; both sides run on this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import ssl
import statistics
import tempfile
import threading
import time
import zlib
from typing import Any

import snappy
import trustme

from actors.broker import Broker, BrokerOptions
from bench.broker_bench import TcpClient, consume_tcp, publish_tcp
from transport.client import Consumer, Producer
from transport.nsq.client_codec import Response
from transport.protocol import commands as pc
from transport.zmq import curve

TCP_CASES = ("plain", "tls", "snappy", "deflate", "tls+snappy")
ZMQ_CASES = ("zmq", "zmq+curve")


class _Compressed:
    """A socket whose bytes go through snappy's or deflate's stream both ways."""

    def __init__(self, sock: Any, how: str) -> None:
        self.sock = sock
        if how == "snappy":
            self._in, self._out = snappy.StreamDecompressor().decompress, \
                snappy.StreamCompressor().add_chunk
        else:
            inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            deflater = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
            self._in = inflater.decompress
            self._out = lambda d: deflater.compress(d) + deflater.flush(zlib.Z_SYNC_FLUSH)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(self._out(data))

    def recv(self, n: int) -> bytes:
        while True:
            data = self.sock.recv(n)
            if not data:
                return b""
            out = self._in(data)
            if out:
                return out

    def close(self) -> None:
        self.sock.close()


def _client(address: str, case: str, ctx: ssl.SSLContext) -> TcpClient:
    """A connection that has negotiated `case` (IDENTIFY, then the upgrades)."""
    c = TcpClient(address)
    if case == "plain":
        return c
    features = {"feature_negotiation": True, "tls_v1": "tls" in case,
                "snappy": "snappy" in case, "deflate": case == "deflate"}
    c.send(pc.Identify(features))
    head = _exactly(c.sock, 8)
    _exactly(c.sock, int.from_bytes(head[:4], "big") - 4)  # the JSON answer
    if "tls" in case:
        c.sock = ctx.wrap_socket(c.sock, server_hostname="127.0.0.1")
        assert _exactly(c.sock, 10)[8:] == b"OK"
    if "snappy" in case or case == "deflate":
        c.sock = _Compressed(c.sock, "snappy" if "snappy" in case else "deflate")
        events = c.events()
        assert events == [Response(b"OK")], events
    return c


def _exactly(sock: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError("closed")
        data += more
    return data


def _tcp_case(b: Broker, case: str, topic: str, bodies: list[bytes], *, batch: int,
              ctx: ssl.SSLContext) -> tuple[float, float]:
    t = time.perf_counter()
    publish_tcp(b.tcp_address, topic, bodies, batch, client=_client(b.tcp_address, case, ctx))
    pub = len(bodies) / (time.perf_counter() - t)
    consumer = _client(b.tcp_address, case, ctx)
    t = time.perf_counter()
    consume_tcp(b.tcp_address, topic, "bench", len(bodies), [], client=consumer)
    return pub, len(bodies) / (time.perf_counter() - t)


def _zmq_case(b: Broker, case: str, topic: str, bodies: list[bytes], *, batch: int,
              server_key: bytes) -> tuple[float, float]:
    keys = {"curve_server_key": server_key} if case == "zmq+curve" else {}
    with Producer(b.zmq_endpoint, timeout=30, **keys) as p:
        t = time.perf_counter()
        for i in range(0, len(bodies), 8 * batch):  # 8 MPUBs in flight
            p.publish_batch(topic, bodies[i:i + 8 * batch], batch)
        pub = len(bodies) / (time.perf_counter() - t)
    done = threading.Event()
    got = [0]

    def handler(_m: Any) -> None:
        got[0] += 1
        if got[0] >= len(bodies):
            done.set()

    t = time.perf_counter()
    c = Consumer(topic, "bench", handler, b.zmq_endpoint, max_in_flight=2500, **keys).start()
    try:
        if not done.wait(300):
            raise TimeoutError(f"{case}: {got[0]} of {len(bodies)} consumed")
        sub = len(bodies) / (time.perf_counter() - t)
    finally:
        c.close()
    return pub, sub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="secbench", dir="/tmp")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(os.path.join(tmp, "server.pem"))
    cert.private_key_pem.write_to_path(os.path.join(tmp, "server.key"))
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    key_path = os.path.join(tmp, "curve.key_secret")
    server_key, _ = curve.load_or_create_keys(key_path)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {ssl.OPENSSL_VERSION}; "
          f"load {os.getloadavg()}")
    print(f"{a.messages} messages of {a.size} B, batches of {a.batch}, {a.rounds} rounds")
    bodies = [os.urandom(a.size // 2).hex().encode()[:a.size] for _ in range(a.messages)]
    opts = BrokerOptions(data_path=os.path.join(tmp, "data"), http_address="127.0.0.1:0",
                         tcp_address="127.0.0.1:0", zmq_address="tcp://127.0.0.1:0",
                         log_level="warn", tls_cert=os.path.join(tmp, "server.pem"),
                         tls_key=os.path.join(tmp, "server.key"),
                         zmq_curve_secret_key=key_path)
    # (a CURVE listener takes CURVE clients only: ZeroMQ in clear needs a broker of its own)
    plain_zmq = opts.replace(data_path=os.path.join(tmp, "data-zmq"), zmq_curve_secret_key="")
    rates: dict[str, list[tuple[float, float]]] = {c: [] for c in (*TCP_CASES, *ZMQ_CASES)}
    try:
        with Broker(opts) as b, Broker(plain_zmq) as bz:
            for r in range(a.rounds):
                for case in TCP_CASES:
                    rates[case].append(_tcp_case(b, case, f"t_{r}_{case.replace('+', '_')}",
                                                 bodies, batch=a.batch, ctx=ctx))
                for case in ZMQ_CASES:
                    rates[case].append(_zmq_case(bz if case == "zmq" else b, case,
                                                 f"z_{r}_{case.replace('+', '_')}",
                                                 bodies, batch=a.batch,
                                                 server_key=server_key))
                print(f"round {r + 1}: " + ", ".join(
                    f"{c} {rates[c][-1][0]:,.0f}/{rates[c][-1][1]:,.0f}" for c in rates),
                    flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'case':<11} {'publish msgs/s':>15} {'ratio':>6} {'consume msgs/s':>15} "
          f"{'ratio':>6}")
    for case, runs in rates.items():
        base = rates["zmq" if case.startswith("zmq") else "plain"]
        pub = statistics.median(p for p, _ in runs)
        sub = statistics.median(s for _, s in runs)
        pub_ratio = statistics.median(p / bp for (p, _), (bp, _) in zip(runs, base, strict=True))
        sub_ratio = statistics.median(s / bs for (_, s), (_, bs) in zip(runs, base, strict=True))
        print(f"{case:<11} {pub:>15,.0f} {pub_ratio:>5.2f}x {sub:>15,.0f} {sub_ratio:>5.2f}x")


if __name__ == "__main__":
    main()
