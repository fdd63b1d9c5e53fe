"""``zmqnsq``: NSQ's command-line tools in one, for our brokers and for nsqd alike.

=============  ===========  ===================================================
subcommand     NSQ's tool   what it does
=============  ===========  ===================================================
``tail``       nsq_tail     prints a topic's message bodies, one per line
``to-file``    nsq_to_file  archives a topic to files, FINing what is on disk
``pub``        to_nsq       publishes the lines of stdin
``stat``       nsq_stat     prints a channel's rates and depths every interval
``ctl``        --           what ``python -m actors.ctl`` does (ps, actors, ...)
=============  ===========  ===================================================

``tail`` and ``pub`` speak NSQ TCP (``--nsqd-tcp-address``, repeatable; ``tail``
also finds brokers through ``--lookupd-http-address``) or our ZeroMQ protocol
(``--zmq-address``); ``stat`` reads the brokers' HTTP ``/stats``
(``--nsqd-http-address`` or ``--lookupd-http-address``).  A bad flag or a
broker that cannot be reached is one line on stderr and exit status 1 (2 for
usage errors, as argparse).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import selectors
import signal
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, TextIO

from transport.nsq.blocking import Connection, ConnectionClosed
from transport.protocol import commands as pc
from transport.protocol.validation import TAG_RULE, ProtocolError, valid_tag

__all__ = ["main"]

USER_AGENT = "zmqnsq"


class Fail(Exception):
    """One line for stderr, exit status 1."""


# ------------------------------------------------------------------ discovery


def _http_json(address: str, path: str, timeout: float = 5.0) -> Any:
    url = f"http://{address}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise Fail(f"{url}: HTTP {e.code}") from None
    except (OSError, ValueError) as e:
        raise Fail(f"cannot reach {address}: {getattr(e, 'reason', e)}") from None


def lookup_producers(lookupds: Sequence[str], topic: str, port_key: str) -> list[str]:
    """``host:port`` of every broker the lookup daemons list for `topic` (`port_key`:
    ``tcp_port`` or ``http_port``); a daemon that does not answer is skipped."""
    found: list[str] = []
    reachable = False
    for address in lookupds:
        try:
            reply = _http_json(address, f"/lookup?topic={urllib.parse.quote(topic)}")
        except Fail:
            continue
        reachable = True
        data = (reply or {}).get("data", reply) or {}  # (nsqlookupd < 1.0 wrapped it)
        for p in data.get("producers") or ():
            addr = f"{p['broadcast_address']}:{p[port_key]}"
            if addr not in found:
                found.append(addr)
    if not reachable:
        raise Fail(f"no lookup daemon answers ({', '.join(lookupds)})")
    return found


# ----------------------------------------------------------------------- tail


class Subscriber:
    """SUB on `topic`/`channel` at every broker (NSQ TCP), RDY `rdy` each; :meth:`poll`
    gives what arrived with its connection, :meth:`fin` finishes messages."""

    def __init__(self, args: argparse.Namespace, channel: str, rdy: int) -> None:
        addresses = list(args.nsqd_tcp_address)
        while args.lookupd_http_address and not addresses:
            addresses = lookup_producers(args.lookupd_http_address, args.topic, "tcp_port")
            if not addresses:
                time.sleep(args.lookupd_poll_interval)  # nsq_tail waits for the topic too
        self.conns: list[Connection] = []
        self.sel = selectors.DefaultSelector()
        try:
            for address in addresses:
                try:
                    conn = Connection(address, user_agent=USER_AGENT)
                    self.conns.append(conn)
                    conn.request(pc.Sub(args.topic, channel))
                except (OSError, ProtocolError) as e:
                    raise Fail(f"cannot subscribe at {address}: {e}") from None
                conn.send(pc.Rdy(rdy))
                conn.sock.settimeout(None)
                self.sel.register(conn, selectors.EVENT_READ)
        except BaseException:
            self.close()
            raise

    def poll(self, timeout: float | None) -> list[tuple[Connection, pc.Message]]:
        if not self.conns:
            raise Fail("every broker closed its connection")
        out: list[tuple[Connection, pc.Message]] = []
        for key, _ in self.sel.select(timeout):
            conn: Connection = key.fileobj  # type: ignore[assignment]
            try:
                events = conn.events()
            except (ConnectionClosed, ProtocolError, OSError) as e:
                print(f"zmqnsq: {e}", file=sys.stderr)
                self.sel.unregister(conn)
                self.conns.remove(conn)
                conn.close()
                continue
            out.extend((conn, e) for e in events if isinstance(e, pc.Message))
        return out

    @staticmethod
    def fin(messages: list[tuple[Connection, pc.Message]]) -> None:
        for conn, message in messages:
            with contextlib.suppress(OSError):  # (gone: the broker requeues it)
                conn.send(pc.Fin((message.id,)))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(pc.Cls())
            conn.close()
        self.sel.close()


def tail(args: argparse.Namespace, out: BinaryIO) -> int:
    channel = args.channel or f"tail{random.randrange(1_000_000):06d}#ephemeral"
    limit = args.n
    if args.zmq_address:
        return _tail_zmq(args, channel, out)
    sub = Subscriber(args, channel, min(args.max_in_flight, limit) if limit
                     else args.max_in_flight)
    try:
        seen = 0
        while True:
            got = sub.poll(None)
            if limit:
                got = got[:limit - seen]
            out.write(b"".join(m.body + b"\n" for _, m in got))
            out.flush()
            sub.fin(got)
            seen += len(got)
            if limit and seen >= limit:
                return 0
    finally:
        sub.close()


def _tail_zmq(args: argparse.Namespace, channel: str, out: BinaryIO) -> int:
    from transport.client import Consumer  # noqa: PLC0415 - pyzmq only here

    done = _Done(args.n)

    def handler(message: Any) -> None:
        if done.take():
            out.write(message.body + b"\n")
            out.flush()

    consumer = Consumer(args.topic, channel, handler, args.zmq_address,
                        max_in_flight=args.max_in_flight,
                        lookupd_http_addresses=args.lookupd_http_address)
    consumer.start()
    try:
        done.wait()
    finally:
        consumer.close()
    return 0


class _Done:
    """Counts messages up to a limit (0: none) and wakes the waiter when it is reached."""

    def __init__(self, limit: int) -> None:
        import threading  # noqa: PLC0415

        self.limit = limit
        self.seen = 0
        self.lock = threading.Lock()
        self.event = threading.Event()

    def take(self) -> bool:
        with self.lock:
            if self.limit and self.seen >= self.limit:
                return False
            self.seen += 1
            if self.limit and self.seen >= self.limit:
                self.event.set()
            return True

    def wait(self) -> None:
        while not self.event.wait(0.2):
            pass


# -------------------------------------------------------------------- to-file


class Archive:
    """nsq_to_file's output: ``--filename-format`` in ``--output-dir``, one body a line,
    gzipped with ``--gzip``, a new file when the name's <DATETIME> changes, past
    ``--rotate-size`` bytes or after ``--rotate-interval``."""

    def __init__(self, args: argparse.Namespace, clock: Callable[[], float] = time.time) -> None:
        self.args = args
        self.clock = clock
        self.file: Any = None
        self.raw: Any = None
        self.path = ""
        self.key = ""
        self.opened_at = 0.0
        self.size = 0
        os.makedirs(args.output_dir, exist_ok=True)

    def _name(self, now: float, rev: int) -> str:
        a = self.args
        name = (a.filename_format.replace("<TOPIC>", a.topic)
                .replace("<HOST>", socket.gethostname().split(".")[0])
                .replace("<PID>", str(os.getpid()))
                .replace("<DATETIME>", time.strftime(a.datetime_format, time.gmtime(now)))
                .replace("<REV>", f"-{rev}" if rev else ""))
        return os.path.join(a.output_dir, name + (".gz" if a.gzip else ""))

    def write(self, bodies: list[bytes]) -> None:
        now = self.clock()
        a = self.args
        key = time.strftime(a.datetime_format, time.gmtime(now))
        if self.file is not None and (
                key != self.key or (a.rotate_size and self.size >= a.rotate_size)
                or (a.rotate_interval and now - self.opened_at >= a.rotate_interval)):
            self.close()
        if self.file is None:
            rev = 0
            while os.path.exists(path := self._name(now, rev)):
                rev += 1
                if "<REV>" not in a.filename_format:
                    raise Fail(f"{path} exists (put <REV> in --filename-format)")
            self.raw = open(path, "xb")  # noqa: SIM115 - closed by close()
            self.file = gzip.GzipFile(fileobj=self.raw, mode="wb",
                                      compresslevel=a.gzip_level) if a.gzip else self.raw
            self.path, self.key, self.opened_at, self.size = path, key, now, 0
        data = b"".join(b + b"\n" for b in bodies)
        self.file.write(data)
        self.size += len(data)

    def sync(self) -> None:
        """Everything written is on disk (a gzip member stays open: sync-flushed)."""
        if self.file is None:
            return
        if self.file is not self.raw:
            self.file.flush(zlib.Z_SYNC_FLUSH)
        self.raw.flush()
        os.fsync(self.raw.fileno())

    def close(self) -> None:
        if self.file is not None:
            if self.file is not self.raw:
                self.file.close()  # the gzip trailer
            self.raw.flush()
            os.fsync(self.raw.fileno())
            self.raw.close()
            self.file = self.raw = None


def to_file(args: argparse.Namespace) -> int:
    """nsq_to_file: a message is FINed only once the file it went to is synced."""
    archive = Archive(args)
    sub = Subscriber(args, args.channel, args.max_in_flight)
    pending: list[tuple[Connection, pc.Message]] = []
    stop = _stop_on_signals()
    synced = shown = time.monotonic()
    written = 0
    show = sys.stderr.isatty()
    try:
        while not stop:
            if show and time.monotonic() - shown >= 1:
                shown = time.monotonic()
                sys.stderr.write(f"\r{written:,} messages, now in {archive.path} ")
                sys.stderr.flush()
            due = synced + args.sync_interval - time.monotonic()
            got = sub.poll(max(0.0, min(due, 0.5)))
            if got:
                archive.write([m.body for _, m in got])
                pending.extend(got)
                written += len(got)
            if pending and (len(pending) >= args.max_in_flight
                            or time.monotonic() >= synced + args.sync_interval):
                archive.sync()
                sub.fin(pending)
                pending = []
                synced = time.monotonic()
            elif not pending:
                synced = time.monotonic()
        return 0
    finally:
        archive.close()
        sub.fin(pending)
        sub.close()


def _stop_on_signals() -> list[int]:
    """A list that becomes non-empty on SIGINT or SIGTERM (the loop then ends cleanly)."""
    got: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        got.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    return got


# ------------------------------------------------------------------------ pub


def _lines(stream: BinaryIO) -> Iterator[bytes]:
    for raw in stream:
        line = raw.rstrip(b"\r\n")
        if line:  # nsqd refuses an empty body; to_nsq skips empty lines
            yield line


def pub(args: argparse.Namespace, stdin: BinaryIO, progress: TextIO) -> int:
    if args.tag and not args.zmq_address:
        raise Fail("--tag needs --zmq-address: NSQ TCP has no tags")
    if args.tag and not valid_tag(args.tag.encode("utf-8")):
        raise Fail(f"bad --tag {args.tag!r} ({TAG_RULE})")
    publish, close = _publisher(args)
    show = progress.isatty()
    start = time.monotonic()
    total = 0
    shown = start
    batch: list[bytes] = []
    per_batch = 1 if args.rate else args.batch_size
    try:
        for line in _lines(stdin):
            batch.append(line)
            if len(batch) >= per_batch:
                publish(batch)
                total += len(batch)
                batch = []
                if args.rate:  # paced: the n-th message goes at start + n / rate
                    delay = start + total / args.rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
            now = time.monotonic()
            if show and now - shown >= 0.5:
                shown = now
                progress.write(f"\r{total:,} messages, {total / (now - start):,.0f}/s ")
                progress.flush()
        if batch:
            publish(batch)
            total += len(batch)
    finally:
        close()
    elapsed = max(time.monotonic() - start, 1e-9)
    if show:
        progress.write(f"\r{total:,} messages in {elapsed:.1f}s, {total / elapsed:,.0f}/s\n")
    return 0


def _publisher(args: argparse.Namespace) -> tuple[Callable[[list[bytes]], None],
                                                   Callable[[], None]]:
    """``(publish(bodies), close())`` over ZeroMQ or NSQ TCP (round-robin)."""
    topic = args.topic
    if args.zmq_address:
        from transport.client import ClientError, Producer  # noqa: PLC0415

        producer = Producer(args.zmq_address)

        def zmq_publish(bodies: list[bytes]) -> None:
            try:
                producer.multi_publish(topic, bodies, tag=args.tag)
            except ClientError as e:
                raise Fail(f"publish failed: {e}") from None

        return zmq_publish, producer.close
    if not args.nsqd_tcp_address:
        raise Fail("--nsqd-tcp-address or --zmq-address required")
    conns = []
    for address in args.nsqd_tcp_address:
        try:
            conns.append(Connection(address, user_agent=USER_AGENT))
        except (OSError, ProtocolError) as e:
            raise Fail(f"cannot connect to {address}: {e}") from None
    turn = iter(range(1 << 62))

    def tcp_publish(bodies: list[bytes]) -> None:
        conn = conns[next(turn) % len(conns)]
        command = pc.Pub(topic, bodies[0]) if len(bodies) == 1 else pc.Mpub(topic, tuple(bodies))
        try:
            conn.request(command)
        except (OSError, ConnectionClosed, ProtocolError) as e:
            raise Fail(f"publish to {conn.address} failed: {e}") from None

    def close() -> None:
        for conn in conns:
            conn.close()

    return tcp_publish, close


# ----------------------------------------------------------------------- stat


def _channel_stats(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Per channel of the topic: nsq_stat's figures, summed over its brokers."""
    if args.lookupd_http_address:
        brokers = lookup_producers(args.lookupd_http_address, args.topic, "http_port")
    else:
        brokers = list(args.nsqd_http_address)
    out: dict[str, dict[str, int]] = {}
    keys = ("message_count", "depth", "memory_depth", "backend_depth", "in_flight_count",
            "deferred_count", "requeue_count", "timeout_count", "client_count")
    for address in brokers:
        stats = _http_json(address, f"/stats?format=json&topic="
                                    f"{urllib.parse.quote(args.topic)}&include_clients=false")
        for topic in (stats or {}).get("topics") or ():
            if topic.get("topic_name") != args.topic:
                continue
            for c in topic.get("channels") or ():
                name = c.get("channel_name", "")
                if args.channel and name != args.channel:
                    continue
                row = out.setdefault(name, dict.fromkeys(keys, 0))
                for key in keys:
                    value = c.get(key)
                    if key == "memory_depth" and value is None:  # (ours: depth - backend)
                        value = (c.get("depth") or 0) - (c.get("backend_depth") or 0)
                    row[key] += int(value or 0)
    return out


