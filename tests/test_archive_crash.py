"""The archiver killed with SIGKILL between upload and commit: after a restart the archive
holds every event exactly once (read back with DuckDB, not our own reader)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from support import REPO, env_for, make_episodes, produce, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def _archiver(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "trajbus", "archive", "run", *args],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


async def test_sigkill_between_upload_and_commit_loses_and_duplicates_nothing(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings)
    eps = make_episodes(300, seed=11, steps=10)
    items = [(e.sandbox, ev) for e in eps for ev in e.events]
    await produce(settings, Topics(settings).sandbox_events, items)
    archive = tmp_path / "archive"
    env = env_for(settings,
                  TRAJBUS_ARCHIVE__URL=str(archive),
                  TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp_path / "spool"),
                  # small objects: many batches, so the kill lands between two of them
                  TRAJBUS_ARCHIVE__TARGET_OBJECT_BYTES="20000")

    proc = _archiver(env)
    markers = archive / "_batches"
    deadline = time.monotonic() + 90
    # A batch marker exists exactly while a batch is uploaded but not yet committed.
    while not (markers.exists() and any(markers.rglob("*.json"))):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the archiver never uploaded a batch"
        time.sleep(0.005)  # polling a file-system condition at a fine grain
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert any(markers.rglob("*.json")), "killed after the commit: retry the race"

    done = _archiver(env, "--until-idle")
    _, err = done.communicate(timeout=180)
    assert done.returncode == 0, err.decode()[-2000:]

    rows = duckdb.sql(
        f"SELECT event_id, count(*) AS n FROM read_parquet('{archive}/events/**/*.parquet') "
        "GROUP BY event_id").fetchall()
    counts = dict(rows)
    expected = {f"{e.episode}-{i}" for e in eps for i in range(e.n)}
    assert set(counts) == expected, (len(set(counts)), len(expected))
    assert max(counts.values()) == 1, "an event was archived twice"
