"""Operator CLI: ``python -m actors.ctl [--data-path D | --run-dir R] ps|actors|spawn|crash``.

It finds a broker by its data path (the same ``--data-path`` it was started
with, ``data`` by default) or a bare runtime by its run directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from actors.broker.options import run_dir_for
from actors.runtime.control import ControlClient
from actors.runtime.errors import ActorsError

__all__ = ["main"]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Render dicts with the same keys as an aligned text table."""
    if not rows:
        return "(none)"
    headers = list(rows[0])
    cells = [[str(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors.ctl", description=__doc__)
    p.add_argument("--data-path", default="data",
                   help="the broker's --data-path (default: data)")
    p.add_argument("--run-dir", help="a runtime's run directory (instead of --data-path)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("command", choices=["ps", "actors", "spawn", "crash"])
    p.add_argument("name", nargs="?")
    args = p.parse_args(argv)
    if args.command in ("spawn", "crash") and not args.name:
        p.error(f"{args.command} needs an actor NAME")
    run_dir = args.run_dir or run_dir_for(args.data_path)
    if not os.path.exists(os.path.join(run_dir, "control.sock")):
        where = run_dir if args.run_dir else f"{os.path.abspath(args.data_path)} ({run_dir})"
        print(f"no broker running in {where}", file=sys.stderr)
        return 1
    with ControlClient(run_dir, timeout=args.timeout) as client:
        try:
            if args.command == "ps":
                print(format_table([asdict(r) for r in client.ps()]))
            elif args.command == "actors":
                print(format_table([asdict(r) for r in client.actors()]))
            elif args.command == "spawn":
                print("created" if client.spawn(args.name) else "already running")
            else:
                client.crash(args.name)
                print(f"crash requested for {args.name}")
        except ActorsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
