"""Shared helpers for the broker tests: options for a quiet broker on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.broker.options import BrokerOptions


def broker_options(data_path: Path | str, **options: Any) -> BrokerOptions:
    """Options for a test broker: a tmp data dir, every listener on a free loopback port."""
    options.setdefault("workers", 1)
    options.setdefault("http_address", "127.0.0.1:0")
    options.setdefault("tcp_address", "127.0.0.1:0")
    options.setdefault("zmq_address", "tcp://127.0.0.1:0")
    options.setdefault("log_level", "warn")
    return BrokerOptions(data_path=str(data_path), **options)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA with a server certificate for 127.0.0.1 and client certificates."""
    from tests.broker.tls_kit import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def start(pki, tmp_path) -> Iterator[Any]:
    """start(kind, required, policy, extra=flags): our broker or the real nsqd with TLS."""
    from tests.broker.tls_kit import starter

    stops: list[Any] = []
    yield starter(pki, tmp_path, stops)
    for stop in reversed(stops):
        stop()
