"""The archiver killed with SIGKILL between upload and commit: after a restart the archive
holds every event exactly once — on a local directory (read back with DuckDB) and on a real S3
endpoint (moto's server on loopback, read back with pyarrow's S3 filesystem), never with our
own reader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import boto3
import duckdb
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest
from support import REPO, env_for, make_episodes, produce, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def _archiver(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "trajbus", "archive", "run", *args],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


@pytest.mark.parametrize("where", ["local", "s3"])
async def test_sigkill_between_upload_and_commit_loses_and_duplicates_nothing(
        kafka_broker, unique_name, tmp_path: Path, where: str,
        request: pytest.FixtureRequest) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings)
    eps = make_episodes(300, seed=11, steps=10)
    items = [(e.sandbox, ev) for e in eps for ev in e.events]
    await produce(settings, Topics(settings).sandbox_events, items)
    archive = tmp_path / "archive"
    url, endpoint = str(archive), ""
    if where == "s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = unique_name.lower().replace("_", "-")[:60].rstrip("-")
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/archive"
    env = env_for(settings,
                  TRAJBUS_ARCHIVE__URL=url,
                  TRAJBUS_ARCHIVE__S3_ENDPOINT_URL=endpoint,
                  TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp_path / "spool"),
                  # small objects: many batches, so the kill lands between two of them
                  TRAJBUS_ARCHIVE__TARGET_OBJECT_BYTES="20000")

    def uploaded_not_committed() -> bool:
        # A batch marker exists exactly while a batch is uploaded but not yet committed.
        if where == "local":
            markers = archive / "_batches"
            return markers.exists() and any(markers.rglob("*.json"))
        listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(
            Bucket=bucket, Prefix="archive/_batches/")
        return listing.get("KeyCount", 0) > 0

    proc = _archiver(env)
    deadline = time.monotonic() + 90
    while not uploaded_not_committed():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the archiver never uploaded a batch"
        time.sleep(0.005)  # polling a storage condition at a fine grain
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert uploaded_not_committed(), "killed after the commit: retry the race"

    done = _archiver(env, "--until-idle")
    _, err = done.communicate(timeout=180)
    assert done.returncode == 0, err.decode()[-2000:]

    if where == "local":
        rows = duckdb.sql(
            f"SELECT event_id, count(*) AS n FROM read_parquet('{archive}/events/**/*.parquet') "
            "GROUP BY event_id").fetchall()
        counts = dict(rows)
    else:
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                               access_key="testing", secret_key="testing")
        table = ds.dataset(f"{bucket}/archive/events", filesystem=fs, format="parquet",
                           partitioning="hive").to_table(columns=["event_id"])
        counts = Counter(table.column("event_id").to_pylist())
    expected = {f"{e.episode}-{i}" for e in eps for i in range(e.n)}
    assert set(counts) == expected, (len(set(counts)), len(expected))
    assert max(counts.values()) == 1, "an event was archived twice"
