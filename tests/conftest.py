"""Suite-wide fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from actors.broker.nodes import NODE_MODULES as BROKER_MODULES
from actors.lookupd.nodes import NODE_MODULES as LOOKUPD_MODULES
from actors.runtime import forkserver


def pytest_configure(config: pytest.Config) -> None:
    # Every broker and lookup daemon of the run is forked from one fork server that
    # imported both once (actors.runtime.forkserver): started here, before any test,
    # so it has both preloads and is in every leak check's baseline.
    # (pytest too: the ``pytest`` command's script, which every node runs again as
    # ``__mp_main__``, imports it)
    forkserver.start((*BROKER_MODULES, *LOOKUPD_MODULES, "pytest"))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The one SparkSession of the run (local[2], UI off), shared by every Spark test."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = (SparkSession.builder.master("local[2]").appName("zmqnsq-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "1g")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
