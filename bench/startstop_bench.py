"""How long a broker takes to start and to stop, beside nsqd (#23).

    python -m bench.startstop_bench [--rounds 5] [--brokers nsqd,ours] [--bin ../shared/nsq/bin]

Each round launches each broker afresh (an empty data directory, free loopback
ports), the brokers alternating, and measures

* **start**: from the launch to ``GET /ping`` answering ``OK`` (polled every
  2 ms), then publishes one message over HTTP;
* **stop**: from SIGTERM to every process of the broker gone (the launched one
  and every child it had).

``embedded`` (or ``embedded@/path/to/checkout``) measures what the pytest
fixture pays instead: in a Python process of its own, ``Broker(...).start()``
until it returns (``/ping`` answers then), one publish, and ``stop()`` until it
returns with every child joined.  That is the first broker of a test session;
``fixture`` is the second one in the same process, started after the first
has stopped: what every later test pays (the fork server is up by then, see
actors/runtime/forkserver.py).

It prints each round, then the medians and their ratios to the first broker.
``ours@/path/to/checkout`` runs another build of ours (its tree on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

BIN_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "nsq", "bin")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(name: str, data: str, http: int, tcp: int, bin_dir: str) -> tuple[list[str], dict]:
    kind, _, tree = name.partition("@")
    env = dict(os.environ)
    if kind == "nsqd":
        nsqd = os.path.join(bin_dir, "nsqd")
        nsqd = nsqd if os.path.exists(nsqd) else shutil.which("nsqd") or "nsqd"
        return [nsqd, f"--data-path={data}", f"--http-address=127.0.0.1:{http}",
                f"--tcp-address=127.0.0.1:{tcp}"], env
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree)
    return [sys.executable, "-m", "actors.broker", f"--data-path={data}",
            f"--http-address=127.0.0.1:{http}", f"--tcp-address=127.0.0.1:{tcp}",
            f"--zmq-address=tcp://127.0.0.1:{_port()}", "--log-level=warn"], env


def _ping(http: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/ping", timeout=1) as r:
            return r.read() == b"OK"
    except OSError:
        return False


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_EMBEDDED = """
import json, sys, tempfile, time
from actors.broker import Broker
from actors.broker.options import BrokerOptions

def once():
    data = tempfile.mkdtemp(prefix="startstop")
    opts = BrokerOptions(data_path=data + "/data", workers=1, http_address="127.0.0.1:0",
                         tcp_address="127.0.0.1:0", zmq_address="tcp://127.0.0.1:0",
                         log_level="warn")
    t = time.perf_counter()
    b = Broker(opts).start()
    up = time.perf_counter() - t
    b.publish("t", [b"x"])
    t = time.perf_counter()
    b.stop()
    return [up, time.perf_counter() - t]

def main():
    print(json.dumps(once() + (once() if sys.argv[1:] == ["twice"] else [])))

if __name__ == "__main__":
    main()
"""


def embedded(name: str) -> tuple[float, float]:
    kind, _, tree = name.partition("@")
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_EMBEDDED)
    try:
        out = subprocess.run([sys.executable, f.name, *(["twice"] if kind == "fixture" else [])],
                             env=env, capture_output=True, text=True, timeout=120,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    up, down = json.loads(out.strip().splitlines()[-1])[-2:]
    return float(up), float(down)


def one(name: str, bin_dir: str) -> tuple[float, float]:
    """(seconds to /ping OK, seconds from SIGTERM to every process gone)."""
    if name.partition("@")[0] in {"embedded", "fixture"}:
        return embedded(name)
    data = tempfile.mkdtemp(prefix="startstop")
    http, tcp = _port(), _port()
    os.makedirs(os.path.join(data, "data"))  # (nsqd needs it made; ours makes it itself)
    cmd, env = _command(name, os.path.join(data, "data"), http, tcp, bin_dir)
    try:
        started = time.perf_counter()
        # (in the other tree: ``python -m`` puts the working directory before PYTHONPATH)
        tree = name.partition("@")[2]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                cwd=os.path.abspath(tree) if tree else None)
        while not _ping(http):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while starting")
            if time.perf_counter() - started > 60:
                raise RuntimeError(f"{name} did not answer /ping within 60 s")
            time.sleep(0.002)
        up = time.perf_counter() - started
        req = urllib.request.Request(f"http://127.0.0.1:{http}/pub?topic=t", data=b"x",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback http
            r.read()
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        stopping = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        while alive := [p for p in family if _running(p)]:  # (psutil.wait_procs polls
            if time.perf_counter() - stopping > 60:       # grandchildren slowly)
                raise RuntimeError(f"{name}: {len(alive)} processes outlived the stop")
            time.sleep(0.001)
        return up, time.perf_counter() - stopping
    finally:
        shutil.rmtree(data, ignore_errors=True)


def _compile(brokers: list[str]) -> None:
    """Write the bytecode of each tree measured, as ``pip install`` does: with
    PYTHONDONTWRITEBYTECODE set (as on this machine) an editable checkout is compiled
    anew by every interpreter, about 0.25 s of each start."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {os.path.abspath(b.partition("@")[2] or here) for b in brokers
             if b.partition("@")[0] != "nsqd"}
    for tree in sorted(trees):
        subprocess.run([sys.executable, "-m", "compileall", "-q",
                        *(os.path.join(tree, d) for d in ("actors", "transport", "storage"))],
                       check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--brokers", default="nsqd,ours")
    ap.add_argument("--bin", default=BIN_DEFAULT, help="where nsqd is (else PATH)")
    args = ap.parse_args(argv)
    brokers = args.brokers.split(",")
    _compile(brokers)
    print(f"startstop_bench: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"brokers {brokers}, {args.rounds} rounds", flush=True)
    starts: dict[str, list[float]] = {b: [] for b in brokers}
    stops: dict[str, list[float]] = {b: [] for b in brokers}
    for rnd in range(args.rounds):
        for name in brokers if rnd % 2 == 0 else brokers[::-1]:
            up, down = one(name, args.bin)
            starts[name].append(up)
            stops[name].append(down)
            print(f"  round {rnd} {name:<14} start {up * 1000:8.1f} ms   "
                  f"stop {down * 1000:8.1f} ms", flush=True)
    base = brokers[0]
    for label, runs in (("start -> /ping OK", starts), ("SIGTERM -> all gone", stops)):
        cells = [f"{b} {statistics.median(runs[b]) * 1000:.1f} ms "
                 f"({statistics.median(runs[b]) / statistics.median(runs[base]):.1f}x)"
                 for b in brokers]
        print(f"== {label}, medians: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
