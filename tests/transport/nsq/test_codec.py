"""NSQ TCP protocol V2 codec: bytes in, events out (whole, byte by byte, with trailing bytes)."""

from __future__ import annotations

import json
import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.nsq.client_codec import ClientConnection, ErrorFrame, Response, encode_command
from transport.nsq.codec import (
    CLOSE_WAIT_FRAME,
    CLOSED,
    HEARTBEAT_FRAME,
    MAGIC,
    NEED_DATA,
    OK_FRAME,
    ServerConnection,
    encode_error,
    encode_identify_response,
    encode_message,
    encode_messages,
    encode_response,
)
from transport.protocol.commands import (
    Auth,
    Cls,
    Command,
    Dpub,
    Fin,
    Heartbeat,
    Identify,
    Message,
    Mpub,
    Nop,
    Pub,
    Rdy,
    Req,
    Sub,
    Touch,
)
from transport.protocol.validation import (
    Limits,
    ProtocolError,
    _split_mpub_checked,
    split_mpub_body,
    split_mpub_view,
)

MSG_ID = b"0a1b2c3d4e5f6789"
SMALL = Limits(max_msg_size=100, max_body_size=1000, max_rdy_count=50, max_req_timeout=10_000)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True)


def size(n: int) -> bytes:
    return struct.pack(">i", n)


def drain(conn: ServerConnection) -> list[object]:
    """Every event until NEED_DATA, with CLOSED kept as the last one."""
    events: list[object] = []
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            return events
        events.append(event)
        if event is CLOSED:
            return events


def decode(data: bytes, *, chunk: int | None = None, limits: Limits = SMALL) -> list[object]:
    """Feed ``data`` (after the magic) whole or in ``chunk``-byte pieces; collect the events."""
    conn = ServerConnection(limits)
    stream = MAGIC + data
    pieces = (
        [stream] if chunk is None else [stream[i : i + chunk] for i in range(0, len(stream), chunk)]
    )
    events: list[object] = []
    for piece in pieces:
        conn.receive_data(piece)
        events += drain(conn)
        if events and events[-1] is CLOSED:
            break
    return events


def subscribed(*commands: Command) -> bytes:
    return encode_command(Sub("t", "c")) + b"".join(encode_command(c) for c in commands)


def only_error(events: list[object]) -> ProtocolError:
    errors = [e for e in events if isinstance(e, ProtocolError)]
    assert len(errors) == 1, events
    return errors[0]


# ---------------------------------------------------------------------------
# Every command round-trips, whatever the split

ROUND_TRIPS: list[tuple[str, list[Command]]] = [
    ("pub", [Pub("orders", b"hello")]),
    ("pub_ephemeral", [Pub("orders#ephemeral", b"\x00\n\r\xff")]),
    ("mpub", [Mpub("orders", (b"a", b"bc", b"d" * 100))]),
    ("dpub", [Dpub("orders", 5000, b"later")]),
    ("sub_then_consumer_commands", [
        Sub("orders", "archive"), Rdy(10), Fin((MSG_ID,)), Req(MSG_ID, 250), Touch(MSG_ID),
        Nop(), Cls(), Fin((MSG_ID,)),
    ]),
    ("auth", [Auth(b"s3cret")]),
    ("nop", [Nop()]),
]  # fmt: skip


@pytest.mark.parametrize("chunk", [None, 1, 3, 7], ids=["whole", "bytewise", "by3", "by7"])
@pytest.mark.parametrize(("name", "commands"), ROUND_TRIPS, ids=[n for n, _ in ROUND_TRIPS])
def test_every_command_round_trips_from_client_encoder_to_server_decoder(
    name: str, commands: list[Command], chunk: int | None
) -> None:
    data = b"".join(encode_command(c) for c in commands)
    assert decode(data, chunk=chunk) == commands


def test_trailing_bytes_are_kept_for_the_next_event() -> None:
    # Given a PUB followed by the first half of another PUB
    second = encode_command(Pub("t", b"second"))
    conn = ServerConnection(SMALL)
    conn.receive_data(MAGIC + encode_command(Pub("t", b"first")) + second[:9])
    # When the events are read, then only the first PUB is complete
    assert conn.next_event() == Pub("t", b"first")
    assert conn.next_event() is NEED_DATA
    # When the rest arrives, then the second PUB completes
    conn.receive_data(second[9:])
    assert conn.next_events() == [Pub("t", b"second")]


def test_a_line_ending_in_crlf_is_accepted() -> None:
    assert decode(b"PUB t\r\n" + size(1) + b"x" + b"NOP\r\n") == [Pub("t", b"x"), Nop()]


