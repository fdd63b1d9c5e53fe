"""`python -m storage`: a small demonstration of the embedded storage engine.

Opens (or reopens) a queue under ``--data-path`` (default: a directory under
the system's temp dir, kept between runs -- never the broker's ``./data``),
puts messages, reads half of them back, and prints the queue's stats.  Run
it twice: the second run finds the messages the first one left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from storage import DiskQueue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m storage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", default=os.path.join(tempfile.gettempdir(), "storage-demo"),
                        help="directory for the queue files (default: %(default)s)")
    parser.add_argument("--messages", type=int, default=100_000, help="messages to put")
    args = parser.parse_args(argv)
    with DiskQueue("demo", args.data_path) as q:
        print(f"opened queue 'demo' in {args.data_path!r} with {q.depth()} messages waiting")
        t = time.perf_counter()
        batch = [b"message %d" % i for i in range(200)]
        for _ in range(args.messages // 200):
            q.put_many(batch)
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        got = len(q.get_many(args.messages // 2))
        get_s = time.perf_counter() - t
        print(f"put {args.messages} messages in {put_s:.3f} s, got {got} in {get_s:.3f} s; "
              f"{q.depth()} left for the next run")
        print(json.dumps(q.stats(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
