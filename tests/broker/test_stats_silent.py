"""/stats of a broker whose worker stops answering between listing its topics and
giving their stats: that worker is named silent and its topics left out, not a 500."""

from __future__ import annotations

import pytest

from actors.broker import gateway
from actors.broker.gateway import GatewayFacade
from actors.runtime import AskTimeout
from actors.runtime.placement import Placement
from tests.broker.conftest import broker_options

pytestmark = pytest.mark.timeout(10)


class Endpoint:
    """Both workers list their topics; then worker-1 answers no stats ask."""

    def __init__(self, on: dict[str, list[str]]) -> None:
        self.on = on

    def ask_nodes(self, asks, timeout):
        return [[{"name": f"topic:{t}"} for t in self.on[node]] for node, _ in asks]

    def ask_many(self, asks, timeout):
        return [AskTimeout("no reply") if name.removeprefix("topic:") in self.on["worker-1"]
                else {"topic_name": name.removeprefix("topic:"), "channels": []}
                for name, _ in asks]


def test_a_worker_silent_after_listing_its_topics_is_named_and_left_out(tmp_path, monkeypatch):
    placement = Placement(2)
    on: dict[str, list[str]] = {"worker-0": [], "worker-1": []}
    for i in range(40):
        on[placement.node_for(f"topic:t{i}")].append(f"t{i}")
    monkeypatch.setattr(gateway, "current_endpoint", lambda: Endpoint(on))
    facade = GatewayFacade(broker_options(tmp_path / "data", workers=2))
    topics, silent = facade.topics(None, None, include_clients=False)
    assert silent == ["worker-1"]
    assert sorted(t["topic_name"] for t in topics) == sorted(on["worker-0"])