def test_extra_parameters_are_ignored_as_nsqd_does() -> None:
    assert decode(b"SUB t c extra\nRDY 3 4\n") == [Sub("t", "c"), Rdy(3)]


def test_rdy_without_a_count_means_one() -> None:
    assert decode(subscribed() + b"RDY\n") == [Sub("t", "c"), Rdy(1)]


def test_next_events_returns_everything_buffered() -> None:
    conn = ServerConnection(SMALL)
    conn.receive_data(MAGIC + b"NOP\n" * 3 + b"NO")
    assert conn.next_events() == [Nop(), Nop(), Nop()]


def test_end_of_input_closes_the_connection_even_mid_command() -> None:
    conn = ServerConnection(SMALL)
    conn.receive_data(MAGIC + b"NOP\nPUB t\n" + size(5) + b"ab")
    conn.receive_data(b"")
    assert drain(conn) == [Nop(), CLOSED]


# ---------------------------------------------------------------------------
# Malformed input: nsqd's codes, sentences and fatality

BAD_INPUT = [
    ("unknown command", b"HELLO world\n", "E_INVALID", "invalid command HELLO"),
    ("empty line", b"\n", "E_INVALID", "invalid command "),
    ("lowercase command", b"pub t\n", "E_INVALID", "invalid command pub"),
    ("pub without topic", b"PUB\n", "E_INVALID", "PUB insufficient number of parameters"),
    ("mpub without topic", b"MPUB\n", "E_INVALID", "MPUB insufficient number of parameters"),
    ("dpub without delay", b"DPUB t\n", "E_INVALID", "DPUB insufficient number of parameters"),
    ("sub without channel", b"SUB t\n", "E_INVALID", "SUB insufficient number of parameters"),
    ("bad topic", b"PUB a*b\n", "E_BAD_TOPIC", 'PUB topic name "a*b" is not valid'),
    ("empty topic", b"PUB \n", "E_BAD_TOPIC", 'PUB topic name "" is not valid'),
    ("long topic", b"PUB " + b"a" * 65 + b"\n", "E_BAD_TOPIC", None),
    ("bad ephemeral", b"PUB #ephemeral\n", "E_BAD_TOPIC", None),
    ("bad channel", b"SUB t c!\n", "E_BAD_CHANNEL", 'SUB channel name "c!" is not valid'),
    ("empty pub", b"PUB t\n" + size(0), "E_BAD_MESSAGE", "PUB invalid message body size 0"),
    ("negative pub", b"PUB t\n" + size(-1), "E_BAD_MESSAGE", "PUB invalid message body size -1"),
    ("big pub", b"PUB t\n" + size(101), "E_BAD_MESSAGE", "PUB message too big 101 > 100"),
    ("big dpub", b"DPUB t 5\n" + size(101), "E_BAD_MESSAGE", "DPUB message too big 101 > 100"),
    ("dpub bad delay", b"DPUB t x\n", "E_INVALID", "DPUB could not parse timeout x"),
    ("dpub negative delay", b"DPUB t -1\n", "E_INVALID", "DPUB could not parse timeout -1"),
    ("dpub long delay", b"DPUB t 10001\n", "E_INVALID", "DPUB timeout 10001 out of range 0-10000"),
    ("empty mpub", b"MPUB t\n" + size(0), "E_BAD_BODY", "MPUB invalid body size 0"),
    ("big mpub", b"MPUB t\n" + size(1001), "E_BAD_BODY", "MPUB body too big 1001 > 1000"),
    ("mpub of none", b"MPUB t\n" + size(4) + size(0), "E_BAD_BODY", "MPUB invalid message count 0"),
    ("mpub count too high", b"MPUB t\n" + size(4) + size(500), "E_BAD_BODY", None),
    ("mpub short count", b"MPUB t\n" + size(2) + b"\0\0", "E_BAD_BODY", None),
    ("mpub empty message", b"MPUB t\n" + size(8) + size(1) + size(0), "E_BAD_MESSAGE",
     "MPUB invalid message(0) body size 0"),
    ("mpub big message", b"MPUB t\n" + size(109) + size(1) + size(101) + b"x" * 101,
     "E_BAD_MESSAGE", "MPUB message too big 101 > 100"),
    ("mpub body too short", b"MPUB t\n" + size(10) + size(1) + size(5) + b"ab", "E_BAD_BODY",
     None),
    ("mpub body too long", b"MPUB t\n" + size(11) + size(1) + size(1) + b"abc", "E_BAD_BODY",
     None),
    ("mpub second size cut", b"MPUB t\n" + size(11) + size(2) + size(1) + b"a" + b"\0\0",
     "E_BAD_BODY", None),
    ("identify empty", b"IDENTIFY\n" + size(0), "E_BAD_BODY", "IDENTIFY invalid body size 0"),
    ("identify big", b"IDENTIFY\n" + size(1001), "E_BAD_BODY", "IDENTIFY body too big 1001 > 1000"),
    ("identify not json", b"IDENTIFY\n" + size(3) + b"{x}", "E_BAD_BODY",
     "IDENTIFY failed to decode JSON body"),
    ("identify not a map", b"IDENTIFY\n" + size(2) + b"[]", "E_BAD_BODY",
     "IDENTIFY failed to decode JSON body"),
    ("auth with params", b"AUTH x\n", "E_INVALID", "AUTH invalid number of parameters"),
    ("auth empty", b"AUTH\n" + size(0), "E_BAD_BODY", "AUTH invalid body size 0"),
    ("rdy before sub", b"RDY 1\n", "E_INVALID", "cannot RDY in current state"),
    ("fin before sub", b"FIN " + MSG_ID + b"\n", "E_INVALID", "cannot FIN in current state"),
    ("req before sub", b"REQ " + MSG_ID + b" 0\n", "E_INVALID", "cannot REQ in current state"),
    ("touch before sub", b"TOUCH " + MSG_ID + b"\n", "E_INVALID", "cannot TOUCH in current state"),
    ("cls before sub", b"CLS\n", "E_INVALID", "cannot CLS in current state"),
    ("sub twice", b"SUB t c\nSUB t c\n", "E_INVALID", "cannot SUB in current state"),
    ("identify after sub", b"SUB t c\nIDENTIFY\n", "E_INVALID", "cannot IDENTIFY in current state"),
    ("auth after sub", b"SUB t c\nAUTH\n", "E_INVALID", "cannot AUTH in current state"),
    ("rdy unparsable", b"SUB t c\nRDY x\n", "E_INVALID", "RDY could not parse count x"),
    ("rdy negative", b"SUB t c\nRDY -1\n", "E_INVALID", "RDY could not parse count -1"),
    ("rdy too big", b"SUB t c\nRDY 51\n", "E_INVALID", "RDY count 51 out of range 0-50"),
    ("rdy huge", b"SUB t c\nRDY " + b"9" * 30 + b"\n", "E_INVALID", None),
    ("fin without id", b"SUB t c\nFIN\n", "E_INVALID", "FIN insufficient number of params"),
    ("fin short id", b"SUB t c\nFIN abc\n", "E_INVALID", 'FIN Invalid Message ID "abc"'),
    ("req without delay", b"SUB t c\nREQ " + MSG_ID + b"\n", "E_INVALID",
     "REQ insufficient number of params"),
    ("req long id", b"SUB t c\nREQ " + MSG_ID + b"0 5\n", "E_INVALID", None),
    ("req bad delay", b"SUB t c\nREQ " + MSG_ID + b" soon\n", "E_INVALID",
     "REQ could not parse timeout soon"),
    ("req long delay", b"SUB t c\nREQ " + MSG_ID + b" 10001\n", "E_INVALID",
     "REQ timeout 10001 out of range 0-10000"),
    ("touch without id", b"SUB t c\nTOUCH\n", "E_INVALID", "TOUCH insufficient number of params"),
]  # fmt: skip


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "bytewise"])
@pytest.mark.parametrize(
    ("name", "data", "code", "text"), BAD_INPUT, ids=[case[0] for case in BAD_INPUT]
)
def test_malformed_input_gets_nsqds_fatal_error_and_closes(
    name: str, data: bytes, code: str, text: str | None, chunk: int | None
) -> None:
    events = decode(data + b"NOP\n", chunk=chunk)
    error = only_error(events)
    assert (error.code, error.fatal) == (code, True)
    if text is not None:
        assert error.text == text
    assert events[-2:] == [error, CLOSED]


