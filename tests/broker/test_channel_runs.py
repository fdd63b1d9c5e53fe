"""The channel actor runs one delivery pass per run of frequent messages: driven directly."""

from __future__ import annotations

from typing import Any

import pytest

from actors.broker.channel import ChannelActor
from actors.broker.client import ClientActor, ClientFin, ClientReq
from actors.broker.messages import ChannelPut, Deliver, Fin, Rdy, Req, Sub
from actors.broker.nsq_message import GuidFactory
from tests.broker.conftest import broker_options

pytestmark = pytest.mark.timeout(10)

NOW = 1_700_000_000_000_000_000


def stubbed(actor: Any) -> list[tuple[str, Any]]:
    sent: list[tuple[str, Any]] = []
    actor.tell = lambda name, message: sent.append((name, message))
    actor.tell_many = lambda name, messages: sent.extend((name, m) for m in messages)
    return sent


def test_a_run_of_puts_and_fins_costs_one_delivery_per_client(tmp_path):
    channel = ChannelActor("channel:t/c", broker_options(tmp_path / "data"), clock=lambda: NOW)
    sent = stubbed(channel)
    channel.on_receive(Sub("client:a", 60_000))
    messages = GuidFactory(1).encode_batch(NOW, [b"1", b"2", b"3", b"4"])
    # Given a run with a RDY and three puts
    channel.on_receive(Rdy("client:a", 10))
    for m in messages[:3]:
        channel.on_receive(ChannelPut([m]))
    assert not [m for _, m in sent if isinstance(m, Deliver)]  # (the pass waits)
    # When the run ends, Then the client gets the three in one Deliver
    channel.on_batch_end()
    (deliver,) = [m for _, m in sent if isinstance(m, Deliver)]
    assert deliver.messages == messages[:3]
    # And a later run of two FINs and a put also ends in one Deliver
    sent.clear()
    channel.on_receive(Fin("client:a", [messages[0][10:26]]))
    channel.on_receive(Fin("client:a", [messages[1][10:26]]))
    channel.on_receive(ChannelPut([messages[3]]))
    channel.on_batch_end()
    assert [m.messages for _, m in sent if isinstance(m, Deliver)] == [[messages[3]]]
    assert channel.state.clients["client:a"].in_flight == 2


def test_another_message_sees_the_pass_of_what_came_before_it(tmp_path):
    channel = ChannelActor("channel:t/c", broker_options(tmp_path / "data"), clock=lambda: NOW)
    sent = stubbed(channel)
    channel.on_receive(Sub("client:a", 60_000))
    (m,) = GuidFactory(1).encode_batch(NOW, [b"1"])
    channel.on_receive(Rdy("client:a", 1))
    channel.on_receive(ChannelPut([m]))
    # When a REQ (not a frequent message) follows in the same run
    channel.on_receive(Req("client:a", m[10:26], 0))
    # Then the message had been delivered first, so the REQ found it in flight (no error)
    # and put it back, and the pass after the REQ delivered it again
    assert not [x for _, x in sent if type(x).__name__ == "ClientError"]
    deliveries = [x.messages for _, x in sent if isinstance(x, Deliver)]
    assert len(deliveries) == 2
    assert [d[0][10:] for d in deliveries] == [m[10:], m[10:]]


def test_a_client_actor_tells_its_channel_the_fins_of_a_run_as_one(tmp_path):
    client = ClientActor("client:c", broker_options(tmp_path / "data"))
    sent = stubbed(client)
    client.channel = "channel:t/c"
    client.on_receive(ClientFin([b"a" * 16]))
    client.on_receive(ClientFin([b"b" * 16, b"c" * 16]))
    assert sent == []
    client.on_batch_end()
    assert sent == [("channel:t/c", Fin("client:c", [b"a" * 16, b"b" * 16, b"c" * 16]))]
    # And a REQ after a FIN reaches the channel after it
    sent.clear()
    client.on_receive(ClientFin([b"d" * 16]))
    client.on_receive(ClientReq(b"e" * 16, 0))
    assert sent == [("channel:t/c", Fin("client:c", [b"d" * 16])),
                    ("channel:t/c", Req("client:c", b"e" * 16, 0))]
