"""nsqlookupd's V1 codec: bytes in, events out (whole, a byte at a time, with trailing
bytes), and the exact answers nsqlookupd 1.3 gives (seen on the wire)."""

from __future__ import annotations

import json
import struct

import pytest

from transport.nsq.lookup_codec import (
    CLOSED,
    MAX_LINE,
    NEED_DATA,
    Answer,
    Identify,
    LookupClientConnection,
    LookupServerConnection,
    Ping,
    Register,
    Unregister,
    encode_answer,
    encode_error,
)
from transport.protocol.validation import ProtocolError

pytestmark = pytest.mark.timeout(10)

NSQD_IDENTIFY = (b'{"broadcast_address":"vm","hostname":"vm","http_port":45375,'
                 b'"tcp_port":55239,"version":"1.3.0"}')
HELLO = b"  V1IDENTIFY\n" + struct.pack(">i", len(NSQD_IDENTIFY)) + NSQD_IDENTIFY


def events(data: bytes, *, split: bool = False) -> list[object]:
    conn = LookupServerConnection()
    out: list[object] = []
    chunks = [data[i:i + 1] for i in range(len(data))] if split else [data]
    for chunk in [*chunks, b""]:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not NEED_DATA:
            out.append(event)
            if event is CLOSED:
                return out
    return out


@pytest.mark.parametrize("split", [False, True])
def test_a_broker_session_decodes_whole_or_a_byte_at_a_time(split: bool) -> None:
    data = HELLO + b"REGISTER t c\nREGISTER t\nUNREGISTER t c\r\nPING \r\nUNREGISTER t\n"
    assert events(data, split=split) == [
        Identify("vm", 55239, 45375, "1.3.0", "vm"),
        Register("t", "c"), Register("t"), Unregister("t", "c"), Ping(), Unregister("t"),
        CLOSED,
    ]


def test_bytes_after_an_event_wait_for_the_next_call() -> None:
    conn = LookupServerConnection()
    conn.receive_data(HELLO + b"PING\nREGI")
    assert isinstance(conn.next_event(), Identify)
    assert conn.next_event() == Ping()
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"STER t\n")
    assert conn.next_event() == Register("t")


@pytest.mark.parametrize(("data", "code", "text"), [
    (b"  V2", "E_BAD_PROTOCOL", ""),
    (b"  V1FOO bar\n", "E_INVALID", "invalid command FOO"),
    (b"  V1\n", "E_INVALID", "invalid command "),
    (b"  V1ping\n", "E_INVALID", "invalid command ping"),
    (b"  V1REGISTER t\n", "E_INVALID", "client must IDENTIFY"),
    (b"  V1UNREGISTER t\n", "E_INVALID", "client must IDENTIFY"),
    (HELLO + b"IDENTIFY\n", "E_INVALID", "cannot IDENTIFY again"),
    (HELLO + b"REGISTER\n", "E_INVALID", "REGISTER insufficient number of params"),
    (HELLO + b"UNREGISTER\n", "E_INVALID", "UNREGISTER insufficient number of params"),
    (HELLO + b"REGISTER bad!topic\n", "E_BAD_TOPIC",
     "REGISTER topic name 'bad!topic' is not valid"),
    (HELLO + b"REGISTER  t\n", "E_BAD_TOPIC", "REGISTER topic name '' is not valid"),
    (HELLO + b"UNREGISTER t bad!\n", "E_BAD_CHANNEL",
     "UNREGISTER channel name 'bad!' is not valid"),
    (b"  V1IDENTIFY\n\x00\x00\x00\x02{]", "E_BAD_BODY", "IDENTIFY failed to decode JSON body"),
    (b"  V1IDENTIFY\n\x00\x00\x00\x02[]", "E_BAD_BODY", "IDENTIFY failed to decode JSON body"),
    (b"  V1IDENTIFY\n\x00\x00\x00\x04null", "E_BAD_BODY", "IDENTIFY missing fields"),
    (b"  V1IDENTIFY\n\x00\x00\x00\x0e{\"tcp_port\":1}", "E_BAD_BODY", "IDENTIFY missing fields"),
    (b"  V1IDENTIFY\n\xff\xff\xff\xff", "E_BAD_BODY", "IDENTIFY invalid body size -1"),
    (b"  V1IDENTIFY\n\x7f\xff\xff\xff", "E_BAD_BODY", "IDENTIFY invalid body size 2147483647"),
    (b"  V1IDENTIFY\n\x00\x00", "E_BAD_BODY", "IDENTIFY failed to read body size"),
    (b"  V1IDENTIFY\n\x00\x00\x00\x09{}", "E_BAD_BODY", "IDENTIFY failed to read body"),
    (b"  V1" + b"P" * (MAX_LINE + 1), "E_INVALID", f"command line longer than {MAX_LINE} bytes"),
])
def test_every_error_is_nsqlookupds_and_closes_the_connection(
        data: bytes, code: str, text: str) -> None:
    *before, error, closed = events(data)
    assert isinstance(error, ProtocolError)
    assert (error.code, error.text, error.fatal) == (code, text, True)
    assert closed is CLOSED
    assert all(isinstance(e, Identify) for e in before)


