"""The channel's pure state machine, driven with plain numbers for time."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from actors.broker.channel_state import DELAYED, MIN_SHARE, ROOMY_SHARE, ChannelState
from actors.broker.errors import BrokerError
from actors.broker.nsq_message import (
    FIRST_ATTEMPT,
    GuidFactory,
    attempts_of,
    encode_message,
    message_id,
    next_attempt,
)

SECOND = 1_000_000_000
_guids = GuidFactory(7)


def msgs(n: int, start: int = 0) -> list[bytes]:
    ids = _guids.new_guids(1_000 + start, n)
    return [encode_message(i, 0, FIRST_ATTEMPT, b"body-%d" % (start + k))
            for k, i in enumerate(ids)]


def channel(**kw) -> ChannelState:
    kw.setdefault("mem_queue_size", 100)
    kw.setdefault("durable", True)
    kw.setdefault("rng", random.Random(1))
    return ChannelState(**kw)


def deliver(ch: ChannelState, now: int = 0) -> dict[str, list[bytes]]:
    ch.pump(now)
    return ch.take_effects().deliveries


def test_messages_go_only_to_clients_that_are_ready():
    ch = channel()
    ch.subscribe("a", 60 * SECOND)
    ch.put(msgs(3))
    assert deliver(ch) == {}  # RDY 0: nobody is ready
    ch.set_rdy("a", 2)
    got = deliver(ch)
    assert len(got["a"]) == 2
    assert ch.depth() == 1
    assert len(ch.in_flight) == 2


def test_a_first_delivery_shows_attempts_1():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(1))
    (m,) = deliver(ch)["a"]
    assert attempts_of(m) == 1


def test_ready_clients_share_a_batch_equally_as_runs():
    # Given three clients with a large RDY
    ch = channel(mem_queue_size=10_000, rng=random.Random(42))
    for c in "abc":
        ch.subscribe(c, 60 * SECOND)
        ch.set_rdy(c, 2500)
    sent = msgs(3000)
    ch.put(sent)
    got = deliver(ch)
    # Then each takes a third, as one run of consecutive messages
    assert sorted(len(v) for v in got.values()) == [1000, 1000, 1000]
    for run in got.values():
        start = sent.index(run[0])
        assert run == sent[start : start + 1000]


def ready_clients(n: int, rdy: int, seed: int) -> ChannelState:
    """A channel with `n` clients subscribed, each with RDY `rdy`."""
    ch = channel(mem_queue_size=100_000, rng=random.Random(seed))
    for i in range(n):
        ch.subscribe(f"c{i}", 60 * SECOND)
        ch.set_rdy(f"c{i}", rdy)
    return ch


def test_many_ready_clients_take_runs_of_a_fifth_of_their_rdy_not_slivers():
    # Given 40 clients with room for 2500 each (a drain's sessions) and a read of 4096
    ch = ready_clients(40, 2500, seed=5)
    ch.put(msgs(4096))
    got = deliver(ch)
    # Then it goes out as runs of 500 (a fifth of their RDY), the last taking the 96
    # that would be left too (an even split was 40 runs of 102: a frame and a FIN frame
    # each), to clients picked at random
    assert sorted(len(v) for v in got.values()) == [2500 // ROOMY_SHARE] * 7 + [596]
    # And a read smaller than a fifth of a RDY goes to one client, not as slivers
    ch.put(msgs(300, start=4096))
    assert [len(v) for v in deliver(ch).values()] == [300]
    # And later reads go to others as well: over many, every client gets some
    for k in range(1, 60):
        ch.put(msgs(4096, start=10_000 * k))
        for name, run in deliver(ch).items():
            got.setdefault(name, []).extend(run)
        for name in list(got):  # (each finishes what it got, so it has room again)
            ch.finish(name, [m[10:26] for m in got[name]])
            got[name] = []
    assert len(got) == 40


def test_clients_of_a_small_rdy_still_take_runs_of_at_least_min_share():
    ch = ready_clients(10, 200, seed=7)
    ch.put(msgs(512))
    assert sorted(len(v) for v in deliver(ch).values()) == [MIN_SHARE] * 4


def test_a_client_with_less_room_takes_what_fits_and_the_others_the_rest():
    ch = channel(mem_queue_size=10_000, rng=random.Random(3))
    for c, rdy in (("a", 10), ("b", 2500), ("c", 2500)):
        ch.subscribe(c, 60 * SECOND)
        ch.set_rdy(c, rdy)
    ch.put(msgs(1000))
    counts = {c: len(v) for c, v in deliver(ch).items()}
    assert counts["a"] == 10
    assert counts["b"] + counts["c"] == 990
    assert abs(counts["b"] - counts["c"]) <= 500  # equal shares of what a left


def test_who_gets_a_single_ready_message_is_random():
    # Given two ready clients and messages arriving one at a time
    ch = channel(mem_queue_size=10_000, rng=random.Random(42))
    for c in "ab":
        ch.subscribe(c, 60 * SECOND)
        ch.set_rdy(c, 2500)
    counts: Counter[str] = Counter()
    for i in range(2000):
        ch.put(msgs(1, start=i))
        for c, v in deliver(ch).items():
            counts[c] += len(v)
    # Then each gets about half (a 5-sigma band of a fair coin)
    assert counts["a"] + counts["b"] == 2000
    assert 888 <= counts["a"] <= 1112, counts


def test_a_client_stops_receiving_when_its_in_flight_reaches_rdy():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.subscribe("b", SECOND)
    ch.set_rdy("a", 1)
    ch.set_rdy("b", 5)
    ch.put(msgs(10))
    got = deliver(ch)
    assert len(got["a"]) == 1
    assert len(got["b"]) == 5
    assert ch.depth() == 4


def test_rdy_out_of_range_or_before_sub_is_a_fatal_invalid():
    ch = channel(max_rdy_count=10)
    with pytest.raises(BrokerError) as e:
        ch.set_rdy("nobody", 1)
    assert e.value.code == "E_INVALID"
    ch.subscribe("a", SECOND)
    with pytest.raises(BrokerError) as e:
        ch.set_rdy("a", 11)
    assert e.value.fatal


def test_fin_finishes_and_unknown_ids_are_non_fatal_errors():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 5)
    ch.put(msgs(2))
    m1, _m2 = deliver(ch)["a"]
    errors = ch.finish("a", [message_id(m1), b"0000000000000000"])
    assert len(errors) == 1
    assert errors[0].code == "E_FIN_FAILED"
    assert not errors[0].fatal
    assert len(ch.in_flight) == 1
    # Another client cannot finish a message it does not hold.
    ch.subscribe("b", SECOND)
    assert ch.finish("b", [message_id(_m2)])[0].code == "E_FIN_FAILED"


def test_a_message_whose_timeout_passes_is_requeued_and_counted():
    # Given a message in flight with a 10 s timeout
    ch = channel()
    ch.subscribe("a", 10 * SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(1))
    (m,) = deliver(ch, now=100 * SECOND)["a"]
    # When the scanner processes the channel before and after the deadline
    assert ch.process(109 * SECOND) is False
    assert ch.process(110 * SECOND) is True
    # Then it is back in the queue, counted, and delivered again with attempts 2
    assert ch.stats.timeout_count == 1
    assert ch.clients["a"].in_flight == 0
    (again,) = deliver(ch, now=111 * SECOND)["a"]
    assert message_id(again) == message_id(m)
    assert attempts_of(again) == 2


def test_touch_resets_the_timeout():
    ch = channel()
    ch.subscribe("a", 10 * SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(1))
    (m,) = deliver(ch, now=0)["a"]
    ch.touch("a", message_id(m), now=8 * SECOND)
    assert ch.process(12 * SECOND) is False
    assert ch.process(18 * SECOND) is True


def test_req_without_delay_puts_the_message_at_the_back_of_the_queue():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 1)
    first, second = msgs(2)
    ch.put([first, second])
    (m,) = deliver(ch)["a"]
    ch.requeue("a", message_id(m), 0, now=0)
    (nxt,) = deliver(ch)["a"]
    assert message_id(nxt) == message_id(second)
    assert next(iter(ch.ready))[1][10:26] == message_id(first)
    assert ch.stats.requeue_count == 1


def test_req_with_a_delay_defers_the_message_until_it_is_due():
    ch = channel()
    ch.subscribe("a", 60 * SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(1))
    (m,) = deliver(ch, now=0)["a"]
    ch.requeue("a", message_id(m), 5 * SECOND, now=1 * SECOND)
    fx = ch.take_effects()
    # kept durably with its due time, and the attempts its next delivery shows
    assert fx.delayed_add == [(6 * SECOND, message_id(m), next_attempt(m))]
    assert len(ch.deferred) == 1
    assert deliver(ch, now=2 * SECOND) == {}
    assert ch.process(5 * SECOND) is False
    assert ch.process(6 * SECOND) is True
    (again,) = deliver(ch, now=6 * SECOND)["a"]
    assert attempts_of(again) == 2
    # Finishing it removes it from the delayed store.
    ch.finish("a", [message_id(again)])
    assert ch.take_effects().delayed_remove == [message_id(m)]


def test_req_of_a_disk_message_moves_it_to_the_delayed_store_before_releasing_it():
    ch = channel(mem_queue_size=0)
    ch.subscribe("a", 60 * SECOND)
    ch.put(msgs(1))
    assert ch.take_effects().disk_put
    ch.set_rdy("a", 1)
    ch.pump(0)
    assert ch.take_effects().disk_read > 0
    (m,) = msgs(1)
    ch.from_disk([(12345, m)], 0)
    (d,) = deliver(ch)["a"]
    ch.requeue("a", message_id(d), SECOND, now=0)
    fx = ch.take_effects()
    assert fx.delayed_add[0][1] == message_id(d)
    assert fx.disk_ack == [12345]


def test_req_delay_out_of_range_is_checked_by_the_client_actor_not_here():
    # The state accepts any delay; limits are the client actor's job (tested there).
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(1))
    (m,) = deliver(ch)["a"]
    ch.requeue("a", message_id(m), 10**15, now=0)
    assert len(ch.deferred) == 1


def test_deferred_publish_waits_for_its_due_time():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 10)
    (m,) = msgs(1)
    ch.put_deferred([(m, 50 * SECOND)])
    assert ch.take_effects().delayed_add == [(50 * SECOND, message_id(m), m)]
    assert deliver(ch, now=10 * SECOND) == {}
    ch.process(50 * SECOND)
    assert deliver(ch, now=50 * SECOND)["a"][0][10:26] == message_id(m)


def test_a_message_delivered_max_attempts_times_goes_to_the_dead_letters():
    ch = channel(max_attempts=2)
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(1))
    for _ in range(2):
        (m,) = deliver(ch)["a"]
        ch.requeue("a", message_id(m), 0, now=0)
    ch.pump(0)
    fx = ch.take_effects()
    assert fx.deliveries == {}
    assert [message_id(x) for x in fx.dead_letters] == [message_id(m)]
    assert ch.stats.dead_letter_count == 1
    assert ch.depth() == 0


def test_a_backlog_on_disk_is_read_only_for_a_client_with_room():
    # Given a channel restored with messages on disk and nobody to take them
    ch = channel(mem_queue_size=0)
    ch.restore(3, [])
    ch.pump(0)
    assert ch.take_effects().disk_read == 0  # (nsqd's messagePump reads for a ready client)
    ch.subscribe("a", SECOND)
    ch.pump(0)
    assert ch.take_effects().disk_read == 0  # subscribed, RDY 0
    # When the client says it is ready, Then the disk is read
    ch.set_rdy("a", 1)
    ch.pump(0)
    assert ch.take_effects().disk_read == ch.read_batch


@pytest.mark.parametrize(("rdys", "read"), [((1,), 512), ((100, 100), 512), ((2500,), 2500),
                                            ((2500, 1000, 0), 3500), ((2500,) * 4, 4096)])
def test_a_disk_read_asks_for_what_the_ready_clients_have_room_for(rdys, read):
    # Given a backlog on disk and clients with this much room between them
    ch = channel(mem_queue_size=0, read_batch=512)
    ch.restore(100_000, [])
    for i, rdy in enumerate(rdys):
        ch.subscribe(f"c{i}", SECOND)
        ch.set_rdy(f"c{i}", rdy)
    # Then one read asks for that much, at least read_batch and at most 8 x read_batch
    ch.pump(0)
    assert ch.take_effects().disk_read == read


def test_beyond_the_memory_queue_messages_go_to_disk_and_come_back_in_batches():
    ch = channel(mem_queue_size=2)
    ch.put(msgs(5))
    fx = ch.take_effects()
    assert len(fx.disk_put) == 3
    assert ch.depth() == 5
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 10)
    ch.pump(0)
    first = ch.take_effects()
    assert len(first.deliveries["a"]) == 2
    assert first.disk_read == ch.read_batch  # memory ran dry: ask the disk queue
    ch.pump(0)
    assert ch.take_effects().disk_read == 0  # one read outstanding at a time
    ch.from_disk([(p, m) for p, m in enumerate(fx.disk_put)], 0)
    got = deliver(ch)["a"]
    assert [message_id(m) for m in got] == [message_id(m) for m in fx.disk_put]
    # Finishing disk messages acks their positions.
    ch.finish("a", [message_id(m) for m in got])
    assert ch.take_effects().disk_ack == [0, 1, 2]


def test_an_ephemeral_channel_drops_and_counts_what_does_not_fit_in_memory():
    ch = channel(mem_queue_size=2, durable=False)
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 0)  # (a client that takes nothing now)
    ch.put(msgs(5))
    fx = ch.take_effects()
    assert fx.disk_put == []
    assert fx.dropped == 3
    assert ch.stats.dropped_count == 3
    assert ch.depth() == 2


def test_an_ephemeral_channel_without_memory_hands_its_ready_clients_what_they_can_take():
    # nsqd with --mem-queue-size=0: an ephemeral channel's unbuffered memoryMsgChan
    # gives a message to a client waiting for one, and drops it only if none waits
    ch = channel(mem_queue_size=0, durable=False, max_rdy_count=4)
    # before its first client (whose SUB created it) it keeps up to the largest RDY
    ch.put(msgs(3))
    assert ch.take_effects().dropped == 0
    # and a client just subscribed (its RDY on its way) may take up to the largest RDY
    ch.subscribe("a", SECOND)
    ch.put(msgs(3))
    assert ch.take_effects().dropped == 2
    ch.set_rdy("a", 2)
    assert len(deliver(ch)["a"]) == 2
    ch.put(msgs(1))  # (2 kept in memory, and its client holds 2 of RDY 2: nobody waits)
    assert ch.take_effects().dropped == 1


def test_a_client_that_leaves_has_its_in_flight_messages_requeued_at_once():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.subscribe("b", SECOND)
    ch.set_rdy("a", 3)
    ch.put(msgs(3))
    got = deliver(ch)["a"]
    ch.unsubscribe("a")
    assert len(ch.in_flight) == 0
    assert ch.stats.requeue_count == 3
    ch.set_rdy("b", 3)
    assert [message_id(m) for m in deliver(ch)["b"]] == [message_id(m) for m in got]


def test_pause_stops_delivery_and_unpause_resumes_it():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 5)
    ch.paused = True
    ch.put(msgs(2))
    assert deliver(ch) == {}
    ch.paused = False
    assert len(deliver(ch)["a"]) == 2


def test_empty_drops_queued_and_deferred_messages_and_releases_their_storage():
    ch = channel(mem_queue_size=1)
    ch.put(msgs(1))
    ch.from_disk([(77, msgs(1, start=5)[0])], 0)
    (deferred,) = msgs(1, start=9)
    ch.restore(0, [(10 * SECOND, message_id(deferred), deferred)])
    ch.take_effects()
    ch.empty()
    fx = ch.take_effects()
    assert ch.depth() == 0
    assert len(ch.deferred) == 0
    assert fx.disk_ack == [77]
    assert fx.delayed_remove == [message_id(deferred)]


def test_restored_deferred_messages_keep_their_due_time():
    ch = channel()
    (m,) = msgs(1)
    ch.restore(3, [(42 * SECOND, message_id(m), m)])
    assert ch.depth() == 3
    assert ch.process(41 * SECOND) is False
    assert ch.process(42 * SECOND) is True
    assert list(ch.ready)[-1] == (DELAYED, m)


def test_memory_only_lists_what_a_clean_shutdown_must_write():
    ch = channel()
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 1)
    ch.put(msgs(3))
    ch.from_disk([(5, msgs(1, start=10)[0])], 0)
    deliver(ch)
    assert len(ch.memory_only()) == 3  # 2 queued + 1 in flight; the disk one is durable


def reading_from_disk(depth: int) -> ChannelState:
    """A channel with a ready client, reading its disk queue (`depth` on disk by its count)."""
    ch = channel(mem_queue_size=0)
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 10)
    ch.restore(depth, [])
    ch.pump(0)
    assert ch.take_effects().disk_read
    return ch


def test_writes_sent_behind_a_read_count_in_the_disk_depth_whatever_the_read_brought():
    # Given a channel reading its disk queue, which holds 2 messages by its own count
    ch = reading_from_disk(2)
    # When 3 more are written while the read is on its way, and the read finds nothing
    # (the count of 2 was stale: the queue had reopened and counts 0 unread)
    ch.put(msgs(3))
    assert len(ch.take_effects().disk_put) == 3
    ch.from_disk([], 0)
    # Then the 3 written behind the read are still to be read: nothing strands on disk
    assert ch.disk_depth == 3
    ch.pump(0)
    assert ch.take_effects().disk_read
    # And a read that brings them leaves the queue's own count (0) plus nothing since
    ch.from_disk([(p, m) for p, m in enumerate(msgs(3))], 0)
    assert ch.disk_depth == 0
    assert len(deliver(ch)["a"]) == 3


def test_after_the_disk_queue_reopens_its_copies_of_messages_held_here_are_dropped():
    # Given a channel holding disk messages: two in flight, one deferred, one waiting
    ch = channel(mem_queue_size=0)
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 3)
    m = msgs(4)
    ch.restore(4, [])
    ch.pump(0)
    ch.from_disk([(p, x) for p, x in enumerate(m)], 0)
    sent = deliver(ch)["a"]
    assert [message_id(x) for x in sent] == [message_id(x) for x in m[:3]]
    ch.requeue("a", message_id(m[2]), 60 * SECOND, now=0)
    fx = ch.take_effects()
    assert fx.disk_ack == [2]
    assert fx.delayed_add[0][1] == message_id(m[2])
    # When the disk queue restarts: its un-acked messages are unread again (all four,
    # the ack of position 2 having reached the old life only)
    ch.disk_reopened(4)
    assert len(ch.ready) == 0  # the waiting copy goes: it comes back by the read
    ch.set_rdy("a", 5)
    ch.pump(0)
    assert ch.take_effects().disk_read
    ch.from_disk([(p, x) for p, x in enumerate(m)], 0)
    # Then only the message nobody holds is delivered again; the deferred one's disk
    # copy is acked (the delayed store keeps it), the in-flight ones wait for their FIN
    fx = ch.take_effects()
    assert fx.disk_ack == [2]
    again = deliver(ch)["a"]
    assert [message_id(x) for x in again] == [message_id(m[3])]
    # And a FIN of the in-flight ones acks their positions, in the new life pending again
    assert ch.finish("a", [message_id(m[0]), message_id(m[1])]) == []
    assert ch.take_effects().disk_ack == [0, 1]


def test_a_second_copy_deferred_keeps_one_and_releases_the_other():
    ch = channel(mem_queue_size=0)
    ch.subscribe("a", SECOND)
    ch.set_rdy("a", 1)
    (m,) = msgs(1)
    ch.restore(2, [])
    ch.pump(0)
    ch.from_disk([(5, m)], 1)
    (first,) = deliver(ch)["a"]
    ch.requeue("a", message_id(first), 60 * SECOND, now=0)
    assert ch.take_effects().disk_ack == [5]  # the delayed store has it now
    # The same message again at another place (a topic's queue re-read after a restart
    # fans it out again), delivered and REQed while its first copy is deferred: this
    # raised DuplicateIdError and crashed the channel actor
    ch.pump(0)
    ch.from_disk([(9, m)], 0)
    (second,) = deliver(ch)["a"]
    ch.requeue("a", message_id(second), 60 * SECOND, now=0)
    fx = ch.take_effects()
    assert fx.disk_ack == [9]
    assert not fx.delayed_add  # the deferred copy stays
    assert len(ch.deferred) == 1


def test_messages_handed_out_before_a_restart_come_back_with_one_attempt_more():
    # Given a channel whose disk queue says the first two of a read were handed out
    # before it restarted (a crash: delivered, never FINed)
    ch = reading_from_disk(3)
    ch.from_disk([(p, m) for p, m in enumerate(msgs(3))], 0, again=2)
    got = deliver(ch)["a"]
    # Then their delivery counts that earlier one, and the third is a first attempt
    assert [attempts_of(m) for m in got] == [2, 2, 1]
