"""Operator CLI: ``python -m actors.ctl --run-dir DIR ps|actors|spawn NAME|crash NAME``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

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
    p.add_argument("--run-dir", required=True)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("command", choices=["ps", "actors", "spawn", "crash"])
    p.add_argument("name", nargs="?")
    args = p.parse_args(argv)
    if args.command in ("spawn", "crash") and not args.name:
        p.error(f"{args.command} needs an actor NAME")
    with ControlClient(args.run_dir, timeout=args.timeout) as client:
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