def test_a_closed_connection_ignores_further_input() -> None:
    conn = ServerConnection(SMALL)
    conn.receive_data(MAGIC + b"BOGUS\n")
    assert isinstance(conn.next_event(), ProtocolError)
    conn.receive_data(b"NOP\n")
    assert conn.next_event() is CLOSED
    assert conn.closed


def test_a_wrong_magic_is_a_fatal_bad_protocol_error() -> None:
    conn = ServerConnection(SMALL)
    conn.receive_data(b"GET / HTTP/1.1\r\n")
    error = conn.next_event()
    assert isinstance(error, ProtocolError)
    assert (error.payload(), error.fatal) == (b"E_BAD_PROTOCOL", True)
    assert conn.next_event() is CLOSED


def test_the_magic_may_arrive_one_byte_at_a_time() -> None:
    conn = ServerConnection(SMALL)
    for byte in MAGIC[:3]:
        conn.receive_data(bytes([byte]))
        assert conn.next_event() is NEED_DATA
    conn.receive_data(MAGIC[3:] + b"NOP\n")
    assert conn.next_event() == Nop()


def test_rdy_after_cls_is_ignored_as_a_nop() -> None:
    assert decode(subscribed(Cls()) + b"RDY 5\nRDY garbage\n") == [
        Sub("t", "c"),
        Cls(),
        Nop(),
        Nop(),
    ]


