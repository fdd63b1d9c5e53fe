"""/ping's publish health across processes: the latest publish answered anywhere says
whether storage takes writes (actors.broker.health)."""

from __future__ import annotations

import pytest

from actors.broker import health

pytestmark = pytest.mark.timeout(10)

FULL = ("E_PUB_FAILED", "PUB failed: disk full - no space", False)


def test_the_latest_outcome_of_any_process_decides():
    gateway, worker = (5.0, "PUB failed: disk full"), (9.0, None)
    assert health.latest_reason([gateway, worker]) is None  # stored since, on a worker
    assert health.latest_reason([(12.0, "PUB failed: disk full"), worker]) \
        == "PUB failed: disk full"
    assert health.latest_reason([(0.0, None), (0.0, None)]) is None  # nothing published


def test_a_process_records_only_storage_failures_and_successes(monkeypatch):
    monkeypatch.setattr(health, "_last", (0.0, None))
    health.record_publish(FULL)
    when, why = health.last_publish()
    assert when > 0
    assert why == FULL[1]
    health.record_publish(("E_BAD_TOPIC", "PUB topic name is not valid", True))
    assert health.last_publish() == (when, FULL[1])  # the client's fault: health unchanged
    health.record_publish(None)
    assert health.last_publish()[1] is None
    assert health.last_publish()[0] >= when
