"""Chaos: kill processes and crash actors under load; nothing acknowledged may be lost.

Producers publish unique ids over ZeroMQ, NSQ TCP and HTTP and record what
was acknowledged; consumers record every delivery (some REQ, some overrun
their timeout); deferred publishes are mixed in.  A nemesis, at random
moments, SIGKILLs a worker, the gateway, or the supervisor with all its
children (then starts the broker again), crashes a topic / channel /
disk-queue actor or a client actor (whose connection then closes) through the
debug hook, cuts a producer's TCP connection, or restarts the broker cleanly.
Then the nemesis stops, the broker recovers, every channel is drained, and
the checker asserts lost = 0 and unexpected = 0 (duplicates are allowed and
reported).

The run is seeded (``CHAOS_SEED``, printed); ``CHAOS_SECONDS`` makes it longer
(the default, about 30 s of nemesis, is part of the normal suite).  The
broker runs with ``--mem-queue-size=0``: the mode that promises no loss.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping

import pytest

from tests.chaos.harness import (
    SOCKETS,
    BrokerProcess,
    Ledger,
    consumer,
    drain,
    http_producer,
    tcp_producer,
    zmq_producer,
)

SEED = int(os.environ.get("CHAOS_SEED", "20261122"))
SECONDS = float(os.environ.get("CHAOS_SECONDS", "30"))

pytestmark = pytest.mark.timeout(max(240, int(SECONDS * 6)))


def nemesis(broker: BrokerProcess, stop: threading.Event, rng: random.Random,
            log: list[str], *, extra: Mapping[str, Callable[[], None]] | None = None,
            interval: tuple[float, float] = (2.0, 4.0)) -> None:
    """Every `interval` seconds, one fault at random; `extra` adds faults of the caller's
    (the soak's power cuts), each as likely as one of the built-in actions."""
    extra = extra or {}
    actions = ["kill_worker", "kill_worker", "kill_gateway", "kill_all", "crash_actor",
               "crash_client", "drop_connection", "restart", *extra]
    while not stop.wait(rng.uniform(*interval)):
        action = rng.choice(actions)
        log.append(action)
        try:
            if action in extra:
                extra[action]()
            elif action in {"kill_worker", "kill_gateway"}:
                role = "worker" if action == "kill_worker" else "gateway"
                victims = [p for p in broker.processes() if p.role == role and p.pid]
                if victims:
                    os.kill(rng.choice(victims).pid, signal.SIGKILL)
            elif action == "kill_all":
                broker.kill_all()
                broker.start()
            elif action == "crash_client":  # its connection is closed; the client reconnects
                clients = broker.client_actors()
                if clients:
                    broker.ctl_crash(rng.choice(sorted(clients)))
            elif action == "drop_connection":
                SOCKETS.cut_one(rng)
            elif action == "crash_actor":
                broker.ctl_crash(rng.choice(["topic:chaos", "channel:chaos/check",
                                             "diskqueue:chaos/check", "diskqueue:chaos"]))
            else:
                broker.stop()
                broker.start()
        except Exception as e:
            log.append(f"{action} failed: {e}")


def test_nothing_acknowledged_is_lost_under_kills_and_crashes(tmp_path):
    print(f"chaos seed {SEED} (replay with CHAOS_SEED={SEED}), {SECONDS:.0f} s of nemesis")
    rng = random.Random(SEED)
    broker = BrokerProcess(tmp_path / "data", tmp_path / "broker.log")
    broker.start()
    ledger = Ledger()
    stop_load, stop_nemesis, draining = threading.Event(), threading.Event(), threading.Event()
    actions: list[str] = []
    consumers = [consumer(broker, ledger, random.Random(rng.random()), draining)
                 for _ in range(2)]
    producers = [
        threading.Thread(target=zmq_producer, args=(broker, ledger, stop_load, "z1",
                                                     random.Random(rng.random()))),
        threading.Thread(target=zmq_producer, args=(broker, ledger, stop_load, "z2",
                                                     random.Random(rng.random()))),
        threading.Thread(target=tcp_producer, args=(broker, ledger, stop_load, "t1",
                                                    random.Random(rng.random()))),
        threading.Thread(target=http_producer, args=(broker, ledger, stop_load, "h1",
                                                     random.Random(rng.random()))),
    ]
    chaos = threading.Thread(target=nemesis, args=(broker, stop_nemesis,
                                                   random.Random(rng.random()), actions))
    try:
        for t in [*producers, chaos]:
            t.start()
        time.sleep(SECONDS)  # the run's length: the workload and the nemesis are at work
        stop_nemesis.set()
        chaos.join(120)
        stop_load.set()
        for t in producers:
            t.join(60)
        draining.set()
        result = drain(broker, ledger, timeout=120)
        print(f"chaos: nemesis did {actions}; {result}; "
              f"duplicate rate {result['duplicated'] / max(1, result['delivered']):.2%}")
        assert result["acknowledged"] > 100, "the workload hardly ran"
        assert result["unexpected"] == 0
        assert result["lost"] == 0, f"lost acknowledged messages, e.g. {ledger.lost()}"
    finally:
        stop_nemesis.set()
        stop_load.set()
        for c in consumers:
            c.close(timeout=5)
        broker.stop()