def test_fin_req_and_touch_are_allowed_while_closing() -> None:
    commands = [Fin((MSG_ID,)), Req(MSG_ID, 0), Touch(MSG_ID)]
    assert decode(subscribed(Cls(), *commands))[2:] == commands


def test_publishing_is_allowed_while_subscribed() -> None:
    assert decode(subscribed(Pub("t", b"x")))[1] == Pub("t", b"x")


def test_sub_is_refused_when_identify_disabled_heartbeats() -> None:
    data = encode_command(Identify({"heartbeat_interval": -1})) + b"SUB t c\n"
    error = only_error(decode(data))
    assert error.text == "cannot SUB with heartbeats disabled"


# ---------------------------------------------------------------------------
# Memory bounds


def test_a_huge_declared_body_is_refused_before_it_is_buffered() -> None:
    conn = ServerConnection()  # default limits: 1 MiB messages
    conn.receive_data(MAGIC + b"PUB t\n" + size(2**31 - 1))
    error = conn.next_event()
    assert isinstance(error, ProtocolError)
    assert error.code == "E_BAD_MESSAGE"
    conn.receive_data(b"x" * 100_000)
    assert len(conn._buf) == 0


def test_a_line_without_end_is_refused_once_it_exceeds_the_limit() -> None:
    conn = ServerConnection(Limits(max_line_size=64))
    conn.receive_data(MAGIC + b"PUB " + b"a" * 60)
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"a" * 10)
    error = conn.next_event()
    assert isinstance(error, ProtocolError)
    assert (error.code, error.fatal) == ("E_INVALID", True)
    assert "too long" in error.text


def test_a_complete_line_longer_than_the_limit_is_refused() -> None:
    conn = ServerConnection(Limits(max_line_size=16))
    conn.receive_data(MAGIC + b"SUB " + b"a" * 30 + b"\n")
    error = conn.next_event()
    assert isinstance(error, ProtocolError)
    assert "too long" in error.text


def test_a_body_at_the_size_limit_is_accepted() -> None:
    assert decode(b"PUB t\n" + size(100) + b"x" * 100) == [Pub("t", b"x" * 100)]


# ---------------------------------------------------------------------------
# IDENTIFY over V2


def test_identify_with_feature_negotiation_answers_nsqds_json_keys() -> None:
    data = {"feature_negotiation": True, "heartbeat_interval": 5000, "msg_timeout": 2000,
            "tls_v1": True, "snappy": True, "deflate": True, "client_id": "c1"}  # fmt: skip
    [event] = decode(encode_command(Identify(data)))
    assert isinstance(event, Identify)
    assert event.settings.heartbeat_interval == 5000
    assert event.settings.client_id == "c1"
    frame = encode_identify_response(event)
    reply = json.loads(frame[8:])
    assert list(reply) == [
        "max_rdy_count", "version", "max_msg_timeout", "msg_timeout", "tls_v1", "deflate",
        "deflate_level", "max_deflate_level", "snappy", "sample_rate", "auth_required",
        "output_buffer_size", "output_buffer_timeout",
    ]  # fmt: skip
    assert (reply["tls_v1"], reply["snappy"], reply["deflate"]) == (False, False, False)
    assert reply["msg_timeout"] == 2000
    assert reply["max_rdy_count"] == SMALL.max_rdy_count


def test_identify_without_feature_negotiation_answers_ok() -> None:
    [event] = decode(encode_command(Identify({"client_id": "x"})))
    assert encode_identify_response(event) == OK_FRAME


