"""Protocol errors (actors.broker.errors): nsqd's codes, fatality, text and wire form."""

from __future__ import annotations

import pickle

import msgpack
import pytest

from actors.broker import errors as e
from actors.broker.errors import BrokerError

NSQD_CODES = {
    "E_INVALID", "E_BAD_BODY", "E_BAD_TOPIC", "E_BAD_CHANNEL", "E_BAD_MESSAGE",
    "E_PUB_FAILED", "E_MPUB_FAILED", "E_DPUB_FAILED", "E_FIN_FAILED", "E_REQ_FAILED",
    "E_TOUCH_FAILED", "E_IDENTIFY_FAILED", "E_AUTH_DISABLED", "E_AUTH_FIRST",
    "E_AUTH_FAILED", "E_AUTH_ERROR", "E_UNAUTHORIZED",
}  # fmt: skip


def test_every_code_nsqd_sends_has_a_class() -> None:
    assert e.CODES == NSQD_CODES
    for code in NSQD_CODES:
        cls = e.error_class(code)
        assert issubclass(cls, BrokerError)
        assert cls.code == code


def test_only_fin_req_and_touch_failures_keep_the_connection_open() -> None:
    non_fatal = {"E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED"}
    assert non_fatal == e.NON_FATAL_CODES
    assert not e.fin_failed(b"0123456789abcdef").fatal
    assert e.bad_topic("x y").fatal


def test_str_is_the_code_then_the_sentence_like_nsqds_error_frame() -> None:
    err = e.bad_topic("bad name!")
    assert str(err) == 'E_BAD_TOPIC PUB topic name "bad name!" is not valid'
    assert err.frame_payload() == str(err).encode()


def test_helper_constructors_produce_nsqd_like_sentences() -> None:
    msg_id = b"0123456789abcdef"
    assert str(e.bad_channel("c h", "SUB")) == 'E_BAD_CHANNEL SUB channel name "c h" is not valid'
    assert str(e.bad_topic(b"t t", "MPUB")) == 'E_BAD_TOPIC MPUB topic name "t t" is not valid'
    assert str(e.message_too_big(2_000_000, 1_048_576)) == (
        "E_BAD_MESSAGE PUB message too big 2000000 > 1048576"
    )
    assert str(e.body_too_big(6, 5)) == "E_BAD_BODY MPUB body too big 6 > 5"
    assert (
        str(e.fin_failed(msg_id)) == f"E_FIN_FAILED FIN {msg_id.decode()} failed ID not in flight"
    )
    assert str(e.req_failed("abc", "client does not own message")) == (
        "E_REQ_FAILED REQ abc failed client does not own message"
    )
    assert str(e.touch_failed(msg_id)).startswith("E_TOUCH_FAILED TOUCH 0123")
    assert str(e.invalid("cannot FIN in current state")) == "E_INVALID cannot FIN in current state"
    assert str(e.bad_message("PUB invalid message body size 0")).startswith("E_BAD_MESSAGE ")
    assert str(e.bad_body("MPUB invalid message count 0")).startswith("E_BAD_BODY ")


def test_names_with_quotes_are_escaped_like_go_percent_q() -> None:
    assert str(e.bad_topic('a"b\\c')) == r'E_BAD_TOPIC PUB topic name "a\"b\\c" is not valid'


def test_an_error_can_be_caught_by_its_class_or_the_root() -> None:
    with pytest.raises(e.FinFailed):
        raise e.fin_failed("x")
    with pytest.raises(BrokerError):
        raise e.bad_topic("x y")


def test_fatality_can_be_overridden_per_instance() -> None:
    assert not e.invalid("soft", fatal=False).fatal
    assert e.FinFailed("forced", fatal=True).fatal


def test_errors_round_trip_through_msgpack_with_their_class() -> None:
    for err in (e.bad_topic("x y"), e.fin_failed("abc"), e.invalid("z", fatal=False)):
        wire = msgpack.unpackb(msgpack.packb(err.to_wire()))
        back = e.from_wire(wire)
        assert type(back) is type(err)
        assert back == err
        assert (back.code, back.text, back.fatal) == (err.code, err.text, err.fatal)


def test_an_unknown_code_from_the_wire_keeps_its_code() -> None:
    back = e.from_wire(("E_SOMETHING_NEW", "text", False))
    assert type(back) is BrokerError
    assert str(back) == "E_SOMETHING_NEW text"
    assert not back.fatal


@pytest.mark.parametrize("wire", [(), ("E_INVALID", "x"), (1, "x", True), ("E_X", None, True)])
def test_malformed_wire_errors_are_refused(wire: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="code, text, fatal"):
        e.from_wire(wire)


def test_errors_survive_pickling_with_fatal_and_code() -> None:
    err = e.invalid("x", fatal=False)
    back = pickle.loads(pickle.dumps(err))  # noqa: S301 - our own bytes
    assert back == err
    assert not back.fatal


def test_a_cause_can_be_chained() -> None:
    def publish() -> None:
        try:
            raise OSError("disk full")
        except OSError as cause:
            raise e.PubFailed("PUB failed disk full") from cause

    with pytest.raises(BrokerError) as info:
        publish()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.to_wire() == ("E_PUB_FAILED", "PUB failed disk full", True)
