"""Placement: stable names map to nodes; a topic's family is co-located."""

from __future__ import annotations

import zlib

import pytest

from actors.runtime.placement import GATEWAY, Placement, split_name, worker_name


def test_client_actors_live_on_the_gateway() -> None:
    placement = Placement(workers=4)
    assert placement.node_for("client:42") == GATEWAY
    assert placement.node_for("client:abc-def") == GATEWAY


def test_topic_channel_and_diskqueue_of_one_topic_share_a_worker() -> None:
    placement = Placement(workers=7)
    expected = worker_name(zlib.crc32(b"orders") % 7)
    assert placement.node_for("topic:orders") == expected
    assert placement.node_for("channel:orders/archive") == expected
    assert placement.node_for("diskqueue:orders/archive") == expected
    assert placement.node_for("diskqueue:orders") == expected


def test_other_names_are_placed_by_the_whole_name() -> None:
    placement = Placement(workers=5)
    for name in ("stats:1", "lookup", "misc:orders/archive"):
        assert placement.node_for(name) == worker_name(zlib.crc32(name.encode()) % 5)


def test_pinned_kinds_name_their_worker_by_index() -> None:
    placement = Placement(workers=3)
    assert [placement.node_for(f"scanner:{i}") for i in range(4)] == [
        "worker-0", "worker-1", "worker-2", "worker-0"]
    assert placement.node_for("scanner:x") == worker_name(zlib.crc32(b"scanner:x") % 3)


def test_placement_is_identical_across_instances() -> None:
    names = [f"topic:t{i}" for i in range(200)] + [f"other:{i}" for i in range(200)]
    first, second = Placement(workers=3), Placement(workers=3)
    assert [first.node_for(n) for n in names] == [second.node_for(n) for n in names]


def test_topics_spread_over_every_worker() -> None:
    placement = Placement(workers=4)
    used = {placement.node_for(f"topic:t{i}") for i in range(100)}
    assert used == {worker_name(i) for i in range(4)}


def test_a_single_worker_hosts_every_non_client_actor() -> None:
    placement = Placement(workers=1)
    assert {placement.node_for(n) for n in ("topic:a", "channel:b/c", "x")} == {"worker-0"}
    assert placement.nodes == (GATEWAY, "worker-0")


def test_extra_topic_kinds_are_co_located_with_their_topic() -> None:
    placement = Placement(workers=8, topic_kinds={"topic", "deferred"})
    assert placement.node_for("deferred:orders/ch") == placement.node_for("topic:orders")


def test_names_split_into_kind_and_key() -> None:
    assert split_name("channel:orders/archive") == ("channel", "orders/archive")
    assert split_name("plain") == ("", "plain")


def test_negative_workers_are_rejected() -> None:
    with pytest.raises(ValueError, match="workers"):
        Placement(workers=-1)


def test_with_no_workers_every_name_lives_on_the_gateway() -> None:
    placement = Placement(workers=0)
    assert placement.nodes == ("gateway",)
    for name in ("topic:orders", "scanner:0", "registry", "peer:1.2.3.4:5", "client:7"):
        assert placement.node_for(name) == "gateway"


def test_the_placement_remembers_a_bounded_number_of_names() -> None:
    # Client actors and ephemeral channels come and go: 50,000 names seen must not
    # all stay in memory, and forgetting them must not change where a name lives.
    p = Placement(3)
    first = {f"client:{i}": p.node_for(f"client:{i}") for i in range(10)}
    for i in range(50_000):
        p.node_for(f"channel:churn/c{i}#ephemeral")
    assert len(p._cache) <= 16_384
    assert {name: p.node_for(name) for name in first} == first
    assert p.node_for("channel:churn/c1#ephemeral") == p.node_for("topic:churn")