def test_identify_updates_the_connection_settings() -> None:
    conn = ServerConnection(SMALL)
    assert conn.settings.heartbeat_interval == SMALL.client_timeout // 2
    conn.receive_data(MAGIC + encode_command(Identify({"heartbeat_interval": 2000})))
    conn.next_events()
    assert conn.settings.heartbeat_interval == 2000


def test_identify_with_an_invalid_value_is_a_fatal_bad_body() -> None:
    error = only_error(decode(encode_command(Identify({"sample_rate": 100}))))
    assert (error.code, error.text, error.fatal) == (
        "E_BAD_BODY", "IDENTIFY sample rate (100) is invalid", True,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# Frames, and the client's decoder


def test_frames_are_size_type_and_data() -> None:
    assert OK_FRAME == b"\x00\x00\x00\x06\x00\x00\x00\x00OK"
    assert size(15) + size(0) + b"_heartbeat_" == HEARTBEAT_FRAME
    assert encode_response(b"CLOSE_WAIT") == CLOSE_WAIT_FRAME
    assert encode_error(ProtocolError("E_INVALID", "bad")) == size(17) + size(1) + b"E_INVALID bad"
    assert encode_message(b"m" * 30) == size(34) + size(2) + b"m" * 30
    assert encode_messages([b"a" * 26, b"b" * 27]) == encode_message(b"a" * 26) + encode_message(
        b"b" * 27
    )


def test_message_frames_of_many_sizes_have_each_its_own_head() -> None:
    # Given runs of messages of more sizes than the heads kept by size (4,096)
    for sizes in (range(26, 5000), [30, 31, 30, 26], range(9000, 4000, -7)):
        messages = [bytes([n % 251]) * n for n in sizes]
        # Then each frame is the message's own, whatever heads were kept before
        assert encode_messages(messages) == b"".join(map(encode_message, messages))


def test_server_send_error_closes_only_for_fatal_errors() -> None:
    conn = ServerConnection(SMALL)
    conn.send_error(ProtocolError("E_FIN_FAILED", f"FIN {MSG_ID.decode()} failed ID not in flight"))
    assert not conn.closed
    conn.send_error(ProtocolError("E_PUB_FAILED", "PUB failed exiting"))
    assert conn.closed


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "bytewise"])
def test_client_decodes_every_frame_type(chunk: int | None) -> None:
    raw = struct.pack(">qH", 1_700_000_000_000_000_000, 2) + MSG_ID + b"body"
    stream = (
        OK_FRAME
        + HEARTBEAT_FRAME
        + encode_error(ProtocolError("E_FIN_FAILED", "FIN x failed"))
        + encode_error(ProtocolError("E_BAD_TOPIC", "nope"))
        + encode_message(raw)
        + CLOSE_WAIT_FRAME
    )
    client = ClientConnection()
    pieces = [stream] if chunk is None else [stream[i : i + 1] for i in range(len(stream))]
    events: list[object] = []
    for piece in pieces:
        client.receive_data(piece)
        while (event := client.next_event()) is not NEED_DATA:
            events.append(event)
    assert events == [
        Response(b"OK"),
        Heartbeat(),
        ErrorFrame(ProtocolError("E_FIN_FAILED", "FIN x failed", fatal=False)),
        ErrorFrame(ProtocolError("E_BAD_TOPIC", "nope", fatal=True)),
        Message(MSG_ID, 1_700_000_000_000_000_000, 2, b"body"),
        Response(b"CLOSE_WAIT"),
    ]


def test_client_sends_the_magic_with_its_first_command_only() -> None:
    client = ClientConnection()
    assert client.send(Nop()) == MAGIC + b"NOP\n"
    assert client.send(Nop()) == b"NOP\n"


@pytest.mark.parametrize(
    "stream",
    [
        size(2) + size(0),
        size(2**30) + size(0),
        size(10) + size(7) + b"xxxxxx",
        size(8) + size(2) + b"shor",
    ],
    ids=["size below four", "size above limit", "unknown type", "short message"],
)
def test_client_refuses_a_malformed_stream(stream: bytes) -> None:
    client = ClientConnection(max_frame_size=1024)
    client.receive_data(stream)
    error = client.next_event()
    assert isinstance(error, ProtocolError)
    assert (error.code, error.fatal) == ("E_BAD_PROTOCOL", True)
    assert client.next_event() is CLOSED


def test_client_fin_of_several_ids_is_several_lines() -> None:
    assert encode_command(Fin((MSG_ID, MSG_ID))) == b"FIN " + MSG_ID + b"\nFIN " + MSG_ID + b"\n"


# ---------------------------------------------------------------------------
# Fuzz: garbage in, only events out

