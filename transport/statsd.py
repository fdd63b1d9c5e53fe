"""statsd's line protocol over UDP, as nsqd writes it (its internal/statsd and writers).

A push is a batch of lines ``<prefix><stat>:<value>|c`` (a counter's increase
since the last push) or ``|g`` (a gauge), each ending in ``\\n``, packed into
datagrams of at most ``packet_size`` bytes without splitting a line (nsqd's
BoundaryBufferedWriter: a line longer than a packet goes alone).  The prefix
is nsqd's: ``%s`` in the template becomes the broker's broadcast address and
HTTP port with ``.`` and ``:`` as ``_``, and it ends in ``.``.
"""

from __future__ import annotations

import socket


def host_key(host_port: str) -> str:
    """nsqd's statsd.HostKey: ``vm:4151`` -> ``vm_4151``, ``10.0.0.1:4151`` -> ``10_0_0_1_4151``."""
    return host_port.replace(".", "_").replace(":", "_")


def prefix_for(template: str, broadcast_address: str, http_port: int) -> str:
    """The prefix nsqd makes of ``--statsd-prefix`` (empty stays empty)."""
    if not template:
        return ""
    host = f"[{broadcast_address}]" if ":" in broadcast_address else broadcast_address
    prefix = template.replace("%s", host_key(f"{host}:{http_port}"))
    return prefix if prefix.endswith(".") else prefix + "."


class Batch:
    """The lines of one push, packed into datagrams."""

    def __init__(self, prefix: str, packet_size: int) -> None:
        self.prefix = prefix
        self.packet_size = packet_size
        self.packets: list[bytes] = []
        self._current = bytearray()

    def incr(self, stat: str, count: int) -> None:
        self._line(f"{self.prefix}{stat}:{int(count)}|c\n")

    def gauge(self, stat: str, value: int) -> None:
        self._line(f"{self.prefix}{stat}:{int(value)}|g\n")

    def _line(self, line: str) -> None:
        data = line.encode()
        if self._current and len(self._current) + len(data) > self.packet_size:
            self.packets.append(bytes(self._current))
            self._current.clear()
        self._current += data

    def finish(self) -> list[bytes]:
        if self._current:
            self.packets.append(bytes(self._current))
            self._current.clear()
        return self.packets


def send(address: str, packets: list[bytes]) -> None:
    """Send the datagrams to ``host:port`` (raises OSError if it cannot be resolved)."""
    host, _, port = address.rpartition(":")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
    family, kind, proto, _, target = infos[0]
    with socket.socket(family, kind, proto) as sock:
        for packet in packets:
            try:
                sock.sendto(packet, target)
            except ConnectionRefusedError:  # nobody listening (ICMP): as nsqd, carry on
                continue
