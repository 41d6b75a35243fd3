"""End to end against a real broker: a simulated fleet whose emitters re-send (duplicates in
the stream, a journal re-send after a restart, a migrated sandbox re-sending from its new host
long after the originals were archived, a conflicting copy), archived by an archiver that is
SIGKILLed between upload and commit and restarted. Every documented read path returns exactly
the acknowledged events, once: DuckDB, Polars and pyarrow over the raw files, ``trajbus archive
sql``, ``trajbus archive episode`` and the reader's episode lookup."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as ds
import pytest
from support import REPO, env_for, make_episodes, produce, settings_for, shuffled_with_duplicates

from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics
from trajbus.schemas.codec import default_codec
from trajbus.schemas.models import ToolCall

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def _trajbus(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajbus", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180, check=False)


def _archiver(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "trajbus", "archive", "run"], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def test_fleet_with_resends_migrations_and_a_crash_archives_each_event_once(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings)
    topic = Topics(settings).sandbox_events
    eps = (make_episodes(120, seed=21, task="web-shop", steps=6)
           + make_episodes(60, seed=22, task="swe", steps=4))
    # acknowledged: every event the producers got an ack for (produce() awaits each ack)
    acked = {(e.sandbox, e.episode, seq) for e in eps for seq in range(e.n)}
    await produce(settings, topic, shuffled_with_duplicates(eps, seed=3, dup_rate=0.15))
    archive = tmp_path / "archive"
    env = env_for(settings, TRAJBUS_ARCHIVE__URL=str(archive),
                  TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp_path / "spool"),
                  TRAJBUS_ARCHIVE__TARGET_OBJECT_BYTES="20000")

    # 1. crash between upload and commit
    proc = _archiver(env)
    deadline = time.monotonic() + 90
    markers = archive / "_batches"
    while not (markers.exists() and any(markers.rglob("*.json"))):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the archiver never wrote a batch"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)

    # 2. the restarted emitters re-send their journals (a third of everything, same bytes)
    rng = random.Random(5)
    resend = [(e.sandbox, ev) for e in eps for ev in e.events if rng.random() < 0.33]
    await produce(settings, topic, resend)
    done = _trajbus(env, "archive", "run", "--until-idle")
    assert done.returncode == 0, done.stderr[-2000:]

    # 3. long after: a migrated sandbox re-sends from its new host (everything of sb-3) and
    # one event comes again with other content (a conflicting copy)
    migrated = [(e.sandbox, ev) for e in eps if e.sandbox == "sb-3" for ev in e.events]
    victim = default_codec().decode(eps[0].events[1]).record
    call = ToolCall.model_validate({**victim, "args_hash": "f" * 64})
    await produce(settings, topic, [*migrated, (eps[0].sandbox, call.encode())])
    done = _trajbus(env, "archive", "run", "--until-idle")
    assert done.returncode == 0, done.stderr[-2000:]

    def exact(counts: Counter[tuple[str, str, int]], what: str) -> None:
        assert set(counts) == acked, f"{what}: {len(set(counts) ^ acked)} events differ"
        assert max(counts.values()) == 1, f"{what}: an event appears twice"

    glob = f"{archive}/events/**/*.parquet"
    exact(Counter(duckdb.sql(f"SELECT sandbox, episode, seq FROM read_parquet('{glob}', "
                             "hive_partitioning=true)").fetchall()), "duckdb")
    exact(Counter(pl.scan_parquet(glob, hive_partitioning=True)
                  .select("sandbox", "episode", "seq").collect().iter_rows()), "polars")
    t = ds.dataset(archive / "events", format="parquet", partitioning="hive").to_table(
        columns=["sandbox", "episode", "seq"])
    exact(Counter(zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True)),
          "pyarrow")
    sql = _trajbus(env, "archive", "sql", "--json", "SELECT sandbox, episode, seq FROM events")
    assert sql.returncode == 0, sql.stderr
    exact(Counter((r["sandbox"], r["episode"], r["seq"])
                  for r in map(json.loads, sql.stdout.splitlines())), "archive sql")
    reader = ArchiveReader(LocalStore(archive))
    via_reader: Counter[tuple[str, str, int]] = Counter()
    for e in eps:
        for seq in reader.episode(e.task, e.sandbox, e.episode)["seq"].to_pylist():
            via_reader[(e.sandbox, e.episode, seq)] += 1
    exact(via_reader, "ArchiveReader.episode")
    for e in eps[:3]:
        out = _trajbus(env, "archive", "episode", "--task", e.task, "--sandbox", e.sandbox,
                       "--episode", e.episode, "--json")
        assert out.returncode == 0, out.stderr
        assert [json.loads(line)["seq"] for line in out.stdout.splitlines()] == list(range(e.n))
    conflicts = duckdb.sql(f"SELECT sandbox, episode, seq, args_hash FROM "
                           f"read_parquet('{archive}/conflicts/**/*.parquet')").fetchall()
    assert conflicts == [(eps[0].sandbox, eps[0].episode, 1, "f" * 64)]
