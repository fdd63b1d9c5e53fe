"""Chunk cache admission and eviction, driven by an injected memory probe and clock."""

from __future__ import annotations

from storage.cache import ChunkCache, FileView, MapView
from tests.storage.conftest import drain


def _fill_and_reopen(open_queue, n: int = 40, **options):
    q = open_queue(max_bytes_per_file=200, **options)
    msgs = [b"%02d" % i + b"c" * 8 for i in range(n)]
    for m in msgs:
        q.put(m)
    q.close()
    return open_queue(max_bytes_per_file=200, **options), msgs


def test_below_the_low_watermark_chunks_read_are_admitted(open_queue, memory):
    memory.percent = 10
    q, msgs = _fill_and_reopen(open_queue)
    assert drain(q) == msgs
    cache = q.stats()["cache"]
    assert cache["admitted"] >= 3
    assert cache["rejected"] == 0


def test_above_the_high_watermark_nothing_is_admitted_and_reads_still_work(open_queue, memory):
    memory.percent = 90
    q, msgs = _fill_and_reopen(open_queue)
    assert drain(q) == msgs
    cache = q.stats()["cache"]
    assert cache["admitted"] == 0
    assert cache["rejected"] >= 3
    assert cache["cached_chunks"] == []


def test_between_the_watermarks_idle_chunks_are_evicted(open_queue, memory, clock):
    # Given three chunks read (and kept, because nothing is acked) while memory was low
    memory.percent = 10
    q, _ = _fill_and_reopen(open_queue, n=40, ack_mode=True)
    first = q.read_many(25)
    assert len(first) == 25
    cached = q.stats()["cache"]["cached_chunks"]
    assert len(cached) >= 3
    # When memory rises above the low watermark and 5 s pass without reads of those chunks
    memory.percent = 50
    clock.advance(6)
    assert len(q.read_many(100)) == 15
    # Then the chunks idle since then are evicted; the one being read stays
    after = q.stats()
    assert after["cache"]["evicted"] >= 2
    assert not set(cached[:-1]) & set(after["cache"]["cached_chunks"])
    assert after["read_chunk"] in after["cache"]["cached_chunks"]


def test_watermarks_are_options(open_queue, memory):
    memory.percent = 30
    q, msgs = _fill_and_reopen(open_queue, cache_low_watermark=10, cache_high_watermark=20)
    assert drain(q) == msgs
    assert q.stats()["cache"]["admitted"] == 0


def test_the_cache_refuses_inconsistent_watermarks():
    import pytest

    with pytest.raises(ValueError, match="watermarks"):
        ChunkCache(low_watermark=80, high_watermark=50)


def test_a_cache_hit_returns_the_same_mapped_view(tmp_path):
    path = tmp_path / "c.dat"
    path.write_bytes(b"\0" * 64)
    cache = ChunkCache(probe=lambda: 1.0, clock=lambda: 0.0)
    v1 = cache.view(1, str(path))
    v2 = cache.view(1, str(path))
    assert v1 is v2
    assert isinstance(v1, MapView)
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    cache.close()
    full = ChunkCache(probe=lambda: 99.0, clock=lambda: 0.0)
    v3 = full.view(1, str(path))
    assert isinstance(v3, FileView)
    v3.close()
