"""Spark reads the archive as the README says -- the files of a snapshot, with the area's
directory as ``basePath`` -- and gets one row per event, ``date`` as DATE and ``hour`` as
INTEGER, ``event_time`` as a timestamp, although every event was received twice and an
hour was compacted (its replaced objects still there for the grace period)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_archive_store import fleet, records, shell_for

from trajbus.archive.maintenance import compact
from trajbus.archive.snapshot import snapshot
from trajbus.archive.storage import LocalStore

pytestmark = [pytest.mark.timeout(300), pytest.mark.java]


def test_spark_reads_each_event_once_with_the_documented_types(tmp_path: Path) -> None:
    pyspark_sql = pytest.importorskip("pyspark.sql", reason="pyspark (test extra) not installed")
    store = LocalStore(tmp_path / "archive")
    events = fleet(sandboxes=4, episodes=2)
    sh = shell_for(store, tmp_path, target_object_bytes=3_000)
    step = sh.process(records(events + events))
    sh.committed(step.batches + sh.flush_all().batches)
    assert compact(store, min_age_ms=0, grace_ms=3_600_000).outputs
    snap = snapshot(str(store.root))

    spark = (pyspark_sql.SparkSession.builder.master("local[1]").appName("trajbus-archive")
             .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    try:
        df = spark.read.option("basePath", snap.base).parquet(*snap.files)
        types = dict(df.dtypes)
        assert (types["date"], types["hour"], types["event_time"]) == ("date", "int",
                                                                      "timestamp")
        assert df.count() == len(events)
        assert df.select("sandbox", "episode", "seq").distinct().count() == len(events)
    finally:
        spark.stop()
