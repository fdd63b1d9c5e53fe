"""Recovery without trusting a checkpoint: torn tails, garbage, flipped bytes, bad headers."""

from __future__ import annotations

import os
import struct

from storage import chunk as chunk_mod
from tests.storage.conftest import chunk_files, drain


def _path(tmp_path, n: int, name: str = "q"):
    return tmp_path / f"{name}.diskqueue.{n:06d}.dat"


def test_a_torn_last_frame_is_cut_off_and_everything_before_it_is_kept(open_queue, tmp_path):
    q = open_queue()
    for i in range(10):
        q.put(b"msg-%d" % i)
    q.close()
    path = _path(tmp_path, 1)
    data = path.read_bytes()
    # A frame whose write stopped halfway: header and half the payload.
    torn = chunk_mod.frame(b"never acknowledged, half written")[:20]
    path.write_bytes(data + torn)
    q = open_queue()
    assert q.stats()["torn_tails"] == 1
    assert q.stats()["corruptions"] == 0
    assert drain(q) == [b"msg-%d" % i for i in range(10)]
    q.put(b"after")
    q.close()
    q = open_queue()
    assert drain(q) == [b"after"]


def test_a_chunk_truncated_mid_frame_keeps_the_complete_frames(open_queue, tmp_path):
    q = open_queue()
    q.put_many([b"a" * 50, b"b" * 50])
    q.put(b"c" * 50)
    q.close()
    path = _path(tmp_path, 1)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    q = open_queue()
    assert drain(q) == [b"a" * 50, b"b" * 50]


def test_garbage_appended_to_the_last_chunk_is_reported_and_kept_aside(open_queue, tmp_path):
    q = open_queue()
    for i in range(5):
        q.put(b"m%d" % i)
    q.close()
    path = _path(tmp_path, 1)
    with open(path, "ab") as f:
        f.write(os.urandom(8) + b"\xff" * 5000)
    q = open_queue()
    assert q.stats()["corruptions"] == 1
    assert (tmp_path / f"{path.name}.bad").exists()
    assert drain(q) == [b"m%d" % i for i in range(5)]
    q.put(b"new")
    assert drain(q) == [b"new"]


def test_a_flipped_byte_in_a_sealed_chunk_is_detected_and_reading_goes_on_with_the_next_file(
        open_queue, tmp_path):
    # Given three sealed chunks of 10 messages each and a fourth being written
    q = open_queue(max_bytes_per_file=200)
    msgs = [b"%02d" % i + b"x" * 8 for i in range(35)]
    for m in msgs:
        q.put(m)
    q.close()
    assert len(chunk_files(tmp_path)) >= 3
    # When a byte in the middle of the second chunk is flipped
    path = _path(tmp_path, 2)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))
    # Then every message of the other chunks is read, the damage is counted, get never raises
    q = open_queue(max_bytes_per_file=200)
    per_chunk = q.stats()["chunks"][1]["messages"]
    got = drain(q)
    stats = q.stats()
    assert stats["corruptions"] == 1
    assert stats["lost_to_corruption"] >= 1
    assert (tmp_path / f"{path.name}.bad").exists()
    assert got[:per_chunk] == msgs[:per_chunk]
    assert got[-10:] == msgs[-10:]
    assert set(got) <= set(msgs)
    assert got == sorted(got)
    assert q.depth() == 0


def test_a_flipped_byte_in_the_last_chunk_saves_the_rest_to_a_bad_file(open_queue, tmp_path):
    q = open_queue()
    msgs = [b"%03d" % i + b"y" * 20 for i in range(50)]
    for m in msgs:
        q.put(m)
    q.close()
    path = _path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    frame_size = len(chunk_mod.frame(msgs[0]))
    data[chunk_mod.HEADER_SIZE + 20 * frame_size + 10] ^= 0x01
    path.write_bytes(bytes(data))
    q = open_queue()
    assert q.stats()["corruptions"] == 1
    assert (tmp_path / f"{path.name}.bad").exists()
    assert drain(q) == msgs[:20]


def test_a_chunk_with_a_damaged_header_is_quarantined(open_queue, tmp_path):
    q = open_queue(max_bytes_per_file=200)
    msgs = [b"%02d" % i + b"z" * 8 for i in range(30)]
    for m in msgs:
        q.put(m)
    q.close()
    path = _path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[0:4] = b"JUNK"
    path.write_bytes(bytes(data))
    q = open_queue(max_bytes_per_file=200)
    assert q.stats()["bad_files"] == 1
    assert (tmp_path / f"{path.name}.bad").exists()
    got = drain(q)
    assert got == msgs[len(msgs) - len(got):]
    assert got[-1] == msgs[-1]


