"""The channel's state machine alone: put, deliver and FIN, in µs per message.

    python -m bench.channel_bench [--messages 300000] [--size 100] [--clients 1]
                                  [--fin-lag 10] [--runs 3]

No actors, no sockets: publish batches of 200 encoded messages go into a
``ChannelState`` with ``--clients`` subscribed clients (RDY 2500 each); each
``put`` is followed by a delivery pass (``pump``), and each delivered batch
is FINed ``--fin-lag`` steps later (a consumer's FINs come back while about
RDY messages are in flight; 0 FINs at once), as a channel actor sees it
between mailbox messages.  This is the part of the topic's worker that the
delivery path changes touch; the broker benchmark measures the whole.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from actors.broker.channel_state import ChannelState
from actors.broker.nsq_message import GuidFactory


def run(messages: int, size: int, clients: int, lag: int) -> float:
    guids = GuidFactory(1)
    now = time.time_ns()
    batches = [guids.encode_batch(now + i * 1_000_000, [b"x" * size] * 200)
               for i in range(messages // 200)]
    ch = ChannelState(mem_queue_size=10**9, durable=True, rng=random.Random(1))
    names = [f"client-{i}" for i in range(clients)]
    for name in names:
        ch.subscribe(name, 60 * 10**9)
        ch.set_rdy(name, 2500)
    fins: list[tuple[str, list[bytes]]] = []

    def deliver() -> None:
        ch.pump(now)
        for name, out in ch.take_effects().deliveries.items():
            fins.append((name, [m[10:26] for m in out]))

    start = time.perf_counter()
    for batch in batches:
        ch.put(batch)
        deliver()
        while len(fins) > lag:
            ch.finish(*fins.pop(0))
            deliver()
    while fins:
        ch.finish(*fins.pop(0))
        deliver()
    assert not ch.in_flight
    assert not ch.ready
    return (time.perf_counter() - start) / (len(batches) * 200) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--fin-lag", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    results = [run(a.messages, a.size, a.clients, a.fin_lag) for _ in range(a.runs)]
    print(f"put + pump + FIN, {a.clients} client(s), {a.size} B, FIN lag {a.fin_lag}: "
          f"median {statistics.median(results):.3f} us/message "
          f"[{', '.join(f'{r:.3f}' for r in results)}]")


if __name__ == "__main__":
    main()