bodies = st.binary(min_size=1, max_size=40)
identify_maps = st.fixed_dictionaries(
    {}, optional={"client_id": st.text(max_size=5), "msg_timeout": st.sampled_from([0, 1000])}
)
commands_strategy = st.one_of(
    st.builds(Pub, st.sampled_from(["t", "a.b", "x#ephemeral"]), bodies),
    st.builds(Mpub, st.just("t"), st.lists(bodies, min_size=1, max_size=5).map(tuple)),
    st.builds(Dpub, st.just("t"), st.integers(0, 10_000), bodies),
    st.builds(Identify, identify_maps),
    st.just(Nop()),
)


@FUZZ
@given(data=st.binary(max_size=300), magic=st.booleans(), cut=st.integers(1, 20))
def test_garbage_never_raises(data: bytes, magic: bool, cut: int) -> None:
    conn = ServerConnection(SMALL)
    stream = (MAGIC if magic else b"") + data
    for i in range(0, len(stream), cut):
        conn.receive_data(stream[i : i + cut])
        for event in drain(conn):
            assert isinstance(event, Command | ProtocolError) or event is CLOSED


@FUZZ
@given(data=st.binary(max_size=300), cut=st.integers(1, 20))
def test_garbage_after_valid_lines_never_raises(data: bytes, cut: int) -> None:
    prefixes = [b"PUB t\n", b"MPUB t\n", b"IDENTIFY\n", b"SUB t c\nREQ ", b"DPUB t 1\n"]
    for prefix in prefixes:
        stream = MAGIC + prefix + data
        conn = ServerConnection(SMALL)
        for i in range(0, len(stream), cut):
            conn.receive_data(stream[i : i + cut])
            drain(conn)


@FUZZ
@given(commands=st.lists(commands_strategy, max_size=8), cut=st.integers(1, 50))
def test_any_split_of_valid_commands_decodes_to_the_same_commands(
    commands: list[Command], cut: int
) -> None:
    data = b"".join(encode_command(c) for c in commands)
    assert decode(data, chunk=cut) == commands


@FUZZ
@given(data=st.binary(max_size=200), cut=st.integers(1, 20))
def test_client_decoder_never_raises_on_garbage(data: bytes, cut: int) -> None:
    client = ClientConnection(max_frame_size=1000)
    for i in range(0, len(data), cut):
        client.receive_data(data[i : i + cut])
        while (event := client.next_event()) not in (NEED_DATA, CLOSED):
            assert isinstance(event, Response | Heartbeat | ErrorFrame | Message | ProtocolError)


# ---------------------------------------------------------------------------
# The real NSQ client library's encoder and decoder (pynsq), when installed


def test_pynsqs_command_bytes_decode_to_the_same_commands() -> None:
    pynsq = pytest.importorskip("nsq.protocol")
    data = b"".join(
        [
            pynsq.identify({"feature_negotiation": True, "heartbeat_interval": 5000}),
            pynsq.pub("t", b"one"),
            pynsq.mpub("t", [b"a", b"bc"]),
            pynsq.dpub("t", 1500, b"later"),
            pynsq.subscribe("t", "c"),
            pynsq.ready(7),
            pynsq.finish(MSG_ID),
            pynsq.requeue(MSG_ID, 250),
            pynsq.touch(MSG_ID),
            pynsq.nop(),
        ]
    )
    events = decode(data, chunk=5)
    assert isinstance(events[0], Identify)
    assert events[1:] == [
        Pub("t", b"one"), Mpub("t", (b"a", b"bc")), Dpub("t", 1500, b"later"), Sub("t", "c"),
        Rdy(7), Fin((MSG_ID,)), Req(MSG_ID, 250), Touch(MSG_ID), Nop(),
    ]  # fmt: skip


def test_pynsq_reads_our_frames() -> None:
    pynsq = pytest.importorskip("nsq.protocol")
    raw = struct.pack(">qH", 42, 3) + MSG_ID + b"body"
    frame_type, data = pynsq.unpack_response(encode_message(raw)[4:])
    message = pynsq.decode_message(data)
    assert (frame_type, message.id, message.body, message.attempts) == (2, MSG_ID, b"body", 3)
    assert pynsq.unpack_response(HEARTBEAT_FRAME[4:]) == (0, b"_heartbeat_")
    error = ProtocolError("E_FIN_FAILED", "FIN x failed")
    assert pynsq.unpack_response(encode_error(error)[4:]) == (1, b"E_FIN_FAILED FIN x failed")