def test_an_unsealed_chunk_before_the_last_is_scanned_and_sealed(open_queue, tmp_path):
    # Power loss can leave a full chunk without its sealed header.
    q = open_queue(max_bytes_per_file=200)
    msgs = [b"%02d" % i + b"u" * 8 for i in range(25)]
    for m in msgs:
        q.put(m)
    q.close()
    path = _path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    header = chunk_mod.ChunkHeader.unpack(bytes(data))
    assert header is not None
    assert header.sealed
    data[: chunk_mod.HEADER_SIZE] = chunk_mod.ChunkHeader(1, header.created_ns, False, 0).pack()
    path.write_bytes(bytes(data))
    q = open_queue(max_bytes_per_file=200)
    assert q.depth() == 25
    assert drain(q) == msgs


def test_a_damaged_metadata_file_is_ignored_and_reading_starts_from_the_oldest_chunk(
        open_queue, tmp_path):
    q = open_queue()
    q.put_many([b"a", b"b"])
    q.get()
    q.close()
    (tmp_path / "q.diskqueue.meta.dat").write_bytes(b"{not json")
    q = open_queue()
    assert drain(q) == [b"a", b"b"]  # at-least-once: never lost, may come again


def test_a_damaged_ack_journal_record_only_causes_redelivery(open_queue, tmp_path):
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b", b"c"])
    recs = q.read_many(3)
    q.ack(recs[1][0])
    q.ack(recs[2][0])
    q.close()
    journal = tmp_path / "q.diskqueue.acks.dat"
    raw = bytearray(journal.read_bytes())
    # Two records of one ack each (8-byte head + 8-byte position); corrupt the second's CRC.
    struct.pack_into("<I", raw, 16 + 4, 0xDEADBEEF)
    journal.write_bytes(bytes(raw))
    q = open_queue(ack_mode=True)
    assert q.stats()["corruptions"] == 1
    assert [m for _, m in q.read_many(5)] == [b"a", b"c"]


def test_a_torn_ack_journal_record_is_cut_off(open_queue, tmp_path):
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b", b"c"])
    recs = q.read_many(3)
    q.ack_many([recs[0][0], recs[1][0]])
    q.close()
    journal = tmp_path / "q.diskqueue.acks.dat"
    raw = journal.read_bytes()
    journal.write_bytes(raw + raw[:12])  # a second record cut short
    q = open_queue(ack_mode=True)
    assert q.stats()["corruptions"] == 0
    assert [m for _, m in q.read_many(5)] == [b"c"]


def _no_listing(monkeypatch) -> None:
    def refuse(*_args):
        raise AssertionError("the queue listed the data directory")
    monkeypatch.setattr(os, "listdir", refuse)


def test_a_queue_finds_its_chunks_without_listing_the_directory(open_queue, tmp_path,
                                                                monkeypatch):
    # Given a queue over many small chunks, the oldest consumed (and deleted)
    q = open_queue(max_bytes_per_file=1024, sync_every=1)
    q.put_many([b"m%03d" % i + b"x" * 60 for i in range(200)])
    got = [q.get() for _ in range(120)]
    q.close()
    assert len(chunk_files(tmp_path)) < 20
    # And more chunks written after the metadata last recorded the live range
    q = open_queue(max_bytes_per_file=1024, sync_every=10**9)
    q.put_many([b"n%03d" % i + b"x" * 60 for i in range(50)])
    q.close()
    # When it reopens and the directory may not be listed
    _no_listing(monkeypatch)
    q = open_queue(max_bytes_per_file=1024)
    # Then it finds every chunk still alive, in order
    rest = drain(q)
    assert [m[:4] for m in got + rest] == (
        [b"m%03d" % i for i in range(200)] + [b"n%03d" % i for i in range(50)])


def test_a_new_queue_is_created_without_listing_the_directory(open_queue, monkeypatch):
    _no_listing(monkeypatch)
    q = open_queue("fresh")
    q.put(b"one")
    assert drain(q) == [b"one"]


def test_metadata_without_a_chunk_range_is_read_by_listing_and_then_gets_one(open_queue,
                                                                            tmp_path):
    # Given a queue whose metadata was written by an older build (no chunk range)
    q = open_queue(max_bytes_per_file=1024)
    q.put_many([b"x" * 60 for _ in range(40)])
    q.close()
    meta_path = tmp_path / "q.diskqueue.meta.dat"
    import json

    meta = json.loads(meta_path.read_bytes())
    del meta["chunks"]
    meta_path.write_text(json.dumps(meta))
    # When it is opened, Then every message is there, and the range is recorded again
    q = open_queue(max_bytes_per_file=1024)
    assert len(drain(q)) == 40
    assert "chunks" in json.loads(meta_path.read_bytes())
