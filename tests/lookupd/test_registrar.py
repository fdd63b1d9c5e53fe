"""The registrar (nsqlookupd's registration database) in-process, with a clock moved by
hand: what brokers announce, what lookups answer, inactivity, tombstones, ephemerals.
The rules are nsqlookupd 1.3's, as seen on the wire (see docs/CLUSTER.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.lookupd.messages import (
    Identified,
    Left,
    Pinged,
    Query,
    Registered,
    Unregistered,
)
from actors.lookupd.options import LookupdOptions
from actors.lookupd.registrar import RegistrarActor
from actors.lookupd.registry import CHANNEL, TOPIC, PeerInfo, Registration, Registry

pytestmark = pytest.mark.timeout(10)

OPTIONS = LookupdOptions(inactive_producer_timeout=300, tombstone_lifetime=45,
                         broadcast_address="lookupd")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def info(peer: str, http_port: int = 4151, **extra: Any) -> dict[str, Any]:
    return {"id": peer, "remote_address": peer, "hostname": f"host-{peer}",
            "broadcast_address": f"b-{peer}", "tcp_port": 4150, "http_port": http_port,
            "version": "1.3.0", "extra": extra}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reg(clock: Clock) -> RegistrarActor:
    return RegistrarActor("registry:lookup", OPTIONS, clock=clock)


def q(reg: RegistrarActor, what: str, topic: str = "", channel: str = "",
      node: str = "") -> Any:
    answer = reg.on_receive(Query(what, topic, channel, node))
    return json.loads(answer) if isinstance(answer, bytes) else answer  # (a /lookup's)


def producers(reg: RegistrarActor, topic: str) -> list[str]:
    found = q(reg, "lookup", topic)
    return sorted(p["remote_address"] for p in found["producers"])


def test_a_registered_topic_and_channel_are_found_with_the_brokers_identity(
        reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1", zmq_port=4153)))
    reg.on_receive(Registered("a:1", "t", "c"))
    assert q(reg, "lookup", "t") == {
        "channels": ["c"],
        "producers": [{"remote_address": "a:1", "hostname": "host-a:1",
                       "broadcast_address": "b-a:1", "tcp_port": 4150, "http_port": 4151,
                       "version": "1.3.0", "zmq_port": 4153}]}
    assert q(reg, "topics") == ["t"]
    assert q(reg, "channels", "t") == ["c"]
    assert q(reg, "lookup", "other") is None


def test_a_register_before_identify_is_ignored(reg: RegistrarActor) -> None:
    reg.on_receive(Registered("a:1", "t"))
    assert q(reg, "topics") == []


def test_unregister_of_a_channel_keeps_the_topic_and_the_channels_name(
        reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t", "c"))
    reg.on_receive(Unregistered("a:1", "t", "c"))
    assert q(reg, "channels", "t") == ["c"]
    assert producers(reg, "t") == ["a:1"]
    assert reg.db.producers(CHANNEL, "t", "c") == []


def test_unregister_of_a_topic_withdraws_its_channels_too_but_keeps_the_names(
        reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t", "c1"))
    reg.on_receive(Registered("a:1", "t", "c2"))
    reg.on_receive(Unregistered("a:1", "t"))
    assert q(reg, "lookup", "t") == {"channels": ["c1", "c2"], "producers": []}
    assert reg.db.producers(CHANNEL, "t", "*") == []


def test_an_ephemeral_name_goes_when_its_last_producer_unregisters_it(
        reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Identified(info("b:2")))
    for peer in ("a:1", "b:2"):
        reg.on_receive(Registered(peer, "t", "tail#ephemeral"))
        reg.on_receive(Registered(peer, "e#ephemeral"))
    reg.on_receive(Unregistered("a:1", "t", "tail#ephemeral"))
    assert q(reg, "channels", "t") == ["tail#ephemeral"]  # b still has it
    reg.on_receive(Unregistered("b:2", "t", "tail#ephemeral"))
    assert q(reg, "channels", "t") == []
    reg.on_receive(Unregistered("a:1", "e#ephemeral"))
    reg.on_receive(Unregistered("b:2", "e#ephemeral"))
    assert q(reg, "topics") == ["t"]


def test_a_broker_that_leaves_is_withdrawn_from_everything_and_the_names_stay(
        reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Identified(info("b:2")))
    reg.on_receive(Registered("a:1", "t", "c"))
    reg.on_receive(Registered("b:2", "t"))
    reg.on_receive(Left("a:1"))
    assert producers(reg, "t") == ["b:2"]
    assert [n["remote_address"] for n in q(reg, "nodes")] == ["b:2"]
    reg.on_receive(Left("b:2"))
    assert q(reg, "lookup", "t") == {"channels": ["c"], "producers": []}


def test_a_silent_broker_is_hidden_until_it_pings_again(reg: RegistrarActor,
                                                        clock: Clock) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t"))
    clock.now += 300
    assert producers(reg, "t") == ["a:1"]  # (at the timeout exactly: still active)
    clock.now += 1
    reg.on_receive(Registered("a:1", "t", "c"))  # a REGISTER is no sign of life
    assert producers(reg, "t") == []
    assert q(reg, "nodes") == []
    reg.on_receive(Pinged("a:1"))
    assert producers(reg, "t") == ["a:1"]


def test_a_tombstone_hides_one_broker_from_one_topic_for_its_lifetime(
        reg: RegistrarActor, clock: Clock) -> None:
    reg.on_receive(Identified(info("a:1", http_port=4151)))
    reg.on_receive(Identified(info("b:2", http_port=4251)))
    for peer in ("a:1", "b:2"):
        reg.on_receive(Registered(peer, "t"))
        reg.on_receive(Registered(peer, "u"))
    # the node is named by broadcast address and HTTP port (not the TCP port)
    q(reg, "tombstone", "t", node="b-a:1:4150")
    assert producers(reg, "t") == ["a:1", "b:2"]
    q(reg, "tombstone", "t", node="b-a:1:4151")
    assert producers(reg, "t") == ["b:2"]
    assert producers(reg, "u") == ["a:1", "b:2"]
    node = next(n for n in q(reg, "nodes") if n["remote_address"] == "a:1")
    assert dict(zip(node["topics"], node["tombstones"], strict=True)) == {"t": True, "u": False}
    # registering again does not lift it; the lifetime does
    reg.on_receive(Registered("a:1", "t"))
    clock.now += 44.9
    assert producers(reg, "t") == ["b:2"]
    clock.now += 0.2
    assert producers(reg, "t") == ["a:1", "b:2"]
    assert q(reg, "debug")["topic:t:"][0]["tombstoned"] is True  # (as nsqlookupd shows it)


def test_unregister_then_register_lifts_a_tombstone(reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t"))
    q(reg, "tombstone", "t", node="b-a:1:4151")
    reg.on_receive(Unregistered("a:1", "t"))
    reg.on_receive(Registered("a:1", "t"))
    assert producers(reg, "t") == ["a:1"]


def test_http_creates_and_deletes_names(reg: RegistrarActor) -> None:
    q(reg, "topic_create", "t")
    q(reg, "channel_create", "u", "c")
    assert q(reg, "topics") == ["t", "u"]
    assert q(reg, "lookup", "u") == {"channels": ["c"], "producers": []}
    assert q(reg, "channel_delete", "u", "c") is True
    assert q(reg, "channel_delete", "u", "c") is False
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t", "c"))
    q(reg, "topic_delete", "t")  # with its channels and their producers
    assert q(reg, "topics") == ["u"]
    assert q(reg, "nodes")[0]["topics"] == []


def test_a_star_is_a_name_not_a_wildcard(reg: RegistrarActor) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t", "c"))
    assert q(reg, "lookup", "*") is None
    assert q(reg, "channels", "*") == []
    q(reg, "topic_delete", "*")
    assert q(reg, "topics") == ["t"]


def test_debug_lists_every_registration_with_producers_as_nsqlookupd_does(
        reg: RegistrarActor, clock: Clock) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t", "c"))
    q(reg, "topic_create", "empty")
    debug = q(reg, "debug")
    assert sorted(debug) == ["channel:t:c", "client::", "topic:t:"]
    entry = debug["topic:t:"][0]
    assert entry["id"] == "a:1"
    assert entry["last_update"] == int(clock.now * 1e9)
    assert (entry["tombstoned"], entry["tombstoned_at"]) == (False, -6795364578871345152)


def test_the_pure_registry_finds_by_wildcard_and_dedupes_producers() -> None:
    db = Registry()
    a = PeerInfo("a:1", "a:1", broadcast_address="a", http_port=1)
    db.add_producer(Registration(CHANNEL, "t", "c1"), a)
    db.add_producer(Registration(CHANNEL, "t", "c2"), a)
    assert db.add_producer(Registration(TOPIC, "t"), a) is True
    assert db.add_producer(Registration(TOPIC, "t"), a) is False
    assert [r.subkey for r in db.find(CHANNEL, "t", "*")] == ["c1", "c2"]
    assert [p.peer.id for p in db.producers(CHANNEL, "t", "*")] == ["a:1"]
    assert db.remove_producer(Registration(TOPIC, "t"), "a:1") == (True, 0)
    assert db.remove_producer(Registration(TOPIC, "t"), "a:1") == (False, 0)
    assert sorted(r.subkey for r in db.remove_peer("a:1")) == ["c1", "c2"]


_OPS = st.lists(st.tuples(
    st.sampled_from(["add_producer", "remove_producer", "add_registration",
                     "remove_registration", "remove_peer"]),
    st.sampled_from([CHANNEL, TOPIC]), st.sampled_from(["t", "u"]),
    st.sampled_from(["", "c", "d"]), st.sampled_from(["a:1", "b:2"])), max_size=60)


@given(_OPS)
def test_the_registrys_indexes_agree_with_a_full_scan(ops: list[tuple[str, ...]]) -> None:
    db = Registry()
    peers = {p: PeerInfo(p, p) for p in ("a:1", "b:2")}
    for op, category, key, subkey, peer in ops:
        reg = Registration(category, key, subkey if category == CHANNEL else "")
        match op:
            case "add_producer":
                db.add_producer(reg, peers[peer])
            case "remove_producer":
                db.remove_producer(reg, peer)
            case "add_registration":
                db.add_registration(reg)
            case "remove_registration":
                db.remove_registration(reg)
            case "remove_peer":
                db.remove_peer(peer)
    entries = dict(db.entries())
    for category in (CHANNEL, TOPIC):
        for key in ("t", "u", "*"):
            assert db.find(category, key, "*") == [r for r in entries
                                                   if r.matches(category, key, "*")]
    for peer in peers:
        assert sorted(db.of_peer(peer), key=repr) == sorted(
            (r for r, ps in entries.items() if any(p.peer.id == peer for p in ps)), key=repr)


def test_a_lookup_answer_is_kept_until_something_it_shows_changes(reg: RegistrarActor,
                                                                   clock: Clock) -> None:
    reg.on_receive(Identified(info("a:1")))
    reg.on_receive(Registered("a:1", "t"))
    first = reg.on_receive(Query("lookup", "t"))
    clock.now += 100
    reg.on_receive(Pinged("a:1"))  # a ping of a live broker changes no answer
    assert reg.on_receive(Query("lookup", "t")) is first  # kept, not encoded again
    # a registration, a channel, a new broker: the next answer shows it
    clock.now += 150
    reg.on_receive(Identified(info("b:2")))
    reg.on_receive(Registered("b:2", "t", "c"))
    assert producers(reg, "t") == ["a:1", "b:2"]
    assert q(reg, "lookup", "t")["channels"] == ["c"]
    # time alone: a's silence past the timeout (it pinged 150 s ago) hides it at once
    clock.now += 150
    assert producers(reg, "t") == ["a:1", "b:2"]
    clock.now += 0.5
    assert producers(reg, "t") == ["b:2"]
