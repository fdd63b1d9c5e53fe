"""A broker process for the Spark tests (the shared SparkSession is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import BrokerProcess


def start_broker(tmp: Path) -> BrokerProcess:
    """A broker subprocess with acknowledged publishes on disk (--mem-queue-size=0)."""
    broker = BrokerProcess(tmp / "data", tmp / "broker.log",
                           extra_args=("--msg-timeout", "60s"))
    broker.start()
    return broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    b = start_broker(tmp_path_factory.mktemp("spark-broker"))
    yield b
    b.stop()
