"""Shared helpers for the broker tests: options for a quiet broker on free ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.broker.options import BrokerOptions


def broker_options(data_path: Path | str, **options: Any) -> BrokerOptions:
    """Options for a test broker: a tmp data dir, every listener on a free loopback port."""
    options.setdefault("workers", 1)
    options.setdefault("http_address", "127.0.0.1:0")
    options.setdefault("tcp_address", "127.0.0.1:0")
    options.setdefault("zmq_address", "tcp://127.0.0.1:0")
    options.setdefault("log_level", "warn")
    return BrokerOptions(data_path=str(data_path), **options)
