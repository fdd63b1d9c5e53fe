"""The Spark example pipeline runs end to end (on the shared local[2] session) and checks itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.spark.conftest import start_broker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark" / "pipeline.py"


@pytest.mark.timeout(240)
def test_iso3166_pipeline_delivers_every_row(spark, tmp_path):
    spec = importlib.util.spec_from_file_location("spark_pipeline_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    broker = start_broker(tmp_path)
    try:
        report = example.run(spark, broker.zmq_endpoint, str(tmp_path / "out"), idle_timeout=3)
    finally:
        broker.stop()
    print(report)
    assert report["source_rows"] > 5000  # the real ISO 3166-2 list, not a stub
    assert report["published"] == report["source_rows"]
    assert report["missing"] == 0
    assert report["unexpected"] == 0
    assert report["bad_messages"] == 0
    assert report["delivered"] >= report["source_rows"]
    assert report["most_subdivisions"][0][1] > 100
