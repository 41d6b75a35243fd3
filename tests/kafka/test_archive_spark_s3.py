"""Spark reads an S3 archive over ``s3a://`` as the README says: its "Spark over S3" snippet
runs verbatim, in a fresh Python process (``spark.jars`` is read when the JVM starts), against
moto's S3 server on loopback (path-style, dummy credentials) with only the jars the project
fetches -- ``hadoop-aws`` at PySpark's Hadoop version and the AWS SDK modules S3A loads, not
the SDK's all-services bundle. Every event is read once although each was received twice and
an hour was compacted (its replaced objects still there for the grace period), ``date`` is a
DATE, ``hour`` an INTEGER and ``event_time`` a timestamp, and the filter by sandbox returns
exactly that sandbox's events. (One Spark JVM for all of it: starting one costs ~40 s of CPU.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
from support import REPO, ci_enabled
from test_archive_readme import blocks, build

from trajbus.archive.maintenance import compact
from trajbus.archive.storage import open_store
from trajbus.infra import s3a
from trajbus.infra.s3a import S3ASetupError, ensure_s3a_jars, s3a_jars, spark_hadoop_version
from trajbus.schemas.models import Event

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def s3a_lib() -> Path:
    """``infra/spark/lib`` (fetched with Maven on first use); skips without PySpark, and
    without Java or Maven unless this is CI."""
    pytest.importorskip("pyspark", reason="pyspark (test extra) not installed")
    try:
        return ensure_s3a_jars()
    except S3ASetupError as exc:
        if ci_enabled():
            pytest.fail(f"cannot fetch the s3a jars, and CI is set: {exc}", pytrace=False)
        pytest.skip(f"cannot fetch the s3a jars: {exc}")


def spark_snippet() -> str:
    (snippet,) = [b for b in blocks("python") if "s3a_jars()" in b]
    return snippet


@pytest.mark.java
def test_the_fetched_jars_are_hadoop_aws_at_sparks_hadoop_without_the_sdk_bundle(
        s3a_lib: Path) -> None:
    names = {jar.name for jar in s3a_lib.glob("*.jar")}
    assert f"hadoop-aws-{spark_hadoop_version()}.jar" in names
    sdk = {n.rsplit("-", 1)[0] for n in names if n.endswith("-2.35.4.jar")}
    assert {"s3", "s3-transfer-manager", "apache-client"} <= sdk
    assert "bundle" not in sdk
    # what Spark ships already is not fetched again: Spark's versions are the only ones
    assert not [n for n in names if n.startswith(("netty-", "httpclient", "httpcore",
                                                  "commons-", "slf4j"))
                and n != "netty-nio-client-2.35.4.jar"]
    assert sum(jar.stat().st_size for jar in s3a_lib.glob("*.jar")) < 30_000_000


@pytest.mark.java
def test_readme_spark_snippet_reads_the_s3_snapshot_over_s3a_each_event_once(
        s3a_lib: Path, s3_server: str, tmp_path: Path) -> None:
    bucket = f"spark-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/trajbus/archive"
    store = open_store(url, s3_server)
    evs: list[Event] = build(store, tmp_path)
    assert compact(store, min_age_ms=0, grace_ms=3_600_000).outputs  # replaced objects remain
    env = {**os.environ, "TRAJBUS_ARCHIVE__URL": url,
           "TRAJBUS_ARCHIVE__S3_ENDPOINT_URL": s3_server,
           "SPARK_LOCAL_IP": "127.0.0.1"}  # the driver binds to loopback only
    # after the snippet: its answers, and a write (with the committer's renames) back over s3a
    script = spark_snippet() + (
        "events.select('sandbox', 'episode', 'seq').write.parquet("
        f"'s3a://{bucket}/spark-copy')\n"
        f"copied = spark.read.parquet('s3a://{bucket}/spark-copy').count()\n"
        "import json\n"
        "keys = events.select('sandbox', 'episode', 'seq').distinct().count()\n"
        "print('RESULT ' + json.dumps({'rows': rows, 'copied': copied, 'keys': keys, "
        "'types': dict(events.dtypes), 'sb': sorted([r.episode, r.seq] for r in sb)}))\n"
        "spark.stop()\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["rows"] == len(evs) == got["copied"] == got["keys"]
    types = got["types"]
    assert (types["date"], types["hour"], types["event_time"]) == ("date", "int", "timestamp")
    assert got["sb"] == sorted([e.header.episode, e.header.seq] for e in evs
                               if e.header.sandbox == "SB")
    assert got["sb"]


def test_a_pyspark_with_another_hadoop_is_refused_before_any_fetch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """hadoop-aws must be the Hadoop that Spark bundles: a mismatch fails at the first s3a://
    call inside the JVM, so ``s3a_jars()`` says so up front, naming both versions."""
    monkeypatch.setattr(s3a, "spark_hadoop_version", lambda: "3.3.4")
    monkeypatch.setattr(s3a, "ensure_s3a_jars", lambda *a, **k: pytest.fail("fetched"))
    with pytest.raises(S3ASetupError, match=r"bundles Hadoop 3\.3\.4.*pins hadoop-aws 3\.5\.0"):
        s3a_jars()