def test_a_run_of_fin_lines_comes_out_as_one_fin_with_every_id():
    from transport.nsq.codec import ServerConnection
    from transport.protocol.commands import Fin, Sub

    conn = ServerConnection()
    conn.receive_data(b"  V2SUB t c\n")
    assert isinstance(conn.next_events()[0], Sub)
    ids = [b"%016d" % i for i in range(5)]
    conn.receive_data(b"".join(b"FIN " + i + b"\n" for i in ids) + b"NOP\n")
    events = conn.next_events()
    assert events[0] == Fin(tuple(ids))
    assert len(events) == 2


def test_a_bad_fin_in_a_run_still_gets_its_exact_error():
    from transport.nsq.codec import ServerConnection
    from transport.protocol.commands import Fin
    from transport.protocol.validation import ProtocolError

    conn = ServerConnection()
    conn.receive_data(b"  V2SUB t c\n")
    conn.next_events()
    conn.receive_data(b"FIN 0000000000000001\nFIN short\n")
    events = conn.next_events()
    assert events[0] == Fin((b"0000000000000001",))
    assert isinstance(events[1], ProtocolError)
    assert events[1].code == "E_INVALID"


def test_fin_before_sub_is_not_taken_by_the_fast_path():
    from transport.nsq.codec import ServerConnection
    from transport.protocol.validation import ProtocolError

    conn = ServerConnection()
    conn.receive_data(b"  V2FIN 0000000000000001\n")
    (event,) = conn.next_events()
    assert isinstance(event, ProtocolError)
    assert "cannot FIN in current state" in event.text


# -- the MPUB split's fast path against its checked twin -------------------------

def _mpub_outcome(split, body: bytes, limits: Limits) -> object:
    try:
        return split(body, limits)
    except ProtocolError as e:
        return (e.code, e.text)


@st.composite
def mpub_bodies(draw: st.DrawFn) -> bytes:
    """An MPUB body whose count, sizes, bodies and length may all disagree."""
    sizes = draw(st.lists(st.integers(min_value=-3, max_value=12), min_size=0, max_size=6))
    parts = [struct.pack(">i", len(sizes) + draw(st.integers(min_value=-2, max_value=2)))]
    for n in sizes:
        parts.append(struct.pack(">i", n) + b"m" * max(0, n))
    body = b"".join(parts) + draw(st.binary(max_size=6))
    cut = draw(st.integers(min_value=0, max_value=8))
    return body[: max(0, len(body) - cut)] if cut < 4 else body


@settings(max_examples=400, deadline=None)
@given(body=mpub_bodies())
def test_mpub_split_fast_path_agrees_with_the_checked_split(body: bytes) -> None:
    limits = Limits(max_msg_size=10, max_body_size=200)
    # Then the fast split returns the same bodies, or the same error, as the checked one
    assert _mpub_outcome(split_mpub_body, body, limits) == \
        _mpub_outcome(_split_mpub_checked, body, limits)


@settings(max_examples=400, deadline=None)
@given(body=mpub_bodies())
def test_mpub_split_of_a_read_buffer_agrees_with_the_split_of_bytes(body: bytes) -> None:
    # Given such a body in a buffer, between other bytes
    limits = Limits(max_msg_size=10, max_body_size=200)
    buf = bytearray(b"head" + body + b"tail")
    got = split_mpub_view(memoryview(buf)[4:4 + len(body)], limits)
    # Then it gives the same bodies, as read-only views, or None where the split of
    # bytes raises
    try:
        want: tuple[bytes, ...] | None = split_mpub_body(body, limits)
    except ProtocolError:
        want = None
    assert got == want
    assert all(type(b) is memoryview and b.readonly for b in got or ())


def test_a_large_mpub_is_split_out_of_the_read_buffer_and_the_stream_goes_on() -> None:
    # Given MPUBs of 200 messages of 1 KiB (split in place: over 64 KiB) arriving in
    # pieces, with commands after them, two MPUBs in one read
    bodies = tuple(bytes([i]) * 1024 for i in range(200))
    body = size(200) + b"".join(size(len(b)) + b for b in bodies)
    mpub = b"MPUB big\n" + size(len(body)) + body
    first = MAGIC + mpub + b"NOP\nPUB t\n" + size(2) + b"ok"
    pieces = [first[i:i + 7000] for i in range(0, len(first), 7000)]
    conn = ServerConnection()
    events: list[object] = []
    for piece in [*pieces, mpub + mpub + b"NOP\n"]:
        conn.receive_data(piece)  # (the buffer is cut and grown each time)
        events += conn.next_events()
    # Then the messages come out whole, and so does what followed; each message is a
    # read-only view that later reads did not change
    assert events == [Mpub("big", bodies), Nop(), Pub("t", b"ok"), Mpub("big", bodies),
                      Mpub("big", bodies), Nop()]
    mpubs = [e for e in events if type(e) is Mpub]
    assert all(type(b) is memoryview and b.readonly for e in mpubs for b in e.bodies)


