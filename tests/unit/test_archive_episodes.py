"""Specification of the episode table: one row per (task, sandbox, episode), true across
topics (events and trace chunks travel on different topics) and objects (small objects split
every episode), with completeness complete / truncated / has_gaps (with the gap ranges) /
in_progress — from ``trajbus archive sql`` and as plain Parquet."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_archive_store import T0, shell_for

from trajbus.archive import cli as archive_cli
from trajbus.archive.context import ContextFacts, Cut, SandboxFacts, Terminate
from trajbus.archive.episodes import (
    EPISODES_KEY,
    build_episodes,
    build_episodes_reference,
    gaps_of,
    merge_runs,
)
from trajbus.archive.index import INDEX_SCHEMA
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.archive.synth import episode_events
from trajbus.schemas.models import EpisodeOutcome, Event, TraceChunk

EVENTS, CHUNKS = "p.sandbox.events", "p.trace.chunks"


def routed(events: list[Event]) -> list[Any]:
    """Records as the emitters send them: trace chunks on their own topic."""
    offsets = {EVENTS: 0, CHUNKS: 0}
    out = []
    for e in events:
        topic = CHUNKS if isinstance(e, TraceChunk) else EVENTS
        out.append(SimpleNamespace(topic=topic, partition=0, offset=offsets[topic],
                                   key=e.header.sandbox.encode(), value=e.encode()))
        offsets[topic] += 1
    return out


def scenario() -> list[Event]:
    trace = b"x" * 300  # 5 chunks of 64 bytes: seqs 7..11 on the chunk topic
    ok = episode_events("web", "sb-0", "ok", t0_ms=T0, trace=trace)
    cut = episode_events("web", "sb-1", "cut", t0_ms=T0, trace=trace,
                         outcome=EpisodeOutcome.TRUNCATED)
    gappy = [e for e in episode_events("web", "sb-2", "gappy", t0_ms=T0, trace=trace)
             if e.header.seq not in (3, 4, 9)]
    running = episode_events("web", "sb-3", "running", t0_ms=T0, trace=trace)[:-1]
    late_start = [e for e in episode_events("code", "sb-4", "late", t0_ms=T0, trace=trace)
                  if e.header.seq >= 2]
    return ok + cut + gappy + running + late_start


@pytest.fixture
def archive(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "a")
    sh = shell_for(store, tmp_path, target_object_bytes=1_500)  # many small objects
    step = sh.process(routed(scenario()))
    sh.committed(step.batches + sh.flush_all().batches)
    return store


EXPECTED = {
    # episode: (completeness, event_count, first, last, end, outcome, gaps)
    "ok": ("complete", 13, 0, 12, 12, "TERMINAL", []),
    "cut": ("truncated", 13, 0, 12, 12, "TRUNCATED", []),
    "gappy": ("has_gaps", 10, 0, 12, 12, "TERMINAL", [(3, 4), (9, 9)]),
    "running": ("in_progress", 12, 0, 11, None, None, []),
    "late": ("has_gaps", 11, 2, 12, 12, "TERMINAL", [(0, 1)]),
}


def check(rows: list[dict[str, Any]]) -> None:
    got = {r["episode"]: (r["completeness"], r["event_count"], r["first_seq"], r["last_seq"],
                          r["end_seq"], r["outcome"],
                          [(g["first"], g["last"]) for g in r["gaps"]]) for r in rows}
    assert len(rows) == len(got), "one row per episode"
    assert got == EXPECTED


def test_episodes_view_has_one_true_row_per_episode_across_topics_and_objects(
        archive: LocalStore) -> None:
    objects = ArchiveReader(archive).connect().execute(
        "SELECT episode, count(DISTINCT object_key) FROM episode_objects "
        "WHERE episode IS NOT NULL GROUP BY ALL").fetchall()
    assert all(n > 1 for _, n in objects), "the scenario must split every episode"
    con = ArchiveReader(archive).connect()
    cur = con.execute("SELECT * FROM episodes ORDER BY episode")
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    check(rows)
    ok = next(r for r in rows if r["episode"] == "ok")
    assert sorted(ok["topics"]) == sorted([EVENTS, CHUNKS])
    assert ok["start_time"].timestamp() * 1000 == ok["start_time_ms"] == T0
    assert ok["end_time_ms"] == T0 + 12_000
    assert str(con.execute("SELECT typeof(start_time), typeof(date) FROM episodes LIMIT 1")
               .fetchall()[0]) == "('TIMESTAMP WITH TIME ZONE', 'DATE')"
    assert con.execute("SELECT count(*) FROM episodes WHERE completeness <> 'complete'"
                       ).fetchall() == [(4,)]


def test_episode_table_as_plain_parquet(archive: LocalStore, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "episodes.parquet"
    args = argparse.Namespace(url=str(archive.root), endpoint_url=None, task=None,
                              out=str(out), publish=True)
    assert archive_cli._cmd_episodes(args) == 0
    check(pq.read_table(out).to_pylist())
    published = archive.root / EPISODES_KEY
    check(duckdb.sql(f"SELECT * FROM read_parquet('{published}')").pl().to_dicts())
    args.out, args.publish = None, False
    assert archive_cli._cmd_episodes(args) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["episode"] for r in printed} == set(EXPECTED)


def test_gap_arithmetic() -> None:
    assert merge_runs([(5, 6), (0, 2), (3, 4), (8, 9), (9, 12)]) == [(0, 6), (8, 12)]
    assert merge_runs([(0, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert gaps_of([(2, 4), (7, 7)], 9) == [(0, 1), (5, 6), (8, 9)]
    assert gaps_of([(0, 9)], 9) == []


def test_seq_runs_belong_to_their_own_index_row_on_large_objects() -> None:
    """Many episodes in one object (a large batch): each index row's runs cover exactly its
    own first..last seqs (the runs are matched to rows by key, not by group order)."""
    from trajbus.archive.index import build_index
    from trajbus.archive.synth import synthetic_table
    from trajbus.archive.writer import SORT_COLUMNS, sort_table

    table = sort_table(synthetic_table(200_000, sandboxes=1_000, events_per_episode=200),
                       SORT_COLUMNS)
    idx = build_index(table, "events/x.parquet", "2024-05-01", "10", [0])
    for r in idx.select(["first_seq", "last_seq", "seq_runs", "event_count"]).to_pylist():
        assert r["seq_runs"] == [{"first": r["first_seq"], "last": r["last_seq"]}]
        assert r["last_seq"] - r["first_seq"] + 1 == r["event_count"]


def _random_index(rng: random.Random, episodes: int) -> tuple[pa.Table, ContextFacts]:
    """Index rows with what the archive can hold: an episode in 1-4 objects, overlapping and
    out-of-order seq runs, runs beyond its EpisodeEnd, a row without runs, gaps, TRUNCATED
    and TERMINAL ends, trace chunks' topic, an empty topic; sandbox lifecycle rows (no
    episode); and decision context for some sandboxes."""
    rows: list[dict[str, Any]] = []
    facts = ContextFacts()
    for e in range(episodes):
        task, sandbox, episode = f"t{e % 3}", f"sb-{e % 7}", f"{e:05d}"
        end = rng.choice([None, rng.randint(0, 30)])
        for _ in range(rng.randint(1, 4)):
            runs = []
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                lo = rng.randint(0, 35)
                runs.append({"first": lo, "last": lo + rng.randint(0, 8)})
            first = min((r["first"] for r in runs), default=rng.randint(0, 5))
            last = max((r["last"] for r in runs), default=first)
            ended = end is not None and rng.random() < 0.6
            rows.append({
                "task": task, "sandbox": sandbox, "episode": episode,
                "object_key": f"events/{rng.randint(0, 5)}.parquet", "first_seq": first,
                "last_seq": last, "end_seq": end if ended else None,
                "seq_runs": runs if runs or rng.random() < 0.5 else None,
                "start_time_ms": T0 + e * 1000 + first, "end_time_ms": T0 + e * 1000 + last,
                "outcome": rng.choice(["TERMINAL", "TRUNCATED"]) if ended else None,
                "kafka_topic": rng.choice([EVENTS, CHUNKS, "", None])})
    rows.append({**rows[0], "episode": None})  # a sandbox's lifecycle stream
    for sandbox in ("sb-1", "sb-2", "sb-3"):
        f = facts.sandboxes[("t1", sandbox)] = SandboxFacts(gone=sandbox != "sb-3")
        f.terminates.append(Terminate(f"d-{sandbox}", T0, "watchdog", "00001", ()))
        f.cuts.append(Cut(T0, "reclaim", (), f"c-{sandbox}"))
    schema = pa.schema([INDEX_SCHEMA.field(name) for name in rows[0]])
    return pa.Table.from_pylist(rows, schema=schema), facts


@pytest.mark.parametrize("seed", range(20))
def test_the_episode_table_equals_the_rules_written_out_in_python(seed: int) -> None:
    index, facts = _random_index(random.Random(seed), 60)
    fast, reference = build_episodes(index, facts), build_episodes_reference(index, facts)
    assert fast.schema.equals(reference.schema)
    assert fast.to_pylist() == reference.to_pylist()


def test_an_empty_index_is_an_empty_table() -> None:
    index, _ = _random_index(random.Random(0), 1)
    empty = index.slice(0, 0)
    assert build_episodes(empty).num_rows == 0 == build_episodes_reference(empty).num_rows
