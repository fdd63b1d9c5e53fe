"""The lookup daemon's options: nsqlookupd's flags and defaults, a TOML config file
under the flags, and a clear sentence for a bad value."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from actors.lookupd.options import LookupdOptions, parse_options
from actors.runtime.flags import OptionsError

pytestmark = pytest.mark.timeout(30)


def test_the_defaults_are_nsqlookupds_on_loopback() -> None:
    o = parse_options([])
    assert (o.tcp_address, o.http_address) == ("127.0.0.1:4160", "127.0.0.1:4161")
    assert (o.inactive_producer_timeout, o.tombstone_lifetime) == (300.0, 45.0)
    assert o.broadcast_address == socket.gethostname()
    assert o.log_level == "info"


def test_a_config_file_is_read_and_flags_win(tmp_path) -> None:
    config = tmp_path / "lookupd.toml"
    config.write_text('tcp-address = "127.0.0.1:5160"\ntombstone_lifetime = "10s"\n'
                      'broadcast_address = "lookup-1"\n')
    o = parse_options(["--config", str(config), "--tombstone-lifetime", "1m"])
    assert (o.tcp_address, o.tombstone_lifetime, o.broadcast_address) == \
        ("127.0.0.1:5160", 60.0, "lookup-1")


@pytest.mark.parametrize(("argv", "sentence"), [
    (["--tcp-address", "4160"], 'invalid option tcp_address: expected "<host>:<port>"'),
    (["--inactive-producer-timeout", "0"], "inactive_producer_timeout: must be a positive"),
    (["--log-level", "loud"], "log_level: must be one of debug, info, warn, error, fatal"),
    (["--tombstone-lifetime", "soon"], "--tombstone-lifetime must be a duration"),
])
def test_a_bad_value_is_named_in_a_sentence(argv: list[str], sentence: str) -> None:
    with pytest.raises(OptionsError, match=sentence.replace("(", r"\(")):
        parse_options(argv)


def test_an_empty_broadcast_address_is_refused() -> None:
    with pytest.raises(OptionsError, match="broadcast_address"):
        LookupdOptions(broadcast_address="")


def test_version_and_help_answer_and_exit_0() -> None:
    for flag in ("--version", "--help"):
        done = subprocess.run([sys.executable, "-m", "actors.lookupd", flag],
                              capture_output=True, text=True, timeout=20, check=False)
        assert done.returncode == 0
        assert "lookupd" in done.stdout