def stat(args: argparse.Namespace, out: TextIO) -> int:
    if bool(args.nsqd_http_address) == bool(args.lookupd_http_address):
        raise Fail("use --nsqd-http-address or --lookupd-http-address (one of them)")
    before: dict[str, dict[str, int]] | None = None
    i = 0
    while args.count is None or i <= args.count:
        now = _channel_stats(args)
        if args.channel and args.channel not in now:
            raise Fail(f"failed to find channel({args.channel}) in stats metadata for "
                       f"topic({args.topic})")
        if i % 25 == 0:
            lead = f"{'':<16} " if not args.channel else ""
            out.write(f"{'-' * 17 if not args.channel else ''}{'------rate------'}+"
                      f"{'----------------depth----------------'}+"
                      f"{'--------------metadata---------------'}\n")
            out.write(f"{lead}{'ingress':>7} {'egress':>7} | {'total':>7} {'mem':>7} "
                      f"{'disk':>7} {'inflt':>5} {'def':>5} | {'req':>7} {'t-o':>7} "
                      f"{'msgs':>12} {'clients':>7}\n")
        if before is not None:
            for name, c in sorted(now.items()):
                o = before.get(name, c)
                ingress = (c["message_count"] - o["message_count"]) / args.interval
                egress = (c["message_count"] - o["message_count"]
                          - (c["depth"] - o["depth"])) / args.interval
                lead = f"{name[:16]:<16} " if not args.channel else ""
                out.write(f"{lead}{int(ingress):>7} {int(egress):>7} | {c['depth']:>7} "
                          f"{c['memory_depth']:>7} {c['backend_depth']:>7} "
                          f"{c['in_flight_count']:>5} {c['deferred_count']:>5} | "
                          f"{c['requeue_count']:>7} {c['timeout_count']:>7} "
                          f"{c['message_count']:>12} {c['client_count']:>7}\n")
        out.flush()
        before = now
        i += 1
        if args.count is None or i <= args.count:
            time.sleep(args.interval)
    return 0


