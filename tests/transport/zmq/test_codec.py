"""ZeroMQ client protocol codec: frames in, commands out; replies out, replies back in."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.protocol.commands import (
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
    Rewind,
    Sub,
    Touch,
)
from transport.protocol.validation import ConnectionState, Limits, ProtocolError, State
from transport.zmq.codec import (
    ErrorReply,
    Messages,
    Ok,
    PackedMessages,
    Request,
    SizedBodies,
    columns_of,
    encode_error,
    encode_heartbeat,
    encode_identify_reply,
    encode_messages,
    encode_ok,
    encode_packed_messages,
    encode_request,
    mpub_body_size,
    pack_bodies,
    parse_reply,
    parse_request,
    unpack_columns,
)

MSG_ID = b"0a1b2c3d4e5f6789"
SMALL = Limits(max_msg_size=100, max_body_size=1000, max_rdy_count=50, max_req_timeout=10_000)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True)

COMMANDS: list[Command] = [
    Pub("orders", b"hello"),
    Pub("orders#ephemeral", b"\x00#\xff"),
    Mpub("orders", (b"a", b"bc", b"d" * 100)),
    Dpub("orders", 5000, b"later"),
    Pub("orders", b"hello", "red"),
    Mpub("orders", (b"a", b"bc"), "eu-west:1.a_b"),
    Dpub("orders", 5000, b"later", "x" * 64),
    Sub("orders", "archive"),
    Rdy(10),
    Fin((MSG_ID,)),
    Fin((MSG_ID, b"fedcba9876543210", MSG_ID)),
    Req(MSG_ID, 250),
    Touch(MSG_ID),
    Cls(),
    Nop(),
]


def parse(frames: list[bytes], state: ConnectionState | None = None) -> Request:
    return parse_request(frames, SMALL, state)


def error_of(frames: list[bytes], state: ConnectionState | None = None) -> ProtocolError:
    command = parse(frames, state).command
    assert isinstance(command, ProtocolError), command
    return command


@pytest.mark.parametrize("command", COMMANDS, ids=repr)
def test_every_command_round_trips_from_client_frames_to_broker_command(command: Command) -> None:
    assert parse(encode_request(command)) == Request(None, command)


@pytest.mark.parametrize("command", COMMANDS, ids=repr)
def test_a_correlation_frame_is_returned_with_the_command(command: Command) -> None:
    assert parse(encode_request(command, corr=b"#42")) == Request(b"#42", command)


def test_the_request_frames_are_the_command_name_then_one_frame_per_argument() -> None:
    assert encode_request(Dpub("t", 5000, b"x"), corr=b"#7") == [
        b"#7",
        b"DPUB",
        b"t",
        b"5000",
        b"x",
    ]
    assert encode_request(Fin((MSG_ID, MSG_ID))) == [b"FIN", MSG_ID, MSG_ID]
    assert encode_request(Mpub("t", (b"a", b"b"))) == [b"MPUB", b"t", b"a", b"b"]
    # the tagged ones (#21) have the tag second
    assert encode_request(Pub("t", b"x", "red")) == [b"TPUB", b"t", b"red", b"x"]
    assert encode_request(Mpub("t", (b"a", b"b"), "red")) == [b"TMPUB", b"t", b"red", b"a", b"b"]
    assert encode_request(Dpub("t", 5, b"x", "red")) == [b"TDPUB", b"t", b"red", b"5", b"x"]
    # REWIND (#21): from unix milliseconds, an RFC 3339 time, or a message id
    assert encode_request(Rewind("t", "c", 1_700_000_000_000_000_000)) == [
        b"REWIND", b"t", b"c", b"1700000000000"]
    assert encode_request(Rewind("t", "c", 0, "0123456789abcdef")) == [
        b"REWIND", b"t", b"c", b"0123456789abcdef"]
    assert parse([b"REWIND", b"t", b"c", b"2023-11-14T22:13:20Z"]).command == Rewind(
        "t", "c", 1_700_000_000_000_000_000)
    assert parse([b"REWIND", b"t", b"c", b"0123456789ABCDEF"]).command == Rewind(
        "t", "c", 0, "0123456789abcdef")


def test_a_correlation_frame_must_start_with_a_hash() -> None:
    with pytest.raises(ValueError, match="correlation"):
        encode_request(Nop(), corr=b"42")


def test_a_correlation_frame_longer_than_256_bytes_is_refused() -> None:
    error = error_of([b"#" + b"x" * 256, b"NOP"])
    assert (error.code, error.fatal) == ("E_INVALID", True)


def test_a_request_of_only_a_correlation_frame_is_refused() -> None:
    request = parse([b"#1"])
    assert request.corr == b"#1"
    assert isinstance(request.command, ProtocolError)


# ---------------------------------------------------------------------------
# Malformed requests: the same codes and sentences as NSQ V2

BAD_REQUESTS = [
    ("no frames", [], "E_INVALID", "missing command frame"),
    ("unknown command", [b"HELLO"], "E_INVALID", "invalid command HELLO"),
    ("empty command frame", [b""], "E_INVALID", "invalid command "),
    ("pub without body", [b"PUB", b"t"], "E_INVALID", "PUB insufficient number of parameters"),
    ("pub with extra", [b"PUB", b"t", b"x", b"y"], "E_INVALID", "PUB too many parameters"),
    ("nop with extra", [b"NOP", b"x"], "E_INVALID", "NOP too many parameters"),
    ("cls with extra", [b"CLS", b"x"], "E_INVALID", "CLS too many parameters"),
    ("bad topic", [b"PUB", b"a b", b"x"], "E_BAD_TOPIC", 'PUB topic name "a b" is not valid'),
    ("bad channel", [b"SUB", b"t", b""], "E_BAD_CHANNEL", 'SUB channel name "" is not valid'),
    ("empty pub", [b"PUB", b"t", b""], "E_BAD_MESSAGE", "PUB invalid message body size 0"),
    ("big pub", [b"PUB", b"t", b"x" * 101], "E_BAD_MESSAGE", "PUB message too big 101 > 100"),
    ("mpub of none", [b"MPUB", b"t"], "E_INVALID", "MPUB insufficient number of parameters"),
    ("mpub empty message", [b"MPUB", b"t", b"a", b""], "E_BAD_MESSAGE",
     "MPUB invalid message(1) body size 0"),
    ("mpub too big", [b"MPUB", b"t", *[b"x" * 100] * 10], "E_BAD_BODY",
     "MPUB body too big 1044 > 1000"),
    ("mpub too many", [b"MPUB", b"t", *[b"x"] * 200], "E_BAD_BODY",
     "MPUB invalid message count 200"),
    ("dpub bad delay", [b"DPUB", b"t", b"-5", b"x"], "E_INVALID",
     "DPUB could not parse timeout -5"),
    ("dpub long delay", [b"DPUB", b"t", b"10001", b"x"], "E_INVALID",
     "DPUB timeout 10001 out of range 0-10000"),
    ("rdy without count", [b"RDY"], "E_INVALID", "RDY insufficient number of parameters"),
    ("rdy too big", [b"RDY", b"51"], "E_INVALID", "RDY count 51 out of range 0-50"),
    ("fin without id", [b"FIN"], "E_INVALID", "FIN insufficient number of parameters"),
    ("fin bad second id", [b"FIN", MSG_ID, b"short"], "E_INVALID",
     'FIN Invalid Message ID "short"'),
    ("req bad delay", [b"REQ", MSG_ID, b"x"], "E_INVALID", "REQ could not parse timeout x"),
    ("touch bad id", [b"TOUCH", b""], "E_INVALID", 'TOUCH Invalid Message ID ""'),
    ("identify not msgpack", [b"IDENTIFY", b"\xc1"], "E_BAD_BODY",
     "IDENTIFY failed to decode msgpack body"),
    ("identify not a map", [b"IDENTIFY", msgpack.packb([1])], "E_BAD_BODY",
     "IDENTIFY failed to decode msgpack body"),
    ("identify empty", [b"IDENTIFY", b""], "E_BAD_BODY", "IDENTIFY invalid body size 0"),
    ("identify no heartbeats", [b"IDENTIFY", msgpack.packb({"heartbeat_interval": -1})],
     "E_BAD_BODY", "IDENTIFY heartbeat interval (-1) is invalid"),
    ("auth without a secret", [b"AUTH"], "E_INVALID", "AUTH invalid number of parameters"),
    ("auth empty", [b"AUTH", b""], "E_BAD_BODY", "AUTH invalid body size 0"),
    ("tpub without body", [b"TPUB", b"t", b"red"], "E_INVALID",
     "TPUB insufficient number of parameters"),
    ("tpub bad tag", [b"TPUB", b"t", b"a,b", b"x"], "E_INVALID",
     'TPUB bad tag "a,b" (1-64 of a-z A-Z 0-9 . _ - :)'),
    ("tmpub long tag", [b"TMPUB", b"t", b"x" * 65, b"x"], "E_INVALID",
     'TMPUB bad tag "' + "x" * 65 + '" (1-64 of a-z A-Z 0-9 . _ - :)'),
    ("tdpub too many", [b"TDPUB", b"t", b"red", b"5", b"x", b"y"], "E_INVALID",
     "TDPUB too many parameters"),
    ("tpub bad topic", [b"TPUB", b"a b", b"red", b"x"], "E_BAD_TOPIC",
     'TPUB topic name "a b" is not valid'),
    ("tpub bad topic and tag", [b"TPUB", b"a b", b"a b", b"x"], "E_BAD_TOPIC",
     'TPUB topic name "a b" is not valid'),
    ("tmpub empty message", [b"TMPUB", b"t", b"red", b"a", b""], "E_BAD_MESSAGE",
     "TMPUB invalid message(1) body size 0"),
    ("rewind bad from", [b"REWIND", b"t", b"c", b"soon"], "E_INVALID",
     "REWIND bad from b'soon' (an RFC 3339 time, unix milliseconds, or a message id of 16 "
     "hex characters)"),
    ("rewind without from", [b"REWIND", b"t", b"c"], "E_INVALID",
     "REWIND insufficient number of parameters"),
    ("rewind bad channel", [b"REWIND", b"t", b"a b", b"0"], "E_BAD_CHANNEL",
     'REWIND channel name "a b" is not valid'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "frames", "code", "text"), BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS]
)
def test_a_malformed_request_gets_the_nsqd_error_and_is_fatal(
    name: str, frames: list[bytes], code: str, text: str
) -> None:
    error = error_of(frames)
    assert (error.code, error.text, error.fatal) == (code, text, True)


def test_the_correlation_frame_is_kept_when_the_request_is_refused() -> None:
    assert parse([b"#9", b"PUB", b"bad topic", b"x"]).corr == b"#9"


# ---------------------------------------------------------------------------
# Connection state


def test_with_a_state_rdy_before_sub_is_refused() -> None:
    assert error_of([b"RDY", b"1"], ConnectionState()).text == "cannot RDY in current state"


def test_with_a_state_the_state_is_checked_before_the_arguments() -> None:
    assert error_of([b"FIN", b"short"], ConnectionState()).text == "cannot FIN in current state"


def test_with_a_state_sub_then_cls_moves_the_state_and_rdy_after_cls_is_a_nop() -> None:
    # Given a fresh session
    state = ConnectionState()
    # When it subscribes, then consumer commands are allowed
    assert parse([b"SUB", b"t", b"c"], state).command == Sub("t", "c")
    assert state.state is State.SUBSCRIBED
    assert parse([b"RDY", b"5"], state).command == Rdy(5)
    # When it sends CLS, then RDY is ignored but FIN still works
    assert parse([b"CLS"], state).command == Cls()
    assert parse([b"RDY", b"5"], state).command == Nop()
    assert parse([b"FIN", MSG_ID], state).command == Fin((MSG_ID,))
    # And a second SUB is refused
    assert error_of([b"SUB", b"t", b"c"], state).text == "cannot SUB in current state"


def test_without_a_state_only_the_frames_are_validated() -> None:
    assert parse([b"RDY", b"1"]).command == Rdy(1)


# ---------------------------------------------------------------------------
# IDENTIFY


def test_identify_answers_ok_with_a_msgpack_map_of_the_negotiated_settings() -> None:
    frames = encode_request(
        Identify({"client_id": "c1", "heartbeat_interval": 5000, "msg_timeout": 3000}), b"#1"
    )
    corr, event = parse(frames)
    assert isinstance(event, Identify)
    reply = encode_identify_reply(corr, event)
    assert reply[:2] == [b"#1", b"OK"]
    answer = msgpack.unpackb(reply[2])
    assert answer["heartbeat_interval"] == 5000
    assert answer["msg_timeout"] == 3000
    assert answer["max_rdy_count"] == SMALL.max_rdy_count
    assert answer["protocol_version"] == 1


def test_identify_grants_packed_messages_to_a_session_that_asks() -> None:
    for asked in (True, False, None):
        data = {} if asked is None else {"packed_messages": asked}
        corr, event = parse([b"#1", b"IDENTIFY", msgpack.packb(data)])
        assert isinstance(event, Identify)
        assert event.settings.packed_messages is bool(asked)
        assert msgpack.unpackb(encode_identify_reply(corr, event)[2])["packed_messages"] \
            is bool(asked)


def test_identify_with_packed_messages_not_a_bool_is_a_bad_body() -> None:
    error = error_of([b"IDENTIFY", msgpack.packb({"packed_messages": 1})])
    assert (error.code, error.text) == ("E_BAD_BODY", "IDENTIFY failed to decode msgpack body")


def test_identify_without_keys_gets_the_defaults() -> None:
    event = parse([b"IDENTIFY", msgpack.packb({})]).command
    assert isinstance(event, Identify)
    assert event.settings.heartbeat_interval == SMALL.client_timeout // 2
    assert event.settings.msg_timeout == SMALL.msg_timeout


@pytest.mark.parametrize("command", [Mpub("orders", (b"a", b"bc", b"d" * 100)),
                                     Mpub("orders", (b"a",), "eu-west:1.a_b")], ids=repr)
def test_a_packed_mpub_is_the_mpub_with_its_bodies_in_one_frame(command: Mpub) -> None:
    frames = encode_request(command, b"#4", packed=True)
    name = b"TPMPUB" if command.tag else b"PMPUB"
    assert frames == [b"#4", name, b"orders", *([command.tag.encode()] if command.tag else []),
                      pack_bodies(command.bodies)]
    assert frames[-1][:4] == struct.pack(">I", len(command.bodies))
    assert parse(frames) == Request(b"#4", command)
    # (only MPUB has a packed form)
    assert encode_request(Pub("orders", b"x"), packed=True) == encode_request(Pub("orders", b"x"))


def test_sized_bodies_are_sent_as_they_are_and_split_only_for_frames() -> None:
    bodies = [b"a", b"", b"bc" * 50, b"\x00\xff"]
    sized = SizedBodies(len(bodies), pack_bodies(bodies)[4:])
    assert len(sized) == 4
    assert pack_bodies(sized) == pack_bodies(bodies)
    assert mpub_body_size(sized) == mpub_body_size(bodies)
    # packed: its data as it is; as MPUB frames: one a body
    assert encode_request(Mpub("t", sized), b"#1", packed=True)[-1] == pack_bodies(bodies)
    assert encode_request(Mpub("t", sized), b"#1")[3:] == bodies
    assert list(sized) == bodies
    assert sized[2] == bodies[2]
    head, rest = sized.take(3, 10**6)
    assert (list(head), list(rest)) == (bodies[:3], bodies[3:])
    assert list(SizedBodies.join([head, rest])) == bodies
    assert pack_bodies(SizedBodies.join([head, rest])) == pack_bodies(bodies)
    # how many of the first fit a count and a size (each body's 4 bytes included)
    assert len(sized.take(10, 10**6)[0]) == 4
    assert len(sized.take(2, 10**6)[0]) == 2
    assert [len(sized.take(4, room)[0]) for room in (9, 8, 4)] == [2, 1, 0]
    assert sized.count(b"a") == 1  # (Sequence's count: the number is `number`)
    with pytest.raises(ValueError, match="do not hold 5 sized bodies"):
        list(SizedBodies(5, sized.data))


@pytest.mark.parametrize(("frames", "code", "text"), [
    ([b"PMPUB", b"orders"], "E_INVALID", "PMPUB insufficient number of parameters"),
    ([b"PMPUB", b"orders", pack_bodies([b"a"]), b"x"], "E_INVALID",
     "PMPUB too many parameters"),
    ([b"PMPUB", b"bad topic!", pack_bodies([b"a"])], "E_BAD_TOPIC", None),
    ([b"PMPUB", b"orders", b"\x00\x00\x00\x02" + struct.pack(">I", 1) + b"a"], "E_BAD_BODY",
     None),
    ([b"PMPUB", b"orders", pack_bodies([b""])], "E_BAD_MESSAGE", None),
    ([b"PMPUB", b"orders", pack_bodies([b"x" * 101])], "E_BAD_MESSAGE", None),
    ([b"PMPUB", b"orders", b"x" * 1001], "E_BAD_BODY", None),
    ([b"TPMPUB", b"orders", b"no spaces", pack_bodies([b"a"])], "E_INVALID",
     'TPMPUB bad tag "no spaces" (1-64 of a-z A-Z 0-9 . _ - :)'),
], ids=["no body", "a frame too many", "bad topic", "short", "empty message", "message too big",
        "body too big", "bad tag"])
def test_a_bad_packed_mpub_gets_the_mpub_error(frames: list[bytes], code: str,
                                               text: str | None) -> None:
    error = error_of(frames)
    assert error.code == code, error
    if text is not None:
        assert error.text == text


def test_fin_takes_many_ids_in_one_frame() -> None:
    other = b"fedcba9876543210"
    assert parse([b"FIN", MSG_ID + other + MSG_ID]).command == Fin((MSG_ID, other, MSG_ID))
    assert parse([b"FIN", MSG_ID]).command == Fin((MSG_ID,))
    assert parse([b"FIN", other, MSG_ID + other]).command == Fin((other, MSG_ID, other))


@pytest.mark.parametrize("n", [2, 3, 5000, 4096, 4097, 8192 + 4095, 20_001])
def test_a_fin_frame_of_any_number_of_ids_gives_each_in_order(n: int) -> None:
    # (read by structs of 2**k ids, one per bit of n, the largest used again past 4096)
    ids = [i.to_bytes(16, "big") for i in range(n)]
    assert parse([b"FIN", b"".join(ids)]).command == Fin(tuple(ids))


def test_a_fin_frame_shorter_than_an_id_gets_nsqds_invalid_message_id() -> None:
    error = error_of([b"FIN", MSG_ID * 2, b"0a1b"])
    assert (error.code, error.text) == ("E_INVALID", 'FIN Invalid Message ID "0a1b"')


@pytest.mark.parametrize("frame", [MSG_ID + b"x", MSG_ID * 2 + b"0123456789"])
def test_a_fin_frame_of_ids_that_is_not_a_multiple_of_16_bytes_is_refused(frame: bytes) -> None:
    error = error_of([b"FIN", frame])
    assert error.code == "E_INVALID"
    assert error.fatal
    assert f"FIN {len(frame)} bytes of message ids is not a multiple of 16" in error.text


# ---------------------------------------------------------------------------
# Replies


def test_replies_are_the_documented_frames() -> None:
    error = ProtocolError("E_FIN_FAILED", "FIN x failed ID not in flight")
    assert encode_ok(b"#1") == [b"#1", b"OK"]
    assert encode_ok(None, b"CLOSE_WAIT") == [b"OK", b"CLOSE_WAIT"]
    assert encode_error(b"#2", error) == [b"#2", b"ERROR", b"E_FIN_FAILED", error.text.encode()]
    assert encode_messages([b"m1", b"m2"]) == [b"MESSAGE", b"m1", b"m2"]
    assert encode_heartbeat() == [b"HEARTBEAT"]


def test_every_reply_round_trips_through_the_client_parser() -> None:
    raw = struct.pack(">qH", 123, 1) + MSG_ID + b"body"
    assert parse_reply(encode_ok(b"#1")) == Ok(b"#1")
    assert parse_reply(encode_ok(None, b"CLOSE_WAIT")) == Ok(None, b"CLOSE_WAIT")
    fin_failed = ProtocolError("E_FIN_FAILED", "FIN x failed")
    reply = parse_reply(encode_error(b"#3", fin_failed))
    assert reply == ErrorReply(b"#3", fin_failed)
    assert isinstance(reply, ErrorReply)
    assert not reply.error.fatal
    assert parse_reply(encode_messages([raw, raw])) == Messages(
        (Message(MSG_ID, 123, 1, b"body"),) * 2
    )
    assert parse_reply(encode_heartbeat()) == Heartbeat()


def test_packed_messages_are_headers_sizes_and_bodies_a_line_each() -> None:
    raw = struct.pack(">qH", 123, 1) + MSG_ID + b"body"
    other = struct.pack(">qH", -5, 65535) + b"fedcba9876543210" + b"x\n" * 35_000
    frames = encode_packed_messages([raw, other])
    assert frames == [b"MESSAGES", raw[:26] + other[:26], struct.pack(">2I", 4, 70_000),
                      b"body\n" + b"x\n" * 35_000]
    reply = parse_reply(frames)
    assert isinstance(reply, PackedMessages)
    assert reply.columns.messages() == [
        (MSG_ID, 123, 1, b"body"), (b"fedcba9876543210", -5, 65535, b"x\n" * 35_000)]


@FUZZ
@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16),
                          st.integers(-2**63, 2**63 - 1), st.integers(0, 65535),
                          st.binary(max_size=40)), min_size=1, max_size=20))
def test_a_packed_reply_as_columns_holds_what_it_holds_as_messages(
        messages: list[tuple[bytes, int, int, bytes]]) -> None:
    frames = encode_packed_messages([struct.pack(">qH", ts, attempts) + i + body
                                     for i, ts, attempts, body in messages])
    columns = unpack_columns(frames[1:])
    assert columns == columns_of(messages)
    assert (columns.ids, columns.timestamps, columns.attempts, columns.bodies) == \
        tuple(map(list, zip(*messages, strict=True)))
    assert columns.lines == b"\n".join(m[3] for m in messages)
    assert parse_reply(frames) == PackedMessages(columns_of(messages))


@pytest.mark.parametrize("frames", [
    [], [b""] * 3, [b"x" * 26, b"\x00\x00\x00", b""], [b"x" * 25, b"\x00" * 4, b""],
    [b"x" * 26, struct.pack(">I", 3), b"ab"], [b"x" * 52, struct.pack(">2I", 1, 1), b"a\nbc"],
    [b"x" * 26, b"\x00" * 4, b"", b""]],
    ids=["no frames", "empty", "short sizes", "short header", "short lines", "long lines",
         "a stray frame"])
def test_a_malformed_packed_reply_is_a_bad_protocol_error(frames: list[bytes]) -> None:
    error = parse_reply([b"MESSAGES", *frames])
    assert isinstance(error, ProtocolError), error
    assert error.code == "E_BAD_PROTOCOL"
    with pytest.raises(ValueError, match=r"frames|headers|lines"):  # (a consumer of deliveries)
        unpack_columns(frames)


@FUZZ
@given(st.lists(st.binary(max_size=60), max_size=4))
def test_an_arbitrary_packed_reply_is_messages_or_a_bad_protocol_error(
        frames: list[bytes]) -> None:
    reply = parse_reply([b"MESSAGES", *frames])
    assert isinstance(reply, PackedMessages | ProtocolError)
    if isinstance(reply, PackedMessages):  # (and then its bodies have the sizes it says)
        columns = reply.columns
        assert [len(b) for b in columns.bodies] == list(
            struct.unpack(f">{len(columns)}I", columns.sizes))


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"WHAT"],
        [b"ERROR", b"E_X"],
        [b"MESSAGE"],
        [b"MESSAGE", b"short"],
        [b"#1", b"HEARTBEAT"],
    ],
    ids=[
        "empty",
        "unknown",
        "error without text",
        "no messages",
        "short message",
        "corr heartbeat",
    ],
)
def test_a_malformed_reply_is_a_bad_protocol_error(frames: list[bytes]) -> None:
    error = parse_reply(frames)
    assert isinstance(error, ProtocolError)
    assert error.code == "E_BAD_PROTOCOL"


# ---------------------------------------------------------------------------
# Fuzz

frames_strategy = st.lists(
    st.one_of(
        st.sampled_from([b"PUB", b"MPUB", b"DPUB", b"SUB", b"RDY", b"FIN", b"REQ", b"TOUCH",
                         b"CLS", b"NOP", b"IDENTIFY", b"#1", b"t", MSG_ID, b"5",
                         b"MESSAGES", b"MESSAGE"]),
        st.binary(max_size=40),
    ),
    max_size=6,
)  # fmt: skip


@FUZZ
@given(frames=frames_strategy, with_state=st.booleans())
def test_arbitrary_frames_give_a_command_or_a_protocol_error(
    frames: list[bytes], with_state: bool
) -> None:
    state = ConnectionState() if with_state else None
    corr, command = parse_request(frames, SMALL, state)
    assert isinstance(command, Command | ProtocolError)
    assert corr is None or corr.startswith(b"#")


@FUZZ
@given(body=st.binary(max_size=60))
def test_an_arbitrary_identify_body_never_raises(body: bytes) -> None:
    _, command = parse([b"IDENTIFY", body])
    assert isinstance(command, Identify | ProtocolError)


@FUZZ
@given(data=st.dictionaries(st.sampled_from(["heartbeat_interval", "msg_timeout", "sample_rate",
                                             "client_id", "output_buffer_size", "x"]),
                            st.one_of(st.integers(-2, 2**40), st.text(max_size=3), st.none(),
                                      st.booleans(), st.floats())))  # fmt: skip
def test_arbitrary_identify_maps_are_settled_or_refused_with_bad_body(
    data: dict[str, object],
) -> None:
    _, command = parse([b"IDENTIFY", msgpack.packb(data)])
    assert isinstance(command, Identify) or command.code == "E_BAD_BODY"


@FUZZ
@given(frames=frames_strategy)
def test_arbitrary_replies_never_raise(frames: list[bytes]) -> None:
    assert isinstance(parse_reply(frames),
                      Ok | ErrorReply | Messages | PackedMessages | Heartbeat | ProtocolError)
