"""kill -9 of a writer at random moments: nothing whose put returned is lost."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from storage import DiskQueue

WRITER = textwrap.dedent("""
    import random, sys
    from storage import DiskQueue
    path, start, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    q = DiskQueue("crash", path, max_bytes_per_file=64 * 1024, sync_every=10**9,
                  sync_timeout=3600)
    out = sys.stdout
    i = start
    while True:
        if rng.random() < 0.5:
            q.put(b"%08d:" % i + b"p" * (i % 97))
            out.write("%d\\n" % i)
            i += 1
        else:
            k = rng.randint(1, 300)
            q.put_many([b"%08d:" % j + b"p" * (j % 97) for j in range(i, i + k)])
            out.write("%d\\n" % (i + k - 1))
            i += k
        out.flush()
""")


def _payload_ok(m: bytes) -> int:
    ident, _, pad = m.partition(b":")
    i = int(ident)
    assert pad == b"p" * (i % 97), f"message {i} altered"
    return i


@pytest.mark.timeout(120)
def test_every_acknowledged_message_survives_kill_9_of_the_writer_in_order(tmp_path):
    seed = int(os.environ.get("CRASH_SEED", "20261122"))
    print(f"crash test seed {seed} (replay with CRASH_SEED={seed})")
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    consumed: list[int] = []
    acknowledged_upto = -1
    next_id = 0
    for round_no in range(6):
        # Given a writer putting as fast as it can
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "q"), str(next_id),
                                 str(seed + round_no)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        # When it is killed after a random number of acknowledged puts
        target = rng.randint(1, 20_000)
        last = acknowledged_upto
        for line in proc.stdout:
            last = int(line)
            if last - next_id >= target:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        acknowledged_upto = max(acknowledged_upto, last)
        # Then every acknowledged message is there, in order and unaltered
        # (checked on a copy, so that checking does not consume)
        check_dir = tmp_path.parent / f"check-{round_no}"
        shutil.copytree(tmp_path / "q", check_dir)
        with DiskQueue("crash", check_dir) as check:
            remaining = []
            while (m := check.get()) is not None:
                remaining.append(_payload_ok(m))
        shutil.rmtree(check_dir)
        assert remaining == sorted(set(remaining)), "out of order or duplicated"
        seen = set(consumed) | set(remaining)
        missing = [i for i in range(acknowledged_upto + 1) if i not in seen]
        assert not missing, f"lost acknowledged messages, e.g. {missing[:5]}"
        next_id = max(seen) + 1
        # And a consumer can take part of them; the rest waits for the next round
        with DiskQueue("crash", tmp_path / "q", max_bytes_per_file=64 * 1024) as q:
            for _ in range(rng.randint(0, len(remaining))):
                m = q.get()
                assert m is not None
                consumed.append(_payload_ok(m))
    assert consumed == sorted(consumed)


@pytest.mark.parametrize("ack_mode", [False, True])
def test_a_sync_makes_a_new_chunk_s_directory_entry_durable_too(open_queue, tmp_path,
                                                                monkeypatch, ack_mode):
    """A power cut keeps a synced file's data but may drop a directory entry that was
    never fsynced: a chunk started by rotation must be in a synced directory before
    `sync` returns, or its acknowledged messages could vanish with the entry."""
    from storage import diskqueue as dq_mod

    seen: list[set[str]] = []  # the directory's files at each directory fsync
    real = dq_mod.fsync_dir

    def spy(path: str) -> None:
        seen.append(set(os.listdir(path)))
        real(path)

    monkeypatch.setattr(dq_mod, "fsync_dir", spy)
    # Given a queue that rotates into its second chunk
    q = open_queue(ack_mode=ack_mode, max_bytes_per_file=300)
    q.sync()
    seen.clear()
    for i in range(30):
        q.put(b"m%04d" % i)
    second = "q.diskqueue.000002.dat"
    assert second in os.listdir(tmp_path)
    # When it syncs (the group commit before an acknowledgement)
    q.sync()
    # Then the directory was fsynced with the new chunk in it
    assert any(second in files for files in seen)
    # And a sync with no new file since does not fsync the directory again
    seen.clear()
    q.sync()
    assert seen == []


def test_a_failed_fsync_is_never_retried_and_the_queue_takes_no_more_writes(
        open_queue, tmp_path, monkeypatch):
    """fsyncgate: after a failed fsync the kernel may have dropped the pages it could not
    write, and a retry can succeed without them; so nothing is acknowledged after it."""
    from storage import DiskFailedError
    from storage import chunk as chunk_mod

    q = open_queue(ack_mode=True)
    q.put(b"synced")
    q.sync()
    calls: list[int] = []

    def eio(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    # Given a disk that fails the next fdatasync
    monkeypatch.setattr(chunk_mod.os, "fdatasync", eio)
    q.put(b"unsynced")
    # When the queue syncs (the group commit before an acknowledgement)
    with pytest.raises(DiskFailedError, match="Input/output error"):
        q.sync()
    # Then it refuses every later write and sync without trying the disk again
    with pytest.raises(DiskFailedError):
        q.put(b"later")
    with pytest.raises(DiskFailedError):
        q.put_many([b"later"])
    with pytest.raises(DiskFailedError):
        q.sync()
    assert len(calls) == 1
    assert "fdatasync" in (q.failed or "")
    # And it still reads what it holds, closes without a clean-close record, and a
    # reopen once the disk is fixed recovers by scanning
    assert [m for _, m in q.read_many(10)] == [b"synced", b"unsynced"]
    monkeypatch.undo()
    q.close()
    assert DiskQueue.closed_depth("q", tmp_path) is None
    q = open_queue(ack_mode=True)
    assert q.failed is None
    assert [m for _, m in q.read_many(10)] == [b"synced", b"unsynced"]


def test_a_data_directory_created_by_the_lock_is_durable_in_its_parent(tmp_path, monkeypatch):
    from storage import meta
    from storage.dirlock import DirLock

    synced: list[str] = []
    real = meta.fsync_dir

    def spy(path: str) -> None:
        synced.append(path)
        real(path)

    monkeypatch.setattr(meta, "fsync_dir", spy)
    lock = DirLock(tmp_path / "a" / "b").acquire()
    lock.release()
    # each new directory's entry was synced into its parent, the topmost first
    assert synced == [str(tmp_path), str(tmp_path / "a")]