def test_a_large_mpub_with_a_bad_message_gets_nsqds_error() -> None:
    # Given a large MPUB whose last message is over the message size limit
    bodies = [b"x" * 1024] * 199 + [b"y" * 2048]
    body = size(200) + b"".join(size(len(b)) + b for b in bodies)
    conn = ServerConnection(Limits(max_msg_size=1024))
    conn.receive_data(MAGIC + b"MPUB t\n" + size(len(body)) + body)
    # Then it is the error the checked split gives, and it closes the connection
    (event,) = conn.next_events()
    assert isinstance(event, ProtocolError)
    assert (event.code, event.text) == ("E_BAD_MESSAGE", "MPUB message too big 2048 > 1024")
    assert event.fatal


def test_a_run_of_fin_lines_with_odd_bytes_in_the_ids_is_read_whole() -> None:
    # Given FIN lines whose 16-byte ids hold spaces, newlines and high bytes
    ids = [b"0123456789abcdef", b"ab\ncd\nef 0123456", bytes(range(240, 256))]
    conn = ServerConnection()
    conn.receive_data(MAGIC + b"SUB t c\n")
    conn.next_events()
    conn.receive_data(b"".join(b"FIN " + i + b"\n" for i in ids) + b"NOP\n")
    # Then they come out as one FIN with every id, then the NOP
    assert conn.next_events() == [Fin(tuple(ids)), Nop()]


def _merged_fins(events: list[object]) -> list[object]:
    """Consecutive FINs as one, as the fast path makes them (errors as their fields)."""
    out: list[object] = []
    for event in events:
        if type(event) is Fin and out and type(out[-1]) is Fin:
            out[-1] = Fin(out[-1].ids + event.ids)
        elif isinstance(event, ProtocolError):
            out.append((event.code, event.text, event.fatal))
        else:
            out.append(event)
    return out


_FIN_LINES = st.one_of(
    st.binary(min_size=16, max_size=16).map(lambda i: b"FIN " + i + b"\n"),
    # a line wrong at one byte of its frame, or of another length
    st.tuples(st.binary(min_size=16, max_size=16), st.sampled_from([0, 1, 2, 3, 20]),
              st.binary(min_size=1, max_size=1)).map(
        lambda t: bytes((b"FIN " + t[0] + b"\n")[: t[1]] + t[2]
                        + (b"FIN " + t[0] + b"\n")[t[1] + 1 :])),
    st.binary(min_size=0, max_size=20).map(lambda i: b"FIN " + i.replace(b"\n", b"") + b"\n"),
    st.just(b"NOP\n"),
    st.just(b"RDY 5\n"),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FIN_LINES, max_size=600), st.integers(min_value=1, max_value=64))
def test_the_fin_fast_path_reads_what_the_general_parser_reads(lines, cut) -> None:
    # Given a subscribed connection's stream of FIN lines, some malformed, with other
    # commands between them, read in pieces
    stream = b"".join(lines)
    fast, slow = ServerConnection(), ServerConnection()

    def by_regex() -> list[bytes]:  # the fast path as it was: two regular expressions
        run = re.compile(rb"(?:FIN .{16}\n)+", re.DOTALL).match(slow._buf, slow._pos)
        if run is None:
            return []
        ids = re.compile(rb"FIN (.{16})\n", re.DOTALL).findall(slow._buf, slow._pos, run.end())
        slow._pos = slow._scan = run.end()
        return ids

    slow._fast_fins = by_regex  # type: ignore[method-assign]
    got: dict[int, list[object]] = {id(fast): [], id(slow): []}
    for conn in (fast, slow):
        conn.receive_data(MAGIC + b"SUB t c\n")
        conn.next_events()
        for at in range(0, len(stream), cut * 21):
            conn.receive_data(stream[at : at + cut * 21])
            got[id(conn)] += conn.next_events()
            if conn.closed:
                break
    # Then the fast path takes the FIN runs a regular expression takes, and the general
    # parser gives the same commands and errors for the rest
    assert _merged_fins(got[id(fast)]) == _merged_fins(got[id(slow)])
