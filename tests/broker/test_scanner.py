"""The scanner's rounds: selection, pool, and the dirty-percent loop (pure)."""

from __future__ import annotations

import random

from actors.broker.scanner import ScanRound, pool_size


def test_the_pool_is_a_quarter_of_the_channels_between_one_and_the_maximum():
    assert pool_size(0, 4) == 1
    assert pool_size(3, 4) == 1
    assert pool_size(8, 4) == 2
    assert pool_size(100, 4) == 4


def test_a_round_picks_at_most_the_selection_count_of_random_channels():
    channels = [f"t/c{i}" for i in range(50)]
    r = ScanRound(channels, selection_count=20, pool_max=4, rng=random.Random(3))
    sent = []
    while not r.finished:
        batch = r.next_to_send()
        assert len(r.outstanding) <= 4
        sent.extend(batch)
        for c in batch:
            r.done(c, dirty=False)
    assert len(sent) == 20
    assert len(set(sent)) == 20
    assert set(sent) <= set(channels)


def test_a_round_keeps_only_the_pool_size_of_scans_outstanding():
    r = ScanRound([f"c{i}" for i in range(40)], selection_count=20, pool_max=4,
                  rng=random.Random(1))
    first = r.next_to_send()
    assert len(first) == 4
    assert r.next_to_send() == []
    r.done(first[0], dirty=True)
    assert len(r.next_to_send()) == 1


def test_a_round_with_more_than_the_dirty_percent_loops_again():
    r = ScanRound(["a", "b", "c", "d"], selection_count=20, pool_max=4, rng=random.Random(1))
    while not r.finished:
        for c in r.next_to_send():
            r.done(c, dirty=c in {"a", "b"})
    assert r.loop_again(0.25)
    assert not r.loop_again(0.5)


def test_a_channel_that_goes_away_mid_round_is_not_waited_for():
    r = ScanRound(["a", "b"], selection_count=20, pool_max=1, rng=random.Random(1))
    (first,) = r.next_to_send()
    r.forget(first)
    (second,) = r.next_to_send()
    r.done(second, dirty=False)
    assert r.finished
