"""Broker options (actors.broker.options): nsqd defaults, durations, config file and flags."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from importlib import metadata
from pathlib import Path

import pytest

from actors.broker.options import (
    BrokerOptions,
    OptionsError,
    build_parser,
    default_node_id,
    format_duration,
    load_config,
    parse_duration,
    parse_options,
    to_ns,
)


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return str(path)


# -- defaults ---------------------------------------------------------------------


def test_defaults_equal_nsqds_defaults_on_loopback() -> None:
    o = BrokerOptions()
    assert (o.tcp_address, o.http_address) == ("127.0.0.1:4150", "127.0.0.1:4151")
    assert o.data_path == "data"
    assert o.mem_queue_size == 10000
    assert o.max_bytes_per_file == 104857600
    assert o.sync_every == 2500
    assert o.sync_timeout == 2.0
    assert o.msg_timeout == 60.0
    assert o.max_msg_timeout == 15 * 60.0
    assert o.max_msg_size == 1048576
    assert o.max_body_size == 5242880
    assert o.max_req_timeout == 3600.0
    assert o.max_rdy_count == 2500
    assert o.max_output_buffer_size == 65536
    assert o.max_output_buffer_timeout == 30.0
    assert o.client_timeout == 60.0
    assert o.max_heartbeat_interval == 60.0
    assert o.queue_scan_interval == 0.1
    assert o.queue_scan_refresh_interval == 5.0
    assert o.queue_scan_selection_count == 20
    assert o.queue_scan_worker_pool_max == 4
    assert o.queue_scan_dirty_percent == 0.25
    assert o.log_level == "info"


def test_our_additions_have_documented_defaults() -> None:
    o = BrokerOptions()
    assert o.zmq_address == "tcp://127.0.0.1:4153"
    assert (o.cache_low_watermark, o.cache_high_watermark) == (40, 75)
    assert o.max_attempts == 0
    assert o.dead_letter_topic == ""
    assert o.debug_hooks is False
    assert o.shutdown_timeout > 0
    assert (o.workers, o.node_id, o.broadcast_address) == (None, None, None)


def test_parsing_no_arguments_resolves_machine_dependent_defaults() -> None:
    o = parse_options([])
    assert o.workers == (os.cpu_count() or 1)
    assert o.node_id == default_node_id()
    assert o.broadcast_address == socket.gethostname()
    assert dataclasses.replace(o, workers=None, node_id=None, broadcast_address=None) == (
        BrokerOptions()
    )


def test_default_node_id_follows_nsqd_hash_of_the_hostname() -> None:
    # nsqd: crc32.ChecksumIEEE(md5("localhost")) % 1024 == 16
    assert default_node_id("localhost") == 16
    assert 0 <= default_node_id() < 1024


def test_resolved_keeps_explicit_values() -> None:
    o = BrokerOptions(workers=3, node_id=12, broadcast_address="h").resolved()
    assert (o.workers, o.node_id, o.broadcast_address) == (3, 12, "h")


def test_every_field_documents_itself_in_help() -> None:
    text = build_parser().format_help()
    for f in dataclasses.fields(BrokerOptions):
        assert "--" + f.name.replace("_", "-") in text
        assert f.metadata["help"]
    assert "(default 2s)" in text
    assert "(default 15m)" in text


def test_to_dict_holds_every_option_as_plain_values() -> None:
    d = parse_options(["--sync-timeout", "250ms"]).to_dict()
    assert d["sync_timeout"] == 0.25
    assert set(d) == {f.name for f in dataclasses.fields(BrokerOptions)}
    json.dumps(d)


# -- durations ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("100ms", 0.1), ("2s", 2.0), ("1m30s", 90.0), ("15m", 900.0), ("1h", 3600.0),
        ("1.5h", 5400.0), ("1h2m3s", 3723.0), ("500us", 0.0005), ("10ns", 1e-8), ("0", 0.0),
        ("2.5", 2.5), (" 3 ", 3.0), (7, 7.0), (0.25, 0.25), ("-1s", -1.0),
        ("7d", 604800.0), ("1d12h", 129600.0),  # (days: ours, for --retention-time)
    ],
)  # fmt: skip
def test_go_durations_and_plain_numbers_parse_to_seconds(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "s", "10x", "1m 30s", "ms10", "1w", True, None, "inf", [1]])
def test_malformed_durations_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.1, "100ms"), (2.0, "2s"), (90.0, "1m30s"), (900.0, "15m"), (3600.0, "1h"), (0, "0s")],
)
def test_durations_format_back_in_go_style(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_seconds_convert_to_integer_nanoseconds() -> None:
    assert to_ns(0.1) == 100_000_000
    assert to_ns(60.0) == 60_000_000_000


# -- command line and config file ---------------------------------------------------------


def test_flags_use_nsqd_spellings_and_convert_their_values() -> None:
    o = parse_options(
        ["--mem-queue-size", "0", "--sync-timeout", "1m30s", "--tcp-address", "0.0.0.0:5150",
         "--queue-scan-dirty-percent", "0.5", "--debug-hooks", "--node-id", "7",
         "--log-level", "WARNING"]
    )  # fmt: skip
    assert o.mem_queue_size == 0
    assert o.sync_timeout == 90.0
    assert o.tcp_address == "0.0.0.0:5150"
    assert o.queue_scan_dirty_percent == 0.5
    assert o.debug_hooks is True
    assert o.node_id == 7
    assert o.log_level == "warn"


def test_config_file_accepts_underscore_and_dash_keys(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        'mem_queue_size = 5\n"max-msg-size" = 100\nsync-timeout = "500ms"\n'
        "msg_timeout = 30\ndebug_hooks = true\n",
    )
    o = parse_options(["--config", cfg])
    assert (o.mem_queue_size, o.max_msg_size, o.sync_timeout) == (5, 100, 0.5)
    assert o.msg_timeout == 30.0
    assert o.debug_hooks is True


def test_flags_override_the_config_file_which_overrides_defaults(tmp_path: Path) -> None:
    # Given a config file that sets two options
    cfg = write_config(tmp_path, 'mem_queue_size = 5\ndata_path = "/from/config"\n')
    # When a flag sets one of them again
    o = parse_options(["--mem-queue-size", "9", "--config", cfg])
    # Then the flag wins, the file wins over the default, and the rest are defaults
    assert o.mem_queue_size == 9
    assert o.data_path == "/from/config"
    assert o.sync_every == 2500


def test_a_flag_can_turn_off_a_boolean_set_in_the_config_file(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "debug-hooks = true\n")
    assert parse_options(["--config", cfg, "--no-debug-hooks"]).debug_hooks is False


def test_unknown_config_keys_are_rejected_with_a_suggestion(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "mem_queue_sizes = 5\n")
    with pytest.raises(OptionsError, match=r"unknown option 'mem_queue_sizes'.*mem_queue_size"):
        parse_options(["--config", cfg])


def test_a_key_given_in_both_spellings_is_rejected(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, 'mem_queue_size = 5\n"mem-queue-size" = 6\n')
    with pytest.raises(OptionsError, match="given twice"):
        load_config(cfg)


def test_a_wrongly_typed_config_value_names_the_option(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, 'mem_queue_size = "lots"\n')
    with pytest.raises(OptionsError, match="mem_queue_size must be an integer") as info:
        load_config(cfg)
    assert info.value.option == "mem_queue_size"


def test_a_bad_flag_value_names_the_option() -> None:
    with pytest.raises(OptionsError, match="--mem-queue-size must be an integer, got 'abc'"):
        parse_options(["--mem-queue-size=abc"])
    with pytest.raises(OptionsError, match="--msg-timeout must be a duration"):
        parse_options(["--msg-timeout", "soon"])


def test_a_missing_or_broken_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match="does not exist"):
        parse_options(["--config", str(tmp_path / "nope.toml")])
    with pytest.raises(OptionsError, match="not valid TOML"):
        parse_options(["--config", write_config(tmp_path, "= broken")])


def test_version_prints_and_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_options(["--version"])
    assert info.value.code == 0
    # the package's constant, which is also what setup.cfg gave the installed metadata
    assert capsys.readouterr().out == f"python -m actors.broker {metadata.version('zmqnsq')}\n"


def test_unknown_flags_exit_with_usage() -> None:
    with pytest.raises(SystemExit):
        parse_options(["--no-such-flag"])


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"msg_timeout": 60.0, "max_msg_timeout": 30.0}, "max_msg_timeout"),
        ({"msg_timeout": 0.0}, "msg_timeout"),
        ({"cache_low_watermark": 80.0, "cache_high_watermark": 70.0}, "cache_low_watermark"),
        ({"cache_high_watermark": 101.0}, "cache_high_watermark"),
        ({"cache_low_watermark": -1.0}, "cache_low_watermark"),
        ({"max_msg_size": 0}, "max_msg_size"),
        ({"max_bytes_per_file": -5}, "max_bytes_per_file"),
        ({"sync_every": 0}, "sync_every"),
        ({"mem_queue_size": -1}, "mem_queue_size"),
        ({"max_rdy_count": 0}, "max_rdy_count"),
        ({"sync_timeout": 0.0}, "sync_timeout"),
        ({"max_req_timeout": -1.0}, "max_req_timeout"),
        ({"queue_scan_dirty_percent": 1.5}, "queue_scan_dirty_percent"),
        ({"tcp_address": "localhost"}, "tcp_address"),
        ({"http_address": "host:99999"}, "http_address"),
        ({"tcp_address": "::1:4150"}, "tcp_address"),
        ({"zmq_address": "udp://1.2.3.4:5"}, "zmq_address"),
        ({"zmq_address": "tcp://nohost"}, "zmq_address"),
        ({"node_id": 1024}, "node_id"),
        ({"workers": 0}, "workers"),
        ({"log_level": "loud"}, "log_level"),
        ({"max_attempts": 70000}, "max_attempts"),
        ({"dead_letter_topic": "bad name"}, "dead_letter_topic"),
        ({"data_path": ""}, "data_path"),
    ],
)
def test_invalid_values_raise_an_error_naming_the_option(
    changes: dict[str, object], option: str
) -> None:
    with pytest.raises(OptionsError, match=f"invalid option {option}: ") as info:
        BrokerOptions(**changes)  # type: ignore[arg-type]
    assert info.value.option == option
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("address", [":4150", "0.0.0.0:0", "[::1]:4150", "my-host.example:80"])
def test_valid_host_port_addresses_are_accepted(address: str) -> None:
    assert BrokerOptions(tcp_address=address).tcp_address == address


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:0", "tcp://*:4153", "tcp://127.0.0.1:*", "ipc:///tmp/b.sock",
                 "inproc://broker"],
)  # fmt: skip
def test_valid_zeromq_endpoints_are_accepted(endpoint: str) -> None:
    assert BrokerOptions(zmq_address=endpoint).zmq_address == endpoint


def test_validation_errors_from_the_command_line_name_the_flag_value() -> None:
    with pytest.raises(
        OptionsError, match=r"max_msg_timeout: must be >= msg_timeout \(2m\), got 1m"
    ):
        parse_options(["--msg-timeout", "2m", "--max-msg-timeout", "1m"])


def test_replace_returns_a_validated_copy() -> None:
    o = BrokerOptions()
    assert o.replace(max_attempts=5).max_attempts == 5
    with pytest.raises(OptionsError):
        o.replace(max_attempts=-1)


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BrokerOptions().mem_queue_size = 1  # type: ignore[misc]


# -- dead-letter topic ----------------------------------------------------------------


def test_dead_letter_topic_defaults_to_the_topic_name_plus_dead() -> None:
    o = BrokerOptions(max_attempts=5)
    assert o.dead_letter_topic_for("orders") == "orders.dead"
    assert o.dead_letter_topic_for("tmp#ephemeral") == "tmp.dead#ephemeral"


def test_dead_letter_topic_name_stays_valid_for_long_topic_names() -> None:
    from actors.broker.nsq_message import is_valid_topic_name

    o = BrokerOptions()
    for topic in ("x" * 64, "y" * 54 + "#ephemeral"):
        dead = o.dead_letter_topic_for(topic)
        assert is_valid_topic_name(dead)
        assert dead.endswith((".dead", ".dead#ephemeral"))


def test_an_explicit_dead_letter_topic_is_used_for_every_topic() -> None:
    o = BrokerOptions(dead_letter_topic="graveyard")
    assert o.dead_letter_topic_for("orders") == "graveyard"
