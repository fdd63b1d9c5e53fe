"""The foreground runtime: SIGTERM/SIGINT shutdown, and the operator CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from actors.runtime import ControlClient, DebugHooksDisabled
from tests.runtime.conftest import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_foreground(run_dir: str, markers: str, *extra: str) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "actors.runtime",
        "--run-dir",
        run_dir,
        "--workers",
        "1",
        "--factory",
        "marker=tests.runtime.helpers:StopMarker",
        "--factory",
        "slowstop=tests.runtime.helpers:SlowStop",
        "--factory",
        "rec=tests.runtime.helpers:Recorder",
        *extra,
    ]
    env = {**os.environ, "ACTORS_TEST_MARKERS": markers, "PYTHONPATH": ROOT}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE)


@pytest.fixture
def control(run_dir: str) -> Iterator[ControlClient]:
    client = ControlClient(run_dir, timeout=20)
    yield client
    client.close()


def ctl(run_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.ctl", "--run-dir", run_dir, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def stop_and_wait(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_stops_every_actor_and_exits_zero(
    run_dir: str, tmp_path, control: ControlClient, sig: int
) -> None:
    # Given a foreground runtime with two actors that write a marker in on_stop
    proc = start_foreground(
        run_dir,
        str(tmp_path),
        "--spawn",
        "marker:a",
        "--spawn",
        "marker:b",
        "--shutdown-timeout",
        "5",
    )
    wait_until(lambda: len(control.actors()) == 2, timeout=20, what="both markers running")
    nodes = [psutil.Process(p.pid) for p in control.ps() if p.pid and p.role != "supervisor"]
    # When it receives the signal
    started = time.monotonic()
    code = stop_and_wait(proc, sig, timeout=10)
    # Then it exits 0 within the shutdown timeout, after on_stop ran everywhere
    assert code == 0
    assert time.monotonic() - started < 5
    assert sorted(os.listdir(tmp_path)) == ["marker_a.stopped", "marker_b.stopped"]
    _, alive = psutil.wait_procs(nodes, timeout=5)
    assert not alive


def test_a_node_that_misses_the_shutdown_deadline_is_killed(
    run_dir: str, tmp_path, control: ControlClient
) -> None:
    proc = start_foreground(
        run_dir, str(tmp_path), "--spawn", "slowstop:x", "--shutdown-timeout", "1"
    )
    wait_until(control.actors, timeout=20, what="slowstop:x running")
    started = time.monotonic()
    assert stop_and_wait(proc, signal.SIGTERM, timeout=10) == 1
    assert time.monotonic() - started < 4


def test_ctl_lists_processes_and_actors_and_refuses_crash_without_debug_hooks(
    run_dir: str, tmp_path, control: ControlClient
) -> None:
    proc = start_foreground(run_dir, str(tmp_path), "--spawn", "rec:one")
    try:
        wait_until(control.actors, timeout=20, what="rec:one running")
        ps = ctl(run_dir, "ps")
        assert ps.returncode == 0
        assert "worker-0" in ps.stdout
        assert "gateway" in ps.stdout
        actors = ctl(run_dir, "actors")
        assert "rec:one" in actors.stdout
        refused = ctl(run_dir, "crash", "rec:one")
        assert refused.returncode == 2
        assert "debug hook" in refused.stderr
        with pytest.raises(DebugHooksDisabled):
            control.crash("rec:one")
        assert [a.restarts for a in control.actors()] == [0]
    finally:
        assert stop_and_wait(proc, signal.SIGTERM, timeout=10) == 0


def test_ctl_crash_restarts_an_actor_when_debug_hooks_are_on(
    run_dir: str, tmp_path, control: ControlClient
) -> None:
    proc = start_foreground(run_dir, str(tmp_path), "--spawn", "rec:one", "--debug-hooks")
    try:
        wait_until(control.actors, timeout=20, what="rec:one running")
        result = ctl(run_dir, "crash", "rec:one")
        assert result.returncode == 0, result.stderr
        wait_until(lambda: control.actors()[0].restarts == 1, what="rec:one restarted")
    finally:
        assert stop_and_wait(proc, signal.SIGTERM, timeout=10) == 0