@pytest.mark.parametrize("body", [
    {"tcp_port": "1"}, {"tcp_port": 1.5}, {"tcp_port": True}, {"version": 3},
])
def test_identify_types_are_strict(body: dict[str, object]) -> None:
    full = {"broadcast_address": "b", "tcp_port": 1, "http_port": 2, "version": "v", **body}
    raw = json.dumps(full).encode()
    error = events(b"  V1IDENTIFY\n" + struct.pack(">i", len(raw)) + raw)[0]
    assert error == ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")


def test_identify_keys_are_read_in_any_case_and_unknown_ones_are_kept() -> None:
    raw = (b'{"BROADCAST_ADDRESS":"b","Tcp_Port":1,"http_port":2,"version":"v",'
           b'"remote_address":"spoofed","zmq_port":4153}')
    (identify, *_) = events(b"  V1IDENTIFY\n" + struct.pack(">i", len(raw)) + raw)
    assert identify == Identify("b", 1, 2, "v", "", {"zmq_port": 4153})


def test_extra_parameters_are_ignored_as_nsqlookupd_does() -> None:
    assert events(HELLO + b"REGISTER t c extra\n")[1] == Register("t", "c")


def test_answers_have_no_frame_type() -> None:
    assert encode_answer() == b"\x00\x00\x00\x02OK"
    assert encode_error(ProtocolError("E_INVALID", "client must IDENTIFY")) == \
        b"\x00\x00\x00\x1eE_INVALID client must IDENTIFY"
    assert encode_error(ProtocolError("E_BAD_PROTOCOL", "")) == b"\x00\x00\x00\x0eE_BAD_PROTOCOL"


def test_the_client_side_speaks_as_nsqd_does_and_reads_answers() -> None:
    client = LookupClientConnection()
    hello = client.send(Identify("vm", 55239, 45375, "1.3.0", "vm"))
    assert hello == HELLO
    assert client.send(Register("t", "c")) == b"REGISTER t c\n"
    assert client.send(Unregister("t")) == b"UNREGISTER t\n"
    assert client.send(Ping()) == b"PING\n"
    reply = encode_answer(b'{"tcp_port":4160}') + encode_answer() + encode_error(
        ProtocolError("E_INVALID", "client must IDENTIFY"))
    for i in range(len(reply)):  # a byte at a time
        client.receive_data(reply[i:i + 1])
    first, second, third = client.next_event(), client.next_event(), client.next_event()
    assert isinstance(first, Answer)
    assert first.json() == {"tcp_port": 4160}
    assert second == Answer(b"OK")
    assert second.ok
    assert isinstance(third, Answer)
    assert third.error == ProtocolError(
        "E_INVALID", "client must IDENTIFY")
    assert client.next_event() is NEED_DATA
    client.receive_data(b"")
    assert client.next_event() is CLOSED
