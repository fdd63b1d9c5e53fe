"""actors.broker.e2e: nsqd's end-to-end processing latency over a two-half window."""

from __future__ import annotations

import random

import pytest

from actors.broker.e2e import LatencyWindow, result

pytestmark = pytest.mark.timeout(30)

S = 1_000_000_000  # ns


def encoded(published_ns: int) -> bytes:
    return published_ns.to_bytes(8, "big") + b"\x00\x01" + b"0" * 16 + b"body"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * S

    def __call__(self) -> int:
        return self.now


def test_percentiles_of_what_was_finished_in_the_window():
    clock = Clock()
    w = LatencyWindow((0.5, 0.99, 1.0), 600 * S, clock=clock)
    # 100 messages finished 1..100 ms after their publish
    w.add_encoded([encoded(clock.now - ms * 1_000_000) for ms in range(1, 101)])
    r = w.result()
    assert r["count"] == 100
    assert [p["quantile"] for p in r["percentiles"]] == [0.5, 0.99, 1.0]
    assert [p["value"] for p in r["percentiles"]] == [50_000_000, 99_000_000, 100_000_000]


def test_the_older_half_goes_when_half_a_window_passes_and_all_after_an_idle_window():
    clock = Clock()
    w = LatencyWindow((0.5,), 10 * S, clock=clock)
    w.add_encoded([encoded(clock.now - 1_000)] * 3)  # 1 us, in the first half
    clock.now += 6 * S  # half a window later: a new half; the first still counts
    w.add_encoded([encoded(clock.now - 2_000)])
    assert w.result()["count"] == 4
    clock.now += 5 * S  # another half: the first half is dropped
    assert w.result() == {"count": 1, "percentiles": [{"quantile": 0.5, "value": 2_000}]}
    clock.now += 60 * S  # idle for longer than a window: nothing left
    assert w.result() == {"count": 0, "percentiles": [{"quantile": 0.5, "value": 0}]}


def test_a_sample_stands_for_the_observations_it_replaced():
    clock = Clock()
    w = LatencyWindow((0.5, 0.9), 600 * S, clock=clock, rng=random.Random(7), samples=500)
    # 90,000 fast messages (1 ms) and 10,000 slow ones (1 s), shuffled
    lat = [1_000_000] * 90_000 + [S] * 10_000
    random.Random(3).shuffle(lat)
    w.add_encoded([encoded(clock.now - x) for x in lat])
    r = w.result()
    assert r["count"] == 100_000
    p50, p90 = (p["value"] for p in r["percentiles"])
    assert p50 == 1_000_000
    assert p90 in (1_000_000, S)  # the boundary itself, within the sample's error
    p95 = result((0.95,), *w.weighted())["percentiles"][0]["value"]
    assert p95 == S


def test_merging_weights_each_channel_by_what_it_saw():
    clock = Clock()
    busy = LatencyWindow((0.5,), 600 * S, clock=clock, samples=10)
    quiet = LatencyWindow((0.5,), 600 * S, clock=clock, samples=10)
    busy.add_encoded([encoded(clock.now - 1_000)] * 1_000)  # 1,000 at 1 us (10 samples)
    quiet.add_encoded([encoded(clock.now - S)] * 10)  # 10 at 1 s (10 samples)
    n1, s1 = busy.weighted()
    n2, s2 = quiet.weighted()
    merged = result((0.5, 0.999), n1 + n2, s1 + s2)
    assert merged["count"] == 1_010
    assert [p["value"] for p in merged["percentiles"]] == [1_000, S]