# ----------------------------------------------------------------------- main


def _duration(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit):
            number = text.removesuffix(unit)
            break
    else:
        number, unit = text, "s"
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 2s, 500ms)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zmqnsq", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{tail,to-file,pub,stat,ctl}")

    def brokers(q: argparse.ArgumentParser, *, tcp: bool = True, http: bool = False) -> None:
        if tcp:
            q.add_argument("--nsqd-tcp-address", action="append", default=[],
                           help="broker NSQ TCP <host>:<port> (repeatable)")
            q.add_argument("--zmq-address", action="append", default=[],
                           help="our broker's ZeroMQ endpoint, tcp://<host>:<port> "
                                "(repeatable; instead of NSQ TCP)")
        if http:
            q.add_argument("--nsqd-http-address", action="append", default=[],
                           help="broker HTTP <host>:<port> (repeatable)")
        q.add_argument("--lookupd-http-address", action="append", default=[],
                       help="lookup daemon HTTP <host>:<port> (repeatable)")
        q.add_argument("--topic", required=True, help="NSQ topic")

    t = sub.add_parser("tail", help="print a topic's message bodies (nsq_tail)")
    brokers(t)
    t.add_argument("--channel", help="NSQ channel (default: tail<random>#ephemeral)")
    t.add_argument("-n", type=int, default=0, help="exit after this many messages (0: never)")
    t.add_argument("--max-in-flight", type=_positive, default=200)
    t.add_argument("--lookupd-poll-interval", type=_duration, default=5.0,
                   help="while the topic has no broker yet, ask the lookup daemons this often")

    f = sub.add_parser("to-file", help="archive a topic to files (nsq_to_file)")
    brokers(f)
    f.add_argument("--channel", default="nsq_to_file", help="NSQ channel (default nsq_to_file)")
    f.add_argument("--max-in-flight", type=_positive, default=200)
    f.add_argument("--output-dir", required=True, help="where the files go")
    f.add_argument("--filename-format", default="<TOPIC>.<HOST><REV>.<DATETIME>.log",
                   help="<TOPIC>, <HOST>, <PID>, <DATETIME>, <REV> (-1, -2 ... when the file "
                        "exists) are replaced")
    f.add_argument("--datetime-format", default="%Y-%m-%d_%H",
                   help="strftime format of <DATETIME> (UTC); a new file when it changes")
    f.add_argument("--gzip", action="store_true", help="gzip the files")
    f.add_argument("--gzip-level", type=int, choices=range(1, 10), default=6, metavar="1-9")
    f.add_argument("--rotate-size", type=int, default=0, help="a new file past this many bytes")
    f.add_argument("--rotate-interval", type=_duration, default=0.0,
                   help="a new file after this long")
    f.add_argument("--sync-interval", type=_duration, default=30.0,
                   help="fsync, then FIN, at least this often (default 30s)")
    f.add_argument("--lookupd-poll-interval", type=_duration, default=5.0)

    u = sub.add_parser("pub", help="publish the lines of stdin (to_nsq)")
    brokers(u)
    u.add_argument("--rate", type=_positive, default=0,
                   help="messages per second (default: as fast as they are taken)")
    u.add_argument("--batch-size", type=_positive, default=200,
                   help="lines per MPUB when not paced")
    u.add_argument("--tag", default="",
                   help="tag every message (ZeroMQ only: NSQ TCP has no tags; docs/HTTP.md)")

    s = sub.add_parser("stat", help="a channel's rates and depths (nsq_stat)")
    brokers(s, tcp=False, http=True)
    s.add_argument("--channel", help="NSQ channel (default: every channel of the topic)")
    s.add_argument("--interval", type=_duration, default=2.0,
                   help="time between rows (default 2s)")
    s.add_argument("--count", type=_positive, default=None, help="rows to print, then exit")

    c = sub.add_parser("ctl", help="python -m actors.ctl: ps, actors, spawn, crash",
                       add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:  # (its own flags, all of them: argparse would take some)
        from actors.ctl import main as ctl_main  # noqa: PLC0415

        return ctl_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in {"tail", "to-file", "pub"} and not (args.nsqd_tcp_address or args.zmq_address
                                                or args.lookupd_http_address):
        print(f"zmqnsq {args.command}: --nsqd-tcp-address, --zmq-address or "
              "--lookupd-http-address required", file=sys.stderr)
        return 1
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `zmqnsq tail ... | head` ends quietly
    try:
        if args.command == "tail":
            return tail(args, sys.stdout.buffer)
        if args.command == "pub":
            return pub(args, sys.stdin.buffer, sys.stderr)
        if args.command == "to-file":
            if args.zmq_address:
                raise Fail("to-file speaks NSQ TCP: --nsqd-tcp-address or --lookupd-http-address")
            return to_file(args)
        return stat(args, sys.stdout)
    except Fail as e:
        print(f"zmqnsq {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
