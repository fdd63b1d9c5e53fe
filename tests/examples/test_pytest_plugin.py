"""The pytest plugin (#23), tested as pytest plugins are: pytester runs suites that use it
in a pytest of their own (a subprocess, so the plugin loads from its entry point)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytest" / "test_with_a_broker.py"


def test_the_documented_example_passes(pytester):
    shutil.copy(EXAMPLE, pytester.path / EXAMPLE.name)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)


def test_each_test_has_its_own_broker_and_nothing_is_left_behind(pytester, tmp_path):
    record = tmp_path / "seen.jsonl"
    pytester.makepyfile(f"""
        import json

        def _note(b):
            with open({str(record)!r}, "a") as f:
                f.write(json.dumps({{"data": b.data_path, "tcp": b.tcp_address,
                                    "pids": b.pids()}}) + "\\n")

        def test_one(zmqnsq_broker):
            _note(zmqnsq_broker)
            zmqnsq_broker.producer.publish("t", b"x")  # the producer is never closed

        def test_two(zmqnsq_broker):
            _note(zmqnsq_broker)
            assert zmqnsq_broker.stats("t")["topics"] is None  # a fresh broker: no topic t
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2)
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(seen) == 2
    assert seen[0]["data"] != seen[1]["data"]
    assert seen[0]["tcp"] != seen[1]["tcp"]
    pids = [pid for s in seen for pid in s["pids"]]
    assert len(pids) >= 6  # supervisor, gateway, worker, for each
    assert not [pid for pid in pids if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_failing_test_shows_the_brokers_log(pytester):
    pytester.makepyfile("""
        from actors.pytest_plugin import broker_fixture

        chatty = broker_fixture(log_level="info")

        def test_fails(chatty):
            chatty.producer.publish("t", b"x")
            assert False, "the application's bug"
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the application's bug*", "*Captured stderr*",
                                 "*tcp protocol listening on 127.0.0.1:*"])


def test_a_fixture_of_another_scope_is_shared(pytester):
    pytester.makepyfile("""
        from actors.pytest_plugin import broker_fixture

        shared = broker_fixture(scope="module")

        def test_a(shared):
            shared.producer.publish("s", b"1")

        def test_b(shared):
            assert shared.stats("s")["topics"][0]["message_count"] == 1
    """)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q").assert_outcomes(passed=2)


def test_a_session_that_will_start_a_broker_starts_the_fork_server_when_collected(pytester):
    # Given a session whose last test uses a broker (of broker_fixture's making)
    pytester.makepyfile(test_later="""
        from multiprocessing import forkserver
        from actors.pytest_plugin import broker_fixture

        mine = broker_fixture(mem_queue_size=0)

        def test_first():
            # Then the fork server runs (importing the broker) before any broker starts
            assert forkserver._forkserver._forkserver_pid is not None

        def test_last(mine):
            mine.producer.publish("t", b"x")
    """, test_none="""
        from multiprocessing import forkserver

        def test_alone():
            assert forkserver._forkserver._forkserver_pid is None
    """)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q",
                                  "test_later.py").assert_outcomes(passed=2)
    # and a session without one does not start it
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q",
                                  "test_none.py").assert_outcomes(passed=1)
