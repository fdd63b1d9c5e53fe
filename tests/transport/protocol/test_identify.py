"""IDENTIFY validation and nsqd 1.x feature negotiation (pure functions)."""

from __future__ import annotations

import pytest

from transport.protocol.identify import (
    IdentifySettings,
    ServerInfo,
    identify_settings,
    negotiate_identify,
)
from transport.protocol.validation import Limits, ProtocolError

LIMITS = Limits()


def refusal(data: dict[str, object], **kwargs: bool) -> str:
    with pytest.raises(ProtocolError) as info:
        identify_settings(data, LIMITS, **kwargs)
    assert (info.value.code, info.value.fatal) == ("E_BAD_BODY", True)
    return info.value.text


def test_an_empty_identify_gets_nsqds_defaults() -> None:
    settings = identify_settings({}, LIMITS)
    assert settings == IdentifySettings.defaults(LIMITS)
    assert settings.heartbeat_interval == 30_000  # half of the 60 s client timeout
    assert (settings.output_buffer_size, settings.output_buffer_timeout) == (16384, 250)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("heartbeat_interval", -1, 0),
        ("heartbeat_interval", 1000, 1000),
        ("heartbeat_interval", 60_000, 60_000),
        ("msg_timeout", 1000, 1000),
        ("msg_timeout", 900_000, 900_000),
        ("sample_rate", 99, 99),
        ("output_buffer_size", 64, 64),
        ("output_buffer_timeout", -1, 0),
        ("output_buffer_timeout", 25, 25),
    ],
)
def test_values_inside_nsqds_ranges_are_accepted(key: str, value: int, expected: int) -> None:
    assert getattr(identify_settings({key: value}, LIMITS), key) == expected


def test_an_output_buffer_size_of_minus_one_disables_buffering() -> None:
    settings = identify_settings({"output_buffer_size": -1}, LIMITS)
    assert (settings.output_buffer_size, settings.output_buffer_timeout) == (1, 0)


@pytest.mark.parametrize(
    ("data", "sentence"),
    [
        ({"heartbeat_interval": 999}, "IDENTIFY heartbeat interval (999) is invalid"),
        ({"heartbeat_interval": 60_001}, "IDENTIFY heartbeat interval (60001) is invalid"),
        ({"heartbeat_interval": -2}, "IDENTIFY heartbeat interval (-2) is invalid"),
        ({"output_buffer_timeout": 24}, "IDENTIFY output buffer timeout (24) is invalid"),
        ({"output_buffer_timeout": 30_001}, "IDENTIFY output buffer timeout (30001) is invalid"),
        ({"output_buffer_size": 63}, "IDENTIFY output buffer size (63) is invalid"),
        ({"output_buffer_size": 65537}, "IDENTIFY output buffer size (65537) is invalid"),
        ({"sample_rate": -1}, "IDENTIFY sample rate (-1) is invalid"),
        ({"sample_rate": 100}, "IDENTIFY sample rate (100) is invalid"),
        ({"msg_timeout": 999}, "IDENTIFY msg timeout (999) is invalid"),
        ({"msg_timeout": 900_001}, "IDENTIFY msg timeout (900001) is invalid"),
        ({"heartbeat_interval": "5000"}, "IDENTIFY failed to decode JSON body"),
        ({"heartbeat_interval": 5000.0}, "IDENTIFY failed to decode JSON body"),
        ({"heartbeat_interval": True}, "IDENTIFY failed to decode JSON body"),
        ({"client_id": 7}, "IDENTIFY failed to decode JSON body"),
        ({"feature_negotiation": 1}, "IDENTIFY failed to decode JSON body"),
        ({"msg_timeout": 2**31}, "IDENTIFY failed to decode JSON body"),
    ],
)
def test_values_outside_nsqds_ranges_are_refused_with_nsqds_sentence(
    data: dict[str, object], sentence: str
) -> None:
    assert refusal(data) == sentence


def test_heartbeats_cannot_be_disabled_where_silence_is_the_only_liveness_signal() -> None:
    text = refusal({"heartbeat_interval": -1}, allow_no_heartbeats=False)
    assert text == "IDENTIFY heartbeat interval (-1) is invalid"


def test_unknown_keys_and_nulls_are_ignored_as_go_does() -> None:
    settings = identify_settings({"long_id": "x", "msg_timeout": None, "whatever": [1]}, LIMITS)
    assert settings.msg_timeout == LIMITS.msg_timeout


def test_negotiation_answers_tls_snappy_deflate_and_auth_as_a_plain_nsqd() -> None:
    data = {"feature_negotiation": True, "tls_v1": True, "snappy": True, "deflate": True,
            "deflate_level": 9, "sample_rate": 10, "output_buffer_size": 128}  # fmt: skip
    reply, settings = negotiate_identify(data, LIMITS, ServerInfo(version="1.2.1"))
    assert reply == {
        "max_rdy_count": 2500,
        "version": "1.2.1",
        "max_msg_timeout": 900_000,
        "msg_timeout": 60_000,
        "tls_v1": False,
        "deflate": False,
        "deflate_level": 6,  # (nsqd's reply without deflate: its default level, capped)
        "max_deflate_level": 6,
        "snappy": False,
        "sample_rate": 10,
        "auth_required": False,
        "output_buffer_size": 128,
        "output_buffer_timeout": 250,
    }
    assert settings.sample_rate == 10


def test_offered_features_are_answered_true_and_the_deflate_level_is_capped() -> None:
    server = ServerInfo(tls_v1=True, deflate=True, snappy=True, max_deflate_level=4)
    ask = {"feature_negotiation": True, "tls_v1": True, "deflate": True, "deflate_level": 9}
    reply, _ = negotiate_identify(ask, LIMITS, server)
    assert reply is not None
    assert (reply["tls_v1"], reply["deflate"], reply["deflate_level"], reply["snappy"]) == \
        (True, True, 4, False)
    reply, _ = negotiate_identify({"feature_negotiation": True, "snappy": True}, LIMITS, server)
    assert reply is not None
    assert (reply["tls_v1"], reply["snappy"], reply["deflate"]) == (False, True, False)
    with pytest.raises(ProtocolError) as e:
        negotiate_identify({"feature_negotiation": True, "snappy": True, "deflate": True},
                           LIMITS, server)
    assert (e.value.code, e.value.fatal) == ("E_IDENTIFY_FAILED", True)


def test_without_feature_negotiation_the_reply_is_plain_ok() -> None:
    reply, settings = negotiate_identify({"user_agent": "pynsq/0.9"}, LIMITS)
    assert reply is None
    assert settings.user_agent == "pynsq/0.9"


def test_limits_are_read_from_broker_options_in_seconds() -> None:
    class Options:
        max_msg_size, max_body_size, max_rdy_count = 10, 20, 30
        max_req_timeout, msg_timeout, max_msg_timeout = 3600.0, 60.0, 900.0
        client_timeout, max_heartbeat_interval = 60.0, 60.0
        max_output_buffer_size, max_output_buffer_timeout = 65536, 30.0

    limits = Limits.from_options(Options())
    assert (limits.max_rdy_count, limits.max_req_timeout, limits.msg_timeout) == (
        30,
        3_600_000,
        60_000,
    )
