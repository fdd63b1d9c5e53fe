"""A pytest plugin that hands a test a broker of its own (registered as ``zmqnsq``
through the ``pytest11`` entry point: ``pip install zmqnsq`` is all a suite needs).

Fixtures (docs/TESTING.md):

* ``zmqnsq_broker``: a broker for the test: a fresh data directory, free loopback
  ports, stopped after the test with every process reaped;
* ``zmqnsq_broker_factory``: ``zmqnsq_broker_factory(mem_queue_size=0, ...)``
  starts another one with those options (any ``BrokerOptions`` field), stopped
  after the test;
* :func:`broker_fixture` makes a fixture of another scope or with other options,
  as pytest-redis's ``factories.redis_proc``::

      from actors.pytest_plugin import broker_fixture
      durable_broker = broker_fixture(scope="session", mem_queue_size=0)

Each yields a :class:`TestBroker`: ``tcp_address``, ``http_address``,
``zmq_address``, ``data_path``, a ready ``producer`` (ZeroMQ) and ``stats()``.
The brokers' processes log to the test's captured output (warnings and up by
default; ``log_level="info"`` for more), which pytest shows with a failure.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["TestBroker", "broker_fixture"]


class TestBroker:
    """A running broker started for a test; see the module docstring."""

    __test__ = False  # (not a test class, whatever its name)

    def __init__(self, data_path: str, **options: Any) -> None:
        # (imported here: every pytest run where the package is installed loads this
        # module, and the broker's imports take about half a second)
        from actors.broker.broker import Broker  # noqa: PLC0415
        from actors.broker.options import BrokerOptions  # noqa: PLC0415

        _start_forkserver()

        options.setdefault("workers", 1)
        options.setdefault("log_level", "warn")
        for key in ("http_address", "tcp_address"):
            options.setdefault(key, "127.0.0.1:0")
        options.setdefault("zmq_address", "tcp://127.0.0.1:0")
        self.options = BrokerOptions(data_path=data_path, **options)
        self.data_path = data_path
        self.broker = Broker(self.options).start()
        self._producer: Any = None

    @property
    def tcp_address(self) -> str:
        """NSQ TCP ``127.0.0.1:<port>`` (pynsq, go-nsq, nsqjs, ``zmqnsq``)."""
        return self.broker.tcp_address

    @property
    def http_address(self) -> str:
        """nsqd's HTTP API, ``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.broker.http_port}"

    @property
    def zmq_address(self) -> str:
        """The ZeroMQ endpoint, ``tcp://127.0.0.1:<port>`` (``transport.client``)."""
        return self.broker.zmq_endpoint

    @property
    def producer(self) -> Any:
        """A ``transport.client.Producer`` on this broker (made on first use, closed with it)."""
        if self._producer is None:
            from transport.client import Producer  # noqa: PLC0415 - pyzmq only if used

            self._producer = Producer(self.zmq_address)
        return self._producer

    def stats(self, topic: str | None = None) -> dict[str, Any]:
        """``/stats?format=json`` (only `topic`'s with one)."""
        query = f"&topic={topic}" if topic else ""
        with urllib.request.urlopen(
                f"http://{self.http_address}/stats?format=json{query}", timeout=10) as r:
            return json.load(r)

    def pids(self) -> list[int]:
        """The pids of the broker's processes."""
        return [p.pid for p in self.broker.supervisor.ps() if p.pid]

    def stop(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        self.broker.stop()


def _start_forkserver() -> None:
    """The brokers of the session are forked from one server that has imported their
    code, and pytest: the ``pytest`` command's script, which each node runs again as
    ``__mp_main__``, imports it (actors.runtime.forkserver).  Returns at once."""
    from actors.broker.nodes import NODE_MODULES  # noqa: PLC0415
    from actors.runtime import forkserver  # noqa: PLC0415

    forkserver.start((*NODE_MODULES, "pytest"))


_BROKER_FIXTURES: set[Any] = set()
"""The functions of the fixtures that start brokers (``broker_fixture`` adds its own)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    # A session that will start a broker starts the fork server now, so that its
    # imports (half a second) run while the first tests do, not in the first broker's.
    for item in session.items:
        info = getattr(item, "_fixtureinfo", None)
        defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
        if any(d.func in _BROKER_FIXTURES for chain in defs.values() for d in chain):
            _start_forkserver()
            return


def _start(tmp_path_factory: Any, options: dict[str, Any]) -> TestBroker:
    return TestBroker(str(tmp_path_factory.mktemp("zmqnsq") / "data"), **options)


def broker_fixture(scope: str = "function", **options: Any) -> Callable[..., Any]:
    """A fixture of `scope` that yields a :class:`TestBroker` started with `options`."""

    def fixture(tmp_path_factory: Any) -> Iterator[TestBroker]:
        broker = _start(tmp_path_factory, options)
        try:
            yield broker
        finally:
            broker.stop()

    _BROKER_FIXTURES.add(fixture)
    return pytest.fixture(scope=scope)(fixture)


zmqnsq_broker = broker_fixture()


def zmqnsq_broker_factory(tmp_path_factory: Any) -> Iterator[Callable[..., TestBroker]]:
    """``zmqnsq_broker_factory(**options)``: another broker, stopped after the test."""
    started: list[TestBroker] = []

    def make(**options: Any) -> TestBroker:
        broker = _start(tmp_path_factory, options)
        started.append(broker)
        return broker

    yield make
    for broker in reversed(started):
        broker.stop()


_BROKER_FIXTURES.add(zmqnsq_broker_factory)
zmqnsq_broker_factory = pytest.fixture(zmqnsq_broker_factory)
